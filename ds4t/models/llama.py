"""Dense decoders: ``model_type`` llama (Llama 2/3, SmolLM2, ...) and qwen3 (Qwen3 dense: llama + q/k norms).

Every layer is GQA attention (:func:`ds4t.models.blocks.gqa_attention`: q/k/v fused into one linear,
with bias when ``attention_bias``, which in llama and Qwen3 also gives o_proj a bias; Qwen3's
per-head RMSNorm on q and k before RoPE; RoPE over the whole head in rotate-half form; split-KV
decode attention over the per-session caches ``layers.{i}.k`` / ``layers.{i}.v``) and a dense
SwiGLU MLP (gate and up fused). Norms are standard RMSNorm (x̂·w). Embeddings tied or not.

RoPE frequencies: ``rope_type`` default, ``linear`` (positions divided by ``factor``) and ``llama3``
(Llama 3.1's per-frequency smoothing, no attention scaling), computed as HF transformers does;
anything else is a CheckpointError.

Native path: every row, always (decode tokens and prompt chunks alike); no fallback needed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Dict

import torch

from ds4t.kernels import weights
from ds4t.kernels.rope import default_inv_freq
from ds4t.models.base import StepBatch
from ds4t.models.blocks import (AttentionProducts, DenseMLP, GQAMixer, GQAShape, Layer, Output,
                                preset_init_plain, swiglu_projection)
from ds4t.models.checkpoint import ConfigError, attention_heads, require, rope_params
from ds4t.models.decoder import DecoderModel, stack_tensors
from ds4t.models.loading import WeightReader

PRESETS = ("tiny-llama",)

ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, p: dict) -> torch.Tensor:
    """fp32 [head_dim / 2] RoPE frequencies for HF rope parameters ``p`` (``rope_params``)."""
    kind = p["rope_type"]
    theta = float(p["rope_theta"])
    inv = default_inv_freq(head_dim, theta)
    if kind == "default":
        ff = p.get("freq_factors")   # a GGUF's rope_freqs (llama.cpp's llama3 scaling): per-pair divisors
        return inv if ff is None else inv / torch.tensor(ff, dtype=torch.float32)
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope_type {kind!r} is not supported for llama/qwen3 "
                          f"(supported: {list(ROPE_TYPES)})")
    factor = p.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ConfigError(f"rope_type {kind!r} needs a positive 'factor', got {factor!r}")
    factor = float(factor)
    if kind == "linear":
        return inv / factor
    # llama3 (HF _compute_llama3_parameters)
    for f in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
        if not isinstance(p.get(f), (int, float)):
            raise ConfigError(f"rope_type 'llama3' needs {f!r}")
    low, high, old_ctx = float(p["low_freq_factor"]), float(p["high_freq_factor"]), p["original_max_position_embeddings"]
    if high == low:
        raise ConfigError(f"rope_type 'llama3': high_freq_factor == low_freq_factor ({low})")
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv
    inv_l = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_l)


@dataclasses.dataclass
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope: dict
    attention_bias: bool
    qk_norm: bool
    max_position: int
    tie_embeddings: bool

    @property
    def attn(self) -> GQAShape:
        return GQAShape(self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim,
                        qkv_bias=self.attention_bias, o_bias=self.attention_bias, qk_norm=self.qk_norm, eps=self.eps)

    @classmethod
    def from_dict(cls, c: dict) -> "LlamaConfig":
        mt = c.get("model_type", "llama")
        n = require(c, "num_hidden_layers", int)
        if n < 1:
            raise ConfigError(f"num_hidden_layers {n} must be >= 1")
        heads, kv, head_dim, hidden = attention_heads(c)
        if head_dim % 2:
            raise ConfigError(f"head_dim {head_dim} must be even (RoPE pairs)")
        act = c.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} not supported (only 'silu')")
        if c.get("mlp_bias"):
            raise ConfigError("mlp_bias true is not supported (SwiGLU MLPs without bias only)")
        if mt == "qwen3" and c.get("use_sliding_window"):
            raise ConfigError("use_sliding_window true is not supported for qwen3")
        rp = rope_params(c)
        if float(rp.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ConfigError(f"partial_rotary_factor {rp['partial_rotary_factor']} not supported "
                              f"for {mt} (RoPE over the whole head only)")
        rope_inv_freq(head_dim, rp)   # errors for unsupported scaling now, at config time
        return cls(
            vocab_size=require(c, "vocab_size", int), hidden_size=hidden,
            intermediate_size=require(c, "intermediate_size", int), num_layers=n,
            eps=float(c.get("rms_norm_eps", 1e-6)), num_heads=heads, num_kv_heads=kv, head_dim=head_dim, rope=rp,
            attention_bias=bool(c.get("attention_bias", False)), qk_norm=mt == "qwen3",
            max_position=int(c.get("max_position_embeddings", 4096)),
            tie_embeddings=bool(c.get("tie_word_embeddings", False)))


def expected_tensors(c: LlamaConfig) -> Dict[str, tuple]:
    """Checkpoint tensor names and shapes implied by the config (HF save_pretrained layout)."""
    D, I = c.hidden_size, c.intermediate_size
    t = stack_tensors(c)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        c.attn.expected(t, p + "self_attn.")
        t[p + "mlp.gate_proj.weight"], t[p + "mlp.up_proj.weight"] = (I, D), (I, D)
        t[p + "mlp.down_proj.weight"] = (D, I)
    return t


class LlamaModel(GQAMixer, DecoderModel):
    family = "llama"
    attention_products = AttentionProducts()

    def __init__(self, cfg: dict, source, device, dtype: torch.dtype, name: str = "llama", progress=None,
                 attention_products: str = "split"):
        c = LlamaConfig.from_dict(cfg)
        self.attention_products = attention_products
        self._init_stack(c, name, device, dtype, source)
        get = WeightReader(source, expected_tensors(c), self.device, dtype, progress=progress)
        self._load_stack(get)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            mlp = DenseMLP(weights.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
                           get(p + "mlp.down_proj.weight"))
            self._add_layer(Layer(c.attn.load(get, p + "self_attn."), mlp))
        get.finish()
        self.inv_freq = rope_inv_freq(c.head_dim, c.rope).to(self.device)
        super().__init__()

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        w = self.layers[i].ffn
        return swiglu_projection(x, w.gate_up, w.down)


class Qwen3Model(LlamaModel):
    """Qwen3 dense (``model_type`` qwen3): llama with per-head q/k RMSNorm before RoPE."""

    family = "qwen3"


def preset_config(name: str) -> dict:
    """HF-style config dicts for the built-in dense presets."""
    if name == "tiny-llama":
        # 2 layers, GQA (4 heads, 2 kv heads), untied LM head, llama3 RoPE scaling: every code path runs.
        return dict(
            model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=False, mlp_bias=False,
            max_position_embeddings=4096, rms_norm_eps=1e-5, hidden_act="silu", tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    raise KeyError(name)


def preset_init(name: str, shape, g: torch.Generator, device="cpu") -> torch.Tensor:
    """Random weights that keep activations O(1) through the stack (plain RMSNorm gains ~1)."""
    return preset_init_plain(name, shape, g, device)
