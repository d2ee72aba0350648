"""GLM-4.5 MoE (``model_type`` glm4_moe): GQA attention + sigmoid-routed MoE.

Attention: q/k/v projections (with bias when ``attention_bias``) fused at load time into one linear
with output ``[q | k | v]``; optional per-head RMSNorm on q and k (``use_qk_norm``, plain x̂·w,
eps = rms_norm_eps) before RoPE; partial RoPE (``partial_rotary_factor``, default 0.5) in
rotate-half form on the first dims of each head, q and k in one launch; split-KV decode attention
over the per-session caches ``layers.{i}.k`` / ``layers.{i}.v`` [CTX, kv_heads, head_dim];
o_proj without bias. Norms are standard RMSNorm (x̂·w).

FFN: the DeepSeek-V3 layout, from :class:`ds4t.models.blocks.SigmoidMoEConfig` (dense SwiGLU below
``first_k_dense_replace``; grouped sigmoid router with ``e_score_correction_bias``, routed experts,
ungated shared experts). Multi-token-prediction layers stored after the decoder layers are
recognised, skipped and reported with one warning.

Native path eligibility (data: ``model.native_rules`` / ``model.row_reasons``): by default every
row is native at any context length: ds4t's split-KV decode attention has no window (measured
native == ordered and its speed at 16k and 32k tokens: bench/results/2026-11-30-h200-decode-long.md).
The option ``native_window=N`` (``ds4t.load(..., native_window=N)`` or ``model.native_window = N``)
reproduces a kernel with a capacity, such as ds4's 2051-token one: a row whose visible window
(cache positions it attends to after the step: pos + new tokens) passes N gets the reason
"visible window W > native capacity N"; ``eval_batch(mode="auto")`` runs the eligible rows
natively and the others ordered, in the same call, and ``mode="native"`` raises naming the row.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ds4t.kernels.rope import default_inv_freq
from ds4t.models.base import NativeRule, StepBatch
from ds4t.models.blocks import (AttentionProducts, GQAAttentionWeights, GQAMixer, GQAShape, Layer, Output,
                                SigmoidMoEConfig, ffn, preset_init_plain)
from ds4t.models.checkpoint import ConfigError, attention_heads, require, rope_params
from ds4t.models.decoder import DecoderModel, decoder_tensors
from ds4t.models.mtp import MTPNames, mtp_layers

PRESETS = ("tiny-glm", "glm-4.5-4l", "glm-4.5-fp8")

DEFAULT_NATIVE_WINDOW: Optional[int] = None
"""No window: every row can run natively. ``native_window=2051`` gives ds4's kernel capacity."""

# HF Glm4MoeConfig class defaults for FFN fields a config.json may omit.
_FFN_DEFAULTS = dict(first_k_dense_replace=1, n_group=1, topk_group=1, num_experts_per_tok=8,
                     norm_topk_prob=True, routed_scaling_factor=1.0, moe_intermediate_size=1408,
                     n_routed_experts=128)


@dataclasses.dataclass
class GlmConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    attention_bias: bool
    use_qk_norm: bool
    max_position: int
    tie_embeddings: bool
    ffn: SigmoidMoEConfig
    mtp_layers: int = 0   # num_nextn_predict_layers (ds4t.models.mtp: the first is loaded)

    @property
    def attn(self) -> GQAShape:
        return GQAShape(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.rotary_dim,
                        qkv_bias=self.attention_bias, o_bias=False, qk_norm=self.use_qk_norm, eps=self.eps)

    @classmethod
    def from_dict(cls, c: dict) -> "GlmConfig":
        n = require(c, "num_hidden_layers", int)
        if n < 1:
            raise ConfigError(f"num_hidden_layers {n} must be >= 1")
        heads, kv, head_dim, hidden = attention_heads(c)
        rp = rope_params(c)
        if rp["rope_type"] != "default":
            raise ConfigError(f"rope_type {rp['rope_type']!r} not supported for glm4_moe yet")
        rotary = int(head_dim * rp.get("partial_rotary_factor", 0.5))   # HF's default for GLM: 0.5
        if rotary < 2 or rotary % 2 or rotary > head_dim:
            raise ConfigError(f"partial_rotary_factor gives {rotary} rotary dims of head_dim "
                              f"{head_dim}: need an even number in [2, head_dim]")
        return cls(
            vocab_size=require(c, "vocab_size", int), hidden_size=hidden, num_layers=n,
            eps=c.get("rms_norm_eps", 1e-5), num_heads=heads, num_kv_heads=kv, head_dim=head_dim,
            rotary_dim=rotary, rope_theta=float(rp["rope_theta"]), attention_bias=bool(c.get("attention_bias", False)),
            use_qk_norm=bool(c.get("use_qk_norm", False)), max_position=c.get("max_position_embeddings", 131072),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)),
            ffn=SigmoidMoEConfig.from_dict(c, n, _FFN_DEFAULTS),
            mtp_layers=mtp_layers(c, "num_nextn_predict_layers"),
        )


def _layer_tensors(c: GlmConfig, t: Dict[str, tuple], p: str, i: int) -> None:
    """Layer i's attention and MLP tensors under prefix ``p`` (i == num_layers: the MTP layer)."""
    c.attn.expected(t, p + "self_attn.")
    c.ffn.expected(t, p + "mlp.", c.hidden_size, i)


def expected_tensors(c: GlmConfig, mtp: Optional[bool] = None, source=None) -> Dict[str, tuple]:
    """Checkpoint tensor names and shapes implied by the config (HF save_pretrained layout); with
    ``mtp`` (default: the config declares num_nextn_predict_layers) the MTP layer too."""
    return decoder_tensors(c, _layer_tensors, MTPNames.nextn(c.num_layers), c.mtp_layers if mtp is None else mtp, source)


GlmAttentionWeights = GQAAttentionWeights
"""GLM's attention weights: the shared GQA layout (o_proj without bias)."""


class GlmModel(GQAMixer, DecoderModel):
    family = "glm4_moe"
    attention_products = AttentionProducts()

    def __init__(self, cfg: dict, source, device, dtype: torch.dtype, name: str = "glm4_moe", progress=None,
                 native_window: Optional[int] = DEFAULT_NATIVE_WINDOW, attention_products: str = "split"):
        c = GlmConfig.from_dict(cfg)
        self.native_window = native_window
        self.attention_products = attention_products
        self._init_stack(c, name, device, dtype, source)

        def load_layer(get, p: str, i: int) -> Layer:
            return Layer(c.attn.load(get, p + "self_attn."), c.ffn.load(get, p + "mlp.", i))

        self._read_checkpoint(source, dtype, progress, MTPNames.nextn(c.num_layers),
                              lambda mtp: expected_tensors(c, mtp=mtp, source=source), load_layer,
                              ignore=c.ffn.unused_prefixes(c.num_layers + 1))
        self.router_cfg = c.ffn.router
        self.inv_freq = default_inv_freq(c.rotary_dim, c.rope_theta).to(self.device)
        super().__init__()

    # -- native-path eligibility (data) ------------------------------------------------------
    @property
    def native_window(self) -> Optional[int]:
        """Visible tokens a native row may attend to (None: no limit)."""
        return self._native_window

    @native_window.setter
    def native_window(self, value: Optional[int]) -> None:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"native_window must be a positive int or None, got {value!r}")
        self._native_window = value

    @staticmethod
    def _rules(window: Optional[int], option_hint: str = "") -> Tuple[NativeRule, ...]:
        cond = ("any visible window (no limit; load option native_window=N sets one, e.g. ds4's 2051)"
                if window is None else f"visible window (pos + new tokens) <= {window}{option_hint}")
        return (NativeRule("native", cond, "ordered: the row runs alone, in item order, in the same eval_batch call"),)

    @property
    def native_rules(self) -> Tuple[NativeRule, ...]:
        return self._rules(self._native_window)

    @classmethod
    def default_native_rules(cls) -> Tuple[NativeRule, ...]:
        """The rule at the default (for ``ds4t support``)."""
        return cls._rules(DEFAULT_NATIVE_WINDOW, " (load option native_window)")

    def row_reasons(self, rows: Sequence[Tuple[int, int]]) -> List[Optional[str]]:
        cap = self._native_window
        if cap is None:
            return [None] * len(rows)
        return [None if pos + n <= cap else f"visible window {pos + n} > native capacity {cap}" for pos, n in rows]

    # -- compute (state_specs and mixer: GQAMixer) -----------------------------------------
    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        return ffn(self.layers[i].ffn, x, self.router_cfg)


def preset_config(name: str) -> dict:
    """HF-style config dicts for the built-in GLM-4.5 MoE presets."""
    if name == "tiny-glm":
        # 2 layers (1 dense + 1 MoE): every layer kind runs, and the CPU interpreter stays fast.
        return dict(
            model_type="glm4_moe", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
            use_qk_norm=True, max_position_embeddings=4096, n_routed_experts=8, n_shared_experts=1,
            num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            norm_topk_prob=True, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
            num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    if name == "glm-4.5-4l":
        # GLM-4.5 (355B-A32B) layer dimensions, 4 layers (1 dense + 3 MoE).
        return dict(
            model_type="glm4_moe", vocab_size=151552, hidden_size=5120, intermediate_size=12288, num_hidden_layers=4,
            first_k_dense_replace=1, num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
            use_qk_norm=True, max_position_embeddings=131072, n_routed_experts=160, n_shared_experts=1,
            num_experts_per_tok=8, moe_intermediate_size=1536, n_group=1, topk_group=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
            num_nextn_predict_layers=1,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5})
    if name == "glm-4.5-fp8":
        # GLM-4.5 (355B-A32B) at full depth in block-FP8 as GLM-4.5-FP8 stores it: 92 layers (3 dense + 89
        # MoE, ~360 GB), for tensor + expert parallel over 4 or 8 GPUs. Random weights, quantized as read.
        from ds4t.models.deepseek import _FP8_CONFIG

        cfg = preset_config("glm-4.5-4l")
        cfg.update(num_hidden_layers=92, first_k_dense_replace=3, quantization_config=dict(_FP8_CONFIG))
        return cfg
    raise KeyError(name)


def preset_init(name: str, shape, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Random weights that keep activations O(1) through the stack (plain RMSNorm gains ~1)."""
    return preset_init_plain(name, shape, g, device)
