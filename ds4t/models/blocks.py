"""Pieces every family composes: dense SwiGLU MLP, routed MoE with shared experts, RoPE tables.

Each is written once here and used by qwen.py, deepseek.py and glm.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

from ds4t.kernels import activation, linear, moe, router


def fused_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [R, N] = x [R, K] @ w [N, K]^T (+ b); the decode linear kernel."""
    return linear.linear(x, w, b)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x) with gate and up fused into one weight [2I, D]."""
    gu = fused_linear(x, w_gate_up)
    i = w_gate_up.shape[0] // 2
    return fused_linear(activation.silu_mul(gu[:, :i].contiguous(), gu[:, i:].contiguous()), w_down)


@dataclasses.dataclass
class MoEWeights:
    """A routed-expert block. router [E(+1), D]: the router, plus the shared-expert gate row
    appended when the family gates its shared expert (Qwen3-Next); experts stacked per expert."""

    router: torch.Tensor
    w_gate: torch.Tensor          # [E, I, D]
    w_up: torch.Tensor            # [E, I, D]
    w_down: torch.Tensor          # [E, D, I]
    shared_gate_up: Optional[torch.Tensor] = None   # [2*Is, D]
    shared_down: Optional[torch.Tensor] = None      # [D, Is]
    shared_gated: bool = False                       # sigmoid(router row E) scales the shared expert
    correction_bias: Optional[torch.Tensor] = None  # [E] fp32, sigmoid routers only


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    kind: str            # "softmax" (Qwen3-Next) or "sigmoid_grouped" (DeepSeek-V3, GLM-4.5)
    num_experts: int
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


def moe_block(x: torch.Tensor, w: MoEWeights, rc: RouterConfig) -> torch.Tensor:
    """Routed experts (combined per token in top-k rank order) + shared experts. x fp32 [R, D]."""
    logits = fused_linear(x, w.router)
    e = rc.num_experts
    scores = logits[:, :e].contiguous() if logits.shape[1] != e else logits
    if rc.kind == "softmax":
        weights, ids = router.router_softmax_topk(scores, rc.top_k, rc.renormalize)
    elif rc.kind == "sigmoid_grouped":
        weights, ids = router.router_sigmoid_grouped(
            scores, w.correction_bias, rc.top_k, rc.n_group, rc.topk_group, rc.renormalize, rc.scaling)
    else:
        raise ValueError(f"unknown router kind {rc.kind!r}")
    out = moe.moe_experts(x, ids, weights, w.w_gate, w.w_up, w.w_down)
    if w.shared_gate_up is not None:
        shared = swiglu(x, w.shared_gate_up, w.shared_down)
        if w.shared_gated:
            gate = logits[:, e:e + 1].expand_as(shared).contiguous()
            shared = activation.sigmoid_mul(shared, gate)
        out = activation.add(out, shared)
    return out


def stack_experts(get, prefix: str, n: int, names=("gate_proj", "up_proj", "down_proj")):
    """Stack per-expert HF weights ``{prefix}.{i}.{name}.weight`` into [E, ...] tensors."""
    return [torch.stack([get(f"{prefix}.{i}.{nm}.weight") for i in range(n)]) for nm in names]


def default_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """HF's default RoPE frequencies, fp32 [rotary_dim/2]."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def yarn_inv_freq(rotary_dim: int, p: dict, max_position: int):
    """YaRN frequencies and attention scaling as HF computes them (``rope_type`` yarn).

    Returns (inv_freq fp32 [rotary_dim/2], attention_factor applied to cos/sin).
    """
    base = p["rope_theta"]
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_position
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    def get_mscale(scale, mscale=1.0):
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = get_mscale(factor, p["mscale"]) / get_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = get_mscale(factor)

    def corr_dim(n_rot):
        return (rotary_dim * math.log(orig / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = corr_dim(beta_fast), corr_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    inv_freq = inv_inter * (1 - extra_factor) + inv_extra * extra_factor
    return inv_freq, float(attention_factor)
