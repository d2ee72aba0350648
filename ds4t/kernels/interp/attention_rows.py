"""The interpreter's twin of :mod:`ds4t.kernels.attention` (op variant ``"interp"``).

The Triton interpreter pays per program and per op, not per element, so the GPU's grid of one
program per (row, kv head, split) costs it most of a decode step. Here one program does ROWS rows,
all their heads, every split and the merge (:func:`_attn_rows_kernel`), and one launch does the
gated-attention prologue (:func:`_norm_rope_kv_kernel`), each with the GPU kernels' arithmetic in
their order: bitwise the same where ``tests/kernels/test_attention.py`` says so.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, cast, grid_dependency, sigmoid
from ds4t.kernels import norm
from ds4t.kernels.rope import cos_sin
from ds4t.kernels.splits import split_of


@triton.jit
def _attn_rows_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    kc_ptr, skc_s, skc_l, skc_h, skc_d,
    vc_ptr, svc_s, svc_l, svc_h, svc_d,
    slots_ptr, lens_ptr,
    out_ptr, so_b, so_h, so_d,
    gate_ptr, sg_b, sg_h,
    qk_scale, L, B,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr, GATED: tl.constexpr,
):
    """Interpreter path: ROWS rows, all their query heads, every split and the merge, in one
    program (the interpreter pays per program and per op, not per element).

    The algorithm is the split kernel's and the merge kernel's: a row's positions cut into splits
    by the schedule (each row its own split size, from its own length), each split folded in tiles
    of BLOCK_N with the online softmax in ascending order, then the splits merged in ascending order
    with log-sum-exp rescaling. Splits are multiples of BLOCK_N, so a row's split ends after some
    tile: there the row merges it and starts the next. (The merge of a lone split gives acc / l
    bitwise, as the GPU's direct store does.) Products are plain fp32 (a 16-bit cache is upcast
    exactly; no hi/lo split needed off tensor cores). A program loops as far as its longest row; a
    tile past a row's own length leaves that row's state untouched (tl.where), so a row's bits never
    depend on the other rows of the program.
    """
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rl = tl.minimum(r, B - 1).to(tl.int64)        # rows past B redo row B-1 and store nothing
    length = tl.minimum(tl.load(lens_ptr + rl).to(tl.int32), L)                    # [ROWS]
    slot = tl.load(slots_ptr + rl).to(tl.int64)
    h = tl.arange(0, BH)
    hl = h if BH == HQ else tl.minimum(h, HQ - 1)  # padded heads/dims read in bounds, never stored
    kvh = (hl // G).to(tl.int64)[None, :, None, None]
    d = tl.arange(0, BD)
    dl = (d if BD == D else tl.minimum(d, D - 1))[None, None, None, :]
    dv = tl.arange(0, BDV)
    dvl = (dv if BDV == DV else tl.minimum(dv, DV - 1))[None, None, None, :]
    r4 = rl[:, None, None, None]
    # q [ROWS, BH, 1, BD], pre-scaled for exp2; padded d columns are 0 so they add nothing.
    q_ptrs = q_ptr + r4 * sq_b + hl[None, :, None, None] * sq_h + d[None, None, None, :] * sq_d
    if BD == D:
        q = tl.load(q_ptrs)
    else:
        q = tl.load(q_ptrs, mask=(d < D)[None, None, None, :], other=0.0)
    q = q.to(tl.float32) * qk_scale
    k_row = kc_ptr + (slot * skc_s)[:, None, None, None] + kvh * skc_h + dl * skc_d      # [ROWS, BH, 1, BD]
    v_row = vc_ptr + (slot * svc_s)[:, None, None, None] + kvh * svc_h + dvl * svc_d     # [ROWS, BH, 1, BDV]
    n3 = tl.arange(0, BLOCK_N)[None, None, :]
    len3 = length[:, None, None]
    n_max = tl.max(length, axis=0)

    split = split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS)[:, None]            # [ROWS, 1]
    l_run = tl.zeros([ROWS, BH], tl.float32)         # a row with length 0 keeps l = 0: output 0
    acc_run = tl.zeros([ROWS, BH, BDV], tl.float32)
    m_run = tl.full([ROWS, BH], float("-inf"), tl.float32)
    m_i = tl.full([ROWS, BH], float("-inf"), tl.float32)
    l_i = tl.zeros([ROWS, BH], tl.float32)
    acc = tl.zeros([ROWS, BH, BDV], tl.float32)
    for t0 in range(0, n_max, BLOCK_N):                                # ascending positions
        pos3 = t0 + n3                                                 # [1, 1, BLOCK_N]
        pm3 = pos3 < len3                                              # [ROWS, 1, BLOCK_N]
        pm = pm3[:, :, :, None]
        pos = pos3[:, :, :, None]
        kt = tl.load(k_row + pos * skc_l, mask=pm, other=0.0).to(tl.float32)      # [ROWS, BH, BN, BD]
        sc = tl.where(pm3, tl.sum(q * kt, axis=3), float("-inf"))                # [ROWS, BH, BN]
        m_new = tl.maximum(m_i, tl.max(sc, axis=2))
        # -inf only for a row with no position yet, whose update is discarded below; 0 there
        # keeps exp2 away from -inf - -inf (no NaN, no numpy warning).
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_sub)
        p = tl.exp2(sc - m_sub[:, :, None])
        vt = tl.load(v_row + pos * svc_l, mask=pm, other=0.0).to(tl.float32)     # [ROWS, BH, BN, BDV]
        live = (t0 < length)[:, None]                                  # this tile holds positions of the row
        l_i = tl.where(live, l_i * alpha + tl.sum(p, axis=2), l_i)
        acc = tl.where(live[:, :, None], acc * alpha[:, :, None] + tl.sum(p[:, :, :, None] * vt, axis=2), acc)
        m_i = tl.where(live, m_new, m_i)
        # the merge kernel's step, for rows whose split ends with this tile
        end = live & ((((t0 + BLOCK_N) % split) == 0) | (t0 + BLOCK_N >= length[:, None]))
        m_new = tl.maximum(m_run, m_i)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)   # as above
        a = tl.exp2(m_run - m_sub)
        c = tl.exp2(m_i - m_sub)
        acc_run = tl.where(end[:, :, None], tl.fma(acc_run, a[:, :, None], acc * c[:, :, None]), acc_run)
        l_run = tl.where(end, tl.fma(l_run, a, l_i * c), l_run)
        m_run = tl.where(end, m_new, m_run)
        m_i = tl.where(end, float("-inf"), m_i)
        l_i = tl.where(end, 0.0, l_i)
        acc = tl.where(end[:, :, None], 0.0, acc)
    res = tl.where(l_run[:, :, None] > 0, acc_run / tl.where(l_run > 0, l_run, 1.0)[:, :, None], 0.0)
    if GATED:  # activation.sigmoid_mul's expression: res * sigmoid(gate)
        dg = (dv if BDV == DV else tl.minimum(dv, DV - 1))[None, None, :]
        gt = tl.load(gate_ptr + rl[:, None, None] * sg_b + hl[None, :, None] * sg_h + dg)
        res = res * sigmoid(gt.to(tl.float32))
    om = (r < B)[:, None, None]
    if BH != HQ:
        om = om & (h < HQ)[None, :, None]
    if BDV != DV:
        om = om & (dv < DV)[None, None, :]
    tl.store(out_ptr + rl[:, None, None] * so_b + h[None, :, None] * so_h + dv[None, None, :] * so_d, res, mask=om)


@triton.jit
def _norm_rotate(row_ptr, s_d, w_ptr, dl3, pd3, dm3, rot, c, sn, eps,
                 D: tl.constexpr, BD: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """[ROWS, heads, BD] heads at ``row_ptr`` (+ d * s_d): RMSNorm (rms_norm's arithmetic) then
    rotate-half RoPE with the partner column re-read and normalised with the same rstd."""
    x = tl.load(row_ptr + dl3 * s_d).to(tl.float32)
    xp = tl.load(row_ptr + pd3 * s_d).to(tl.float32)
    if BD != D:
        x = tl.where(dm3, x, 0.0)
    rstd = norm.rstd_of(norm.add_square(tl.zeros(x.shape, tl.float32), x), D, eps)
    w = tl.load(w_ptr + dl3).to(tl.float32)
    wp = tl.load(w_ptr + pd3).to(tl.float32)
    if ZERO_CENTERED:
        w = 1.0 + w
        wp = 1.0 + wp
    y = (x * rstd) * w
    return tl.where(rot, y * c + ((xp * rstd) * wp) * sn, y)


@triton.jit
def _norm_rope_kv_kernel(
    q_ptr, sq_r, sq_h, sq_d,
    k_ptr, sk_r, sk_h, sk_d,
    v_ptr, sv_r, sv_h, sv_d,
    qw_ptr, kw_ptr, freq_ptr, pos_ptr, slots_ptr,
    kc_ptr, skc_s, skc_l, skc_h, skc_d,
    vc_ptr, svc_s, svc_l, svc_h, svc_d,
    qo_ptr, sqo_r, sqo_h, sqo_d,
    R, S, L, eps,
    H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
    ROWS: tl.constexpr, BH: tl.constexpr, BKV: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):
    """ROWS rows: per-head RMSNorm of q and k, rotate-half RoPE on their first 2*HALF dims, q out
    (fp32), k and v into the cache at (slots[r], positions[r]) (skipped when either is out of range).

    The arithmetic is that of :func:`ds4t.kernels.norm.rms_norm` then :func:`ds4t.kernels.rope.rope`
    then :func:`write_kv`, element by element: y = (x * rstd) * w, then y1*c - y2*s / y2*c + y1*s. The
    rotation partner of column d (d + HALF or d - HALF) is re-read from memory and normalised
    with the same rstd. Everything is per row: a row's bits never depend on the other rows.
    """
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rl = tl.minimum(r, R - 1).to(tl.int64)       # rows past R redo row R-1 and store nothing
    r3 = rl[:, None, None]
    d = tl.arange(0, BD)
    ROT: tl.constexpr = 2 * HALF
    pd = (d + HALF) % ROT                        # rotation partner (in bounds; unused past ROT)
    d3 = d[None, None, :]
    pd3 = pd[None, None, :]
    # cos / sin tables [ROWS, 1, BD]: fp32 angle = position * inv_freq[d mod HALF], as rope does
    f = tl.load(freq_ptr + d % HALF)
    pos = tl.load(pos_ptr + rl)
    ang = pos.to(tl.float32)[:, None, None] * f[None, None, :]
    c, sn = cos_sin(ang)                         # libdevice on the GPU, as rope
    first = d3 < HALF
    sn = tl.where(first, -sn, sn)                # y1*c - y2*s == y1*c + y2*(-s), exactly
    rot = d3 < ROT
    if BD != D:
        dl3 = tl.minimum(d3, D - 1)              # padded columns read in bounds, count as 0
        dm3 = d3 < D
    else:
        dl3 = d3
        dm3 = None

    # q [ROWS, BH, BD]
    h = tl.arange(0, BH)
    hl = h[None, :, None] if BH == H else tl.minimum(h, H - 1)[None, :, None]
    yq = _norm_rotate(q_ptr + r3 * sq_r + hl * sq_h, sq_d, qw_ptr, dl3, pd3, dm3, rot, c, sn, eps,
                      D, BD, ZERO_CENTERED)
    om = (r < R)[:, None, None]
    if BH != H:
        om = om & (h < H)[None, :, None]
    if BD != D:
        om = om & dm3
    tl.store(qo_ptr + r3 * sqo_r + h[None, :, None] * sqo_h + d3 * sqo_d, yq, mask=om)

    # k [ROWS, BKV, BD] -> cache
    slot = tl.load(slots_ptr + rl).to(tl.int64)
    p64 = pos.to(tl.int64)
    ok = (r < R) & (slot >= 0) & (slot < S) & (p64 >= 0) & (p64 < L)   # never write outside the pool
    ok3 = ok[:, None, None]
    sl3 = slot[:, None, None]
    ps3 = p64[:, None, None]
    g = tl.arange(0, BKV)
    gl = g[None, :, None] if BKV == KV else tl.minimum(g, KV - 1)[None, :, None]
    km = ok3
    if BKV != KV:
        km = km & (g < KV)[None, :, None]
    yk = _norm_rotate(k_ptr + r3 * sk_r + gl * sk_h, sk_d, kw_ptr, dl3, pd3, dm3, rot, c, sn, eps,
                      D, BD, ZERO_CENTERED)
    if BD != D:
        kmd = km & dm3
    else:
        kmd = km
    tl.store(kc_ptr + sl3 * skc_s + ps3 * skc_l + g[None, :, None] * skc_h + d3 * skc_d,
             cast(yk, kc_ptr.dtype.element_ty), mask=kmd)

    # v [ROWS, BKV, BDV] -> cache
    dv = tl.arange(0, BDV)[None, None, :]
    if BDV != DV:
        vm = km & (dv < DV)
        vx = tl.load(v_ptr + r3 * sv_r + gl * sv_h + tl.minimum(dv, DV - 1) * sv_d)
    else:
        vm = km
        vx = tl.load(v_ptr + r3 * sv_r + gl * sv_h + dv * sv_d)
    tl.store(vc_ptr + sl3 * svc_s + ps3 * svc_l + g[None, :, None] * svc_h + dv * svc_d,
             cast(vx, vc_ptr.dtype.element_ty), mask=vm)


_MAX_TILE = 1 << 20  # elements of one interpreter tile (triton's TRITON_MAX_TENSOR_NUMEL)


def rows_config(B: int, HQ: int, D: int, DV: int, block_n: int):
    """(ROWS, BH, BD, BDV) of the interpreter path, or None when its tiles would not fit. ROWS (the M
    tile) grows with B up to 16: no arithmetic runs across rows (see the kernel), and the
    interpreter's loads cost per element, so a lone decode row should not carry 15 padding rows."""
    BH, BD, BDV = triton.next_power_of_2(HQ), triton.next_power_of_2(D), triton.next_power_of_2(DV)
    rows = min(16, triton.next_power_of_2(B))
    while rows > 1 and rows * BH * block_n * max(BD, BDV) > _MAX_TILE:
        rows //= 2
    if rows * BH * block_n * max(BD, BDV) > _MAX_TILE:
        return None
    return rows, BH, BD, BDV


def launch_decode(q, k_cache, v_cache, slots, lengths, out, gate, qk_scale: float, sched, block_n: int) -> bool:
    """:func:`ds4t.kernels.attention.decode_attention` on checked arguments (``qk_scale`` = scale ·
    log2 e) in one launch of :func:`_attn_rows_kernel`; False, launching nothing, when its tiles
    would not fit."""
    B, HQ, D = q.shape
    L, HKV = k_cache.shape[1], k_cache.shape[2]
    DV = v_cache.shape[3]
    rows_cfg = rows_config(B, HQ, D, DV, block_n)
    if rows_cfg is None:
        return False
    ROWS, BH, BD, BDV = rows_cfg
    _attn_rows_kernel[(triton.cdiv(B, ROWS),)](
        q, *q.stride(),
        k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
        slots, lengths,
        out, *out.stride(),
        gate if gate is not None else out, gate.stride(0) if gate is not None else 0, DV,
        qk_scale, L, B,
        HQ=HQ, G=HQ // HKV, D=D, DV=DV, **sched.kernel_args(), BLOCK_N=block_n,
        ROWS=ROWS, BH=BH, BD=BD, BDV=BDV, GATED=gate is not None, **LAUNCH,
    )
    return True


def launch_norm_rope_write_kv(q, k, v, q_norm, k_norm, eps: float, positions, inv_freq, k_cache, v_cache, slots,
                              rotary_dim: int, zero_centered: bool, out: torch.Tensor) -> None:
    """:func:`ds4t.kernels.attention.norm_rope_write_kv` on checked arguments, one launch of
    :func:`_norm_rope_kv_kernel`."""
    S, L, KV, D = k_cache.shape
    DV = v_cache.shape[3]
    R, H, _ = q.shape
    BH, BKV = triton.next_power_of_2(H), triton.next_power_of_2(KV)
    BD, BDV = triton.next_power_of_2(D), triton.next_power_of_2(DV)
    # Rows per program: up to 16 (the M tile: every value is per row, nothing is reduced across rows).
    rows = min(16, triton.next_power_of_2(R))
    _norm_rope_kv_kernel[(triton.cdiv(R, rows),)](
        q, *q.stride(), k, *k.stride(), v, *v.stride(),
        q_norm.contiguous(), k_norm.contiguous(), inv_freq.contiguous(), positions, slots,
        k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
        out, *out.stride(),
        R, S, L, float(eps),
        H=H, KV=KV, D=D, DV=DV, HALF=rotary_dim // 2, ZERO_CENTERED=bool(zero_centered),
        ROWS=rows, BH=BH, BKV=BKV, BD=BD, BDV=BDV, **LAUNCH,
    )
