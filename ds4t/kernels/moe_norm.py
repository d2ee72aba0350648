"""A MoE block's routed experts whose output goes straight into the residual add + RMSNorm after them.

    (normed, summed) = add_rms_norm(moe_experts(h, ids, weights, w_gate, w_up, w_down, ...), residual,
                                    norm_weight, eps)

Shapes and dtypes: those of the two ops -- h [B, D], ids [B, k], weights [B, k] fp32, the expert weights
(float tensors of one dtype, three :class:`~ds4t.kernels.weights.FP8Weight` or three
:class:`~ds4t.kernels.quant_blocks.GGUFWeight`), residual [B, D] (any float), norm_weight [D]; returns
(normed [B, D] in ``out_dtype``, summed fp32 [B, D]).

Why one op: ``moe_experts`` ends with a kernel that combines each row's per-pair outputs over its ranks in
rank order (the routing weight times each expert's output, the shared expert last). Here the norm kernel
does that combine itself with the same device function (:func:`ds4t.kernels.moe.combine_rows`), then adds
the residual, so the result is the bits of ``moe_experts`` followed by ``add_rms_norm`` with one launch
fewer a MoE layer. Launches of fewer than :data:`FUSE_MIN_ROWS` rows run the two kernels (faster there, the
same bits). Where ``moe_experts`` finishes the rows itself (the interpreter's rows path) the norm gets them
finished.

Overrides: while ``moe_experts`` or ``add_rms_norm`` is overridden (:mod:`ds4t.kernels.registry`), this op
runs them as the two calls, so a replacement kernel sees every call it saw before this op existed.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds4t.backend import timer
from ds4t.kernels import moe as _moe
from ds4t.kernels import norm as _norm
from ds4t.kernels.registry import CheckResult, op, ops, register_check, register_op, rows_invariant

__all__ = ["moe_add_rms_norm", "moe_add_rms_norm_ref", "FUSE_MIN_ROWS"]

FUSE_MIN_ROWS = 8
"""Launches of fewer rows run the combine kernel, then the norm (the same bits: the choice is free per launch).
The norm kernel has one program a row, the combine kernel one a 256-column block of a row, so at a few rows the
fused combine runs on too few SMs: on an H200, Qwen3-Next-80B in FP8 at 4k (``bench/step_ab.py``, the fused op
against its two calls, one process) the fused step was 1.2 % slower at N = 1, 0.7 % at N = 4, and 0.9 % faster
at N = 8 and 16, 0.1 % at N = 64 (bench/results/2026-12-03-h200-fused-combine.md)."""


def moe_add_rms_norm(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate, w_up, w_down,
                     residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, *,
                     shared_expert: Optional[int] = None, shared_gate: Optional[torch.Tensor] = None,
                     zero_centered: bool = False, out_dtype: torch.dtype = torch.float32
                     ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed) = ``add_rms_norm(moe_experts(...), residual, norm_weight, eps)``, the rank-ordered
    combine inside the norm kernel (same bits, one launch fewer). Arguments as
    :func:`ds4t.kernels.moe.moe_experts` and :func:`ds4t.kernels.norm.add_rms_norm`."""
    moe_kw = dict(shared_expert=shared_expert, shared_gate=shared_gate)
    norm_kw = dict(zero_centered=zero_centered, out_dtype=out_dtype)
    if op("moe_experts").overridden or op("add_rms_norm").overridden:
        y = ops.moe_experts(h, ids, weights, w_gate, w_up, w_down, **moe_kw)
        return ops.add_rms_norm(y, residual, norm_weight, eps, **norm_kw)
    if h.shape[0] < FUSE_MIN_ROWS:
        y = _moe.moe_experts(h, ids, weights, w_gate, w_up, w_down, **moe_kw)
        return _norm.add_rms_norm(y, residual, norm_weight, eps, **norm_kw)
    parts = _moe.moe_partials(h, ids, weights, w_gate, w_up, w_down, **moe_kw)
    return _norm.add_rms_norm(parts, residual, norm_weight, eps, **norm_kw)


def moe_add_rms_norm_ref(h, ids, weights, w_gate, w_up, w_down, residual, norm_weight, eps, *, shared_expert=None,
                         shared_gate=None, zero_centered=False, out_dtype=torch.float32):
    """Plain-torch :func:`moe_add_rms_norm`: the two references composed."""
    y = _moe.moe_experts_ref(h, ids, weights, w_gate, w_up, w_down, shared_expert=shared_expert,
                             shared_gate=shared_gate)
    return _norm.add_rms_norm_ref(y, residual, norm_weight, eps, zero_centered=zero_centered, out_dtype=out_dtype)


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(4)
    B, E, k, D, I, eps = 5, 8, 2, 48, 32, 1e-6
    wg, wu = ((torch.randn(E, I, D, generator=g) * D ** -0.5).to(device) for _ in range(2))
    wd = (torch.randn(E, D, I, generator=g) * I ** -0.5).to(device)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(B)]).to(device, torch.int32)
    wts = torch.rand(B, k, generator=g).to(device)
    gate = torch.randn(B, generator=g).to(device)
    nw = (1 + 0.2 * torch.randn(D, generator=g)).to(device)
    # one row of t: h, residual, ids (as floats), routing weights, shared gate -- rows_invariant slices rows
    t = torch.cat([torch.randn(B, 2 * D, generator=g), ids.float().cpu(), wts.cpu(), gate[:, None].cpu()], 1).to(device)

    def run(t, fn=moe_add_rms_norm):
        h, r, i, w, sg = t[:, :D], t[:, D:2 * D], t[:, 2 * D:2 * D + k], t[:, 2 * D + k:2 * D + 2 * k], t[:, -1]
        return torch.cat(fn(h, i.to(torch.int32), w.contiguous(), wg, wu, wd, r, nw, eps, shared_gate=sg.contiguous(),
                            shared_expert=E - 1), 1)

    y, yr = run(t), run(t, moe_add_rms_norm_ref)
    err = ((y - yr).abs().max() / yr.abs().max()).item()
    return [CheckResult("moe_add_rms_norm", f"B={B} E={E} k={k}+1 D={D} I={I} fp32", err, 1e-4,
                        rows_invariant(run, t), timer(lambda: run(t), warmup=1, iters=3), note="relative to max|ref|")]


register_op(moe_add_rms_norm, reference=moe_add_rms_norm_ref)
