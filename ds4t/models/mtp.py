"""Multi-token-prediction (MTP) heads, as the three families' checkpoints store them.

DeepSeek-V3 and GLM-4.5 keep ``num_nextn_predict_layers`` (1) extra layers after the decoder,
``model.layers.{n}.``: ``enorm``, ``hnorm``, ``eh_proj`` [D, 2D], a full decoder layer (attention +
MoE), ``shared_head.norm`` and, in some files, their own ``embed_tokens`` / ``shared_head.head``
(copies of the main ones). Qwen3-Next keeps ``mtp.``: ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``fc`` [D, 2D], ``layers.0.`` (a gated-attention layer + MoE) and ``norm``,
and predicts with the main LM head.

The head (``DecoderModel.mtp_forward``): for the hidden h_p of position p and the token t_{p+1},
``x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])``, one decoder layer at position p with its own
KV cache, the final norm and the head give logits for t_{p+2}. Drafting k tokens chains it: the
next step takes this step's hidden and its drafted token. Which hidden chains follows vLLM's
implementations: DeepSeek / GLM chain the layer's output before ``shared_head.norm``, Qwen3-Next
after ``mtp.norm``; the main model's hidden is its final-norm output in both.

Only the first MTP layer is loaded (every release has one); its decoder layer sits in the model's
``layers`` at index ``num_layers`` and its KV cache in the state pool under ``layers.{num_layers}.``.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Dict, Optional

import torch

from ds4t.kernels.weights import Weight


@dataclasses.dataclass(frozen=True, eq=False)
class MTPWeights:
    """The MTP head besides its decoder layer. Norm gains fp32 [D]; matrices in the model dtype."""

    enorm: torch.Tensor       # [D]: norm of the next token's embedding
    hnorm: torch.Tensor       # [D]: norm of the incoming hidden
    eh_proj: Weight           # [D, 2D]: columns [embedding | hidden]
    final_norm: torch.Tensor  # [D]: shared_head.norm / mtp.norm
    head: Weight              # [V, D]: the head's own LM head, or the model's
    embed: torch.Tensor       # [V, D]: its own embedding, or the model's
    chain_normed: bool        # chain the hidden after final_norm (Qwen3-Next) or before it (DeepSeek, GLM)


@dataclasses.dataclass(frozen=True)
class MTPNames:
    """Where one family's checkpoints keep the MTP head. ``head`` / ``embed``: names of the optional
    own copies (None: the family never stores them)."""

    enorm: str
    hnorm: str
    eh_proj: str
    final_norm: str
    layer_prefix: str
    head: Optional[str] = None
    embed: Optional[str] = None
    chain_normed: bool = False

    @classmethod
    def nextn(cls, num_layers: int) -> "MTPNames":
        """DeepSeek-V3 / GLM-4.5: the layer after the decoder, ``model.layers.{num_layers}.``."""
        p = f"model.layers.{num_layers}."
        return cls(enorm=p + "enorm.weight", hnorm=p + "hnorm.weight", eh_proj=p + "eh_proj.weight",
                   final_norm=p + "shared_head.norm.weight", layer_prefix=p, head=p + "shared_head.head.weight",
                   embed=p + "embed_tokens.weight")

    @classmethod
    def qwen3_next(cls) -> "MTPNames":
        return cls(enorm="mtp.pre_fc_norm_embedding.weight", hnorm="mtp.pre_fc_norm_hidden.weight",
                   eh_proj="mtp.fc.weight", final_norm="mtp.norm.weight", layer_prefix="mtp.layers.0.",
                   chain_normed=True)

    def present(self, source) -> bool:
        """The checkpoint holds this MTP head (its ``eh_proj``; a partial head fails the load later)."""
        return self.eh_proj in source

    def ignored(self, source, num_layers: int, loaded: bool) -> tuple:
        """Checkpoint prefixes to skip (with one warning): MTP layers the checkpoint holds but the
        model does not load (``loaded``: whether this head is loaded)."""
        if self.layer_prefix.startswith("mtp."):
            return () if loaded else ("mtp.",)
        from ds4t.models.loading import mtp_layer_prefixes

        return tuple(p for p in mtp_layer_prefixes(source, num_layers) if not (loaded and p == self.layer_prefix))

    def wanted(self, source, declared: int) -> bool:
        """Load the head: the config declares one and the checkpoint holds it (under tensor parallel
        too: its layer is sharded like the decoder's, its own embedding / LM head by vocabulary rows)."""
        return declared > 0 and self.present(source)

    def tensors(self, D: int, V: int, source=None) -> Dict[str, tuple]:
        """Names and shapes of the head besides its decoder layer; the optional own head / embedding
        only where ``source`` holds them (presets: never)."""
        t = {self.enorm: (D,), self.hnorm: (D,), self.eh_proj: (D, 2 * D), self.final_norm: (D,)}
        for name in (self.head, self.embed):
            if name is not None and source is not None and name in source:
                t[name] = (V, D)
        return t

    def load(self, get, model) -> MTPWeights:
        """The head through a WeightReader ``get``; the model's embedding / LM head where the
        checkpoint has no copy of its own."""
        f32 = torch.float32
        src = get.source
        tp = model.tp
        head = get(self.head) if self.head is not None and self.head in src else None
        embed = get(self.embed) if self.embed is not None and self.embed in src else None
        if tp is not None:   # own copies: this rank's vocabulary rows, as the model's (tp.vocab)
            head, embed = (None if t is None else tp.shard_vocab_rows(t) for t in (head, embed))
        head = model.lm_head if head is None else head
        embed = model.embed if embed is None else embed
        return MTPWeights(enorm=get(self.enorm, f32), hnorm=get(self.hnorm, f32), eh_proj=get(self.eh_proj),
                          final_norm=get(self.final_norm, f32), head=head, embed=embed,
                          chain_normed=self.chain_normed)


def mtp_layers(cfg: dict, key: str) -> int:
    """How many MTP layers a config declares (``num_nextn_predict_layers`` / ``mtp_num_hidden_layers``);
    warns that only the first is used when it declares more."""
    n = int(cfg.get(key, 0) or 0)
    if n > 1:
        warnings.warn(f"config.json: {key} = {n}: ds4t loads the first MTP layer only", stacklevel=3)
    return n


def mtp_tensors(names: MTPNames, D: int, V: int, layer_tensors, source=None) -> Dict[str, tuple]:
    """Names and shapes of a whole MTP module: the head (:meth:`MTPNames.tensors`), its decoder
    layer's two norms, and the layer's own tensors, which ``layer_tensors(t, prefix)`` adds to ``t``
    (the family's per-layer table at the MTP layer's index)."""
    t = names.tensors(D, V, source)
    p = names.layer_prefix
    t[p + "input_layernorm.weight"] = (D,)
    t[p + "post_attention_layernorm.weight"] = (D,)
    layer_tensors(t, p)
    return t


def load_mtp(model, get, names: MTPNames, load_layer) -> None:
    """Read an MTP module into ``model``: its decoder layer (``load_layer(prefix)``, the family's
    per-layer loader at index ``num_layers``) and norms appended to the model's layer lists, the
    head in ``model.mtp``."""
    p = names.layer_prefix
    model.input_norms.append(get(p + "input_layernorm.weight", torch.float32))
    model.post_norms.append(get(p + "post_attention_layernorm.weight", torch.float32))
    model._add_layer(load_layer(p))   # sharded under tensor parallel, as the decoder layers
    model.mtp = names.load(get, model)
