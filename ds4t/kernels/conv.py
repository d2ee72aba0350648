"""Depthwise causal conv1d with a per-session state (Qwen3-Next Gated DeltaNet front end).

State model: a per-layer pool ``conv_state`` [S, C, W-1] float32, one slot per session, holding
the last W-1 inputs of the conv (oldest first; zeros for a fresh session). Each batch row names
its slot; kernels read the slot's history and update it in place.

For one channel c and one output position, with ``inp = [state[c, 0], ..., state[c, W-2], x[c]]``::

    acc = bias[c] (or 0)
    for j in 0..W-1:  acc = acc + w[c, j] * inp[j]        # always this order
    out = silu(acc) if silu else acc

Numerics: inputs/weights/bias of any float dtype are upcast to fp32; all arithmetic is fp32; the
state stores the fp32 value of each input (bf16 inputs are exact in it). The decode kernel and
the prefill kernel evaluate each output with the same expression in the same order, so prefill
equals successive decodes bitwise (checked in the interpreter by tests/kernels/test_conv.py).

Batch invariance: one program per (row, channel block); the channel block depends on C only;
there is no reduction across rows. Rows must name distinct slots. Prefill: one program per (segment,
channel block, token tile), a segment being one session's consecutive rows (``conv1d_prefill_segments``
runs every session's chunk of a step in one launch; ``conv1d_prefill`` is its one-segment case). Outputs
are independent, so token tiles run in parallel; the tile changes no operation an output sees.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency, split_sum_bias, timer
from ds4t.backend import silu as _silu
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.interp import conv_rows
from ds4t.kernels.registry import GPU, INTERP, CheckResult, register_check, register_op, variant
from ds4t.kernels.tensors import SplitPartials, check_segments, one_segment


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """Launch constants of the conv kernels: channels per program, and tokens per tile in prefill
    (the tile never changes which operations an output sees). Warps: Triton's default."""
    block_c: int
    block_t: int


CONV_CONFIGS: ConfigTable[ConvConfig] = ConfigTable(
    "conv1d", gpu={},
    gpu_rule=lambda C: ConvConfig(block_c=min(256, triton.next_power_of_2(C)), block_t=16),
    interp_rule=lambda C: ConvConfig(block_c=triton.next_power_of_2(C), block_t=64),  # few, big programs
    source="rule: 256 channels per program, 16 tokens per prefill tile (tiles in parallel programs: "
           "bench/results/2026-11-30-h200-prefill-round3.md, 6.5x the sequential tile loop); not swept")
"""Keyed on the channel count C."""


@triton.jit
def _conv1d_update_kernel(
    x_ptr, sx_b, sx_c,
    state_ptr, ss_s, ss_c, ss_w,
    w_ptr, sw_c, sw_w,
    bias_ptr,
    slots_ptr,
    out_ptr, so_b, so_c,
    C,
    W: tl.constexpr, BW: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
    SPLIT: tl.constexpr = 0, stride_ps=0, pb_ptr=None, HAS_PB: tl.constexpr = False, y_ptr=None, sy_b=0, N=0,
):
    """SPLIT > 0: x is a linear's split-K partials [SPLIT, B, N] (split stride ``stride_ps``, N >= C columns)
    with its bias ``pb_ptr`` (HAS_PB): each program finishes its channels' columns as the linear's sum kernel
    would (:func:`ds4t.backend.split_sum_bias`) and stores them to y [B, N] (row stride ``sy_b``) before the
    conv reads them; the programs past cdiv(C, BC) on grid axis 1 finish and store columns C .. N, which the
    conv does not read."""
    # Index math in int64 (no overflow on big pools; also skips the interpreter's int32
    # overflow checks, which cost more than the arithmetic).
    grid_dependency()
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    if SPLIT > 0:
        if tl.program_id(1) * BC >= C:     # a block of the linear's other columns: finish, store, done
            n = C + (tl.program_id(1).to(tl.int64) * BC - tl.cdiv(C, BC) * BC) + tl.arange(0, BC)
            nm = n < N
            v = split_sum_bias(x_ptr + r * sx_b + n * sx_c, nm, stride_ps, SPLIT, pb_ptr + n, HAS_PB)
            tl.store(y_ptr + r * sy_b + n, v, mask=nm)
            return
    cm = c < C
    slot = tl.load(slots_ptr + r).to(tl.int64)
    sbase = state_ptr + slot * ss_s + c * ss_c       # [BC] pointers to state[slot, c, 0]
    wbase = w_ptr + c * sw_c

    if SPLIT > 0:
        xv = split_sum_bias(x_ptr + r * sx_b + c * sx_c, cm, stride_ps, SPLIT, pb_ptr + c, HAS_PB)
        tl.store(y_ptr + r * sy_b + c, xv, mask=cm)
    else:
        xv = tl.load(x_ptr + r * sx_b + c * sx_c, mask=cm, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BC], dtype=tl.float32)
    # Taps over the history (oldest first), then the new input: the fixed order.
    sp = sbase
    wp = wbase
    for j in tl.static_range(W - 1):
        sj = tl.load(sp, mask=cm, other=0.0)
        wj = tl.load(wp, mask=cm, other=0.0).to(tl.float32)
        acc = acc + wj * sj
        sp += ss_w
        wp += sw_w
    wl = tl.load(wp, mask=cm, other=0.0).to(tl.float32)
    acc = acc + wl * xv
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + r * so_b + c * so_c, acc, mask=cm)

    # Shift the history left and append x: new[i] = state[i + 1] (i < W-2), new[W-2] = x. All
    # reads of the slot come before the barrier, all writes after it (threads may own
    # different columns of the same channel).
    i = tl.arange(0, BW).to(tl.int64)
    iw = i * ss_w
    m2 = cm[:, None] & (i < W - 2)[None, :]
    sptr = sbase[:, None] + iw[None, :]
    sh = tl.load(sptr + ss_w, mask=m2, other=0.0)
    new = tl.where((i == W - 2)[None, :], xv[:, None], sh)
    tl.debug_barrier()
    tl.store(sptr, new, mask=cm[:, None] & (i < W - 1)[None, :])


@triton.jit
def _conv1d_prefill_kernel(
    x_ptr, sx_t, sx_c,
    state_ptr, ss_s, ss_c, ss_w,
    w_ptr, sw_c, sw_w,
    bias_ptr,
    out_ptr, so_t, so_c,
    seg_ptr, C,
    W: tl.constexpr, BW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    # Program (segment, channel block, token tile): segment g is seg[g] = (first row, T rows, slot, -) of
    # x / out, its history in state[slot]; the program computes tokens [BT * tile, BT * (tile + 1)) of it
    # (none if the tile starts past T). Outputs are independent, so tiles run in parallel. Only tile 0
    # reads the history (token t reads it for t < W-1 <= BT), so tile 0 alone writes the new history,
    # after its reads: no other program touches the slot. Index math in int64 (see above).
    grid_dependency()
    g = tl.program_id(0).to(tl.int64) * 4
    tile = tl.program_id(2).to(tl.int64)
    r0 = tl.load(seg_ptr + g).to(tl.int64)
    T = tl.load(seg_ptr + g + 1).to(tl.int64)
    state_ptr += tl.load(seg_ptr + g + 2).to(tl.int64) * ss_s
    x_ptr += r0 * sx_t
    out_ptr += r0 * so_t
    c = tl.program_id(1).to(tl.int64) * BC + tl.arange(0, BC)
    cm = c < C
    xc = x_ptr + c * sx_c
    sc = state_ptr + c * ss_c
    wc = w_ptr + c * sw_c
    t = tile * BT + tl.arange(0, BT).to(tl.int64)
    m2 = (t < T)[:, None] & cm[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
        acc = tl.zeros([BT, BC], dtype=tl.float32) + bias[None, :]
    else:
        acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(W):
        # input j of output t is concat(history, x)[t + j]; x position p = t + j - (W-1)
        p = t + (j - (W - 1))
        from_x = (p >= 0)[:, None]
        xv = tl.load(xc[None, :] + (p * sx_t)[:, None], mask=m2 & from_x, other=0.0).to(tl.float32)
        sv = tl.load(sc[None, :] + ((t + j) * ss_w)[:, None], mask=m2 & (p < 0)[:, None], other=0.0)
        inp = tl.where(from_x, xv, sv)
        wj = tl.load(wc + j * sw_w, mask=cm, other=0.0).to(tl.float32)
        acc = acc + wj[None, :] * inp
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + (t * so_t)[:, None] + (c * so_c)[None, :], acc, mask=m2)

    # New history (tile 0 only): concat(history, x)[T + i] for i < W-1. All reads of the slot precede
    # the barrier, all writes follow it.
    i = tl.arange(0, BW).to(tl.int64)
    p = i + (T - (W - 1))
    m2 = cm[:, None] & tl.where(tile == 0, i < W - 1, False)[None, :]
    xv = tl.load(xc[:, None] + (p * sx_t)[None, :], mask=m2 & (p >= 0)[None, :], other=0.0).to(tl.float32)
    sv = tl.load(sc[:, None] + ((i + T) * ss_w)[None, :], mask=m2 & (p < 0)[None, :], other=0.0)
    new = tl.where((p >= 0)[None, :], xv, sv)
    tl.debug_barrier()
    tl.store(sc[:, None] + (i * ss_w)[None, :], new, mask=m2)


def _out(out, shape, device):
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != tuple(shape) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 {tuple(shape)}, got {out.dtype} {tuple(out.shape)}")
    return out


def _check_args(x, conv_state, weight, bias):
    if weight.dim() != 2:
        raise ValueError(f"weight must be [C, W] (squeeze HF's [C, 1, W]), got {tuple(weight.shape)}")
    C, W = weight.shape
    if W < 2:
        raise ValueError(f"conv width W={W} not supported (W >= 2)")
    if conv_state.dtype != torch.float32 or conv_state.dim() != 3 or conv_state.shape[1:] != (C, W - 1):
        raise ValueError(f"conv_state must be float32 [S, {C}, {W - 1}], got {conv_state.dtype} {tuple(conv_state.shape)}")
    if x.shape[-1] != C:
        raise ValueError(f"x has {x.shape[-1]} channels, weight has {C}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [{C}]")
    return C, W


def conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    silu: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One decode step of the depthwise causal conv for B rows of B distinct sessions.

    x [B, C] (fp32/bf16/fp16), conv_state [S, C, W-1] fp32 (updated in place: the slot's history
    shifted left with x appended), weight [C, W], slots [B] int32 (distinct), bias [C] or None.
    Returns fp32 [B, C] (``out`` if given): act(bias + sum_j w[:, j] * concat(state, x)[:, j]).
    """
    C, W = _check_args(x, conv_state, weight, bias)
    B = x.shape[0]
    out = _out(out, (B, C), x.device)
    if B == 0:
        return out
    BC = CONV_CONFIGS(C).block_c
    if variant("conv1d_update") == INTERP:
        conv_rows.launch_update(x, conv_state, weight, slots, bias, silu, out, BC)
        return out
    _launch_update(x, conv_state, weight, slots, bias, silu, out, B, C, W, BC, triton.cdiv(C, BC), {})
    return out


def _launch_update(x, conv_state, weight, slots, bias, silu, out, B, C, W, BC, blocks, extra):
    _conv1d_update_kernel[(B, blocks)](
        x, x.stride(-2), x.stride(-1),
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        slots,
        out, out.stride(0), out.stride(1),
        C,
        W=W, BW=triton.next_power_of_2(W - 1), BC=BC, HAS_BIAS=bias is not None, SILU=silu, **extra, **LAUNCH,
    )


def conv1d_update_partials(parts: SplitPartials, conv_state: torch.Tensor, weight: torch.Tensor,
                           slots: torch.Tensor, *, bias: Optional[torch.Tensor] = None, silu: bool = True
                           ) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv1d_update` of the first C columns of a linear's output given as its split-K partials
    (:class:`~ds4t.kernels.tensors.SplitPartials` [S, B, N], N >= C), finished in the conv kernel in the
    linear's order (the bits its sum kernel would store). Returns (conv output fp32 [B, C], the linear's
    finished output fp32 [B, N], every column: its other readers take columns C .. N from it). The grouped
    kernel of :func:`conv1d_update`; ``conv_state`` is updated as there."""
    part = parts.part
    if part.dim() != 3 or part.dtype != torch.float32 or not part.is_contiguous():
        raise ValueError(f"split partials must be contiguous fp32 [S, B, N], got {part.dtype} {list(part.shape)}")
    S, B, N = part.shape
    C, W = _check_args(part[0, :, :weight.shape[0]], conv_state, weight, bias)
    if parts.bias is not None and parts.bias.shape != (N,):
        raise ValueError(f"split partials' bias must be [{N}], got {tuple(parts.bias.shape)}")
    out = torch.empty((B, C), dtype=torch.float32, device=part.device)
    y = torch.empty((B, N), dtype=torch.float32, device=part.device)
    if B == 0:
        return out, y
    BC = CONV_CONFIGS(C).block_c
    pb = parts.bias.contiguous() if parts.bias is not None else y
    extra = dict(SPLIT=S, stride_ps=part.stride(0), pb_ptr=pb, HAS_PB=parts.bias is not None, y_ptr=y,
                 sy_b=y.stride(0), N=N)
    _launch_update(part[0], conv_state, weight, slots, bias, silu, out, B, C, W, BC,
                   triton.cdiv(C, BC) + triton.cdiv(N - C, BC), extra)
    return out, y


def conv1d_prefill_segments(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    segments: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    silu: bool = True,
    out: Optional[torch.Tensor] = None,
    max_rows: Optional[int] = None,
) -> torch.Tensor:
    """Several sessions' consecutive tokens in one launch: segment g = ``segments[g]`` = (first row r0,
    T rows, slot, -) runs rows r0 .. r0+T-1 of x [R, C] from ``conv_state[slot]``, exactly as
    :func:`conv1d_prefill` would alone (programs per segment, channel block and token tile; slots
    distinct). ``max_rows``: the longest segment's T when the caller knows it on the host (it bounds the
    grid; the table stays on the device); default R. Returns fp32 [R, C] (``out`` if given); rows
    outside every segment are not written."""
    C, W = _check_args(x, conv_state, weight, bias)
    R = x.shape[0]
    out = _out(out, (R, C), x.device)
    M = check_segments(segments, "conv1d_prefill_segments")
    if R == 0 or M == 0:
        return out
    cfg = CONV_CONFIGS(C)
    BC = cfg.block_c
    if cfg.block_t < W - 1:
        raise ValueError(f"conv1d prefill: token tile {cfg.block_t} < W-1 = {W - 1} (tile 0 must hold every "
                         "history reader)")
    rows = R if max_rows is None else int(max_rows)
    if not 0 < rows <= R:
        raise ValueError(f"max_rows must be in 1..{R} (the rows of x), got {max_rows}")
    grid = (M, triton.cdiv(C, BC), triton.cdiv(rows, cfg.block_t))
    if grid[2] > 65535:   # CUDA's limit on a grid's third axis
        raise ValueError(f"conv1d prefill: a segment of {rows} rows needs {grid[2]} token tiles of "
                         f"{cfg.block_t}, more than one launch holds (65535); prefill in chunks")
    _conv1d_prefill_kernel[grid](
        x, x.stride(0), x.stride(1),
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        out, out.stride(0), out.stride(1),
        segments, C,
        W=W, BW=triton.next_power_of_2(W - 1), BT=cfg.block_t, BC=BC, HAS_BIAS=bias is not None, SILU=silu, **LAUNCH,
    )
    return out


def conv1d_prefill(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slot: int,
    *,
    bias: Optional[torch.Tensor] = None,
    silu: bool = True,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """T consecutive tokens of one session: x [T, C], history from ``conv_state[slot]``.

    Leaves the last W-1 inputs of concat(history, x) in the slot (history included when
    T < W-1). Returns fp32 [T, C]; bitwise equal to T successive :func:`conv1d_update` calls.
    (One segment of :func:`conv1d_prefill_segments`.)
    """
    return conv1d_prefill_segments(x, conv_state, weight, one_segment(x.shape[0], slot, x.device),
                                   bias=bias, silu=silu, out=out)


# ----------------------------------------------------------------------------- references


def conv1d_update_ref(x, conv_state, weight, slots, *, bias=None, silu=True, out=None):
    """Plain-torch :func:`conv1d_update` (same signature, same in-place state update)."""
    C, W = weight.shape
    idx = slots.long()
    hist = conv_state[idx]                                            # [B, C, W-1]
    inp = torch.cat([hist, x.float()[:, :, None]], dim=-1)            # [B, C, W]
    w = weight.float()
    acc = bias.float().expand(x.shape[0], C).clone() if bias is not None else torch.zeros(
        x.shape[0], C, dtype=torch.float32, device=x.device)
    for j in range(W):
        acc = acc + w[:, j] * inp[:, :, j]
    if silu:
        acc = acc / (1.0 + torch.exp(-acc))
    conv_state[idx] = inp[:, :, 1:]
    if out is not None:
        out.copy_(acc)
        return out
    return acc


def conv1d_prefill_ref(x, conv_state, weight, slot, *, bias=None, silu=True, out=None):
    """Plain-torch :func:`conv1d_prefill`: T successive :func:`conv1d_update_ref` steps."""
    slots = torch.tensor([slot], dtype=torch.int32, device=x.device)
    res = torch.stack(
        [conv1d_update_ref(x[t : t + 1], conv_state, weight, slots, bias=bias, silu=silu)[0] for t in range(x.shape[0])]
    ) if x.shape[0] else torch.empty((0, weight.shape[0]), dtype=torch.float32, device=x.device)
    if out is not None:
        out.copy_(res)
        return out
    return res


def conv1d_prefill_segments_ref(x, conv_state, weight, segments, *, bias=None, silu=True, out=None, max_rows=None):
    """Plain-torch :func:`conv1d_prefill_segments`: :func:`conv1d_prefill_ref` per segment, in order
    (``max_rows`` only bounds the kernel's grid)."""
    out = torch.full((x.shape[0], weight.shape[0]), float("nan"), device=x.device) if out is None else out
    for r0, n, slot, _ in segments.tolist():
        out[r0:r0 + n] = conv1d_prefill_ref(x[r0:r0 + n], conv_state, weight, slot, bias=bias, silu=silu)
    return out


# ----------------------------------------------------------------------------- self-check


@register_check
def _check(device) -> List[CheckResult]:
    g = torch.Generator().manual_seed(0)
    results = []
    S, B, C, W, T = 6, 5, 200, 4, 7
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-5)):
        w = (torch.randn(C, W, generator=g) * 0.5).to(device, dt)
        bias = (torch.randn(C, generator=g) * 0.1).to(device, dt)
        x = torch.randn(B, C, generator=g).to(device, dt)
        state0 = torch.randn(S, C, W - 1, generator=g).to(device)
        slots = torch.tensor([3, 0, 5, 1, 4], dtype=torch.int32, device=device)

        def run(rows):
            st = state0.clone()
            o = conv1d_update(x[rows], st, w, slots[rows], bias=bias)
            return o, st

        o, st = run(list(range(B)))
        st_r = state0.clone()
        ref = conv1d_update_ref(x, st_r, w, slots, bias=bias)
        err = max((o - ref).abs().max().item(), (st - st_r).abs().max().item())
        inv = True
        for i in range(B):
            oi, sti = run([i])
            s = slots[i].item()
            inv &= torch.equal(oi[0], o[i]) and torch.equal(sti[s], st[s])
        st_t = state0.clone()
        ms = timer(lambda: conv1d_update(x, st_t, w, slots, bias=bias), warmup=1, iters=3)
        results.append(CheckResult(f"conv1d_update {str(dt).split('.')[-1]}", f"B={B} C={C} W={W}", err, tol, inv, ms))

        xs = torch.randn(T, C, generator=g).to(device, dt)
        st_p, st_d = state0.clone(), state0.clone()
        op = conv1d_prefill(xs, st_p, w, 2, bias=bias)
        sl = torch.tensor([2], dtype=torch.int32, device=device)
        od = torch.stack([conv1d_update(xs[t : t + 1], st_d, w, sl, bias=bias)[0] for t in range(T)])
        err = max((op - od).abs().max().item(), (st_p - st_d).abs().max().item())
        st_t = state0.clone()
        ms = timer(lambda: conv1d_prefill(xs, st_t, w, 2, bias=bias), warmup=1, iters=3)
        results.append(CheckResult(f"conv1d_prefill {str(dt).split('.')[-1]}", f"T={T} C={C} W={W}", err, tol, True, ms,
                                   note="max_err vs successive conv1d_update"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(conv1d_update, reference=conv1d_update_ref, variants=(GPU, INTERP))
register_op(conv1d_prefill, reference=conv1d_prefill_ref)
register_op(conv1d_prefill_segments, reference=conv1d_prefill_segments_ref)
