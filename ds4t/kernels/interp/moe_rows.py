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

from ds4t.backend import cast, tl_dtype
from ds4t.backend import silu as _silu
from ds4t.kernels.moe import _INTERP_CONFIG, _pair_expert, _pair_weight


@triton.jit
def _moe_rows_kernel(
    h_ptr, sh_b, ids_ptr, si_b, wts_ptr, swt_b, gate_ptr, sg_b, SHARED,
    wg_ptr, wu_ptr, sw_e, sw_n, sw_k,
    wd_ptr, sd_e, sd_n, sd_k,
    out_ptr, so_b, B,
    D: tl.constexpr, I: tl.constexpr, KTOP: tl.constexpr, KT: tl.constexpr, GATED: tl.constexpr,
    WDT: tl.constexpr, ROWS: tl.constexpr,
    KP: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr,
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
    """
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r64 = tl.minimum(r, B - 1).to(tl.int64)  # rows past B load row B-1 (in bounds) and store nothing
    j = tl.arange(0, KP)[None, :]
    kk = tl.arange(0, BK)
    ii = tl.arange(0, BI)
    dd = tl.arange(0, BD)
    r2 = r64[:, None]
    live = (j < KT) & (r2 >= 0)                                          # [ROWS, KP]
    e = tl.maximum(_pair_expert(ids_ptr, si_b, r2, j, live, KTOP, SHARED), 0).to(tl.int64)
    wj = _pair_weight(wts_ptr, swt_b, gate_ptr, sg_b, r2, j, live, KTOP, GATED)
    e4 = e[:, :, None, None]
    g_ptrs = (e4 * sw_e + (kk * sw_k)[None, None, :, None]) + (ii * sw_n)[None, None, None, :]   # [ROWS, KP, BK, BI]
    d_ptrs = (e4 * sd_e + (ii * sd_k)[None, None, :, None]) + (dd * sd_n)[None, None, None, :]   # [ROWS, KP, BI, BD]
    h_row = h_ptr + r2 * sh_b                                            # [ROWS, 1]
    EVEN: tl.constexpr = (D % BK == 0) and (I % BI == 0) and (D == BD)
    for i0 in tl.static_range(0, I, BI):
        for k0 in tl.static_range(0, D, BK):
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
            pg = tl.sum(a * wg.to(tl.float32), axis=2)                    # [ROWS, KP, BI]
            pu = tl.sum(a * wu.to(tl.float32), axis=2)
            if k0 == 0:  # 0 + first chunk, as the grouped kernel's zero-initialised accumulator
                acc_g = 0.0 + pg
                acc_u = 0.0 + pu
            else:
                acc_g = acc_g + pg
                acc_u = acc_u + pu
        act = cast(_silu(acc_g) * acc_u, WDT).to(tl.float32)[:, :, :, None]   # [ROWS, KP, BI, 1]
        if EVEN:
            wd = tl.load(wd_ptr + i0 * sd_k + d_ptrs)
        else:
            wd = tl.load(wd_ptr + i0 * sd_k + d_ptrs,
                         mask=((i0 + ii) < I)[None, None, :, None] & (dd < D)[None, None, None, :], other=0.0)
        pd = tl.sum(act * wd.to(tl.float32), axis=2)                      # [ROWS, KP, BD]
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


_MAX_TILE = 1 << 20  # elements of one interpreter tile (triton's TRITON_MAX_TENSOR_NUMEL)


def rows_config(B: int, k: int, D: int, I: int):
    """(ROWS, BI, BK, BD) of the interpreter path, or None when its tiles would not fit. BI, BK, BD
    come from the weight shapes only. ROWS (rows per program, the M tile) grows with B up to 16:
    a row's arithmetic never depends on the M tile (no reduction runs across rows, and each sum
    over K runs in the same order for every row), while the interpreter's gathers cost per element,
    so a lone decode row should not pay for 15 padding rows."""
    BI, BK = _INTERP_CONFIG.tiles(I, D)   # the grouped gate/up kernel's tiles in the interpreter
    BD = triton.next_power_of_2(D)
    KP = triton.next_power_of_2(k)
    rows = min(16, triton.next_power_of_2(B))
    while rows > 1 and rows * KP * max(BK * BI, BI * BD) > _MAX_TILE:
        rows //= 2
    if rows * KP * max(BK * BI, BI * BD) > _MAX_TILE:
        return None
    return rows, KP, BI, BK, BD


def launch(h, ids, weights, gate, w_gate, w_up, w_down, shared: int, gated: bool, out) -> bool:
    """:func:`ds4t.kernels.moe.moe_experts` on checked arguments (``shared`` = -1 without a shared
    expert; ``gate`` any valid pointer when not ``gated``); False, launching nothing, when its tiles
    would not fit."""
    B, k = ids.shape
    KT = k + (shared >= 0)
    D, I = h.shape[1], w_gate.shape[1]
    cfg = rows_config(B, KT, D, I)
    if cfg is None:
        return False
    ROWS, KP, BI, BK, BD = cfg
    _moe_rows_kernel[(triton.cdiv(B, ROWS),)](
        h, h.stride(0), ids, ids.stride(0), weights, weights.stride(0), gate, gate.stride(0), shared,
        w_gate, w_up, w_gate.stride(0), w_gate.stride(1), w_gate.stride(2),
        w_down, w_down.stride(0), w_down.stride(1), w_down.stride(2),
        out, out.stride(0), B,
        D=D, I=I, KTOP=k, KT=KT, GATED=gated, WDT=tl_dtype(w_gate.dtype), ROWS=ROWS, KP=KP, BI=BI, BK=BK,
        BD=BD,
    )
    return True
