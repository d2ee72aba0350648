"""A linear whose output goes straight into the residual add + RMSNorm: the last projection of a mixer
(``o_proj``, ``out_proj``) or of a dense MLP (``down_proj``), and the norm after it.

    (normed, summed) = add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)

Shapes and dtypes: those of the two ops -- x [B, K] (fp32 / bf16 / fp16), weight [N, K] (a float tensor,
an :class:`~ds4t.kernels.weights.FP8Weight` or a :class:`~ds4t.kernels.quant_blocks.GGUFWeight`), bias [N]
or None, residual [B, N] (any float), norm_weight [N]; returns (normed [B, N] in ``out_dtype``, summed fp32
[B, N]).

Why one op: a weight whose launch config splits K (decode shapes with few output tiles need the extra
programs) ends with a second kernel that adds the S fp32 partials. Here the norm kernel adds them itself,
in the same order and then the bias (:func:`ds4t.kernels.norm._load_x`), so the result is the bits of
``linear`` followed by ``add_rms_norm`` with one launch fewer; an unsplit weight runs the two kernels as
before. At one row a launch costs ~1.2 us of an H200 step in a CUDA graph however little it does.

Overrides: while ``linear`` or ``add_rms_norm`` is overridden (:mod:`ds4t.kernels.registry`), this op runs
them as the two calls, so a replacement kernel sees every call it saw before this op existed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds4t.backend import timer
from ds4t.kernels import linear as _linear
from ds4t.kernels import norm as _norm
from ds4t.kernels.registry import CheckResult, op, ops, register_check, register_op, rows_invariant
from ds4t.kernels.weights import Weight

__all__ = ["linear_add_rms_norm", "linear_add_rms_norm_ref"]


def linear_add_rms_norm(x: torch.Tensor, weight: Weight, residual: torch.Tensor, norm_weight: torch.Tensor,
                        eps: float, *, bias: Optional[torch.Tensor] = None, zero_centered: bool = False,
                        out_dtype: torch.dtype = torch.float32) -> Tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed) = ``add_rms_norm(linear(x, weight, bias), residual, norm_weight, eps)``, the split-K
    partials of the linear added inside the norm kernel (same bits, one launch fewer). Arguments as
    :func:`ds4t.kernels.linear.linear` and :func:`ds4t.kernels.norm.add_rms_norm`."""
    if op("linear").overridden or op("add_rms_norm").overridden:
        y = ops.linear(x, weight, bias)
        return ops.add_rms_norm(y, residual, norm_weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)
    parts = _linear.linear_parts(x, weight, bias)
    return _norm.add_rms_norm(parts, residual, norm_weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)


def linear_add_rms_norm_ref(x, weight, residual, norm_weight, eps, *, bias=None, zero_centered=False,
                            out_dtype=torch.float32):
    """Plain-torch :func:`linear_add_rms_norm`: the two references composed."""
    y = _linear.linear_ref(x, weight, bias)
    return _norm.add_rms_norm_ref(y, residual, norm_weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(3)
    B, K, N, eps = 5, 96, 80, 1e-6
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(device)
    b = (0.1 * torch.randn(N, generator=g)).to(device)
    nw = (1 + 0.2 * torch.randn(N, generator=g)).to(device)
    t = torch.cat([torch.randn(B, K, generator=g), torch.randn(B, N, generator=g)], 1).to(device)

    def run(t):
        return torch.cat(linear_add_rms_norm(t[:, :K], w, t[:, K:], nw, eps, bias=b), 1)

    def ref(t):
        return torch.cat(linear_add_rms_norm_ref(t[:, :K], w, t[:, K:], nw, eps, bias=b), 1)

    y, yr = run(t), ref(t)
    err = ((y - yr).abs().max() / yr.abs().max()).item()
    return [CheckResult("linear_add_rms_norm", f"B={B} K={K} N={N} fp32", err, 1e-5, rows_invariant(run, t),
                        timer(lambda: run(t), warmup=1, iters=3), note="relative to max|ref|")]


register_op(linear_add_rms_norm, reference=linear_add_rms_norm_ref)
