"""Gated DeltaNet recurrence (Qwen3-Next linear attention), decode and prefill.

State model: a per-layer pool ``state`` [S, Hv, Dk, Dv] float32 (fp32 even for bf16 models), one
slot per session; each batch row names its slot and the kernels update it in place.

Per token, value head h (key head h // (Hv // Hk), as HF's repeat_interleave)::

    q = l2norm(q) * Dk**-0.5,  k = l2norm(k)          # l2norm(x) = x * rsqrt(sum(x^2) + 1e-6)
    g = -exp(A_log) * softplus(a + dt_bias),  beta = sigmoid(b)
    S = exp(g) * S
    delta = beta * (v - S^T k)
    S = S + k (x) delta
    o = S^T q

Inputs of any float dtype are upcast to fp32; all arithmetic is fp32.

Kernels: one program per (row, block of value heads, Dv tile). The Dk reductions always run over
the whole of Dk inside one program; in the interpreter one program holds all heads and all of Dv
(fewer, bigger programs). Tiles depend on (Hv, Dk, Dv) and the state's memory layout only, never on
the number of rows; rows never interact, so a row's output and new state are bitwise the same
whatever else shares the launch. Rows must name distinct slots.

State layout. ``state`` may be stored with Dv contiguous (``[S, Hv, Dk, Dv]`` contiguous, "dv") or
with Dk contiguous (a transposed view of ``[S, Hv, Dv, Dk]``, "dk"; the models' state pools,
``StateSpec.order``). On the GPU the compiler lays S out after its loads: with Dk contiguous one
warp's lanes hold all of Dk (4 elements a lane at Dk = 128), warps split Dv, and every Dk reduction
of a token is lane shuffles -- no barrier, and the same tree for every Dv tile and warp count (H200:
``bench/gdn_tiles.py``, all eight tiles swept gave one set of bits), so a one-warp, 8-column program
(the fastest prefill chain) costs decode nothing. With Dv contiguous, Dk spans warps: barriers in
the chain, bits that change with the tile; that layout keeps the 4-warp, 32-column tile.

``gdn_prefill`` loops over its T tokens inside the kernel with S in registers, calling the same
step function with the same tiles as ``gdn_decode``; prefill loads token t + 1 while token t's step
runs (the step is a latency-bound chain of Dk reductions). It equals T successive decode steps
bitwise in the interpreter and on an H200 (the harness's chunk check). ``gdn_prefill_segments`` runs
several sessions' chunks in one launch, one program per (segment, value head, Dv tile), each doing
exactly what ``gdn_prefill`` does for that session alone (``gdn_prefill`` is its one-segment case).
Prefill launches without programmatic dependent launch (``backend.LAUNCH_SERIAL``: launched
early beside the conv kernel, its blocks ran 1.65x slower).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, LAUNCH_SERIAL, cast, grid_dependency, sigmoid, softplus, timer
from ds4t.kernels import norm
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.interp import gdn_rows
from ds4t.kernels.registry import GPU, INTERP, CheckResult, register_check, register_op, variant
from ds4t.kernels.tensors import check_segments, one_segment

L2_EPS = 1e-6


@dataclasses.dataclass(frozen=True)
class GDNConfig:
    """Launch constants of the recurrence: value heads per program, the Dk block (always all of
    Dk), the Dv tile and warps (with Dk contiguous neither changes a bit: module docstring)."""
    block_h: int
    block_k: int
    block_v: int
    num_warps: int = 4
    prefetch: bool = True   # prefill: load token t + 1 before token t's step (the same values; speed only)
    norm_rows: int = 0      # whole-heads decode entries: fuse the gated norm into launches of <= this many rows


def _gpu_rule(Hv: int, Dk: int, Dv: int, layout: str, whole_heads: bool = False) -> GDNConfig:
    bk = triton.next_power_of_2(Dk)
    if layout == "dk":
        if whole_heads:   # Dk stays in one warp's lanes, warps split Dv: the tree of every Dk reduction is kept
            # norm_rows 0: one program a head is no faster than the 8-column programs plus the norm launch
            # (an H100, Qwen3-Next-4l: N = 1 within 0.3-1.4 %, N = 16 / 64 0.9-7.8 % slower fused;
            # bench/results/2026-12-06-h100-gdn-norm.md). The entry is there to be switched on and timed.
            bv = triton.next_power_of_2(Dv)
            return GDNConfig(block_h=1, block_k=bk, block_v=bv, num_warps=max(1, min(8, bv // 16)), norm_rows=0)
        return GDNConfig(block_h=1, block_k=bk, block_v=min(8, triton.next_power_of_2(Dv)), num_warps=1)
    return GDNConfig(block_h=1, block_k=bk, block_v=min(32, triton.next_power_of_2(Dv)), num_warps=4)


GDN_CONFIGS: ConfigTable[GDNConfig] = ConfigTable(
    "gdn", gpu={}, gpu_rule=_gpu_rule,
    interp_rule=lambda Hv, Dk, Dv, layout, whole_heads=False: GDNConfig(block_h=triton.next_power_of_2(Hv),
                                                                        block_k=triton.next_power_of_2(Dk),
                                                                        block_v=triton.next_power_of_2(Dv),
                                                                        norm_rows=1 << 16 if whole_heads else 0),
    source="bench/results/2026-12-04-h200-gdn-dk-state.md (python bench/gdn_tiles.py): state with Dk "
           "contiguous: one value head, 8 Dv columns, 1 warp -- a 1024-token prefill chunk 1.22 -> 0.82 ms a layer "
           "in Qwen3-Next-4l (launched without PDL), 8 x 128 0.79 -> 0.49 ms, decode R = 64 81 -> 74 us against "
           "the Dv-contiguous 32-column, 4-warp tile, which "
           "that layout keeps (bench/results/2026-11-30-h200-prefill-round3.md: its fastest decode at R = 16 / "
           "64; there decode and prefill must share the tile: their bits)")
"""Keyed on the head shapes (Hv, Dk, Dv), the state's layout (:func:`state_layout`) and ``whole_heads`` (the
decode tile of a launch that also computes the gated norm, which needs each head's whole Dv in one program;
"dk" only, where the Dv tile and warps change no bit), never on the number of rows."""


STATE_ORDER = (0, 2, 1)
"""The per-slot memory order (``StateSpec.order``) of a state [Hv, Dk, Dv] these kernels read fastest: Dk
innermost ("dk", module docstring)."""


def state_layout(state: torch.Tensor) -> str:
    """"dk" when a state [S, Hv, Dk, Dv] has Dk contiguous, else "dv" (module docstring)."""
    return "dk" if state.stride(2) == 1 and state.shape[2] > 1 else "dv"


@triton.jit
def _gdn_step(S, q, k, v, a, b, A_log, dt_bias, scale, EPS: tl.constexpr):
    """One token. S [BH,BK,BV] fp32; q,k [BH,BK]; v [BH,BV]; a,b,A_log,dt_bias [BH]. -> (S, o).

    q and k are broadcast to S's shape before their norms: every Dk reduction of the step (the two
    norms, S^T k, S^T q) then runs on one [BH, BK, BV] layout, the state's, so its tree is the state
    layout's alone (module docstring: with Dk contiguous, one warp's lanes)."""
    q = tl.broadcast_to(q[:, :, None], S.shape)
    k = tl.broadcast_to(k[:, :, None], S.shape)
    q = q * tl.rsqrt(tl.sum(q * q, axis=1) + EPS)[:, None, :]
    q = q * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None, :]
    g = -tl.exp(A_log) * softplus(a + dt_bias)
    beta = sigmoid(b)
    S = S * tl.exp(g)[:, None, None]
    kv = tl.sum(S * k, axis=1)                             # S^T k   [BH, BV]
    delta = (v - kv) * beta[:, None]
    S = S + k * delta[:, None, :]
    o = tl.sum(S * q, axis=1)                              # S^T q   [BH, BV]
    return S, o


@triton.jit
def _load_token(
    h, hk, dk, dv, hm, km, vm,
    q_ptr, sq_h, sq_d, k_ptr, sk_h, sk_d, v_ptr, sv_h, sv_d, a_ptr, sa_h, b_ptr, sb_h,
):
    # The pointers point at the token's row.
    qk_m = hm[:, None] & km[None, :]
    q = tl.load(q_ptr + hk[:, None] * sq_h + dk[None, :] * sq_d, mask=qk_m, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + hk[:, None] * sk_h + dk[None, :] * sk_d, mask=qk_m, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + h[:, None] * sv_h + dv[None, :] * sv_d,
                mask=hm[:, None] & vm[None, :], other=0.0).to(tl.float32)
    a = tl.load(a_ptr + h * sa_h, mask=hm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + h * sb_h, mask=hm, other=0.0).to(tl.float32)
    return q, k, v, a, b


@triton.jit(do_not_specialize=["sst_t", "can_keep"])   # one binary with and without kept states
def _gdn_kernel(
    q_ptr, sq_r, sq_h, sq_d,
    k_ptr, sk_r, sk_h, sk_d,
    v_ptr, sv_r, sv_h, sv_d,
    a_ptr, sa_r, sa_h,
    b_ptr, sb_r, sb_h,
    A_log_ptr, dt_bias_ptr,
    state_ptr, ss_s, ss_h, ss_k, ss_v,
    slots_ptr,
    out_ptr, so_r, so_h, so_v,
    Hv, Dk, Dv, G, scale,
    PREFILL: tl.constexpr,
    BH: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    states_ptr, sst_t, can_keep,
    PREFETCH: tl.constexpr = True,
    z_ptr=None, sz_r=0, sz_h=0, sz_v=0, nw_ptr=None, norm_eps=0.0, NORM_D: tl.constexpr = 0,
):
    # Decode: program (row, head block, Dv tile), one token, slot from slots[row].
    # Prefill: program (segment, head block, Dv tile); segment g = slots[g] = (first row r0, T rows,
    # slot, states row s0 or -1) of a [M, 4] table: T tokens of one session from state[slot]. s0 >= 0
    # (and can_keep, a states buffer was given): the state after its token t also goes to
    # states[s0 + t] (same layout as a slot, row stride sst_t), so the session can be rolled back to any
    # prefix of the chunk. keep is a runtime value, not a constexpr: with and without it the prefill is
    # ONE compiled kernel, so keeping the states cannot change how the compiler lays out (and so sums)
    # the step's math.
    # NORM_D > 0 (decode, a program holds whole heads: BV >= Dv): out gets norm.gated_rms_norm of each
    # head's o with z [R, Hv, Dv] and the norm weight nw [Dv] (norm.gated_rms: the norm kernel's bits).
    grid_dependency()
    pid_r = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_v = tl.program_id(2)
    # Index math in int64: no overflow on big pools, and it skips the interpreter's int32
    # overflow checks (which cost more than the arithmetic).
    h = pid_h.to(tl.int64) * BH + tl.arange(0, BH)
    dk = tl.arange(0, BK).to(tl.int64)
    dv = pid_v.to(tl.int64) * BV + tl.arange(0, BV)
    hm = h < Hv
    km = dk < Dk
    vm = dv < Dv
    hk = h // G
    if PREFILL:
        g4 = pid_r.to(tl.int64) * 4
        r0 = tl.load(slots_ptr + g4).to(tl.int64)
        T = tl.load(slots_ptr + g4 + 1).to(tl.int64)
        state_ptr += tl.load(slots_ptr + g4 + 2).to(tl.int64) * ss_s
        s0 = tl.load(slots_ptr + g4 + 3).to(tl.int64)
        keep = (s0 >= 0).to(tl.int32) * can_keep
        q_ptr += r0 * sq_r
        k_ptr += r0 * sk_r
        v_ptr += r0 * sv_r
        a_ptr += r0 * sa_r
        b_ptr += r0 * sb_r
        out_ptr += r0 * so_r
        states_ptr += tl.maximum(s0, 0) * sst_t
    else:
        state_ptr += tl.load(slots_ptr + pid_r).to(tl.int64) * ss_s
    A_log = tl.load(A_log_ptr + h, mask=hm, other=0.0).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + h, mask=hm, other=0.0).to(tl.float32)

    s_off = h[:, None, None] * ss_h + dk[None, :, None] * ss_k + dv[None, None, :] * ss_v
    s_m = hm[:, None, None] & km[None, :, None] & vm[None, None, :]
    S = tl.load(state_ptr + s_off, mask=s_m, other=0.0)
    o_m = hm[:, None] & vm[None, :]

    o_off = h[:, None] * so_h + dv[None, :] * so_v
    if PREFILL:
        # Walk the token rows by advancing 64-bit pointers. The step is latency-bound (a chain of Dk
        # reductions per token), so PREFETCH issues token t + 1's loads before token t's step; without
        # it they follow the step. Either way the step sees the same values.
        q, k, v, a, b = _load_token(h, hk, dk, dv, tl.where(T > 0, hm, False), km, vm,
                                    q_ptr, sq_h, sq_d, k_ptr, sk_h, sk_d, v_ptr, sv_h, sv_d,
                                    a_ptr, sa_h, b_ptr, sb_h)
        for t in range(T):
            more = tl.where(t + 1 < T, hm, False)   # docs/design.md: a scalar condition masks through tl.where
            if PREFETCH:
                q2, k2, v2, a2, b2 = _load_token(h, hk, dk, dv, more, km, vm,
                                                 q_ptr + sq_r, sq_h, sq_d, k_ptr + sk_r, sk_h, sk_d,
                                                 v_ptr + sv_r, sv_h, sv_d, a_ptr + sa_r, sa_h, b_ptr + sb_r, sb_h)
            S, o = _gdn_step(S, q, k, v, a, b, A_log, dt_bias, scale, EPS)
            tl.store(out_ptr + o_off, o, mask=o_m)
            if keep != 0:
                tl.store(states_ptr + s_off, S, mask=s_m)
            states_ptr += sst_t
            q_ptr += sq_r
            k_ptr += sk_r
            v_ptr += sv_r
            a_ptr += sa_r
            b_ptr += sb_r
            out_ptr += so_r
            if PREFETCH:
                q, k, v, a, b = q2, k2, v2, a2, b2
            else:
                q, k, v, a, b = _load_token(h, hk, dk, dv, more, km, vm,
                                            q_ptr, sq_h, sq_d, k_ptr, sk_h, sk_d, v_ptr, sv_h, sv_d,
                                            a_ptr, sa_h, b_ptr, sb_h)
    else:
        r = pid_r.to(tl.int64)
        q, k, v, a, b = _load_token(h, hk, dk, dv, hm, km, vm,
                                    q_ptr + r * sq_r, sq_h, sq_d, k_ptr + r * sk_r, sk_h, sk_d,
                                    v_ptr + r * sv_r, sv_h, sv_d, a_ptr + r * sa_r, sa_h, b_ptr + r * sb_r, sb_h)
        S, o = _gdn_step(S, q, k, v, a, b, A_log, dt_bias, scale, EPS)
        if NORM_D > 0:
            z = tl.load(z_ptr + r * sz_r + h[:, None] * sz_h + dv[None, :] * sz_v, mask=o_m, other=0.0)
            nw = tl.load(nw_ptr + dv, mask=vm, other=0.0).to(tl.float32)
            o = norm.gated_rms(o, nw[None, :], z.to(tl.float32), NORM_D, norm_eps)
        tl.store(out_ptr + r * so_r + o_off, cast(o, out_ptr.dtype.element_ty), mask=o_m)
    # Each element of S is read and written by the same thread (same layout), and no two
    # programs share an element: no barrier needed.
    tl.store(state_ptr + s_off, S, mask=s_m)


def _check_args(q, k, v, a, b, A_log, dt_bias, state):
    R, Hk, Dk = q.shape
    Rv, Hv, Dv = v.shape
    if k.shape != q.shape or Rv != R:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: shapes disagree")
    if Hv % Hk:
        raise ValueError(f"value heads {Hv} not a multiple of key heads {Hk}")
    if a.shape != (R, Hv) or b.shape != (R, Hv):
        raise ValueError(f"a, b must be [{R}, {Hv}], got {tuple(a.shape)}, {tuple(b.shape)}")
    if A_log.shape != (Hv,) or dt_bias.shape != (Hv,):
        raise ValueError(f"A_log, dt_bias must be [{Hv}]")
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (Hv, Dk, Dv):
        raise ValueError(f"state must be float32 [S, {Hv}, {Dk}, {Dv}], got {state.dtype} {tuple(state.shape)}")
    return R, Hk, Hv, Dk, Dv


def _launch(q, k, v, a, b, A_log, dt_bias, state, slots, out, prefill, gated_norm=None, out_dtype=torch.float32,
            states_out=None,
            states_rows=None):
    """slots: decode, int32 [R] (a slot per row); prefill, the [M, 4] segments table. states_rows: the
    rows states_out must have, where the caller knows them (the table's values stay on the device)."""
    R, Hk, Hv, Dk, Dv = _check_args(q, k, v, a, b, A_log, dt_bias, state)
    if gated_norm is not None:
        z, norm_w, _ = gated_norm
        if z.shape != (R, Hv, Dv) or z.stride(2) != 1 or norm_w.shape != (Dv,):
            raise ValueError(f"z must be [{R}, {Hv}, {Dv}] with unit last stride and norm_w [{Dv}]")
    if out is not None and (tuple(out.shape) != (R, Hv, Dv) or out.dtype != torch.float32):
        raise ValueError(f"out must be float32 {(R, Hv, Dv)}, got {out.dtype} {tuple(out.shape)}")

    def fp32_out():   # allocated only where o itself is stored (the fused norm may store y instead)
        return out if out is not None else torch.empty((R, Hv, Dv), dtype=torch.float32, device=q.device)

    programs = check_segments(slots, "gdn_prefill_segments") if prefill else R
    if R == 0 or programs == 0:
        return fp32_out().to(out_dtype)
    layout = state_layout(state)
    cfg = GDN_CONFIGS(Hv, Dk, Dv, layout)
    BH, BK, BV = cfg.block_h, cfg.block_k, cfg.block_v
    if not prefill and variant("gdn_decode") == INTERP:
        out = fp32_out()
        gdn_rows.launch_decode(q, k, v, a, b, A_log, dt_bias, state, slots, out, gated_norm, BK, L2_EPS)
        return out.to(out_dtype)   # in the interpreter y is computed in fp32, then rounded as the GPU stores it
    norm_args = {}
    if gated_norm is not None and not prefill and layout == "dk":
        whole = GDN_CONFIGS(Hv, Dk, Dv, layout, True)
        if whole.block_v >= Dv and R <= whole.norm_rows:   # the norm in the decode program: the same bits
            z, norm_w, eps = gated_norm
            cfg, BH, BK, BV = whole, whole.block_h, whole.block_k, whole.block_v
            out = fp32_out() if out_dtype == torch.float32 else torch.empty((R, Hv, Dv), dtype=out_dtype,
                                                                            device=q.device)
            norm_args = dict(z_ptr=z, sz_r=z.stride(0), sz_h=z.stride(1), sz_v=z.stride(2), nw_ptr=norm_w,
                             norm_eps=float(eps), NORM_D=Dv)
            gated_norm = None
    if not norm_args:
        out = fp32_out()
    grid = (programs, triton.cdiv(Hv, BH), triton.cdiv(Dv, BV))
    keep = dict(states_ptr=state, sst_t=0, can_keep=0)   # never written when can_keep == 0
    if states_out is not None:
        rows = states_out.shape[0] if states_rows is None else states_rows
        if tuple(states_out.shape) != (rows, Hv, Dk, Dv) or states_out.dtype != torch.float32:
            raise ValueError(f"states_out must be float32 {(rows, Hv, Dk, Dv)}, got {states_out.dtype} "
                             f"{tuple(states_out.shape)}")
        if tuple(states_out.stride()[1:]) != tuple(state.stride()[1:]):
            raise ValueError("states_out must have the state's per-slot layout (its strides past the first)")
        keep = dict(states_ptr=states_out, sst_t=states_out.stride(0), can_keep=1)
    _gdn_kernel[grid](
        q, *q.stride(), k, *k.stride(), v, *v.stride(),
        a, *a.stride(), b, *b.stride(),
        A_log, dt_bias,
        state, *state.stride(),
        slots,
        out, *out.stride(),
        Hv, Dk, Dv, Hv // Hk, Dk ** -0.5,
        PREFILL=prefill, BH=BH, BK=BK, BV=BV, EPS=L2_EPS, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, **keep, **norm_args, **(LAUNCH_SERIAL if prefill else LAUNCH),
    )
    if gated_norm is not None:
        z, norm_w, eps = gated_norm
        out = norm.gated_rms_norm(out.view(R * Hv, Dv), z, norm_w, eps,
                                  out_dtype=out_dtype).view(R, Hv, Dv)
    return out


def gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, *, out: Optional[torch.Tensor] = None,
               z: Optional[torch.Tensor] = None, norm_w: Optional[torch.Tensor] = None,
               norm_eps: float = 1e-6, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One gated-delta-rule step for B rows of B distinct sessions.

    q, k [B, Hk, Dk], v [B, Hv, Dv] (post-conv activations), a, b [B, Hv], A_log, dt_bias [Hv]
    (any float dtype); state [S, Hv, Dk, Dv] fp32, updated in place at ``slots`` [B] int32.
    Returns o fp32 [B, Hv, Dv] (``out`` if given). With ``z`` [B, Hv, Dv] (unit last stride) and
    ``norm_w`` [Dv] it returns ``norm.gated_rms_norm(o, z, norm_w, norm_eps)`` per head instead,
    bitwise the same (computed in the same launch in the interpreter, and on the GPU for a Dk-contiguous
    state at up to ``GDNConfig.norm_rows`` rows, one program a head; ``out`` then holds o or y),
    stored as ``out_dtype`` (fp32, or bf16 / fp16 rounded to nearest even: a new tensor).
    """
    if (z is None) != (norm_w is None):
        raise ValueError("z and norm_w go together")
    if out_dtype != torch.float32 and (z is None or out_dtype not in (torch.bfloat16, torch.float16)):
        raise ValueError(f"gdn_decode: out_dtype {out_dtype} needs the gated norm (z, norm_w) and a 16-bit "
                         f"float dtype; the state's output o stays fp32")
    gn = (z, norm_w, norm_eps) if z is not None else None
    return _launch(q, k, v, a, b, A_log, dt_bias, state, slots, out, prefill=False, gated_norm=gn,
                   out_dtype=out_dtype)


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, slot: int, *, out: Optional[torch.Tensor] = None,
                states_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """T consecutive tokens of one session, from ``state[slot]``, leaving the final state there.

    q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv]. Returns o fp32 [T, Hv, Dv]; equal to T
    successive :func:`gdn_decode` steps (bitwise in the interpreter). ``states_out`` fp32
    [T, Hv, Dk, Dv] (contiguous): also receives the state after each token (a speculative verify
    chunk keeps them to roll the session back to any prefix without recomputing).
    """
    segments = one_segment(q.shape[0], slot, q.device, keep=states_out is not None)
    return _launch(q, k, v, a, b, A_log, dt_bias, state, segments, out, prefill=True, states_out=states_out,
                   states_rows=q.shape[0])


def gdn_prefill_segments(q, k, v, a, b, A_log, dt_bias, state, segments, *, out: Optional[torch.Tensor] = None,
                         states_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Several sessions' consecutive tokens in one launch: segment g = ``segments[g]`` = (first row r0,
    T rows, slot, states row s0) runs rows r0 .. r0+T-1 from ``state[slot]`` exactly as
    :func:`gdn_prefill` would alone (one program per segment, value head and Dv tile; slots distinct).

    q, k [R, Hk, Dk], v [R, Hv, Dv], a, b [R, Hv]; segments an int32/int64 [M, 4] table on the device
    (:attr:`ds4t.step.StepBatch.multi_segments`). Returns o fp32 [R, Hv, Dv] (``out`` if given; rows
    outside every segment are not written). ``states_out`` fp32 [K, Hv, Dk, Dv], the kept states: a
    segment with s0 >= 0 writes the state after its token t to ``states_out[s0 + t]`` (s0 = -1: none);
    K covers every such segment's rows (:attr:`ds4t.step.Segment.states_row`)."""
    return _launch(q, k, v, a, b, A_log, dt_bias, state, segments, out, prefill=True, states_out=states_out)


# ----------------------------------------------------------------------------- references


def _l2norm(x):
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, state, slots, *, out=None):
    """Plain-torch :func:`gdn_decode` (same signature, same in-place state update)."""
    Hk, Dk = q.shape[1:]
    Hv = v.shape[1]
    idx = slots.long()
    q = _l2norm(q.float().repeat_interleave(Hv // Hk, dim=1)) * (Dk ** -0.5)
    k = _l2norm(k.float().repeat_interleave(Hv // Hk, dim=1))
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())      # [B, Hv]
    beta = torch.sigmoid(b.float())
    S = state[idx] * g.exp()[..., None, None]                             # [B, Hv, Dk, Dv]
    kv = (S * k[..., None]).sum(dim=-2)
    delta = (v.float() - kv) * beta[..., None]
    S = S + k[..., None] * delta[..., None, :]
    o = (S * q[..., None]).sum(dim=-2)
    state[idx] = S
    if out is not None:
        out.copy_(o)
        return out
    return o


def gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, state, slot, *, out=None, states_out=None):
    """Plain-torch :func:`gdn_prefill`: T successive :func:`gdn_decode_ref` steps."""
    slots = torch.tensor([slot], dtype=torch.int32, device=q.device)
    T, Hv, Dv = v.shape
    o = torch.empty((T, Hv, Dv), dtype=torch.float32, device=q.device)
    for t in range(T):
        o[t] = gdn_decode_ref(q[t : t + 1], k[t : t + 1], v[t : t + 1], a[t : t + 1], b[t : t + 1],
                              A_log, dt_bias, state, slots)[0]
        if states_out is not None:
            states_out[t] = state[int(slot)]
    if out is not None:
        out.copy_(o)
        return out
    return o


def gdn_prefill_segments_ref(q, k, v, a, b, A_log, dt_bias, state, segments, *, out=None, states_out=None):
    """Plain-torch :func:`gdn_prefill_segments`: :func:`gdn_prefill_ref` per segment, in order."""
    R, Hv, Dv = v.shape
    out = torch.full((R, Hv, Dv), float("nan"), device=q.device) if out is None else out
    for r0, n, slot, s0 in segments.tolist():
        rows = slice(r0, r0 + n)
        gdn_prefill_ref(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, state, slot, out=out[rows],
                        states_out=states_out[s0:s0 + n] if s0 >= 0 and states_out is not None else None)
    return out


# ----------------------------------------------------------------------------- self-check


@register_check
def _check(device) -> List[CheckResult]:
    g = torch.Generator().manual_seed(0)
    results = []
    S_, B, Hk, Hv, Dk, Dv, T = 6, 4, 2, 4, 16, 24, 5

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        q, k = rnd(B, Hk, Dk).to(dt), rnd(B, Hk, Dk).to(dt)
        v = rnd(B, Hv, Dv).to(dt)
        a, b = rnd(B, Hv).to(dt), rnd(B, Hv).to(dt)
        A_log, dt_bias = rnd(Hv, scale=0.5), rnd(Hv, scale=0.5)
        state0 = rnd(S_, Hv, Dk, Dv, scale=0.1)
        slots = torch.tensor([2, 5, 0, 3], dtype=torch.int32, device=device)

        def run(rows):
            st = state0.clone()
            o = gdn_decode(q[rows], k[rows], v[rows], a[rows], b[rows], A_log, dt_bias, st, slots[rows])
            return o, st

        o, st = run(list(range(B)))
        st_r = state0.clone()
        ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, st_r, slots)
        err = max((o - ref).abs().max().item(), (st - st_r).abs().max().item())
        inv = True
        for i in range(B):
            oi, sti = run([i])
            s = slots[i].item()
            inv &= torch.equal(oi[0], o[i]) and torch.equal(sti[s], st[s])
        st_t = state0.clone()
        ms = timer(lambda: gdn_decode(q, k, v, a, b, A_log, dt_bias, st_t, slots), warmup=1, iters=3)
        name = str(dt).split(".")[-1]
        results.append(CheckResult(f"gdn_decode {name}", f"B={B} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}", err, tol, inv, ms))

        qs, ks, vs = rnd(T, Hk, Dk).to(dt), rnd(T, Hk, Dk).to(dt), rnd(T, Hv, Dv).to(dt)
        as_, bs = rnd(T, Hv).to(dt), rnd(T, Hv).to(dt)
        st_p, st_r = state0.clone(), state0.clone()
        op = gdn_prefill(qs, ks, vs, as_, bs, A_log, dt_bias, st_p, 1)
        ref = gdn_prefill_ref(qs, ks, vs, as_, bs, A_log, dt_bias, st_r, 1)
        err = max((op - ref).abs().max().item(), (st_p - st_r).abs().max().item())
        st_t = state0.clone()
        ms = timer(lambda: gdn_prefill(qs, ks, vs, as_, bs, A_log, dt_bias, st_t, 1), warmup=1, iters=3)
        results.append(CheckResult(f"gdn_prefill {name}", f"T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv}", err, tol, True, ms,
                                   note="loop over tokens in one kernel"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(gdn_decode, reference=gdn_decode_ref, variants=(GPU, INTERP))
register_op(gdn_prefill, reference=gdn_prefill_ref)
register_op(gdn_prefill_segments, reference=gdn_prefill_segments_ref)
