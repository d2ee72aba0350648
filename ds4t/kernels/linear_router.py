"""A MoE router's linear and its top-k selection as one op.

    logits = linear(x, weight, bias)                                    # fp32 [B, N], N >= E
    (weights, ids) = router(logits[:, :E], ...)                         # the "softmax" or "sigmoid_grouped" router

Shapes and dtypes: x [B, K] (fp32 / bf16 / fp16), weight [N, K] (a float tensor, an
:class:`~ds4t.kernels.weights.FP8Weight` or a :class:`~ds4t.kernels.quant_blocks.GGUFWeight`), bias [N] or None;
returns (weights fp32 [B, k], ids int32 [B, k], logits fp32 [B, N]). Columns past the E experts are logits
other code reads (Qwen3-Next appends its shared-expert gate as row E of the router weight).

Why one op: a router weight is small (E x D), so its launch config splits K to give the decode step enough
programs, and the linear ends with a second kernel that adds the split partials. Here the router kernel adds
them itself, in the same order and then the bias (:func:`ds4t.kernels.router._summed_logits`), and stores the
finished logits for their other readers: the bits of ``linear`` followed by the router, one launch fewer a MoE
layer. An unsplit weight runs the two kernels as before.

Overrides: while ``linear`` or the router op is overridden (:mod:`ds4t.kernels.registry`), this op runs them
as the two calls, so a replacement kernel sees every call it saw before this op existed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds4t.backend import timer
from ds4t.kernels import linear as _linear
from ds4t.kernels import router as _router
from ds4t.kernels.registry import CheckResult, op, ops, register_check, register_op, rows_invariant
from ds4t.kernels.weights import Weight

__all__ = ["linear_router", "linear_router_ref", "router_args", "ROUTER_OPS"]

ROUTER_OPS = {"softmax": "router_softmax_topk", "sigmoid_grouped": "router_sigmoid_grouped"}
"""Router kind -> the router op it runs."""


def router_args(kind: str, top_k: int, renormalize: bool, correction_bias: Optional[torch.Tensor] = None,
                n_group: int = 1, topk_group: int = 1, scaling: float = 1.0) -> tuple:
    """The arguments after the logits of router ``kind``'s op (:data:`ROUTER_OPS`), so that every two-call form
    (this op under an override, its reference, the benchmark twin, the tests) calls the router one way."""
    if kind not in ROUTER_OPS:
        raise ValueError(f"unknown router kind {kind!r}: one of {sorted(ROUTER_OPS)}")
    if kind == "softmax":
        return (top_k, renormalize)
    if correction_bias is None:
        raise ValueError("the sigmoid_grouped router needs its correction_bias")
    return (correction_bias, top_k, n_group, topk_group, renormalize, scaling)


def linear_router(x: torch.Tensor, weight: Weight, num_experts: int, kind: str, top_k: int, renormalize: bool, *,
                  bias: Optional[torch.Tensor] = None, correction_bias: Optional[torch.Tensor] = None,
                  n_group: int = 1, topk_group: int = 1, scaling: float = 1.0,
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights, ids, logits): ``logits = linear(x, weight, bias)`` and the router ``kind`` on its first
    ``num_experts`` columns (:func:`ds4t.kernels.router.router_softmax_topk` with (top_k, renormalize);
    :func:`ds4t.kernels.router.router_sigmoid_grouped` with correction_bias, top_k, n_group, topk_group,
    renormalize, scaling), the linear's split-K partials added inside the router kernel (same bits, one
    launch fewer). Shapes in the module docstring."""
    args = router_args(kind, top_k, renormalize, correction_bias, n_group, topk_group, scaling)
    router_op = ROUTER_OPS[kind]
    if op("linear").overridden or op(router_op).overridden:
        logits = ops.linear(x, weight, bias)
        w, ids = getattr(ops, router_op)(logits[:, :num_experts], *args)
        return w, ids, logits
    parts = _linear.linear_parts(x, weight, bias)
    if parts.splits == 1:
        logits = parts.part[0]
        w, ids = getattr(_router, router_op)(logits[:, :num_experts], *args)
        return w, ids, logits
    return _router.route_partials(parts, num_experts, kind, top_k, renormalize, correction_bias=correction_bias,
                                  n_group=n_group, topk_group=topk_group, scaling=scaling)


def linear_router_ref(x, weight, num_experts, kind, top_k, renormalize, *, bias=None, correction_bias=None,
                      n_group=1, topk_group=1, scaling=1.0):
    """Plain-torch :func:`linear_router`: the references composed."""
    args = router_args(kind, top_k, renormalize, correction_bias, n_group, topk_group, scaling)
    logits = _linear.linear_ref(x, weight, bias)
    ref = getattr(_router, ROUTER_OPS[kind] + "_ref")
    w, ids = ref(logits[:, :num_experts], *args)
    return w, ids, logits


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(4)
    B, K, E, k = 5, 96, 12, 3
    w = (torch.randn(E + 1, K, generator=g) * K ** -0.5).to(device)
    x = torch.randn(B, K, generator=g).to(device)

    def run(t):
        wt, ids, logits = linear_router(t, w, E, "softmax", k, True)
        return torch.cat([wt, ids.float(), logits], 1)

    y = run(x)
    wr, ir, lr = linear_router_ref(x, w, E, "softmax", k, True)
    err = max(((y[:, :k] - wr).abs().max()).item(), ((y[:, 2 * k:] - lr).abs().max() / lr.abs().max()).item()) \
        if torch.equal(y[:, k:2 * k].long(), ir.long()) else float("inf")
    return [CheckResult("linear_router", f"B={B} K={K} E={E}+1 k={k} fp32", err, 1e-5, rows_invariant(run, x),
                        timer(lambda: run(x), warmup=1, iters=3), note="inf if ids differ")]


register_op(linear_router, reference=linear_router_ref)
