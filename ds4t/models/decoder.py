"""The pre-norm decoder stack all three families share: embed -> layers -> norm -> LM head.

A family supplies ``mixer(i, x, batch)`` (attention / Gated DeltaNet / MLA for layer i) and
``ffn(i, x)`` (dense MLP or MoE) and its norm weights; residual adds are fused into the norms.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List

import torch

from ds4t.kernels import embedding, linear, norm
from ds4t.models.base import Model, StepBatch


class DecoderModel(Model):
    zero_centered_norms: bool = False  # Qwen3-Next: x̂·(1+w)

    # set by the family
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    input_norms: List[torch.Tensor]
    post_norms: List[torch.Tensor]
    eps: float
    num_layers: int

    def mixer(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        raise NotImplementedError

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, batch: StepBatch) -> torch.Tensor:
        zc = self.zero_centered_norms
        h = embedding.embedding(batch.tokens, self.embed)
        x = norm.rms_norm(h, self.input_norms[0], self.eps, zero_centered=zc)
        res = h
        for i in range(self.num_layers):
            out = self.mixer(i, x, batch)
            x, res = norm.add_rms_norm(out, res, self.post_norms[i], self.eps, zero_centered=zc)
            out = self.ffn(i, x, batch)
            nxt = self.input_norms[i + 1] if i + 1 < self.num_layers else self.final_norm
            x, res = norm.add_rms_norm(out, res, nxt, self.eps, zero_centered=zc)
        if batch.out_rows.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.out_rows)
        return linear.linear(x, self.lm_head)

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every weight by name: the shared stack, then each layer's dict ``self.layers[i]``
        whose values are tensors or dataclasses of tensors (MoE / dense MLP weights)."""
        p = {"embed": self.embed, "lm_head": self.lm_head, "final_norm": self.final_norm}
        for i in range(self.num_layers):
            p[f"layers.{i}.input_norm"] = self.input_norms[i]
            p[f"layers.{i}.post_norm"] = self.post_norms[i]
            for k, v in self.layers[i].items():
                if isinstance(v, torch.Tensor):
                    p[f"layers.{i}.{k}"] = v
                elif dataclasses.is_dataclass(v):
                    for f in dataclasses.fields(v):
                        t = getattr(v, f.name)
                        if isinstance(t, torch.Tensor):
                            p[f"layers.{i}.{k}.{f.name}"] = t
        return p
