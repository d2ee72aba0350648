"""GGUF checkpoints as llama.cpp writes them: ``ds4t.load("model.gguf")`` (or the first of split
files ``name-00001-of-0000N.gguf``).

What is read, for the architectures in :data:`ARCHITECTURES` (``llama``; ``qwen3`` dense):

* **Config** from the ``{arch}.*`` metadata (block_count, embedding_length, feed_forward_length,
  attention.head_count / head_count_kv / key_length / layer_norm_rms_epsilon, rope.freq_base,
  rope.dimension_count, rope.scaling.type / factor, context_length), turned into the HF config dict
  the family parses, so a GGUF and an HF checkpoint of one model load through the same code.
  ``output.weight`` absent means tied embeddings; ``attn_q.bias`` present means ``attention_bias``.
* **Tensors** named as gguf-py's ``TENSOR_NAMES`` spell them (``token_embd``, ``blk.N.attn_q`` ...,
  ``output_norm``, ``output``), mapped to the HF names the family expects. llama.cpp's converter
  permutes the rows of ``attn_q`` and ``attn_k`` of llama models (``LlamaModel.permute``: within each
  head, rotate-half pairs (i, i + hd/2) become interleaved pairs (2i, 2i+1), for its GPT-J style
  RoPE); :func:`unpermute_rows` undoes it, exactly (rows only move). Qwen3 files are not permuted.
* **Types**: F32, F16 and BF16 are read as stored. Q8_0, Q4_K and Q6_K linear weights (and LM head)
  **stay as blocks** (:class:`~ds4t.kernels.quant_blocks.GGUFWeight`, the file's bytes; the decode linear
  and MoE kernels read them, :mod:`ds4t.kernels.qlinear`). Every other quantized type gguf-py can
  dequantize (Q4_0, Q4_1, Q5_*, Q2_K, Q3_K, Q5_K, IQ*), and kernel types in tensors that are not linear
  weights (embeddings), is **dequantized at load** with ``gguf.quants.dequantize`` to the model dtype.
  One log line (logger ``ds4t.gguf``) says which types were kept and which dequantized.
* **Tokenizer** from ``tokenizer.ggml.*``: a GPT-2 style byte-level BPE (``tokenizer.ggml.model``
  "gpt2": tokens, merges, token types, the pre-tokenizer split named by ``tokenizer.ggml.pre``) built
  as a ``tokenizers.Tokenizer``; control tokens are special tokens, BOS is added when
  ``add_bos_token`` says so. The chat template (``tokenizer.chat_template``) and the BOS/EOS/EOT
  ids go to ``model.text_meta`` for :class:`ds4t.text.TextCodec`. Other tokenizer models
  (sentencepiece "llama", ...) are not built yet: ``model.tokenizer`` is None, with a warning.

Anything else is a :class:`CheckpointError` naming the file and the problem: an architecture
outside the supported ones, a missing or unexpected tensor, a shape that disagrees with the
metadata, a tensor type gguf-py cannot dequantize, a missing split file.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import os
import re
import warnings
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch

from ds4t.models.checkpoint import CheckpointError, TensorSource

log = logging.getLogger("ds4t.gguf")

ARCHITECTURES = ("llama", "qwen3")
"""llama.cpp architectures (``general.architecture``) ds4t loads, each to the HF model_type of the same name."""

# (gguf-py MODEL_TENSOR name, HF name) per layer; {i} is the layer.
_LAYER_TENSORS = [
    ("ATTN_NORM", "model.layers.{i}.input_layernorm"),
    ("ATTN_Q", "model.layers.{i}.self_attn.q_proj"),
    ("ATTN_K", "model.layers.{i}.self_attn.k_proj"),
    ("ATTN_V", "model.layers.{i}.self_attn.v_proj"),
    ("ATTN_OUT", "model.layers.{i}.self_attn.o_proj"),
    ("ATTN_Q_NORM", "model.layers.{i}.self_attn.q_norm"),
    ("ATTN_K_NORM", "model.layers.{i}.self_attn.k_norm"),
    ("FFN_NORM", "model.layers.{i}.post_attention_layernorm"),
    ("FFN_GATE", "model.layers.{i}.mlp.gate_proj"),
    ("FFN_UP", "model.layers.{i}.mlp.up_proj"),
    ("FFN_DOWN", "model.layers.{i}.mlp.down_proj"),
]
_GLOBAL_TENSORS = [("TOKEN_EMBD", "model.embed_tokens"), ("OUTPUT_NORM", "model.norm"), ("OUTPUT", "lm_head")]
_FLOAT_TYPES = ("F32", "F16", "BF16")
ROPE_FREQS = "rope_freqs.weight"
"""llama.cpp's per-pair RoPE frequency divisors (its converter's form of llama3 scaling)."""
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<n>\d{5})\.gguf$")


def is_gguf(path) -> bool:
    """A path that names a GGUF file (by its extension; the magic is checked when it is read)."""
    return str(path).lower().endswith(".gguf")


def split_files(path: str) -> List[str]:
    """The files of a GGUF model: ``path`` alone, or for ``stem-0000k-of-0000N.gguf`` all N parts
    in order (each must exist)."""
    m = _SPLIT.match(path)
    if m is None:
        return [path]
    n = int(m.group("n"))
    files = [f"{m.group('stem')}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)]
    for f in files:
        if not os.path.isfile(f):
            raise CheckpointError(f"{path}: split GGUF part {os.path.basename(f)!r} is missing "
                                  f"(a split model needs all {n} files side by side)")
    return files


def _open(path: str):
    import gguf

    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path, "r")
    except Exception as e:  # gguf-py raises ValueError / struct errors / numpy errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _meta(reader) -> dict:
    """Every metadata key -> its Python value (strings, numbers, lists)."""
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{reader.path}: cannot read metadata key {k!r} ({e})") from None
    return out


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``LlamaModel.permute`` on the rows of a q/k weight [n_head·hd, ...] or bias
    [n_head·hd]: the converter maps row order (head, half, i) to (head, i, half); this maps back."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise CheckpointError(f"cannot un-permute {rows} rows into {n_head} heads of rotary pairs")
    hd2 = rows // n_head // 2
    return w.reshape(n_head, hd2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute`` (what its converter writes), the inverse of :func:`unpermute_rows`."""
    hd2 = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, hd2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


@dataclasses.dataclass
class TextMeta:
    """What text handling needs beyond the tokenizer (read by :class:`ds4t.text.TextCodec`)."""

    chat_template: Optional[str] = None
    special: Dict[str, str] = dataclasses.field(default_factory=dict)   # bos_token / eos_token -> text
    eos_ids: List[int] = dataclasses.field(default_factory=list)


class GGUFSource(TensorSource):
    """The tensors of one GGUF model (one file or all split parts) under HF names.

    Reading a tensor checks its shape against what the config implies, un-permutes llama's q/k rows,
    reads float types as stored and dequantizes the rest (counted in ``dequantized``)."""

    def __init__(self, path: str, readers, arch: str, num_heads: int, num_kv_heads: int, num_layers: int):
        import gguf

        super().__init__(origin=path)
        self.arch = arch
        self.dequantized: Dict[str, int] = collections.Counter()
        self.kept: Dict[str, int] = collections.Counter()
        self._gguf_tensors: Dict[str, Tuple[object, str]] = {}   # HF name -> (ReaderTensor, gguf name)
        self._permute: Dict[str, int] = {}
        names = {}
        for key, hf in _GLOBAL_TENSORS:
            names[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]]] = hf
        for i in range(num_layers):
            for key, hf in _LAYER_TENSORS:
                names[gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]].format(bid=i)] = hf.format(i=i)
        self._gguf_name = {f"{hf}.{sfx}": f"{g}.{sfx}" for g, hf in names.items() for sfx in ("weight", "bias")}
        for r in readers:
            for t in r.tensors:
                base, dot, suffix = t.name.rpartition(".")
                if t.name == ROPE_FREQS:
                    continue   # read into the config (hf_config), not a weight
                if not dot or suffix not in ("weight", "bias") or base not in names:
                    hint = ""
                    raise CheckpointError(f"{path}: tensor {t.name!r} has no place in a {arch} model "
                                          f"of {num_layers} layers{hint}")
                hf = f"{names[base]}.{suffix}"
                if hf in self._gguf_tensors:
                    raise CheckpointError(f"{path}: tensor {t.name!r} appears twice")
                self._gguf_tensors[hf] = (t, t.name)
                if arch == "llama" and base.endswith((".attn_q", ".attn_k")):
                    self._permute[hf] = num_heads if base.endswith(".attn_q") else num_kv_heads

    def keys(self):
        return list(self._gguf_tensors)

    def describe(self, name: str) -> str:
        """``name`` (an HF name) as an error message shows it: the GGUF tensor name first."""
        g = self._gguf_name.get(name)
        return f"{g!r} ({name})" if g else repr(name)

    def __contains__(self, name: str) -> bool:
        return name in self._gguf_tensors

    def stored_dtype(self, name: str) -> Optional[torch.dtype]:
        """The float dtype ``name`` is stored in; None for a quantized (or absent) tensor."""
        if name not in self._gguf_tensors:
            return None
        t, _ = self._gguf_tensors[name]
        return {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}.get(t.tensor_type.name)

    def gguf_type(self, name: str) -> str:
        return self._gguf_tensors[name][0].tensor_type.name

    def shape(self, name: str):
        t, _ = self._gguf_tensors[name]
        return tuple(int(d) for d in reversed(t.shape.tolist()))

    def get(self, name: str, shape=None, dtype: Optional[torch.dtype] = None, device="cpu") -> torch.Tensor:
        from gguf import quants

        if name not in self._gguf_tensors:
            raise CheckpointError(f"{self.origin}: missing tensor {name!r}")
        t, gname = self._gguf_tensors[name]
        logical = self.shape(name)
        if shape is not None and logical != tuple(shape):
            raise CheckpointError(f"{self.origin}: tensor {gname!r} ({name}) has shape {logical}, "
                                  f"the metadata implies {tuple(shape)}")
        kind = t.tensor_type.name
        data = t.data
        try:
            if kind == "F32":
                out = torch.from_numpy(np.array(data, dtype=np.float32))   # a copy: the reader maps the file read-only
            elif kind == "F16":
                out = torch.from_numpy(np.array(data, dtype=np.float16))
            elif kind == "BF16":
                raw = np.array(data).view(np.int16)
                out = torch.from_numpy(raw).view(torch.bfloat16)
            else:
                out = torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, t.tensor_type), dtype=np.float32))
                self.dequantized[kind] += 1
        except NotImplementedError:
            raise CheckpointError(f"{self.origin}: tensor {gname!r} has type {kind}, which gguf-py cannot "
                                  f"dequantize") from None
        except (ValueError, TypeError) as e:
            raise CheckpointError(f"{self.origin}: tensor {gname!r} ({kind}) cannot be read ({e})") from None
        if tuple(out.shape) != logical:
            try:
                out = out.reshape(logical)
            except RuntimeError:
                raise CheckpointError(f"{self.origin}: tensor {gname!r} holds {out.numel()} values, its shape "
                                      f"{logical} needs {int(np.prod(logical))}") from None
        if name in self._permute:
            out = unpermute_rows(out, self._permute[name])
        return out.to(device=device, dtype=dtype or out.dtype).contiguous()

    def blocks(self, name: str, shape=None, device="cpu"):
        """``name`` as a :class:`~ds4t.kernels.quant_blocks.GGUFWeight` when it is stored as Q8_0, Q4_K or
        Q6_K (llama's q/k rows un-permuted: rows move, blocks run along K), else None."""
        from ds4t.kernels.quant_blocks import QTYPES, GGUFWeight

        if name not in self._gguf_tensors or self.gguf_type(name) not in QTYPES:
            return None
        t, gname = self._gguf_tensors[name]
        logical = self.shape(name)
        if shape is not None and logical != tuple(shape):
            raise CheckpointError(f"{self.origin}: tensor {gname!r} ({name}) has shape {logical}, "
                                  f"the metadata implies {tuple(shape)}")
        kind = self.gguf_type(name)
        raw = np.asarray(t.data)
        try:
            data = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(*logical[:-1], -1)
            w = GGUFWeight(data, kind, logical[-1])
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.origin}: tensor {gname!r} ({kind}) does not hold {logical} in "
                                  f"{kind} blocks ({e})") from None
        if name in self._permute:
            rows = torch.arange(logical[0])[:, None]
            w = w[unpermute_rows(rows, self._permute[name])[:, 0]]
        self.kept[kind] += 1
        return w.to(device).contiguous()

    def default_dtype(self) -> torch.dtype:
        """bf16 / fp16 when every matrix is stored so, else fp32 (what dequantized types need)."""
        kinds = {t.tensor_type.name for t, _ in self._gguf_tensors.values() if len(t.shape) == 2}
        if kinds == {"BF16"}:
            return torch.bfloat16
        if kinds == {"F16"}:
            return torch.float16
        return torch.float32

    def log_dequantized(self, dtype: torch.dtype) -> None:
        """The one log line of a load that kept or dequantized quantized tensors (nothing when none was)."""
        def kinds(c):
            return ", ".join(f"{k} ({n} tensors)" for k, n in sorted(c.items()))

        parts = []
        if self.kept:
            parts.append(f"kept {kinds(self.kept)} as blocks (quantized kernels)")
        if self.dequantized:
            parts.append(f"dequantized {kinds(self.dequantized)} to {str(dtype).replace('torch.', '')} at load "
                         f"(no kernel reads those blocks)")
        if parts:
            log.warning("%s: %s", os.path.basename(self.origin), "; ".join(parts))


def _get(meta: dict, key: str, kind, path: str, default=None):
    if key not in meta:
        if default is not None:
            return default
        raise CheckpointError(f"{path}: missing metadata {key!r}")
    v = meta[key]
    if kind is float and isinstance(v, int):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise CheckpointError(f"{path}: metadata {key!r} = {v!r} should be {kind.__name__}")
    return v


def hf_config(meta: dict, tensor_shapes: Dict[str, tuple], path: str) -> dict:
    """The HF config dict of a GGUF model from its metadata (and, for what metadata leaves implicit,
    which tensors it holds: tied embeddings, attention bias, vocabulary size)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {list(ARCHITECTURES)})")
    a = arch + "."
    n = _get(meta, a + "block_count", int, path)
    hidden = _get(meta, a + "embedding_length", int, path)
    heads = _get(meta, a + "attention.head_count", int, path)
    kv = _get(meta, a + "attention.head_count_kv", int, path, default=heads)
    head_dim = _get(meta, a + "attention.key_length", int, path, default=hidden // heads if heads else 0)
    vdim = _get(meta, a + "attention.value_length", int, path, default=head_dim)
    if vdim != head_dim:
        raise CheckpointError(f"{path}: attention.value_length {vdim} != key_length {head_dim} is not supported")
    rot = _get(meta, a + "rope.dimension_count", int, path, default=head_dim)
    if rot != head_dim:
        raise CheckpointError(f"{path}: rope.dimension_count {rot} != head dim {head_dim}: partial RoPE is not "
                              f"supported for {arch}")
    if "token_embd.weight" not in tensor_shapes:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = tensor_shapes["token_embd.weight"][0]
    if a + "vocab_size" in meta and meta[a + "vocab_size"] != vocab:
        raise CheckpointError(f"{path}: {a}vocab_size {meta[a + 'vocab_size']} but token_embd has {vocab} rows")
    if _get(meta, a + "expert_count", int, path, default=0):
        raise CheckpointError(f"{path}: {arch} with experts (MoE, e.g. Mixtral) is not supported yet")
    rope = {"rope_type": "default", "rope_theta": _get(meta, a + "rope.freq_base", float, path, default=10000.0)}
    scaling = _get(meta, a + "rope.scaling.type", str, path, default="none")
    if scaling == "linear":
        rope.update(rope_type="linear", factor=_get(meta, a + "rope.scaling.factor", float, path))
    elif scaling != "none":
        raise CheckpointError(f"{path}: rope.scaling.type {scaling!r} is not supported (supported: none, linear)")
    layer0 = "blk.0.attn_q.bias" in tensor_shapes
    cfg = dict(
        model_type=arch, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n,
        intermediate_size=_get(meta, a + "feed_forward_length", int, path), num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=_get(meta, a + "attention.layer_norm_rms_epsilon", float, path),
        max_position_embeddings=_get(meta, a + "context_length", int, path, default=4096),
        tie_word_embeddings="output.weight" not in tensor_shapes, attention_bias=layer0,
        hidden_act="silu", rope_parameters=rope)
    return cfg


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the regex splits llama.cpp applies in order (llama-vocab.cpp), before byte-level BPE.
_PRE_SPLITS = {
    "gpt2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT], "mpt": [_GPT2_SPLIT], "olmo": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
}
_CONTROL, _USER_DEFINED = 3, 4


def build_tokenizer(meta: dict, path: str):
    """``(tokenizers.Tokenizer or None, TextMeta)`` from the ``tokenizer.*`` metadata."""
    text = TextMeta(chat_template=meta.get("tokenizer.chat_template"))
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or tokens is None:
        return None, text
    for key, special in (("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        i = meta.get("tokenizer.ggml." + key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            text.special[special] = tokens[i]
    text.eos_ids = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
                    if isinstance(meta.get(k), int)]
    text.eos_ids = list(dict.fromkeys(text.eos_ids))
    if kind != "gpt2":
        warnings.warn(f"{path}: tokenizer model {kind!r} is not built yet (only 'gpt2', byte-level BPE): "
                      f"model.tokenizer is None, pass token ids", stacklevel=3)
        return None, text
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    merges = meta.get("tokenizer.ggml.merges") or []
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((a, b))
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    pre = meta.get("tokenizer.ggml.pre", "default")
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        warnings.warn(f"{path}: pre-tokenizer {pre!r} is not known to ds4t: splitting text as GPT-2 does "
                      f"(token ids may differ from llama.cpp's)", stacklevel=3)
        splits = [_GPT2_SPLIT]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos = text.special.get("bos_token")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return tok, text


def open_gguf(path: str):
    """``(hf config dict, GGUFSource, tokenizer or None, TextMeta)`` of the GGUF model at ``path``."""
    files = split_files(path)
    readers = [_open(f) for f in files]
    meta = _meta(readers[0])
    if len(files) > 1:
        want = meta.get("split.count")
        if want is not None and want != len(files):
            raise CheckpointError(f"{path}: split.count is {want}, the file name says {len(files)}")
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for r in readers for t in r.tensors}
    cfg = hf_config(meta, shapes, path)
    freqs = [t for r in readers for t in r.tensors if t.name == ROPE_FREQS]
    if freqs:
        f = np.asarray(freqs[0].data, dtype=np.float32).reshape(-1)
        if f.shape[0] * 2 != cfg["head_dim"] or not np.all(np.isfinite(f)) or np.any(f <= 0):
            raise CheckpointError(f"{path}: {ROPE_FREQS!r} must hold {cfg['head_dim'] // 2} positive factors, "
                                  f"got {f.shape[0]}")
        if cfg["rope_parameters"]["rope_type"] != "default":
            raise CheckpointError(f"{path}: {ROPE_FREQS!r} together with rope.scaling.type is not supported")
        cfg["rope_parameters"]["freq_factors"] = [float(v) for v in f]
    source = GGUFSource(path, readers, cfg["model_type"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
                        cfg["num_hidden_layers"])
    tokenizer, text = build_tokenizer(meta, path)
    return cfg, source, tokenizer, text
