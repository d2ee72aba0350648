"""The pre-norm decoder stack all three families share: embed -> layers -> norm -> LM head.

A family supplies ``mixer(i, x, batch)`` (attention / Gated DeltaNet / MLA for layer i) and
``ffn(i, x)`` (dense MLP or MoE), its layers' weights (``self.layers``, one
:class:`~ds4t.models.blocks.Layer` each) and its norm weights; residual adds are fused into the norms. A
mixer or FFN may return its last op unapplied (a :class:`~ds4t.models.blocks.Projection`, the MoE's
:class:`~ds4t.models.blocks.RoutedExperts`): the decoder runs it with the norm after it as one op
(``linear_add_rms_norm``, ``moe_add_rms_norm``).
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from ds4t.kernels import ops
from ds4t.models.base import Model, StepBatch
from ds4t.models.blocks import Layer, Output, store_kwargs
from ds4t.models.checkpoint import CheckpointError
from ds4t.models.mtp import MTPNames, MTPWeights, mtp_tensors


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


def decoder_tensors(c, layer_tensors, mtp_names: MTPNames, with_mtp: bool, source=None) -> Dict[str, tuple]:
    """HF names and shapes of a whole decoder checkpoint: the stack (:func:`stack_tensors`), each layer's
    own tensors (``layer_tensors(c, table, prefix, i)`` adds layer i's to the table) and, ``with_mtp``,
    the MTP module named by ``mtp_names`` (its layer at index ``c.num_layers``)."""
    t = stack_tensors(c)
    for i in range(c.num_layers):
        layer_tensors(c, t, f"model.layers.{i}.", i)
    if with_mtp:
        t.update(mtp_tensors(mtp_names, c.hidden_size, c.vocab_size,
                             lambda t_, p: layer_tensors(c, t_, p, c.num_layers), source))
    return t


class DecoderModel(Model):
    zero_centered_norms: bool = False  # Qwen3-Next: x̂·(1+w)
    tp = None
    """Tensor parallel (``ds4t.load(..., tp=K)``): a :class:`ds4t.parallel.runtime.TensorParallel`; this
    rank then holds its shard of every layer (heads, MLP columns, experts, vocabulary rows), the mixer
    and FFN outputs are partial sums reduced batch-invariantly, and the logits are gathered whole."""

    # set by the family
    embed: torch.Tensor
    lm_head: torch.Tensor
    final_norm: torch.Tensor
    input_norms: List[torch.Tensor]
    post_norms: List[torch.Tensor]
    layers: List[Layer]   # the decoder layers, then the MTP module's layer (index num_layers) when loaded
    eps: float
    num_layers: int
    mtp: Optional[MTPWeights] = None   # the multi-token-prediction head (ds4t.models.mtp), when the checkpoint has one

    def _init_stack(self, c, name: str, device, dtype: torch.dtype, source) -> None:
        """Identity fields every family sets from its config ``c``; checks that ``source`` holds as many
        layers as ``c`` says before any name table is built (a corrupt layer count would make one without
        bound)."""
        last = f"model.layers.{c.num_layers - 1}.input_layernorm.weight"
        if last not in source:
            held = {k.split(".")[2] for k in source.keys() if k.startswith("model.layers.")}
            raise CheckpointError(f"{source.origin}: missing tensor {last!r} (num_hidden_layers is {c.num_layers}; "
                                  f"the checkpoint has tensors of {len(held)} layers)")
        self.cfg = c
        self.name, self.device, self.dtype = name, torch.device(device), dtype
        self.vocab_size, self.max_position = c.vocab_size, c.max_position
        self.num_layers, self.eps = c.num_layers, c.eps

    def _load_stack(self, get) -> None:
        """Embedding, LM head (or the tied embedding), final norm and every layer's two norms
        (norms in fp32) through the family's WeightReader ``get``."""
        f32 = torch.float32
        self.tp = getattr(get.source, "tp", None)   # load(tp=K) puts it on the source
        if self.tp is not None:
            self.tp.check_config(self.cfg)          # a tp the heads cannot take fails before any read
            get.expert_split = self.tp.expert_range  # each rank reads (or draws) only its own experts
        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if self.cfg.tie_embeddings else get("lm_head.weight")
        if self.tp is not None:
            self.embed, self.lm_head = self.tp.shard_vocab(self.embed, self.lm_head)
        self.final_norm = get("model.norm.weight", f32)
        self.input_norms = [get(f"model.layers.{i}.input_layernorm.weight", f32) for i in range(self.num_layers)]
        self.post_norms = [get(f"model.layers.{i}.post_attention_layernorm.weight", f32)
                           for i in range(self.num_layers)]
        self.layers = []

    def _add_layer(self, layer: Layer) -> None:
        """Append layer i's weights, or under tensor parallel this rank's shard of them (as each layer
        loads, so a rank never holds more than its shard plus one full layer)."""
        if self.tp is not None:
            layer = self.tp.shard_layer(layer, self.cfg, len(self.layers))
        self.layers.append(layer)

    def __init__(self):
        if self.tp is not None:   # the mixers and the state specs see this rank's heads
            self.cfg = self.tp.local_config(self.cfg)
        super().__init__()

    def _read_checkpoint(self, source, dtype: torch.dtype, progress, names: MTPNames, expected, load_layer,
                         ignore=()) -> None:
        """Read the stack, every decoder layer and (when wanted: :meth:`MTPNames.wanted`) the MTP module.
        ``expected(with_mtp)``: the family's name -> shape table; ``load_layer(get, prefix, i)``: layer i's
        weights under a checkpoint prefix (i == num_layers: the MTP layer); ``ignore``: prefixes the
        family tolerates and skips. MTP tensors present but not loaded are skipped with one warning."""
        from ds4t.models.loading import WeightReader, warn_mtp_skipped
        from ds4t.models.mtp import load_mtp

        c = self.cfg
        with_mtp = names.wanted(source, c.mtp_layers)
        skipped = names.ignored(source, c.num_layers, with_mtp)
        get = WeightReader(source, expected(with_mtp), self.device, dtype, ignore_prefixes=skipped + tuple(ignore),
                           progress=progress)
        self._load_stack(get)
        for i in range(c.num_layers):
            self._add_layer(load_layer(get, f"model.layers.{i}.", i))
        if with_mtp:
            load_mtp(self, get, names, lambda p: load_layer(get, p, c.num_layers))
        get.finish()
        warn_mtp_skipped(get, skipped)

    def mixer(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        raise NotImplementedError

    def ffn(self, i: int, x: torch.Tensor, batch: StepBatch) -> Output:
        raise NotImplementedError

    def norm_dtype(self, i: int, site: str) -> torch.dtype:
        """The dtype of the norm output that feeds layer ``i``'s ``site`` ("mixer" or "ffn"): the model's
        activation dtype (bf16 / fp16 models) when every kernel reading that tensor rounds it to that dtype
        first -- linears and fused projections on weights of the model dtype, FP8 or GGUF blocks, the MoE
        experts -- else fp32. The norm rounds to nearest even as it stores, so those consumers read what
        they would have rounded to, from half the bytes, bit for bit (the norm's statistics do not depend on its
        output dtype: ``ds4t.kernels.norm``).
        An MoE router kept in fp32 (DeepSeek-V3, GLM-4.5 load ``gate.weight`` so) reads the norm output
        unrounded: those FFN inputs stay fp32."""
        if self.dtype not in (torch.bfloat16, torch.float16):
            return torch.float32
        if site == "ffn" and i < len(self.layers):
            router = getattr(getattr(self.layers[i], "ffn", None), "router", None)
            if router is not None and router.dtype != self.dtype:
                return torch.float32
        return self.dtype

    def _narrow(self, i: int, site: str) -> dict:
        """The norm call's keywords for :meth:`norm_dtype` (:func:`ds4t.models.blocks.store_kwargs`)."""
        return store_kwargs(self.norm_dtype(i, site))

    def _add_norm(self, out, res: torch.Tensor, weight: torch.Tensor, **kw) -> Tuple[torch.Tensor, torch.Tensor]:
        """(normed, summed) of a mixer's or FFN's output added to the residual stream ``res``: ``out`` a tensor,
        or its last op unapplied, which runs with the norm as one op (a :class:`~ds4t.models.blocks.Projection`:
        the linear's split-K sum inside the norm kernel; :class:`~ds4t.models.blocks.RoutedExperts`: the MoE's
        combine there), the same bits as the op then the norm. Under tensor parallel it is applied and
        all-reduced first."""
        zc, tp = self.zero_centered_norms, self.tp
        if not isinstance(out, torch.Tensor):
            if tp is None:
                return out.add_rms_norm(res, weight, self.eps, zero_centered=zc, **kw)
            out = out.apply()
        if tp is not None:
            out = tp.reduce(out)
        return ops.add_rms_norm(out, res, weight, self.eps, zero_centered=zc, **kw)

    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits fp32 [len(out_rows), vocab]. With ``batch.hidden_rows`` set, ``batch.hidden`` gets the
        final-norm output (the LM head's input) of those rows, fp32 [len(hidden_rows), D]: what an MTP
        head reads."""
        zc, tp = self.zero_centered_norms, self.tp
        h = ops.embedding(batch.tokens, self.embed) if tp is None else tp.embedding(batch.tokens, self.embed)
        x = ops.rms_norm(h, self.input_norms[0], self.eps, zero_centered=zc, **self._narrow(0, "mixer"))
        res = h
        for i in range(self.num_layers):
            x, res = self._add_norm(self.mixer(i, x, batch), res, self.post_norms[i], **self._narrow(i, "ffn"))
            last = i + 1 == self.num_layers   # the final norm's output stays fp32: MTP heads read it as hidden
            x, res = self._add_norm(self.ffn(i, x, batch), res, self.final_norm if last else self.input_norms[i + 1],
                                    **({} if last else self._narrow(i + 1, "mixer")))
        if batch.hidden_rows is not None:
            batch.hidden = x.index_select(0, batch.hidden_rows)
        if batch.out_rows.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.out_rows)
        logits = ops.linear(x, self.lm_head)
        return logits if tp is None else tp.logits(logits, self.vocab_size)

    def mtp_forward(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP head on a step batch: row r pairs ``hidden[r]`` (fp32 [R, D]: the main model's
        final-norm output at position p, or this head's previous ``batch.hidden``) with
        ``batch.tokens[r]`` (the token at p + 1), runs at position p in the MTP layer's own cache,
        and predicts the token at p + 2. Returns logits fp32 [len(out_rows), vocab]; ``batch.hidden``
        gets every row's hidden to chain from (:attr:`MTPWeights.chain_normed` says which)."""
        m = self.mtp
        if m is None:
            raise ValueError(f"model {self.name!r} has no MTP head (the checkpoint holds no MTP weights)")
        zc, eps, L, tp = self.zero_centered_norms, self.eps, self.num_layers, self.tp
        # Under tensor parallel the head's embedding and LM head are vocabulary shards and its layer is
        # sharded like the decoder's: the same hooks as forward(); eh_proj and the norms are replicated.
        emb = ops.embedding(batch.tokens, m.embed) if tp is None else tp.embedding(batch.tokens, m.embed)
        e = ops.rms_norm(emb, m.enorm, eps, zero_centered=zc)
        hh = ops.rms_norm(hidden, m.hnorm, eps, zero_centered=zc)
        res = ops.linear(torch.cat([e, hh], dim=1), m.eh_proj)
        x = ops.rms_norm(res, self.input_norms[L], eps, zero_centered=zc, **self._narrow(L, "mixer"))
        x, res = self._add_norm(self.mixer(L, x, batch), res, self.post_norms[L], **self._narrow(L, "ffn"))
        x, res = self._add_norm(self.ffn(L, x, batch), res, m.final_norm)
        batch.hidden = x if m.chain_normed else res
        if batch.out_rows.shape[0] != x.shape[0]:
            x = x.index_select(0, batch.out_rows)
        logits = ops.linear(x, m.head)
        return logits if tp is None else tp.logits(logits, self.vocab_size)

    @property
    def mtp_state_prefix(self) -> Optional[str]:
        """The pool state names of the MTP layer (``layers.{num_layers}.``), None without MTP."""
        return f"layers.{self.num_layers}." if self.mtp is not None else None

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every weight tensor once, by the first name that holds it: the shared stack, then each
        layer's weights named by their path through the nested dataclasses (``layers.3.mixer.w_qkv``,
        ``layers.3.ffn.w_gate``). A tied LM head is not listed twice, so byte counts stay right."""
        named = [("embed", self.embed), ("lm_head", self.lm_head), ("final_norm", self.final_norm)]
        for i in range(self.num_layers):
            named += [(f"layers.{i}.input_norm", self.input_norms[i]), (f"layers.{i}.post_norm", self.post_norms[i])]
            named += named_tensors(self.layers[i], f"layers.{i}")
        if self.mtp is not None:   # listed as "mtp.*": a plain decode step never reads them
            L = self.num_layers
            named += [("mtp.input_norm", self.input_norms[L]), ("mtp.post_norm", self.post_norms[L])]
            named += [*named_tensors(self.layers[L], "mtp.layer"), *named_tensors(self.mtp, "mtp")]
        p, seen = {}, set()
        for name, w in named:
            for name_, t in named_tensors(w, name):   # a quantized weight (GGUF blocks) lists its tensors
                if id(t) not in seen:
                    seen.add(id(t))
                    p[name_] = t
        return p


def named_tensors(obj, prefix: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """(dotted name, tensor) for every tensor in ``obj``, a tensor or a dataclass of them (nested
    to any depth, through tuples too: a :class:`~ds4t.kernels.weights.RowParts` weight's parts), in field
    order; fields that hold no tensor (None, flags, indices) are skipped."""
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            yield from named_tensors(v, f"{prefix}.{i}")
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from named_tensors(getattr(obj, f.name), f"{prefix}.{f.name}")
