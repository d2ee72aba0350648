"""The interpreter's twin of :func:`ds4t.kernels.gdn.gdn_decode` (op variant ``"interp"``): ROWS rows,
all heads, all of Dk and Dv in one program instead of one program per (row, head block, Dv tile),
each row the GPU kernel's operations in their order (tests/kernels/test_gdn.py compares them bitwise).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency, sigmoid, softplus
from ds4t.kernels import norm


@triton.jit
def _gdn_rows_kernel(
    q_ptr, sq_r, sq_h, sq_d,
    k_ptr, sk_r, sk_h, sk_d,
    v_ptr, sv_r, sv_h, sv_d,
    a_ptr, sa_r, sa_h,
    b_ptr, sb_r, sb_h,
    A_log_ptr, dt_bias_ptr,
    state_ptr, ss_s, ss_h, ss_k, ss_v,
    slots_ptr,
    out_ptr, so_r, so_h, so_v,
    z_ptr, sz_r, sz_h, sz_v, nw_ptr, norm_eps,
    B, scale,
    Hv: tl.constexpr, Dk: tl.constexpr, Dv: tl.constexpr, G: tl.constexpr,
    ROWS: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    GATED_NORM: tl.constexpr,
):
    """Interpreter decode path: ROWS rows, all heads, all of Dk and Dv in one program. Per row the
    same operations as :func:`ds4t.kernels.gdn._gdn_step` in the same order (an extra leading row axis; every
    reduction runs inside one row's head), so it equals the one-row kernel and gdn_prefill bitwise."""
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rl = tl.minimum(r, B - 1).to(tl.int64)          # rows past B redo row B-1 and store nothing
    r2 = rl[:, None]
    r3 = r2[:, :, None]
    h = tl.arange(0, BH)
    hl = h if BH == Hv else tl.minimum(h, Hv - 1)
    h2 = hl[None, :]
    h3 = h2[:, :, None]
    hk3 = h3 // G
    dk3 = tl.arange(0, BK)[None, None, :]
    dv3 = tl.arange(0, BV)[None, None, :]
    EVEN: tl.constexpr = (BK == Dk) and (BV == Dv)
    if EVEN:
        q = tl.load(q_ptr + r3 * sq_r + hk3 * sq_h + dk3 * sq_d).to(tl.float32)
        k = tl.load(k_ptr + r3 * sk_r + hk3 * sk_h + dk3 * sk_d).to(tl.float32)
        v = tl.load(v_ptr + r3 * sv_r + h3 * sv_h + dv3 * sv_d).to(tl.float32)
    else:
        q = tl.load(q_ptr + r3 * sq_r + hk3 * sq_h + dk3 * sq_d, mask=dk3 < Dk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + r3 * sk_r + hk3 * sk_h + dk3 * sk_d, mask=dk3 < Dk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + r3 * sv_r + h3 * sv_h + dv3 * sv_d, mask=dv3 < Dv, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + r2 * sa_r + h2 * sa_h).to(tl.float32)
    b = tl.load(b_ptr + r2 * sb_r + h2 * sb_h).to(tl.float32)
    A_log = tl.load(A_log_ptr + h2).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h2).to(tl.float32)
    slot = tl.load(slots_ptr + r3).to(tl.int64)
    s_off = (slot * ss_s + h3 * ss_h)[:, :, :, None] + (dk3 * ss_k)[:, :, :, None] + (dv3 * ss_v)[:, :, None, :]
    if EVEN:
        S = tl.load(state_ptr + s_off)
    else:
        S = tl.load(state_ptr + s_off, mask=(dk3 < Dk)[:, :, :, None] & (dv3 < Dv)[:, :, None, :], other=0.0)
    # _gdn_step with a leading row axis
    q = tl.broadcast_to(q[:, :, :, None], S.shape)
    k = tl.broadcast_to(k[:, :, :, None], S.shape)
    q = q * tl.rsqrt(tl.sum(q * q, axis=2) + EPS)[:, :, None, :]
    q = q * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=2) + EPS)[:, :, None, :]
    g = -tl.exp(A_log) * softplus(a + dt_bias)
    beta = sigmoid(b)
    S = S * tl.exp(g)[:, :, None, None]
    kv = tl.sum(S * k, axis=2)                                # S^T k   [ROWS, BH, BV]
    delta = (v - kv) * beta[:, :, None]
    S = S + k * delta[:, :, None, :]
    o = tl.sum(S * q, axis=2)                                 # S^T q   [ROWS, BH, BV]
    if GATED_NORM:  # norm.gated_rms_norm of each head's o, the norm kernel's expression
        if EVEN:
            zt = tl.load(z_ptr + r3 * sz_r + h3 * sz_h + dv3 * sz_v).to(tl.float32)
            nw = tl.load(nw_ptr + dv3).to(tl.float32)
        else:
            zt = tl.load(z_ptr + r3 * sz_r + h3 * sz_h + dv3 * sz_v, mask=dv3 < Dv, other=0.0).to(tl.float32)
            nw = tl.load(nw_ptr + dv3, mask=dv3 < Dv, other=0.0).to(tl.float32)
        o = norm.gated_rms(o, nw, zt, Dv, norm_eps)
    m = (r < B)[:, None, None]
    if BH != Hv:
        m = m & (h < Hv)[None, :, None]
    if BV != Dv:
        tl.store(out_ptr + r3 * so_r + h3 * so_h + dv3 * so_v, o, mask=m & (dv3 < Dv))
    else:
        tl.store(out_ptr + r3 * so_r + h3 * so_h + dv3 * so_v, o, mask=m)
    if EVEN:
        tl.store(state_ptr + s_off, S, mask=m[:, :, :, None])
    else:
        tl.store(state_ptr + s_off, S, mask=m[:, :, :, None] & (dk3 < Dk)[:, :, :, None] & (dv3 < Dv)[:, :, None, :])


def launch_decode(q, k, v, a, b, A_log, dt_bias, state, slots, out, gated_norm, BK: int, eps: float) -> None:
    """:func:`ds4t.kernels.gdn.gdn_decode` on checked arguments (``gated_norm``: None or
    (z, norm_w, norm_eps)), ``BK`` = next_pow2(Dk) as the GPU kernel's."""
    R, Hk, Dk = q.shape
    Hv, Dv = v.shape[1], v.shape[2]
    BH, BV = triton.next_power_of_2(Hv), triton.next_power_of_2(Dv)
    rows = min(16, triton.next_power_of_2(R))   # the M tile; rows never interact
    while rows > 1 and rows * BH * BK * BV > (1 << 20):
        rows //= 2
    _gdn_rows_kernel[(triton.cdiv(R, rows),)](
        q, *q.stride(), k, *k.stride(), v, *v.stride(),
        a, *a.stride(), b, *b.stride(),
        A_log, dt_bias,
        state, *state.stride(),
        slots,
        out, *out.stride(),
        *((gated_norm[0], *gated_norm[0].stride(), gated_norm[1].contiguous(), float(gated_norm[2]))
          if gated_norm is not None else (out, 0, 0, 0, out, 0.0)),
        R, Dk ** -0.5,
        Hv=Hv, Dk=Dk, Dv=Dv, G=Hv // Hk, ROWS=rows, BH=BH, BK=BK, BV=BV, EPS=eps,
        GATED_NORM=gated_norm is not None, **LAUNCH,
    )
