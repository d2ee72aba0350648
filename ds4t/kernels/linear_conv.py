"""A linear whose first C output columns go straight into the depthwise causal conv's decode step: Qwen3-Next's
Gated DeltaNet input projection (q | k | v | z | b | a) and the conv over its q | k | v channels.

    y = linear(x, weight, bias)                                               # fp32 [B, N], N >= C
    conv = conv1d_update(y[:, :C], conv_state, conv_weight, slots, ...)       # fp32 [B, C]

Shapes and dtypes: x [B, K] (fp32 / bf16 / fp16), weight [N, K] (a float tensor, an
:class:`~ds4t.kernels.weights.FP8Weight` or a :class:`~ds4t.kernels.quant_blocks.GGUFWeight`), bias [N] or None;
conv_state [S, C, W-1] fp32 (updated in place), conv_weight [C, W], slots [B] int32 (distinct); returns (conv
fp32 [B, C], y fp32 [B, N]). The columns past C (z, b, a) are read by the recurrence and its output norm.

Why one op: the projection's launch config splits K at decode shapes, and the linear ends with a second kernel
that adds the split partials. Here the conv kernel adds them itself, in the same order and then the bias
(:func:`ds4t.backend.split_sum_bias`), stores the finished columns for their other readers, and convolves its
channels from the registers it summed: the bits of ``linear`` followed by ``conv1d_update``, one launch fewer
a Gated DeltaNet layer. An unsplit weight (or the interpreter's conv rows path) runs the two kernels as before.

Overrides: while ``linear`` or ``conv1d_update`` is overridden (:mod:`ds4t.kernels.registry`), this op runs them
as the two calls, so a replacement kernel sees every call it saw before this op existed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds4t.backend import timer
from ds4t.kernels import conv as _conv
from ds4t.kernels import linear as _linear
from ds4t.kernels.registry import INTERP, CheckResult, op, ops, register_check, register_op, rows_invariant, variant
from ds4t.kernels.weights import Weight

__all__ = ["linear_conv1d_update", "linear_conv1d_update_ref"]


def linear_conv1d_update(x: torch.Tensor, weight: Weight, conv_state: torch.Tensor, conv_weight: torch.Tensor,
                         slots: torch.Tensor, *, bias: Optional[torch.Tensor] = None,
                         conv_bias: Optional[torch.Tensor] = None, silu: bool = True
                         ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(conv, y): ``y = linear(x, weight, bias)`` and ``conv1d_update`` of its first C = conv_weight.shape[0]
    columns (``conv_bias``, ``silu`` as there), the linear's split-K partials added inside the conv kernel (same
    bits, one launch fewer). Shapes in the module docstring."""
    C = conv_weight.shape[0]
    conv_kw = dict(bias=conv_bias, silu=silu)
    if op("linear").overridden or op("conv1d_update").overridden:
        y = ops.linear(x, weight, bias)
        return ops.conv1d_update(y[:, :C], conv_state, conv_weight, slots, **conv_kw), y
    if weight.shape[0] < C:
        raise ValueError(f"linear_conv1d_update: the linear has {weight.shape[0]} output columns, the conv {C}")
    parts = _linear.linear_parts(x, weight, bias)
    if parts.splits > 1 and variant("conv1d_update") != INTERP:
        return _conv.conv1d_update_partials(parts, conv_state, conv_weight, slots, **conv_kw)
    y = parts.part[0]
    if parts.splits > 1:
        y = _linear.finish_splits(parts.part, parts.bias, torch.empty_like(y))
    return _conv.conv1d_update(y[:, :C], conv_state, conv_weight, slots, **conv_kw), y


def linear_conv1d_update_ref(x, weight, conv_state, conv_weight, slots, *, bias=None, conv_bias=None, silu=True):
    """Plain-torch :func:`linear_conv1d_update`: the references composed."""
    y = _linear.linear_ref(x, weight, bias)
    conv = _conv.conv1d_update_ref(y[:, :conv_weight.shape[0]], conv_state, conv_weight, slots, bias=conv_bias,
                                   silu=silu)
    return conv, y


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(6)
    B, K, C, N, W, S = 4, 96, 40, 56, 4, 6
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device)
    cw = (0.5 * torch.randn(C, W, generator=g)).to(device)
    state0 = torch.randn(S, C, W - 1, generator=g).to(device)
    # one row of t: x, then the row's slot (as a float) -- rows_invariant slices rows
    t = torch.cat([torch.randn(B, K, generator=g), torch.tensor([[3.0], [0.0], [5.0], [1.0]])], 1).to(device)

    def run(t, fn=linear_conv1d_update):
        st = state0.clone()
        slots = t[:, K].to(torch.int32)
        conv, y = fn(t[:, :K], w, st, cw, slots)
        return torch.cat([conv, y, st[slots.long()].flatten(1)], 1)

    got, want = run(t), run(t, linear_conv1d_update_ref)
    err = ((got - want).abs().max() / want.abs().max()).item()
    return [CheckResult("linear_conv1d_update", f"B={B} K={K} N={N} C={C} W={W} fp32", err, 1e-5,
                        rows_invariant(run, t), timer(lambda: run(t), warmup=1, iters=3), note="relative to max|ref|")]


register_op(linear_conv1d_update, reference=linear_conv1d_update_ref)
