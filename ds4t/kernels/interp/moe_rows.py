"""The interpreter's twin of :func:`ds4t.kernels.moe.moe_experts` (op variant ``"interp"``).

The grouped kernels run one program per (chosen expert, N tile) plus a grouping and a combine
launch; the interpreter pays per program and per op. Here one launch does gate/up, down and the
rank combine of ROWS rows per program, every (row, rank) pair gathering its own expert's weight
tiles, with the grouped kernels' arithmetic in their order (tests/kernels/test_moe.py compares
them bitwise).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ds4t.backend import LAUNCH, cast, grid_dependency, scaled_add, tl_dtype
from ds4t.backend import silu as _silu
from ds4t.kernels.moe import _INTERP_CONFIG, _pair_expert, _pair_weight, k_step
from ds4t.kernels.weights import FP8Weight


@triton.jit
def _moe_rows_kernel(
    h_ptr, sh_b, ids_ptr, si_b, wts_ptr, swt_b, gate_ptr, sg_b, SHARED,
    wg_ptr, wu_ptr, sw_e, sw_n, sw_k,
    wd_ptr, sd_e, sd_n, sd_k,
    out_ptr, so_b, B,
    D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KT: tl.constexpr, GATED: tl.constexpr,
    WDT: tl.constexpr, ROWS: tl.constexpr,
    KP: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
    sg_ptr=None, su_ptr=None, ss_e=0, ss_n=0, sd_ptr=None, sds_e=0, sds_n=0,
    SBK: tl.constexpr = 0, KSTEP_D: tl.constexpr = 0, KSTEP_I: tl.constexpr = 0,
):
    """Interpreter path: gate/up, down and the rank combine of ROWS rows in one program.

    Every (row, rank) pair gathers its own expert's weight tiles ([ROWS, KP, ., .] tiles, KP =
    next_pow2(KT) ranks; padded ranks use expert 0 with weight 0), so nothing is grouped by expert. A pair's
    arithmetic is the grouped kernels' own, in their order: gate/up summed over D in BK chunks (the
    grouped gate/up kernel's BK), the down product summed over I in BI chunks (the grouped kernels'
    I tile), each chunk a broadcast product summed over K in order (as :func:`ds4t.backend.mma` in the interpreter); the rank
    combine sums w_j * y_j over the ranks in rank order. Rows never mix: a row's result does not
    depend on the other rows of the program (tests/kernels/test_moe.py checks it bitwise, and
    against the grouped kernels).

    FP8 weights (SBK > 0): the grouped kernels' scale blocks too. Over D (gate/up) and over I (down)
    the BK / BI chunks of one scale block (KSTEP_D / KSTEP_I columns) are summed from zero, then
    the block's sum times its per-row scale is added to the accumulator (first block: 0 + s * sum).
    """
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r64 = tl.minimum(r, B - 1).to(tl.int64)  # rows past B load row B-1 (in bounds) and store nothing
    j = tl.arange(0, KP)[None, :]
    kk = tl.arange(0, BK)
    ii = tl.arange(0, BI)
    dd = tl.arange(0, BD)
    r2 = r64[:, None]
    live = (j < KT) & (r2 >= 0)                                          # [ROWS, KP]
    e_raw = _pair_expert(ids_ptr, si_b, r2, j, live, KTOP, SHARED)
    e = tl.maximum(e_raw, 0).to(tl.int64)
    wj = _pair_weight(wts_ptr, swt_b, gate_ptr, sg_b, r2, j, live, KTOP, GATED)
    wj = tl.where(e_raw >= 0, wj, 0.0)   # a skipped pair (expert -1) computes expert 0 and adds 0 * y
    e4 = e[:, :, None, None]
    g_ptrs = (e4 * sw_e + (kk * sw_k)[None, None, :, None]) + (ii * sw_n)[None, None, None, :]   # [ROWS, KP, BK, BI]
    d_ptrs = (e4 * sd_e + (ii * sd_k)[None, None, :, None]) + (dd * sd_n)[None, None, None, :]   # [ROWS, KP, BI, BD]
    h_row = h_ptr + r2 * sh_b                                            # [ROWS, 1]
    EVEN: tl.constexpr = (D % BK == 0) and (I % BI == 0) and (D == BD)
    if SBK > 0:
        _fp8_rows(h_row, e[:, :, None], wg_ptr, wu_ptr, g_ptrs, sw_k, sw_n, wd_ptr, d_ptrs, sd_k,
                  sg_ptr, su_ptr, ss_e, ss_n, sd_ptr, sds_e, sds_n, wj, out_ptr, so_b, r, r2, B,
                  D, I, WDT, BI, BK, BD, SBK, KSTEP_D, KSTEP_I, EVEN)
    else:
        for i0 in tl.static_range(0, I, BI):
            for k0 in tl.static_range(0, D, BK):
                pg, pu = _gate_up_chunk(h_row, k0, i0, kk, ii, wg_ptr, wu_ptr, g_ptrs, sw_k, sw_n, D, I, WDT, BK, EVEN)
                if k0 == 0:  # 0 + first chunk, as the grouped kernel's zero-initialised accumulator
                    acc_g = 0.0 + pg
                    acc_u = 0.0 + pu
                else:
                    acc_g = acc_g + pg
                    acc_u = acc_u + pu
            act = cast(_silu(acc_g) * acc_u, WDT).to(tl.float32)[:, :, :, None]   # [ROWS, KP, BI, 1]
            pd = _down_chunk(act, i0, ii, dd, wd_ptr, d_ptrs, sd_k, D, I, EVEN)
            if i0 == 0:
                y = 0.0 + pd
            else:
                y = y + pd
        # rank combine: (w0*y0 + w1*y1) + w2*y2 ..., a sum over the rank axis in rank order
        out = tl.sum(wj[:, :, None] * y, axis=1)
        rm = (r < B)[:, None]
        if D == BD:
            tl.store(out_ptr + r2 * so_b + dd[None, :], out, mask=rm)
        else:
            tl.store(out_ptr + r2 * so_b + dd[None, :], out, mask=rm & (dd < D)[None, :])


@triton.jit
def _gate_up_chunk(h_row, k0, i0, kk, ii, wg_ptr, wu_ptr, g_ptrs, sw_k, sw_n,
                   D: tl.constexpr, I: tl.constexpr, WDT: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr):
    """One BK chunk of h (rounded to WDT) times the gate and up weight tiles of columns i0 .. i0 + BI:
    (pg, pu) [ROWS, KP, BI] fp32, summed over the chunk. Float and fp8 weights alike (fp8 -> fp32 exact)."""
    if D % BK == 0:
        a = tl.load(h_row + (k0 + kk)[None, :])
    else:
        a = tl.load(h_row + (k0 + kk)[None, :], mask=((k0 + kk) < D)[None, :], other=0.0)
    a = cast(a.to(tl.float32), WDT).to(tl.float32)[:, None, :, None]   # [ROWS, 1, BK, 1]
    off = k0 * sw_k + i0 * sw_n
    if EVEN:
        wg = tl.load(wg_ptr + off + g_ptrs)
        wu = tl.load(wu_ptr + off + g_ptrs)
    else:
        wmask = ((k0 + kk) < D)[None, None, :, None] & ((i0 + ii) < I)[None, None, None, :]
        wg = tl.load(wg_ptr + off + g_ptrs, mask=wmask, other=0.0)
        wu = tl.load(wu_ptr + off + g_ptrs, mask=wmask, other=0.0)
    return tl.sum(a * wg.to(tl.float32), axis=2), tl.sum(a * wu.to(tl.float32), axis=2)


@triton.jit
def _down_chunk(act, i0, ii, dd, wd_ptr, d_ptrs, sd_k, D: tl.constexpr, I: tl.constexpr, EVEN: tl.constexpr):
    """act [ROWS, KP, BI, 1] times the down weight tile of I columns i0 .. i0 + BI: [ROWS, KP, BD] fp32."""
    if EVEN:
        wd = tl.load(wd_ptr + i0 * sd_k + d_ptrs)
    else:
        wd = tl.load(wd_ptr + i0 * sd_k + d_ptrs,
                     mask=((i0 + ii) < I)[None, None, :, None] & (dd < D)[None, None, None, :], other=0.0)
    return tl.sum(act * wd.to(tl.float32), axis=2)


@triton.jit
def _fp8_rows(h_row, e3, wg_ptr, wu_ptr, g_ptrs, sw_k, sw_n, wd_ptr, d_ptrs, sd_k,
              sg_ptr, su_ptr, ss_e, ss_n, sd_ptr, sds_e, sds_n, wj, out_ptr, so_b, r, r2, B,
              D: tl.constexpr, I: tl.constexpr, WDT: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr,
              BD: tl.constexpr, SBK: tl.constexpr, KSTEP_D: tl.constexpr, KSTEP_I: tl.constexpr,
              EVEN: tl.constexpr):
    """:func:`_moe_rows_kernel` with FP8 weights (fp8 tiles, fp32 per-row block scales)."""
    kk = tl.arange(0, BK)
    ii = tl.arange(0, BI)
    dd = tl.arange(0, BD)
    for i0 in tl.static_range(0, I, BI):
        # gate / up for I columns i0 .. i0 + BI: scale blocks over D, BK chunks inside each
        s_gu = e3 * ss_e + ((i0 + ii) * ss_n)[None, None, :]                     # [ROWS, KP, BI]
        for kb in tl.static_range(0, D, KSTEP_D):
            for ks in tl.static_range(0, KSTEP_D, BK):
                if kb + ks < D:
                    pg, pu = _gate_up_chunk(h_row, kb + ks, i0, kk, ii, wg_ptr, wu_ptr, g_ptrs, sw_k, sw_n,
                                            D, I, WDT, BK, EVEN)
                    if ks == 0:   # a block's dot starts from zero, as the grouped kernel's
                        bg = 0.0 + pg
                        bu = 0.0 + pu
                    else:
                        bg = bg + pg
                        bu = bu + pu
            if I % BI == 0:
                sg = tl.load(sg_ptr + s_gu + kb // SBK)
                su = tl.load(su_ptr + s_gu + kb // SBK)
            else:
                smask = ((i0 + ii) < I)[None, None, :]
                sg = tl.load(sg_ptr + s_gu + kb // SBK, mask=smask, other=0.0)
                su = tl.load(su_ptr + s_gu + kb // SBK, mask=smask, other=0.0)
            if kb == 0:
                acc_g = scaled_add(0.0, bg, sg)
                acc_u = scaled_add(0.0, bu, su)
            else:
                acc_g = scaled_add(acc_g, bg, sg)
                acc_u = scaled_add(acc_u, bu, su)
        act = cast(_silu(acc_g) * acc_u, WDT).to(tl.float32)[:, :, :, None]   # [ROWS, KP, BI, 1]
        # down: this I chunk is one BI (= the down kernel's BK) chunk of a KSTEP_I scale block
        pd = _down_chunk(act, i0, ii, dd, wd_ptr, d_ptrs, sd_k, D, I, EVEN)
        if i0 % KSTEP_I == 0:
            bd = 0.0 + pd
        else:
            bd = bd + pd
        if (i0 + BI) % KSTEP_I == 0 or i0 + BI >= I:   # the block ends here
            s_d = e3 * sds_e + (dd * sds_n)[None, None, :] + i0 // SBK
            if D == BD:
                sd = tl.load(sd_ptr + s_d)
            else:
                sd = tl.load(sd_ptr + s_d, mask=(dd < D)[None, None, :], other=0.0)
            if i0 < KSTEP_I:
                y = scaled_add(0.0, bd, sd)
            else:
                y = scaled_add(y, bd, sd)
    out = tl.sum(wj[:, :, None] * y, axis=1)
    rm = (r < B)[:, None]
    if D == BD:
        tl.store(out_ptr + r2 * so_b + dd[None, :], out, mask=rm)
    else:
        tl.store(out_ptr + r2 * so_b + dd[None, :], out, mask=rm & (dd < D)[None, :])


_MAX_TILE = 1 << 20  # elements of one interpreter tile (triton's TRITON_MAX_TENSOR_NUMEL)


def rows_config(B: int, k: int, D: int, I: int, scale_bk: int = 0):
    """(ROWS, BI, BK, BD) of the interpreter path, or None when its tiles would not fit. BI, BK, BD
    come from the weight shapes only (and the FP8 scale block). ROWS (rows per program, the M tile) grows with B up to 16:
    a row's arithmetic never depends on the M tile (no reduction runs across rows, and each sum
    over K runs in the same order for every row), while the interpreter's gathers cost per element,
    so a lone decode row should not pay for 15 padding rows."""
    # the grouped kernels' K tiles in the interpreter: gate/up's over D, down's over I (the I chunk)
    BK = _INTERP_CONFIG.tiles(I, D, scale_bk)[1]
    BI = _INTERP_CONFIG.tiles(D, I, scale_bk)[1]
    BD = triton.next_power_of_2(D)
    KP = triton.next_power_of_2(k)
    rows = min(16, triton.next_power_of_2(B))
    while rows > 1 and rows * KP * max(BK * BI, BI * BD) > _MAX_TILE:
        rows //= 2
    if rows * KP * max(BK * BI, BI * BD) > _MAX_TILE:
        return None
    return rows, KP, BI, BK, BD


def launch(h, ids, weights, gate, w_gate, w_up, w_down, shared: int, gated: bool, out, act_dtype=None) -> bool:
    """:func:`ds4t.kernels.moe.moe_experts` on checked arguments (``shared`` = -1 without a shared
    expert; ``gate`` any valid pointer when not ``gated``; ``act_dtype``: the activation dtype, needed
    for FP8 weights); False, launching nothing, when its tiles would not fit."""
    B, k = ids.shape
    KT = k + (shared >= 0)
    D, I = h.shape[1], w_gate.shape[1]
    fp8 = isinstance(w_gate, FP8Weight)
    sbk = w_gate.block_k if fp8 else 0
    cfg = rows_config(B, KT, D, I, sbk)
    if cfg is None:
        return False
    ROWS, KP, BI, BK, BD = cfg
    extra = {}
    if fp8:
        extra = dict(sg_ptr=w_gate.scale, su_ptr=w_up.scale, ss_e=w_gate.scale.stride(0), ss_n=w_gate.scale.stride(1),
                     sd_ptr=w_down.scale, sds_e=w_down.scale.stride(0), sds_n=w_down.scale.stride(1),
                     SBK=sbk, KSTEP_D=k_step(D, BK, sbk), KSTEP_I=k_step(I, BI, sbk))
        w_gate, w_up, w_down = w_gate.data, w_up.data, w_down.data
    wdt = act_dtype if fp8 else w_gate.dtype
    _moe_rows_kernel[(triton.cdiv(B, ROWS),)](
        h, h.stride(0), ids, ids.stride(0), weights, weights.stride(0), gate, gate.stride(0), shared,
        w_gate, w_up, w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_down, w_down.stride(0), w_down.stride(1), w_down.stride(2),
        out, out.stride(0), B,
        D=D, I=I, KTOP=k, KT=KT, GATED=gated, WDT=tl_dtype(wdt), ROWS=ROWS, KP=KP, BI=BI, BK=BK,
        BD=BD, **extra, **LAUNCH,
    )
    return True
