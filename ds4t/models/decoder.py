"""The pre-norm decoder stack all three families share: embed -> layers -> norm -> LM head.

A family supplies ``mixer(i, x, batch)`` (attention / Gated DeltaNet / MLA for layer i) and
``ffn(i, x)`` (dense MLP or MoE), its layers' weights (``self.layers``, one
:class:`~ds4t.models.blocks.Layer` each) and its norm weights; residual adds are fused into the norms.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Tuple

import torch

from ds4t.kernels import ops
from ds4t.models.base import Model, StepBatch
from ds4t.models.blocks import Layer


def stack_tensors(c) -> Dict[str, tuple]:
    """HF names and shapes of the stack every family shares: embedding, final norm, LM head
    (unless tied) and each layer's two norms. ``c``: a family config (vocab_size, hidden_size,
    num_layers, tie_embeddings)."""
    D = c.hidden_size
    t = {"model.embed_tokens.weight": (c.vocab_size, D), "model.norm.weight": (D,)}
    if not c.tie_embeddings:
        t["lm_head.weight"] = (c.vocab_size, D)
    for i in range(c.num_layers):
        t[f"model.layers.{i}.input_layernorm.weight"] = (D,)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = (D,)
    return t


class DecoderModel(Model):
    zero_centered_norms: bool = False  # Qwen3-Next: x̂·(1+w)

    # set by the family
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    input_norms: List[torch.Tensor]
    post_norms: List[torch.Tensor]
    layers: List[Layer]
    eps: float
    num_layers: int

    def _init_stack(self, c, name: str, device, dtype: torch.dtype) -> None:
        """Identity fields every family sets from its config ``c``."""
        self.cfg = c
        self.name, self.device, self.dtype = name, torch.device(device), dtype
        self.vocab_size, self.max_position = c.vocab_size, c.max_position
        self.num_layers, self.eps = c.num_layers, c.eps

    def _load_stack(self, get) -> None:
        """Embedding, LM head (or the tied embedding), final norm and every layer's two norms
        (norms in fp32) through the family's WeightReader ``get``."""
        f32 = torch.float32
        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if self.cfg.tie_embeddings else get("lm_head.weight")
        self.final_norm = get("model.norm.weight", f32)
        self.input_norms = [get(f"model.layers.{i}.input_layernorm.weight", f32) for i in range(self.num_layers)]
        self.post_norms = [get(f"model.layers.{i}.post_attention_layernorm.weight", f32)
                           for i in range(self.num_layers)]
        self.layers = []

    def mixer(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        raise NotImplementedError

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: StepBatch) -> torch.Tensor:
        zc = self.zero_centered_norms
        h = ops.embedding(batch.tokens, self.embed)
        x = ops.rms_norm(h, self.input_norms[0], self.eps, zero_centered=zc)
        res = h
        for i in range(self.num_layers):
            out = self.mixer(i, x, batch)
            x, res = ops.add_rms_norm(out, res, self.post_norms[i], self.eps, zero_centered=zc)
            out = self.ffn(i, x, batch)
            nxt = self.input_norms[i + 1] if i + 1 < self.num_layers else self.final_norm
            x, res = ops.add_rms_norm(out, res, nxt, self.eps, zero_centered=zc)
        if batch.out_rows.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.out_rows)
        return ops.linear(x, self.lm_head)

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every weight tensor once, by the first name that holds it: the shared stack, then each
        layer's weights named by their path through the nested dataclasses (``layers.3.mixer.w_qkv``,
        ``layers.3.ffn.w_gate``). A tied LM head is not listed twice, so byte counts stay right."""
        named = [("embed", self.embed), ("lm_head", self.lm_head), ("final_norm", self.final_norm)]
        for i in range(self.num_layers):
            named += [(f"layers.{i}.input_norm", self.input_norms[i]), (f"layers.{i}.post_norm", self.post_norms[i])]
            named += named_tensors(self.layers[i], f"layers.{i}")
        p, seen = {}, set()
        for name, w in named:
            for name_, t in named_tensors(w, name):   # a quantized weight (GGUF blocks) lists its tensors
                if id(t) not in seen:
                    seen.add(id(t))
                    p[name_] = t
        return p


def named_tensors(obj, prefix: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in ``obj``, a tensor or a dataclass of them (nested
    to any depth), in field order; fields that hold no tensor (None, flags, indices) are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from named_tensors(getattr(obj, f.name), f"{prefix}.{f.name}")
