"""Pieces every family composes: the layer weight types (a layer = a mixer + an FFN; the FFN a
dense SwiGLU MLP or routed MoE with shared experts), their compute, RoPE tables.

Each is written once here and used by qwen.py, deepseek.py, glm.py and llama.py.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Tuple, Union

import torch

from ds4t.kernels import ops, weights
from ds4t.kernels.splits import SameSlotRuns
from ds4t.kernels.weights import Weight, activation_dtype


def fused_linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [R, N] = x [R, K] @ w [N, K]^T (+ b); the decode linear kernel."""
    return ops.linear(x, w, b)


def linear_input_dtype(x: torch.Tensor, w: Weight) -> torch.dtype:
    """The dtype a producer may store ``x`` in when its only reader is a linear over ``w``: the 16-bit
    dtype that linear rounds its input to (bf16 / fp16 weights; FP8 or GGUF blocks with a 16-bit
    activation dtype), else fp32. Rounded to nearest even at the store as the linear would round it: the
    same bits from half the bytes, which the FP8 linear feels most
    (bench/results/2026-12-01-h200-fp8-options.md). Used by :func:`swiglu` (silu(g)·u before the down
    projection), DeepSeek's MLA (W_UV's output before o_proj) and Qwen3-Next (the gated attention output
    before o_proj, Gated DeltaNet's gated-norm output before out_proj)."""
    adt = activation_dtype("linear", x, w, None)
    return adt if adt in (torch.bfloat16, torch.float16) else torch.float32


def store_kwargs(dt: torch.dtype) -> dict:
    """A producer call's keywords for storing in ``dt``: none for fp32 (the call as it always was, so an op
    override written without ``out_dtype`` runs), else ``out_dtype`` (an advisory keyword:
    ``ds4t.kernels.registry.ADVISORY_KWARGS``)."""
    return {} if dt == torch.float32 else {"out_dtype": dt}


def narrow_store(x: torch.Tensor, w: Weight) -> dict:
    """:func:`store_kwargs` for a producer call whose output only a linear over ``w`` reads."""
    return store_kwargs(linear_input_dtype(x, w))


@dataclasses.dataclass(frozen=True, eq=False)
class Projection:
    """``linear(x, w, b)`` not applied yet: what a mixer or a dense MLP returns for its last projection, so
    that the decoder can hand it to the residual add + norm after it as one op
    (:func:`ds4t.kernels.linear_norm.linear_add_rms_norm`, the split-K sum inside the norm kernel)."""
    x: torch.Tensor
    w: Weight
    b: Optional[torch.Tensor] = None

    def apply(self) -> torch.Tensor:
        """The fp32 [R, N] product (:func:`fused_linear`)."""
        return fused_linear(self.x, self.w, self.b)

    def add_rms_norm(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, **kw):
        """(normed, summed) of the product added to ``residual``, one op (``linear_add_rms_norm``)."""
        return ops.linear_add_rms_norm(self.x, self.w, residual, norm_weight, eps, bias=self.b, **kw)


@dataclasses.dataclass(frozen=True, eq=False)
class RoutedExperts:
    """``moe_experts(h, ids, weights, ...)`` not applied yet: what a MoE block returns when its experts'
    output is all of it, so that the decoder can hand it to the residual add + norm after it as one op
    (:func:`ds4t.kernels.moe_norm.moe_add_rms_norm`, the rank-ordered combine inside the norm kernel)."""
    h: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    w_gate: Weight
    w_up: Weight
    w_down: Weight
    shared_expert: Optional[int] = None
    shared_gate: Optional[torch.Tensor] = None

    def _args(self):
        return ((self.h, self.ids, self.weights, self.w_gate, self.w_up, self.w_down),
                dict(shared_expert=self.shared_expert, shared_gate=self.shared_gate))

    def apply(self) -> torch.Tensor:
        """The fp32 [R, D] output (``moe_experts``)."""
        args, kw = self._args()
        return ops.moe_experts(*args, **kw)

    def add_rms_norm(self, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float, **kw):
        """(normed, summed) of the output added to ``residual``, one op (``moe_add_rms_norm``)."""
        args, moe_kw = self._args()
        return ops.moe_add_rms_norm(*args, residual, norm_weight, eps, **moe_kw, **kw)


Output = Union[torch.Tensor, Projection, RoutedExperts]
"""What a family's ``mixer`` / ``ffn`` returns: fp32 [R, D], or its last op not yet applied (a projection, the
routed experts), which the decoder runs with the residual add + norm after it (``add_rms_norm``)."""


def applied(out: Output) -> torch.Tensor:
    """``out`` as the fp32 tensor it stands for."""
    return out if isinstance(out, torch.Tensor) else out.apply()


def swiglu_projection(x: torch.Tensor, w_gate_up: Weight, w_down: Weight) -> Projection:
    """down(silu(gate x) * up x) with gate and up fused into one weight [2I, D], the down projection not
    applied yet (:class:`Projection`)."""
    gu = fused_linear(x, w_gate_up)
    i = w_gate_up.shape[0] // 2
    return Projection(ops.silu_mul(gu[:, :i], gu[:, i:], **narrow_store(gu, w_down)), w_down)


def swiglu(x: torch.Tensor, w_gate_up: Weight, w_down: Weight) -> torch.Tensor:
    """fp32 down(silu(gate x) * up x) with gate and up fused into one weight [2I, D]."""
    return swiglu_projection(x, w_gate_up, w_down).apply()


# eq=False on the weight types: field-wise == would compare tensors elementwise (an error, not a
# bool); identity is what two layers' weights being "equal" means.
@dataclasses.dataclass(frozen=True, eq=False)
class DenseMLP:
    """A dense SwiGLU MLP (model dtype), gate and up fused into one weight."""

    gate_up: Weight   # [2I, D]: rows [gate | up]
    down: Weight      # [D, I]


@dataclasses.dataclass(eq=False)
class MoEWeights:
    """A routed-expert block. router [E(+1), D]: the router, plus the shared-expert gate row
    appended when the family gates its shared expert (Qwen3-Next); model dtype for Qwen3-Next, fp32
    for DeepSeek-V3 / GLM-4.5 (their routers run in fp32). Experts stacked per expert, model dtype;
    E+1 of them once a shared expert is fused in (:func:`fuse_shared_expert`)."""

    router: torch.Tensor
    w_gate: Weight          # [E, I, D]
    w_up: Weight            # [E, I, D]
    w_down: Weight          # [E, D, I]
    shared_gate_up: Optional[Weight] = None   # [2*Is, D]
    shared_down: Optional[Weight] = None      # [D, Is]
    shared_gated: bool = False                       # sigmoid(router row E) scales the shared expert
    correction_bias: Optional[torch.Tensor] = None  # [E] fp32, sigmoid routers only
    shared_index: Optional[int] = None  # set by fuse_shared_expert: the shared expert is expert E
    expert_range: Optional[Tuple[int, int]] = None
    """Expert parallel (:mod:`ds4t.parallel`): this rank holds routed experts [lo, hi) of the router's E,
    stacked as local experts 0 .. hi - lo; None: all E."""

    def routed_only(self) -> "MoEWeights":
        """The routed experts alone, for a caller that runs the shared expert itself: the same
        tensors (a fused shared expert stays stacked as expert E, which the router never picks)."""
        return dataclasses.replace(self, shared_gate_up=None, shared_down=None, shared_index=None)


FFN = Union[DenseMLP, MoEWeights]


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """One decoder layer's weights: the family's token mixer (attention, Gated DeltaNet or MLA
    weights, defined in the family's module) and the FFN. The layer's two RMSNorm gains stay on the
    stack (``DecoderModel.input_norms`` / ``post_norms``): each is fused with the residual add before
    it, and the next layer's input norm with this layer's last add."""

    mixer: Any
    ffn: FFN


def fuse_shared_expert(w: MoEWeights) -> MoEWeights:
    """Append the shared expert to the stacked experts when its width matches theirs.

    Then the expert kernel computes it with the routed ones (as an extra top-k rank, combined
    last, in fixed order): one grouped launch instead of five small ones, weights still read
    once per batch. Qwen3-Next, DeepSeek-V3 and GLM-4.5 all have shared width == expert width.
    """
    if w.shared_gate_up is None or w.shared_index is not None:
        return w
    i = w.w_gate.shape[1]
    if w.shared_gate_up.shape[0] != 2 * i:
        return w
    if not all(weights.joinable([a, b]) for a, b in ((w.w_gate, w.shared_gate_up), (w.w_down, w.shared_down))):
        return w   # e.g. GGUF experts and shared expert of different types: the shared one runs apart
    e = w.w_gate.shape[0]
    return dataclasses.replace(
        w,
        w_gate=weights.cat([w.w_gate, w.shared_gate_up[:i][None]]),
        w_up=weights.cat([w.w_up, w.shared_gate_up[i:][None]]),
        w_down=weights.cat([w.w_down, w.shared_down[None]]),
        shared_gate_up=None, shared_down=None, shared_index=e)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    kind: str            # "softmax" (Qwen3-Next) or "sigmoid_grouped" (DeepSeek-V3, GLM-4.5)
    num_experts: int
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


def moe_block(x: torch.Tensor, w: MoEWeights, rc: RouterConfig) -> Output:
    """Routed experts (combined per token in top-k rank order) + shared experts. x fp32 [R, D]. Returns the
    experts unapplied (:class:`RoutedExperts`) when they are the whole output (no shared expert, or one fused
    into them), else fp32 [R, D]."""
    e = rc.num_experts
    # The router linear and the selection in one op (the linear's split-K sum inside the router kernel);
    # the selection reads the view logits[:, :e], never a .contiguous() copy: with one row .contiguous() is
    # a no-op (size-1 dims count as contiguous) and with many it copies, so the kernel would see other
    # strides/alignment, Triton would compile another variant and a reduction could change order (seen on
    # an H200).
    weights, ids, logits = ops.linear_router(x, w.router, e, rc.kind, rc.top_k, rc.renormalize,
                                             correction_bias=w.correction_bias, n_group=rc.n_group,
                                             topk_group=rc.topk_group, scaling=rc.scaling)
    if w.expert_range is not None:
        ids = local_expert_ids(ids, *w.expert_range)
    # A fused shared expert is the kernel's extra last rank (weight sigmoid(its router row), or 1).
    out = RoutedExperts(x, ids, weights, w.w_gate, w.w_up, w.w_down, shared_expert=w.shared_index,
                        shared_gate=logits[:, e] if w.shared_index is not None and w.shared_gated else None)
    if w.shared_gate_up is None:
        return out
    shared = swiglu(x, w.shared_gate_up, w.shared_down)
    if w.shared_gated:
        gate = logits[:, e:e + 1].expand_as(shared).contiguous()
        shared = ops.sigmoid_mul(shared, gate)
    return ops.add(out.apply(), shared)


def local_expert_ids(ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Router choices ids [R, k] (global expert ids) as ids of the experts [lo, hi) this rank holds
    (``id - lo``), and -1 for the others, which the expert kernel skips (they add exactly 0 here; the
    rank holding them adds them). Same dtype, no host sync."""
    return torch.where((ids >= lo) & (ids < hi), ids - lo, torch.full_like(ids, -1))


def stack_experts(get, prefix: str, n: int, names=("gate_proj", "up_proj", "down_proj"), tails=None):
    """Stack per-expert HF weights ``{prefix}.{i}.{name}.weight`` into [E, ...] tensors: all n experts, or
    under tensor parallel only this rank's ``get.expert_range(n)`` (the others are never read; the
    MoEWeights built from them carries that range as its ``expert_range``). ``tails``: a tensor per name
    that the reader may stack after the experts (``WeightReader.stack``'s ``tail``)."""
    lo, hi = get.expert_range(n) or (0, n)
    get.skip((n - (hi - lo)) * len(names))
    return [get.stack([f"{prefix}.{i}.{nm}.weight" for i in range(lo, hi)], tail=t)
            for nm, t in zip(names, tails or (None,) * len(names))]


def moe_weights(get, prefix: str, n: int, shared_gate_up: Optional[Weight] = None,
                shared_down: Optional[Weight] = None, **fields) -> MoEWeights:
    """The :class:`MoEWeights` of the ``n`` routed experts ``{prefix}.{i}.{gate,up,down}_proj.weight`` (this
    rank's range under expert parallel) with ``fields`` (router, ...) and a shared expert (gate | up
    [2 Is, D], down [D, Is]; None: none), fused in as expert E wherever :func:`fuse_shared_expert` fuses it.
    Float experts take the shared one into their stacks as they are read: loading a layer needs no second
    copy of its experts (the reader fills each stack in place)."""
    tails = None
    if isinstance(shared_gate_up, torch.Tensor) and isinstance(shared_down, torch.Tensor):
        i = shared_gate_up.shape[0] // 2
        tails = (shared_gate_up[:i], shared_gate_up[i:], shared_down)
    stacks = dict(zip(("w_gate", "w_up", "w_down"), stack_experts(get, prefix, n, tails=tails)))
    rng = get.expert_range(n)
    e = (rng[1] - rng[0]) if rng else n
    held = {k: v.shape[0] == e + 1 for k, v in stacks.items()}
    if all(held.values()):
        return MoEWeights(**stacks, shared_index=e, expert_range=rng, **fields)
    stacks = {k: v[:e] if held[k] else v for k, v in stacks.items()}   # all or none: fuse_shared_expert decides
    return fuse_shared_expert(MoEWeights(**stacks, shared_gate_up=shared_gate_up, shared_down=shared_down,
                                         expert_range=rng, **fields))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention scaling for a context-extension ``scale`` (HF's ``get_mscale``)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(rotary_dim: int, p: dict, max_position: int):
    """YaRN frequencies and attention scaling as HF computes them (``rope_type`` yarn).

    Returns (inv_freq fp32 [rotary_dim/2], attention_factor applied to cos/sin).
    """
    base = p["rope_theta"]
    factor = p["factor"]
    orig = p.get("original_max_position_embeddings") or max_position
    beta_fast = p.get("beta_fast") or 32
    beta_slow = p.get("beta_slow") or 1

    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention_factor = yarn_mscale(factor, p["mscale"]) / yarn_mscale(factor, p["mscale_all_dim"])
        else:
            attention_factor = yarn_mscale(factor)

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


# ----------------------------------------------------------------------------------------------
# GQA attention with RoPE (GLM-4.5, llama, Qwen3 dense)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, eq=False)
class GQAAttentionWeights:
    """A grouped-query attention layer's weights. Matrices in the model dtype, the rest fp32."""

    w_qkv: Weight             # [(H + 2KV)·hd, D]: rows [q | k | v]
    b_qkv: Optional[torch.Tensor]   # [(H + 2KV)·hd]; with q/k/v bias only
    q_norm: Optional[torch.Tensor]  # [hd], plain RMSNorm gain; with q/k norm only
    k_norm: Optional[torch.Tensor]  # [hd]; with q/k norm only
    w_o: Weight               # [D, H·hd]
    b_o: Optional[torch.Tensor] = None   # [D]; with o_proj bias only (llama's attention_bias)


@dataclasses.dataclass(frozen=True)
class GQAShape:
    """What GQA attention needs to know about a config: heads, kv heads, head dim, rotary dims (the
    first ``rotary_dim`` of each head, rotate-half pairs), which optional tensors a layer has, and
    the q/k-norm epsilon."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    eps: float

    def expected(self, t: dict, prefix: str) -> None:
        """Add one layer's attention tensors (HF names under ``prefix`` = "model.layers.{i}.self_attn.") to ``t``."""
        D, H, KV, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
        t[prefix + "q_proj.weight"] = (H * hd, D)
        t[prefix + "k_proj.weight"] = (KV * hd, D)
        t[prefix + "v_proj.weight"] = (KV * hd, D)
        if self.qkv_bias:
            t[prefix + "q_proj.bias"], t[prefix + "k_proj.bias"], t[prefix + "v_proj.bias"] = \
                (H * hd,), (KV * hd,), (KV * hd,)
        t[prefix + "o_proj.weight"] = (D, H * hd)
        if self.o_bias:
            t[prefix + "o_proj.bias"] = (D,)
        if self.qk_norm:
            t[prefix + "q_norm.weight"] = (hd,)
            t[prefix + "k_norm.weight"] = (hd,)

    def load(self, get, prefix: str) -> GQAAttentionWeights:
        """One layer's weights through a WeightReader ``get``: q/k/v fused into one matrix (and one bias)."""
        f32 = torch.float32
        b_qkv = q_norm = k_norm = b_o = None
        if self.qkv_bias:
            b_qkv = torch.cat([get(prefix + "q_proj.bias", f32), get(prefix + "k_proj.bias", f32),
                               get(prefix + "v_proj.bias", f32)])
        if self.o_bias:
            b_o = get(prefix + "o_proj.bias", f32)
        if self.qk_norm:
            q_norm, k_norm = get(prefix + "q_norm.weight", f32), get(prefix + "k_norm.weight", f32)
        w_qkv = weights.cat([get(prefix + "q_proj.weight"), get(prefix + "k_proj.weight"),
                             get(prefix + "v_proj.weight")])
        return GQAAttentionWeights(w_qkv=w_qkv, b_qkv=b_qkv, q_norm=q_norm, k_norm=k_norm,
                                   w_o=get(prefix + "o_proj.weight"), b_o=b_o)

    def state_specs(self, num_layers: int, dtype: torch.dtype) -> dict:
        """Per-session KV caches ``layers.{i}.k`` / ``layers.{i}.v`` [CTX, kv_heads, head_dim]."""
        from ds4t.models.base import CTX, StateSpec

        s = {}
        for i in range(num_layers):
            s[f"layers.{i}.k"] = StateSpec((CTX, self.num_kv_heads, self.head_dim), dtype)
            s[f"layers.{i}.v"] = StateSpec((CTX, self.num_kv_heads, self.head_dim), dtype)
        return s


def attention_products_option(value) -> str:
    """The ``attention_products`` load option of the GQA families, checked: how decode attention multiplies
    with a 16-bit cache (:data:`ds4t.kernels.attention.PRODUCTS`; "split", the default: fp32-accurate hi + lo
    halves; "cache": once in the cache dtype, as FlashAttention does -- half the tensor-core work of a long
    prompt's attention, bf16-sized errors). Every row of the model, decode or prefill, uses it."""
    from ds4t.kernels.attention import checked_products

    return checked_products(value, "attention_products")


class AttentionProducts:
    """A model's ``attention_products`` attribute, checked by :func:`attention_products_option` whenever it is
    set, at load or later (a bad value raises and the model keeps the one it had)."""

    def __set_name__(self, owner, name):
        self.slot = "_" + name

    def __get__(self, obj, objtype=None):
        return self if obj is None else getattr(obj, self.slot)

    def __set__(self, obj, value):
        setattr(obj, self.slot, attention_products_option(value))


def products_kwargs(products: str) -> dict:
    """decode_attention's ``products`` keyword, left out at the default so that an override of the op written
    before the option existed still sees the calls it saw (setting the option needs one that takes it)."""
    return {} if products == "split" else {"products": products}


def runs_hint(batch) -> Optional[SameSlotRuns]:
    """The attention kernels' launch hint of a step (``same_slot_runs``): its runs of more than one row
    (prefill and verify chunks) as a table on the device with their shortest / longest lengths, or None
    for a pure decode step."""
    if batch.multi_segments is None:
        return None
    return SameSlotRuns(batch.multi_segments, batch.shortest_run, batch.longest_run)


def gqa_attention(x: torch.Tensor, w: GQAAttentionWeights, a: GQAShape, inv_freq: torch.Tensor,
                  kc: torch.Tensor, vc: torch.Tensor, batch, products: str = "split") -> torch.Tensor:
    """One GQA attention layer on rows x fp32 [R, D]: fused q/k/v (+ bias), optional per-head q/k
    RMSNorm (plain x̂·w), rotate-half RoPE on the first ``a.rotary_dim`` dims of q and k, the rows'
    k/v written into the caches ``kc`` / ``vc`` at their slots and positions (all of it one launch),
    split-KV decode attention (scale hd^-1/2; ``products``: :func:`attention_products_option`), o_proj
    (+ bias)."""
    R, H, KV, hd = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
    qkv = fused_linear(x, w.w_qkv, w.b_qkv)
    v = qkv[:, (H + KV) * hd:].view(R, KV, hd)
    if a.qk_norm:   # norms, RoPE and the cache write in one launch
        q = ops.norm_rope_write_kv(qkv[:, :H * hd].view(R, H, hd), qkv[:, H * hd:(H + KV) * hd].view(R, KV, hd), v,
                                   w.q_norm, w.k_norm, a.eps, batch.positions, inv_freq, kc, vc, batch.slots,
                                   rotary_dim=a.rotary_dim)
    else:
        qk = ops.rope(qkv[:, :(H + KV) * hd].view(R, H + KV, hd), batch.positions, inv_freq,
                      rotary_dim=a.rotary_dim)   # q and k in one launch
        ops.write_kv(qk[:, H:], v, kc, vc, batch.slots, batch.positions)
        q = qk[:, :H]
    o = ops.decode_attention(q, kc, vc, batch.slots, batch.lengths, hd ** -0.5,
                             same_slot_runs=runs_hint(batch), **products_kwargs(products))
    return Projection(o.reshape(R, H * hd), w.w_o, w.b_o)


class GQAMixer:
    """The token mixer of a family whose every layer is GQA attention (``cfg.attn``: :class:`GQAShape`;
    ``layers[i].mixer``: :class:`GQAAttentionWeights`): its KV-cache state and :func:`gqa_attention`
    over it. Mixed in before DecoderModel (GLM-4.5, llama, Qwen3 dense)."""

    def state_specs(self):
        # + the MTP module's layer (index num_layers) when loaded
        return self.cfg.attn.state_specs(self.cfg.num_layers + (getattr(self, "mtp", None) is not None), self.dtype)

    def mixer(self, i: int, x: torch.Tensor, batch) -> Output:
        pool = self.pool.tensors
        return gqa_attention(x, self.layers[i].mixer, self.cfg.attn, self.inv_freq,
                             pool[f"layers.{i}.k"], pool[f"layers.{i}.v"], batch, self.attention_products)


# ----------------------------------------------------------------------------------------------
# The DeepSeek-V3 / GLM-4.5 feed-forward layout (shared by deepseek.py and glm.py)
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SigmoidMoEConfig:
    """FFN layout of DeepSeek-V3 and GLM-4.5 MoE: layers below ``first_k_dense_replace`` are dense
    SwiGLU MLPs (``intermediate_size``); the others hold ``num_experts`` routed SwiGLU experts chosen
    by the grouped sigmoid router (``noaux_tc``) plus ``n_shared_experts`` ungated shared experts,
    run as one SwiGLU of width ``n_shared_experts * moe_intermediate_size``."""

    intermediate_size: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int

    @classmethod
    def from_dict(cls, c: dict, num_layers: int, defaults: dict) -> "SigmoidMoEConfig":
        """Parse (and check) the fields from an HF config dict; ``defaults`` are the family's HF
        class defaults for fields a config.json may leave out."""
        from ds4t.models.checkpoint import ConfigError, require

        def get(field, kind):
            return require(c, field, kind, default=defaults.get(field))

        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} not supported (only 'silu')")
        if c.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"scoring_func {c['scoring_func']!r} not supported (only 'sigmoid')")
        if c.get("topk_method", "noaux_tc") != "noaux_tc":
            raise ConfigError(f"topk_method {c['topk_method']!r} not supported (only 'noaux_tc')")
        if c.get("moe_layer_freq", 1) != 1:
            raise ConfigError(f"moe_layer_freq {c['moe_layer_freq']!r} not supported (only 1)")
        dense = get("first_k_dense_replace", int)
        if not 0 <= dense <= num_layers:
            raise ConfigError(f"first_k_dense_replace {dense} outside "
                              f"[0, num_hidden_layers={num_layers}]")
        E = get("n_routed_experts", int)
        n_group, topk_group, top_k = get("n_group", int), get("topk_group", int), get("num_experts_per_tok", int)
        if E < 1 or n_group < 1 or E % n_group:
            raise ConfigError(f"n_routed_experts {E} is not a positive multiple of n_group {n_group}")
        if E // n_group < 2:
            raise ConfigError(f"groups of {E // n_group} expert(s): the group score sums the top 2 "
                              f"of each group, so n_routed_experts / n_group must be >= 2")
        if not 1 <= topk_group <= n_group:
            raise ConfigError(f"topk_group {topk_group} outside [1, n_group={n_group}]")
        if not 1 <= top_k <= topk_group * (E // n_group):
            raise ConfigError(f"num_experts_per_tok {top_k} outside [1, topk_group * experts per "
                              f"group = {topk_group * (E // n_group)}]")
        inter = c.get("intermediate_size")
        if dense > 0:
            inter = require(c, "intermediate_size", int)
        return cls(
            intermediate_size=inter or 0, num_experts=E, top_k=top_k,
            moe_intermediate_size=get("moe_intermediate_size", int),
            n_shared_experts=c.get("n_shared_experts") or 0, n_group=n_group, topk_group=topk_group,
            norm_topk_prob=get("norm_topk_prob", bool), routed_scaling_factor=get("routed_scaling_factor", float),
            first_k_dense_replace=dense)

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @property
    def router(self) -> RouterConfig:
        return RouterConfig("sigmoid_grouped", self.num_experts, self.top_k, self.norm_topk_prob,
                            self.n_group, self.topk_group, self.routed_scaling_factor)

    def expected(self, t: dict, prefix: str, D: int, layer: int) -> None:
        """Add layer ``layer``'s FFN tensors (HF names under ``prefix`` = "model.layers.{i}.mlp.") to ``t``."""
        if not self.is_moe(layer):
            I = self.intermediate_size
            t[prefix + "gate_proj.weight"], t[prefix + "up_proj.weight"] = (I, D), (I, D)
            t[prefix + "down_proj.weight"] = (D, I)
            return
        E, I = self.num_experts, self.moe_intermediate_size
        t[prefix + "gate.weight"] = (E, D)
        t[prefix + "gate.e_score_correction_bias"] = (E,)
        for e in range(E):
            t[prefix + f"experts.{e}.gate_proj.weight"] = (I, D)
            t[prefix + f"experts.{e}.up_proj.weight"] = (I, D)
            t[prefix + f"experts.{e}.down_proj.weight"] = (D, I)
        if self.n_shared_experts:
            Is = self.n_shared_experts * I
            t[prefix + "shared_experts.gate_proj.weight"] = (Is, D)
            t[prefix + "shared_experts.up_proj.weight"] = (Is, D)
            t[prefix + "shared_experts.down_proj.weight"] = (D, Is)

    def unused_prefixes(self, num_layers: int) -> Tuple[str, ...]:
        """Tensors to tolerate and skip: HF writes zero-size ``shared_experts`` when n_shared_experts is 0."""
        if self.n_shared_experts:
            return ()
        return tuple(f"model.layers.{i}.mlp.shared_experts." for i in range(num_layers) if self.is_moe(i))

    def load(self, get, prefix: str, layer: int) -> FFN:
        """Layer ``layer``'s FFN as DenseMLP or MoEWeights. The router weight and the correction
        bias are read as fp32 whatever the checkpoint stores (HF keeps them fp32 and runs the router
        product in fp32; bf16 checkpoints may store them either way). A shared expert as wide as a
        routed one is fused in as an extra expert (:func:`fuse_shared_expert`)."""
        if not self.is_moe(layer):
            return DenseMLP(weights.cat([get(prefix + "gate_proj.weight"), get(prefix + "up_proj.weight")]),
                            get(prefix + "down_proj.weight"))
        shared = {}
        if self.n_shared_experts:   # read first, so float experts can stack it in place (moe_weights)
            shared = dict(shared_gate_up=weights.cat([get(prefix + "shared_experts.gate_proj.weight"),
                                                      get(prefix + "shared_experts.up_proj.weight")]),
                          shared_down=get(prefix + "shared_experts.down_proj.weight"))
        return moe_weights(get, prefix + "experts", self.num_experts, **shared,
                           router=get(prefix + "gate.weight", torch.float32),
                           correction_bias=get(prefix + "gate.e_score_correction_bias", torch.float32))


def ffn(w: FFN, x: torch.Tensor, rc: Optional[RouterConfig]) -> Output:
    """A DenseMLP (its down projection as a :class:`Projection`) or a MoE block (MoEWeights with router
    config ``rc``; fp32 [R, D]) on rows x [R, D]."""
    if isinstance(w, MoEWeights):
        return moe_block(x, w, rc)
    return swiglu_projection(x, w.gate_up, w.down)


def preset_init_plain(name: str, shape, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Random preset weights for families with plain (x̂·w) RMSNorms (DeepSeek-V3, GLM-4.5) that keep
    activations O(1): norm gains 1 + 0.1·N(0,1), small biases, router correction biases of both signs,
    matrices N(0, 1/fan_in)."""
    if name.endswith("e_score_correction_bias"):
        return 0.05 * torch.randn(shape, generator=g, device=device)
    if name.endswith(".bias"):
        return 0.02 * torch.randn(shape, generator=g, device=device)
    if len(shape) == 1:
        return 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
    return torch.randn(shape, generator=g, device=device) * (shape[-1] ** -0.5)
