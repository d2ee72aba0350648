"""DeepSeek-V3 (``model_type`` deepseek_v3): multi-head latent attention (MLA) + sigmoid-routed MoE.

Attention (absorbed MLA decode):

* Down-projections, fused at load time into ONE linear ``w_a`` whose output is
  ``[q part | c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim)]``: the q part is ``q_a_proj``'s output
  (q_lora_rank) or, without q_lora_rank, the whole ``q_proj`` output.
* q: ``q_a_layernorm`` -> ``q_b_proj`` (rows reordered at load time to ``[nope of all heads | rope of
  all heads]``); c_kv: ``kv_a_layernorm``; RoPE on the rope parts only (q_pe of every head and the
  single shared k_pe, in one launch), with YaRN frequencies / attention factor when configured.
  ``rope_interleave`` checkpoints rotate pairs (2i, 2i+1) in place where HF de-interleaves first;
  q and k get the same layout, so q·k is unchanged (see ds4t.kernels.rope).
* Absorption: ``W_UK`` and ``W_UV`` come from ``kv_b_proj``. ``q_latent[h] = W_UK[h]^T q_nope[h]``
  and ``o[h] = W_UV[h] latent_out[h]`` are per-head linear-kernel launches (batch-invariant: the
  K order of each depends only on the weight shape), then ``o_proj``.
* The per-session cache is ``layers.{i}.latent`` [CTX, kv_lora_rank + qk_rope_head_dim] holding
  ``[c_kv || k_pe after RoPE]``; attention over it is :func:`ds4t.kernels.ops.mla_decode` (MQA).
* Softmax scale: ``qk_head_dim^-0.5``, × ``mscale(factor, mscale_all_dim)^2`` for YaRN configs
  that set ``mscale_all_dim`` (as HF's DeepseekV3Attention).

FFN: dense SwiGLU below ``first_k_dense_replace``; above it the grouped sigmoid router (fp32 router
weight, ``e_score_correction_bias``), routed experts and ungated shared experts
(:class:`ds4t.models.blocks.SigmoidMoEConfig`, shared with GLM-4.5). Multi-token-prediction layers
(``model.layers.{num_hidden_layers}.*``) are recognised, skipped and reported with one warning.

Native paths (which one ``eval_batch``'s "native" call runs is data: ``model.native_rules``):

* ``native_path="full"`` (default): all rows of the batch go through every layer together, so every
  weight is read once per batch.
* ``native_path="ds4"``: the ds4 engine's split. Batched across all rows: the fused Q/KV
  down-projection and the shared experts (plus the per-row steps: embedding, norms, residual adds,
  and the LM head). Per session (one segment of rows at a time): everything of the attention
  after the down-projection (q up-projection, absorption, RoPE, latent-cache write, MLA, W_UV,
  o_proj), the router + routed experts, and the dense MLPs. Worth it from 2 rows; with one
  session it is the same computation as "full".

Select it with ``ds4t.load(path_or_preset, native_path="ds4")`` or by setting
``model.native_path = "ds4"`` at any time between steps (the state layout is the same). Both paths
give the ordered fallback's bits exactly (tests/exactness/test_deepseek_exactness.py).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ds4t.kernels import ops, weights
from ds4t.kernels.weights import Weight
from ds4t.kernels.rope import default_inv_freq
from ds4t.models.base import CTX, NativeRule, StateSpec, StepBatch
from ds4t.models.blocks import (DenseMLP, Layer, Output, Projection, SigmoidMoEConfig, applied, ffn, fused_linear,
                                moe_block, narrow_store, preset_init_plain, runs_hint, store_kwargs, swiglu,
                                yarn_inv_freq, yarn_mscale)
from ds4t.models.checkpoint import ConfigError, require, rope_params
from ds4t.models.decoder import DecoderModel, decoder_tensors
from ds4t.models.mtp import MTPNames, mtp_layers

PRESETS = ("tiny-deepseek", "deepseek-v3-4l", "deepseek-v3-16l-fp8", "deepseek-v3-fp8")

# HF DeepseekV3Config class defaults for FFN fields a config.json may omit.
_FFN_DEFAULTS = dict(first_k_dense_replace=3, n_group=8, topk_group=4, num_experts_per_tok=8,
                     norm_topk_prob=True, routed_scaling_factor=2.5, moe_intermediate_size=2048,
                     n_routed_experts=256)


@dataclasses.dataclass
class DeepseekConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    eps: float
    num_heads: int
    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    rope_interleave: bool
    rope: dict                # rope parameters (rope_type "default" or "yarn", rope_theta, yarn fields)
    max_position: int
    tie_embeddings: bool
    ffn: SigmoidMoEConfig
    mtp_layers: int = 0   # num_nextn_predict_layers (ds4t.models.mtp: the first is loaded)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def q_width(self) -> int:
        """Width of the q part of the fused down-projection output."""
        return self.q_lora_rank or self.num_heads * self.qk_head_dim

    @classmethod
    def from_dict(cls, c: dict) -> "DeepseekConfig":
        n = require(c, "num_hidden_layers", int)
        if n < 1:
            raise ConfigError(f"num_hidden_layers {n} must be >= 1")
        q_lora = c.get("q_lora_rank")
        if q_lora is not None and (not isinstance(q_lora, int) or q_lora < 1):
            raise ConfigError(f"q_lora_rank {q_lora!r} should be a positive int or null")
        rp = rope_params(c)
        if rp["rope_type"] not in ("default", "yarn"):
            raise ConfigError(f"rope_type {rp['rope_type']!r} not supported for deepseek_v3 "
                              "(supported: 'default', 'yarn')")
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor must be 1 for deepseek_v3 "
                              "(RoPE covers qk_rope_head_dim)")
        max_pos = c.get("max_position_embeddings", 4096)
        if rp["rope_type"] == "yarn":
            if rp.get("factor") is None:
                orig = rp.get("original_max_position_embeddings")
                if not orig:
                    raise ConfigError("yarn rope needs 'factor' or 'original_max_position_embeddings'")
                rp["factor"] = max_pos / orig
        rope_dim = require(c, "qk_rope_head_dim", int)
        if rope_dim % 2:
            raise ConfigError(f"qk_rope_head_dim {rope_dim} must be even")
        return cls(
            vocab_size=require(c, "vocab_size", int), hidden_size=require(c, "hidden_size", int), num_layers=n,
            eps=c.get("rms_norm_eps", 1e-6), num_heads=require(c, "num_attention_heads", int), q_lora_rank=q_lora,
            kv_lora_rank=require(c, "kv_lora_rank", int), qk_nope_head_dim=require(c, "qk_nope_head_dim", int),
            qk_rope_head_dim=rope_dim, v_head_dim=require(c, "v_head_dim", int),
            attention_bias=bool(c.get("attention_bias", False)), rope_interleave=bool(c.get("rope_interleave", True)),
            rope=rp, max_position=max_pos, tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            ffn=SigmoidMoEConfig.from_dict(c, n, _FFN_DEFAULTS),
            mtp_layers=mtp_layers(c, "num_nextn_predict_layers"),
        )


def expected_tensors(c: DeepseekConfig, mtp: Optional[bool] = None, source=None) -> Dict[str, tuple]:
    """Checkpoint tensor names and shapes implied by the config (HF save_pretrained layout); with
    ``mtp`` (default: the config declares num_nextn_predict_layers) the MTP layer too."""
    return decoder_tensors(c, _layer_tensors, MTPNames.nextn(c.num_layers), c.mtp_layers if mtp is None else mtp, source)


def _layer_tensors(c: DeepseekConfig, t: Dict[str, tuple], p: str, i: int) -> None:
    """Layer i's attention and MLP tensors under prefix ``p`` (i == num_layers: the MTP layer)."""
    D, H = c.hidden_size, c.num_heads
    a = p + "self_attn."
    if c.q_lora_rank:
        t[a + "q_a_proj.weight"] = (c.q_lora_rank, D)
        if c.attention_bias:
            t[a + "q_a_proj.bias"] = (c.q_lora_rank,)
        t[a + "q_a_layernorm.weight"] = (c.q_lora_rank,)
        t[a + "q_b_proj.weight"] = (H * c.qk_head_dim, c.q_lora_rank)
    else:
        t[a + "q_proj.weight"] = (H * c.qk_head_dim, D)
    t[a + "kv_a_proj_with_mqa.weight"] = (c.kv_lora_rank + c.qk_rope_head_dim, D)
    t[a + "kv_a_layernorm.weight"] = (c.kv_lora_rank,)
    t[a + "kv_b_proj.weight"] = (H * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank)
    t[a + "o_proj.weight"] = (D, H * c.v_head_dim)
    if c.attention_bias:
        t[a + "kv_a_proj_with_mqa.bias"] = (c.kv_lora_rank + c.qk_rope_head_dim,)
        t[a + "o_proj.bias"] = (D,)
    c.ffn.expected(t, p + "mlp.", D, i)


def _q_rows(c: DeepseekConfig) -> torch.Tensor:
    """HF q rows are [nope_h | rope_h] per head; reorder to [nope of all heads | rope of all heads]."""
    H, dn, dr = c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    per = dn + dr
    nope = [h * per + j for h in range(H) for j in range(dn)]
    pe = [h * per + dn + j for h in range(H) for j in range(dr)]
    return torch.tensor(nope + pe)


@dataclasses.dataclass(frozen=True, eq=False)
class MLAWeights:
    """An MLA layer's weights, laid out for absorbed decode (both native paths and the ordered one
    use them as they are). H heads; dn, dr, dv = qk_nope / qk_rope / v head dims; Rk = kv_lora_rank;
    qw = q_width (q_lora_rank, or H·(dn + dr) without it). Matrices in the model dtype, the rest fp32."""

    w_a: Weight                 # [qw + Rk + dr, D]: rows [q part | c_kv | k_pe]
    b_a: Optional[torch.Tensor]       # [qw + Rk + dr]; with attention_bias only (q part zeros without q_lora_rank)
    q_a_norm: Optional[torch.Tensor]  # [q_lora_rank]; with q_lora_rank only
    w_qb: Optional[Weight]      # [H·(dn + dr), q_lora_rank]: rows [nope all heads | rope all heads]
    kv_a_norm: torch.Tensor           # [Rk]
    w_uk_t: torch.Tensor              # [H, Rk, dn]: W_UK transposed, q_latent = W_UK^T q_nope
    w_uv: torch.Tensor                # [H, dv, Rk]: o = W_UV latent_out
    w_o: Weight                 # [D, H·dv]
    b_o: Optional[torch.Tensor]       # [D]; with attention_bias only


class DeepseekModel(DecoderModel):
    family = "deepseek_v3"

    NATIVE_PATHS = {
        "full": NativeRule(
            "native", "any batch (native_path='full'): all rows through every layer in one pass, "
                      "each weight read once per batch", "-"),
        "ds4": NativeRule(
            "native", "any batch (native_path='ds4'): fused Q/KV down-projection and shared experts batched "
                      "over rows; MLA attention (latent cache), router + routed experts and dense MLPs per "
                      "session; pays from 2 rows", "-"),
    }

    def __init__(self, cfg: dict, source, device, dtype: torch.dtype, name: str = "deepseek_v3", progress=None,
                 native_path: str = "full"):
        c = DeepseekConfig.from_dict(cfg)
        self.native_path = native_path
        self._init_stack(c, name, device, dtype, source)
        self._read_checkpoint(source, dtype, progress, MTPNames.nextn(c.num_layers),
                              lambda mtp: expected_tensors(c, mtp=mtp, source=source), self._load_layer,
                              ignore=c.ffn.unused_prefixes(c.num_layers + 1))
        self.router_cfg = c.ffn.router
        rp, dr = c.rope, c.qk_rope_head_dim
        self.softmax_scale = c.qk_head_dim ** -0.5
        if rp["rope_type"] == "yarn":
            inv_freq, self.rope_scale = yarn_inv_freq(dr, rp, c.max_position)
            if rp.get("mscale_all_dim"):
                m = yarn_mscale(rp["factor"], rp["mscale_all_dim"])
                self.softmax_scale = self.softmax_scale * m * m
        else:
            inv_freq, self.rope_scale = default_inv_freq(dr, float(rp["rope_theta"])), 1.0
        self.inv_freq = inv_freq.to(self.device)
        super().__init__()

    def _load_layer(self, get, p: str, i: int) -> Layer:
        """Layer i's weights under checkpoint prefix ``p`` (i == num_layers: the MTP layer)."""
        c, f32 = self.cfg, torch.float32
        H, dn, dv, R = c.num_heads, c.qk_nope_head_dim, c.v_head_dim, c.kv_lora_rank
        q_rows = _q_rows(c).to(self.device)
        a = p + "self_attn."
        kv_a = get(a + "kv_a_proj_with_mqa.weight")
        kv_a_b = get(a + "kv_a_proj_with_mqa.bias", f32) if c.attention_bias else None
        b_a = q_a_norm = w_qb = None
        if c.q_lora_rank:
            w_a = weights.cat([get(a + "q_a_proj.weight"), kv_a])
            if c.attention_bias:
                b_a = torch.cat([get(a + "q_a_proj.bias", f32), kv_a_b])
            q_a_norm = get(a + "q_a_layernorm.weight", f32)
            w_qb = get(a + "q_b_proj.weight")[q_rows].contiguous()
        else:
            w_a = weights.cat([get(a + "q_proj.weight")[q_rows], kv_a])
            if c.attention_bias:
                b_a = torch.cat([torch.zeros(c.q_width, dtype=f32, device=self.device), kv_a_b])
        kv_a_norm = get(a + "kv_a_layernorm.weight", f32)
        # Absorbed MLA splits kv_b per head and transposes its K half: a rearrangement along K that
        # block scales cannot follow, so an FP8 kv_b is dequantized here (the one tensor that is).
        kv_b = weights.as_float(get(a + "kv_b_proj.weight"), self.dtype).view(H, dn + dv, R)
        mixer = MLAWeights(
            w_a=w_a, b_a=b_a, q_a_norm=q_a_norm, w_qb=w_qb, kv_a_norm=kv_a_norm,
            w_uk_t=kv_b[:, :dn, :].transpose(1, 2).contiguous(), w_uv=kv_b[:, dn:, :].contiguous(),
            w_o=get(a + "o_proj.weight"), b_o=get(a + "o_proj.bias", f32) if c.attention_bias else None)
        return Layer(mixer, c.ffn.load(get, p + "mlp.", i))

    # -- native path selection (data) --------------------------------------------------------
    @property
    def native_path(self) -> str:
        return self._native_path

    @native_path.setter
    def native_path(self, value: str) -> None:
        if value not in self.NATIVE_PATHS:
            raise ValueError(f"native_path must be one of {sorted(self.NATIVE_PATHS)}, got {value!r}")
        self._native_path = value

    @property
    def native_rules(self) -> Tuple[NativeRule, ...]:
        return (self.NATIVE_PATHS[self._native_path],)

    @classmethod
    def default_native_rules(cls) -> Tuple[NativeRule, ...]:
        """Every selectable native path (for ``ds4t support``)."""
        return tuple(cls.NATIVE_PATHS.values())

    def row_reasons(self, rows: Sequence[Tuple[int, int]]) -> List[Optional[str]]:
        return [None] * len(rows)   # both native paths take any batch

    def graph_key(self, rows: int):
        return ("decode", rows, self._native_path)   # the two paths launch different kernels

    # -- state -------------------------------------------------------------------------------
    def state_specs(self) -> Dict[str, StateSpec]:
        c = self.cfg
        return {f"layers.{i}.latent": StateSpec((CTX, c.kv_lora_rank + c.qk_rope_head_dim), self.dtype, replicated=True)
                for i in range(c.num_layers + (self.mtp is not None))}


    # -- compute -----------------------------------------------------------------------------
    def _per_session(self, segments) -> bool:
        return self._native_path == "ds4" and segments is not None and len(segments) > 1

    def mixer(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        w = self.layers[i].mixer
        a = fused_linear(x, w.w_a, w.b_a)   # Q/KV down-projections: always batched
        if not self._per_session(batch.segments):
            return self._mla(i, a, batch.positions, batch.slots, batch.lengths, runs_hint(batch))
        out = torch.empty((x.shape[0], self.cfg.hidden_size), dtype=torch.float32, device=x.device)
        for s in batch.segments:
            r = slice(s.start_row, s.start_row + s.n)
            out[r] = self._mla(i, a[r], batch.positions[r], batch.slots[r], batch.lengths[r]).apply()
        return out

    def _mla(self, i: int, a: torch.Tensor, positions, slots, lengths, runs=None) -> Projection:
        """Attention after the down-projection for rows ``a`` [R, q_width + kv_lora_rank + rope], o_proj not
        applied yet; ``runs``: the step's runs hint (:func:`blocks.runs_hint`) when ``a`` is the whole step."""
        c, w = self.cfg, self.layers[i].mixer
        n, H, R = a.shape[0], c.num_heads, c.kv_lora_rank
        dn, dr, dv = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        qw = c.q_width
        if c.q_lora_rank:
            q = fused_linear(ops.rms_norm(a[:, :qw], w.q_a_norm, c.eps), w.w_qb)
        else:
            q = a[:, :qw]
        cache = self.pool.tensors[f"layers.{i}.latent"]
        # kv_a_layernorm, RoPE on q_pe of every head and on the shared k_pe, and the cache write: one launch.
        q_pe = ops.norm_rope_write_latent(a[:, qw:qw + R], w.kv_a_norm, c.eps, q[:, H * dn:].view(n, H, dr),
                                          a[:, qw + R:], positions, self.inv_freq, cache, slots,
                                          interleaved=c.rope_interleave, scale=self.rope_scale)
        # Absorb W_UK into the query and apply W_UV after attention: per-head linears, all heads
        # in one launch each (bitwise the per-head loop; 2 launches instead of 2·H).
        # mla_decode rounds q_latent to the cache dtype; storing it so here is the same rounding (RNE):
        # the same bits from half the bytes.
        q_lat = ops.linear_heads(q[:, :H * dn].view(n, H, dn), w.w_uk_t, **store_kwargs(cache.dtype))
        lat = ops.mla_decode(q_lat, q_pe, cache, slots, lengths, self.softmax_scale, kv_lora_rank=R,
                             same_slot_runs=runs)
        o = ops.linear_heads(lat, w.w_uv, **narrow_store(lat, w.w_o))   # o_proj rounds it so anyway
        return Projection(o.view(n, H * dv), w.w_o, w.b_o)

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        w = self.layers[i].ffn
        segs = batch.segments
        if not self._per_session(segs):
            return ffn(w, x, self.router_cfg)
        rows = [slice(s.start_row, s.start_row + s.n) for s in segs]
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)   # x may be bf16 (norm_dtype)
        if isinstance(w, DenseMLP):
            for r in rows:
                out[r] = swiglu(x[r], w.gate_up, w.down)
            return out
        routed = w.routed_only()
        for r in rows:
            out[r] = applied(moe_block(x[r], routed, self.router_cfg))
        # Shared experts: one launch over all rows, computed exactly as inside moe_block (the fused
        # extra expert with weight 1 as the last rank, or a SwiGLU of their own), then added last.
        if w.shared_index is not None:
            none = torch.empty((x.shape[0], 0), dtype=torch.int32, device=x.device)
            shared = ops.moe_experts(x, none, none.float(), w.w_gate, w.w_up, w.w_down, shared_expert=w.shared_index)
        elif w.shared_gate_up is not None:
            shared = swiglu(x, w.shared_gate_up, w.shared_down)
        else:
            return out
        return ops.add(out, shared)


_FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""The quantization_config of the published block-FP8 releases (DeepSeek-V3, GLM-4.5-FP8, Qwen3-Next-FP8)."""


def preset_config(name: str) -> dict:
    """HF-style config dicts for the built-in DeepSeek-V3 presets."""
    if name == "tiny-deepseek":
        # 2 layers (1 dense + 1 MoE): every layer kind runs, and the CPU interpreter stays fast.
        return dict(
            model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=4096,
            rope_interleave=True, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
            v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid",
            topk_method="noaux_tc", rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
            num_nextn_predict_layers=1)
    if name == "deepseek-v3-4l":
        # DeepSeek-V3 (671B) layer dimensions, 4 layers (1 dense + 3 MoE), YaRN as in V3's config.json.
        return dict(
            model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
            num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=128, num_key_value_heads=128,
            max_position_embeddings=163840, rope_interleave=True, q_lora_rank=1536, kv_lora_rank=512,
            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, n_routed_experts=256, n_shared_experts=1,
            num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8, topk_group=4, routed_scaling_factor=2.5,
            norm_topk_prob=True, scoring_func="sigmoid", topk_method="noaux_tc", rms_norm_eps=1e-6,
            hidden_act="silu", attention_bias=False, tie_word_embeddings=False, num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                             "mscale": 1.0, "mscale_all_dim": 1.0})
    if name in ("deepseek-v3-fp8", "deepseek-v3-16l-fp8"):
        # DeepSeek-V3 (671B) in block-FP8 as its release stores it: 61 layers (3 dense + 58 MoE, ~690 GB with
        # the MTP layer), for tensor + expert parallel over 8 GPUs; the 16-layer cut (~190 GB) runs the same
        # code on 2 GPUs. Random weights drawn on the device and quantized as they are read.
        cfg = preset_config("deepseek-v3-4l")
        cfg.update(num_hidden_layers=61 if name == "deepseek-v3-fp8" else 16, first_k_dense_replace=3,
                   quantization_config=dict(_FP8_CONFIG))
        return cfg
    raise KeyError(name)


def preset_init(name: str, shape, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Random weights that keep activations O(1) through the stack (plain RMSNorm gains ~1)."""
    return preset_init_plain(name, shape, g, device)
