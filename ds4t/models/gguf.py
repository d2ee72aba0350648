"""GGUF checkpoints as llama.cpp writes them: ``ds4t.load("model.gguf")`` (or the first of split
files ``name-00001-of-0000N.gguf``).

What is read, for the architectures in :data:`ARCHITECTURES` (``llama``, ``qwen3`` dense; ``qwen3next``,
``deepseek2``, ``glm4moe`` MoE: config in :func:`_moe_config`, tensor recipes in :class:`GGUFSource`):

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
* **Types**: F32, F16 and BF16 are read as stored. Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K linear weights (and
  LM head) **stay as blocks** (:class:`~ds4t.kernels.quant_blocks.GGUFWeight`, the file's bytes; the decode
  linear and MoE kernels read them, :mod:`ds4t.kernels.qlinear`) unless ``load(..., dequantize=True)``. Every other quantized type gguf-py can
  dequantize (Q5_0, Q5_1, Q2_K, Q3_K, IQ*), and kernel types in tensors that are not linear
  weights (embeddings), is **dequantized at load** with ``gguf.quants.dequantize`` to the model dtype.
  One log line (logger ``ds4t.gguf``) says which types were kept and which dequantized.
* **Tokenizer** from ``tokenizer.ggml.*``: a GPT-2 style byte-level BPE (``tokenizer.ggml.model``
  "gpt2": tokens, merges, token types, the pre-tokenizer splits llama.cpp applies for ``tokenizer.ggml.pre``
  -- gpt2, smollm, llama3, qwen2, deepseek-v3, glm4 (no BOS, as llama.cpp), ...) built
  as a ``tokenizers.Tokenizer``; control tokens are special tokens, BOS is added when
  ``add_bos_token`` says so. The chat template (``tokenizer.chat_template``) and the BOS/EOS/EOT
  ids go to ``model.text_meta`` for :class:`ds4t.text.TextCodec`. A SentencePiece BPE vocabulary
  ("llama": tokens and scores) tokenizes as llama.cpp's SPM tokenizer (merges by score, byte fallback).
  Other tokenizer models (Unigram "t5", ...) are not built: ``model.tokenizer`` is None, with a warning.

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

ARCHITECTURES = ("llama", "qwen3", "qwen3next", "deepseek2", "glm4moe")
"""llama.cpp architectures (``general.architecture``) ds4t loads (:data:`MODEL_TYPES`: to which family)."""
MOE_ARCHITECTURES = ("qwen3next", "deepseek2", "glm4moe")
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "qwen3next": "qwen3_next", "deepseek2": "deepseek_v3",
               "glm4moe": "glm4_moe"}
"""llama.cpp architecture -> the HF model_type (ds4t family) it loads as."""

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


def _meta(reader, path: str) -> dict:
    """Every metadata key of the GGUF file at ``path`` (read by ``reader``) -> its Python value (strings,
    numbers, lists)."""
    out = {}
    for k, f in reader.fields.items():
        try:
            out[k] = f.contents()
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{path}: cannot read metadata key {k!r} ({e})") from None
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


# ----------------------------------------------------------------------------------------------
# tensor names: gguf-py's (per architecture) -> the HF names the families load
# ----------------------------------------------------------------------------------------------
_DS, _GLM, _QN = ("deepseek2",), ("glm4moe",), ("qwen3next",)
# (gguf-py MODEL_TENSOR, HF name under the layer prefix, the MoE architectures it belongs to (None: all))
_MOE_LAYER = [
    ("ATTN_NORM", "input_layernorm", None),
    ("FFN_NORM", "post_attention_layernorm", _DS),
    ("ATTN_POST_NORM", "post_attention_layernorm", _GLM + _QN),
    ("ATTN_Q", "self_attn.q_proj", None),
    ("ATTN_K", "self_attn.k_proj", _GLM + _QN),
    ("ATTN_V", "self_attn.v_proj", _GLM + _QN),
    ("ATTN_OUT", "self_attn.o_proj", None),
    ("ATTN_Q_NORM", "self_attn.q_norm", _GLM + _QN),
    ("ATTN_K_NORM", "self_attn.k_norm", _GLM + _QN),
    ("ATTN_Q_A", "self_attn.q_a_proj", _DS),
    ("ATTN_Q_A_NORM", "self_attn.q_a_layernorm", _DS),
    ("ATTN_Q_B", "self_attn.q_b_proj", _DS),
    ("ATTN_KV_A_MQA", "self_attn.kv_a_proj_with_mqa", _DS),
    ("ATTN_KV_A_NORM", "self_attn.kv_a_layernorm", _DS),
    ("ATTN_KV_B", "self_attn.kv_b_proj", _DS),
    ("FFN_GATE", "mlp.gate_proj", _DS + _GLM),
    ("FFN_UP", "mlp.up_proj", _DS + _GLM),
    ("FFN_DOWN", "mlp.down_proj", _DS + _GLM),
    ("FFN_GATE_INP", "mlp.gate", None),
    ("FFN_GATE_SHEXP", "mlp.shared_experts.gate_proj", _DS + _GLM),
    ("FFN_UP_SHEXP", "mlp.shared_experts.up_proj", _DS + _GLM),
    ("FFN_DOWN_SHEXP", "mlp.shared_experts.down_proj", _DS + _GLM),
    ("FFN_GATE_SHEXP", "mlp.shared_expert.gate_proj", _QN),
    ("FFN_UP_SHEXP", "mlp.shared_expert.up_proj", _QN),
    ("FFN_DOWN_SHEXP", "mlp.shared_expert.down_proj", _QN),
    ("FFN_GATE_INP_SHEXP", "mlp.shared_expert_gate", _QN),
    ("SSM_BETA_ALPHA", "linear_attn.in_proj_ba", _QN),
    ("SSM_CONV1D", "linear_attn.conv1d", _QN),
    ("SSM_NORM", "linear_attn.norm", _QN),
    ("SSM_OUT", "linear_attn.out_proj", _QN),
]
# names whose suffix llama.cpp's converter changes: gguf (with suffix) -> HF (with suffix)
_MOE_RENAMED = [
    ("FFN_EXP_PROBS_B", ".bias", "mlp.gate.e_score_correction_bias", _DS + _GLM),
    ("SSM_A", "", "linear_attn.A_log", _QN),                 # stored as -exp(A_log)
    ("SSM_DT", ".bias", "linear_attn.dt_bias", _QN),         # renamed dt_proj.bias by the converter
]
_EXPERTS = {"FFN_GATE_EXP": "gate_proj", "FFN_UP_EXP": "up_proj", "FFN_DOWN_EXP": "down_proj"}
# the NextN / MTP head of a layer after the decoder (gguf-py's NEXTN_*), HF names under the layer prefix
_NEXTN = {"NEXTN_EH_PROJ": "eh_proj", "NEXTN_ENORM": "enorm", "NEXTN_HNORM": "hnorm",
          "NEXTN_SHARED_HEAD_NORM": "shared_head.norm", "NEXTN_SHARED_HEAD_HEAD": "shared_head.head",
          "NEXTN_EMBED_TOKENS": "embed_tokens"}
# Qwen3-Next keeps its MTP head as mtp.*: what llama.cpp's (newer) converters rename to nextn names
_QWEN_MTP = {"eh_proj": "mtp.fc", "enorm": "mtp.pre_fc_norm_embedding", "hnorm": "mtp.pre_fc_norm_hidden",
             "shared_head.norm": "mtp.norm"}


def _sub(key: str) -> str:
    """gguf-py's per-layer name of MODEL_TENSOR ``key`` without the ``blk.{bid}.`` prefix."""
    import gguf

    return gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]].split(".", 2)[2]


def _layer_table(arch: str) -> Dict[str, Tuple[str, str]]:
    """{gguf name under blk.N. (with suffix): (recipe kind, HF name under the layer prefix)} of ``arch``."""
    t: Dict[str, Tuple[str, str]] = {}
    if arch not in MOE_ARCHITECTURES:
        for key, hf in _LAYER_TENSORS:
            base = hf.split(".", 3)[3]
            for sfx in (".weight", ".bias"):
                t[_sub(key) + sfx] = ("plain", base + sfx)
        return t
    for key, hf, archs in _MOE_LAYER:
        if archs is None or arch in archs:
            for sfx in (".weight", ".bias"):
                t[_sub(key) + sfx] = ("plain", hf + sfx)
    for key, sfx, hf, archs in _MOE_RENAMED:
        if arch in archs:
            t[_sub(key) + sfx] = ("plain", hf)
    for key, proj in _EXPERTS.items():
        t[_sub(key) + ".weight"] = ("experts", proj)
    for key, hf in _NEXTN.items():
        t[_sub(key) + ".weight"] = ("nextn", hf)
    if arch == "qwen3next":
        t[_sub("ATTN_QKV") + ".weight"] = ("qkvz", "linear_attn.in_proj_qkvz.weight")
        t[_sub("ATTN_GATE") + ".weight"] = ("qkvz", "linear_attn.in_proj_qkvz.weight")
    if arch == "deepseek2":
        t[_sub("ATTN_K_B") + ".weight"] = ("kv_b", "self_attn.kv_b_proj.weight")
        t[_sub("ATTN_V_B") + ".weight"] = ("kv_b", "self_attn.kv_b_proj.weight")
    return t


@dataclasses.dataclass
class _Recipe:
    """How an HF tensor is made from GGUF tensors: ``plain`` (one tensor, with ``transform``), ``expert``
    (entry ``index`` of a stacked [E, N, K] tensor), ``qkvz`` (Qwen3-Next's in_proj_qkvz from attn_qkv +
    attn_gate), ``kv_b`` (DeepSeek's kv_b_proj from attn_k_b + attn_v_b)."""
    kind: str
    gnames: List[str]
    transform: Optional[str] = None   # plain: "permute", "norm1" (stored 1 + w), "a_log" (stored -exp), "conv"
    index: int = 0


def _undo_neg_exp(a: torch.Tensor) -> torch.Tensor:
    """A_log from llama.cpp's ``ssm_a = -exp(A_log)`` (fp32): log(-a), then the nearest fp32 value whose
    torch.exp gives back the stored value exactly (a few ulps around log(-a)), so that a model computing
    exp(A_log) sees the stored decay bit for bit wherever such a value exists."""
    y = (-a.float()).contiguous()
    x = torch.log(y)
    best = x.clone()
    found = torch.exp(x) == y
    for k in range(1, 5):
        for sign in (1.0, -1.0):
            cand = x.clone()
            for _ in range(k):
                cand = torch.nextafter(cand, torch.full_like(cand, sign * float("inf")))
            hit = (torch.exp(cand) == y) & ~found
            best = torch.where(hit, cand, best)
            found = found | hit
    return best


class GGUFSource(TensorSource):
    """The tensors of one GGUF model (one file or all split parts) under HF names.

    Every HF name has a recipe (:class:`_Recipe`) over the file's tensors: the converter's transforms
    undone (llama's q/k row permutation, Qwen3-Next's ``1 + w`` norms, ``-exp(A_log)``, squeezed conv,
    split in_proj_qkvz; DeepSeek's kv_b split into k_b / v_b; experts stacked per layer). Float types
    are read as stored, the rest dequantized (counted in ``dequantized``) unless kept as blocks."""

    def __init__(self, path: str, readers, arch: str, num_heads: int, num_kv_heads: int, num_layers: int,
                 num_main_layers: Optional[int] = None, gdn: Optional[Tuple[int, int]] = None):
        import gguf

        super().__init__(origin=path)
        self.arch = arch
        self._gdn = gdn   # Qwen3-Next: (linear_num_key_heads, linear_key_head_dim), to rebuild in_proj_qkvz
        self._heads: Dict[str, int] = {}
        self.dequantized: Dict[str, int] = collections.Counter()
        self.kept: Dict[str, int] = collections.Counter()
        self.dequantize = False
        """``load(..., dequantize=True)``: every quantized tensor dequantized at load, none kept as blocks."""
        self._tensors_by_gname: Dict[str, object] = {}
        self._recipes: Dict[str, _Recipe] = {}
        self._cache: Tuple[Optional[str], object] = (None, None)
        n_main = num_layers if num_main_layers is None else num_main_layers
        top = {gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[k]]: hf for k, hf in _GLOBAL_TENSORS}
        table = _layer_table(arch)
        for r in readers:
            for t in r.tensors:
                if t.name == ROPE_FREQS:
                    continue   # read into the config (hf_config), not a weight
                if t.name in self._tensors_by_gname:
                    raise CheckpointError(f"{path}: tensor {t.name!r} appears twice")
                self._tensors_by_gname[t.name] = t
                self._place(t, top, table, num_layers, n_main, num_heads, num_kv_heads)
        self._gguf_name = {hf: " + ".join(repr(g) for g in r.gnames) for hf, r in self._recipes.items()}

    def _place(self, t, top, table, num_layers, n_main, num_heads, num_kv_heads) -> None:
        name, arch = t.name, self.arch
        base, dot, suffix = name.rpartition(".")
        if dot and base in top and suffix in ("weight", "bias"):
            return self._add(f"{top[base]}.{suffix}", _Recipe("plain", [name], self._norm(f"{top[base]}.{suffix}")))
        m = re.match(r"^blk\.(\d+)\.(.+)$", name)
        entry = table.get(m.group(2)) if m else None
        if entry is None or int(m.group(1)) >= num_layers:
            raise CheckpointError(f"{self.origin}: tensor {name!r} has no place in a {arch} model "
                                  f"of {num_layers} layers")
        i, (kind, hf) = int(m.group(1)), entry
        if kind == "nextn" and i < n_main:
            raise CheckpointError(f"{self.origin}: tensor {name!r} is a NextN (MTP) tensor in decoder layer {i} "
                                  f"(the MTP layers follow the {n_main} decoder layers)")
        if arch == "qwen3next" and i >= n_main:
            p = f"mtp.layers.{i - n_main}."
            if kind == "nextn":
                if hf not in _QWEN_MTP:
                    return   # a copy of the embedding / LM head: Qwen3-Next's MTP head uses the model's
                full = f"{_QWEN_MTP[hf]}.weight"   # its norms were renamed *norm before the converter's + 1
                return self._add(full, _Recipe("plain", [name], "norm1" if hf.endswith("norm") else None))
        else:
            p = f"model.layers.{i}."
        if kind in ("plain", "nextn"):
            full = p + (hf if kind == "plain" else hf + ".weight")
            transform = self._norm(full)
            if arch == "llama" and m.group(2) in ("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias"):
                transform = "permute"
                self._heads[full] = num_heads if ".attn_q." in name else num_kv_heads
            elif full.endswith(".A_log"):
                transform = "a_log"
            elif full.endswith("conv1d.weight"):
                transform = "conv"
            return self._add(full, _Recipe("plain", [name], transform))
        if kind == "experts":
            E = int(t.shape.tolist()[-1]) if len(t.shape) == 3 else 0
            if E < 1:
                raise CheckpointError(f"{self.origin}: tensor {name!r} has shape "
                                      f"{tuple(reversed(t.shape.tolist()))}, not [experts, rows, columns]")
            for e in range(E):
                self._add(f"{p}mlp.experts.{e}.{hf}.weight", _Recipe("expert", [name], index=e))
            return
        # two tensors make one HF tensor (qkvz: attn_qkv + attn_gate; kv_b: attn_k_b + attn_v_b)
        full = p + hf
        r = self._recipes.get(full)
        first = m.group(2).startswith(("attn_qkv", "attn_k_b"))
        if r is None:
            r = self._recipes[full] = _Recipe(kind, [None, None])
        slot = 0 if first else 1
        if r.gnames[slot] is not None:
            raise CheckpointError(f"{self.origin}: tensor {name!r} appears twice")
        r.gnames[slot] = name

    def _norm(self, hf: str) -> Optional[str]:
        """Qwen3-Next's zero-centred norms are stored as 1 + w (every ``*norm.weight`` but the GDN output norm)."""
        if self.arch == "qwen3next" and hf.endswith("norm.weight") and not hf.endswith("linear_attn.norm.weight"):
            return "norm1"
        return None

    def _add(self, hf: str, recipe: _Recipe) -> None:
        if hf in self._recipes:
            raise CheckpointError(f"{self.origin}: tensor {recipe.gnames[0]!r} appears twice (as {hf})")
        self._recipes[hf] = recipe

    def _complete(self, name: str) -> _Recipe:
        r = self._recipes[name]
        if None in r.gnames:
            have = next(g for g in r.gnames if g is not None)
            want = {"qkvz": ("attn_qkv", "attn_gate"), "kv_b": ("attn_k_b", "attn_v_b")}[r.kind]
            missing = have.replace(want[0], want[1]) if r.gnames[1] is None else have.replace(want[1], want[0])
            raise CheckpointError(f"{self.origin}: missing tensor {missing!r} ({name} needs both "
                                  f"{want[0]} and {want[1]})")
        return r

    def keys(self):
        return list(self._recipes)

    def describe(self, name: str) -> str:
        """``name`` (an HF name) as an error message shows it: the GGUF tensor name first."""
        g = self._gguf_name.get(name)
        if g is None:
            g = _expected_gguf_name(self.arch, name)
        return f"{g} ({name})" if g else repr(name)

    def __contains__(self, name: str) -> bool:
        return name in self._recipes

    def _t(self, gname: str):
        return self._tensors_by_gname[gname]

    def stored_dtype(self, name: str) -> Optional[torch.dtype]:
        """The float dtype ``name`` is stored in; None for a quantized (or absent) tensor."""
        if name not in self._recipes:
            return None
        g = self._recipes[name].gnames[0]
        return None if g is None else _FLOAT_DTYPES.get(self._t(g).tensor_type.name)

    def gguf_type(self, name: str) -> str:
        return self._t(self._complete(name).gnames[0]).tensor_type.name

    def _gshape(self, gname: str) -> tuple:
        return tuple(int(d) for d in reversed(self._t(gname).shape.tolist()))

    def shape(self, name: str):
        r = self._complete(name)
        s = self._gshape(r.gnames[0])
        if r.kind == "expert":
            return s[1:]
        if r.kind == "qkvz":
            g = self._gshape(r.gnames[1])
            return (s[0] + g[0], s[1])
        if r.kind == "kv_b":   # k_b [H, R, dn], v_b [H, dv, R] -> [H (dn + dv), R]
            v = self._gshape(r.gnames[1])
            return (s[0] * (s[2] + v[1]), s[1])
        if r.transform == "conv":
            return (s[0], 1, *s[1:])
        return s

    def _read(self, gname: str) -> torch.Tensor:
        """One GGUF tensor of its logical shape: float types as stored, others dequantized to fp32."""
        from gguf import quants

        if self._cache[0] == gname:
            return self._cache[1]
        t = self._t(gname)
        logical = self._gshape(gname)
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
        if len(logical) == 3:
            self._cache = (gname, out)   # stacked experts: read once for all of them
        return out

    def _check_shape(self, name: str, shape) -> tuple:
        logical = self.shape(name)
        if shape is not None and tuple(logical) != tuple(shape):
            raise CheckpointError(f"{self.origin}: tensor {self._gguf_name[name]} ({name}) has shape {logical}, "
                                  f"the metadata implies {tuple(shape)}")
        return logical

    def get(self, name: str, shape=None, dtype: Optional[torch.dtype] = None, device="cpu") -> torch.Tensor:
        if name not in self._recipes:
            raise CheckpointError(f"{self.origin}: missing tensor {name!r}")
        r = self._complete(name)
        logical = self._check_shape(name, shape)
        if r.kind == "expert":
            out = self._read(r.gnames[0])[r.index]
        elif r.kind == "qkvz":
            out = self._qkvz(self._read(r.gnames[0]), self._read(r.gnames[1]))
        elif r.kind == "kv_b":
            kb, vb = self._read(r.gnames[0]), self._read(r.gnames[1])
            if kb.dtype != vb.dtype:
                kb, vb = kb.float(), vb.float()
            out = torch.cat([kb.transpose(1, 2), vb], dim=1).reshape(logical)
        else:
            out = self._read(r.gnames[0])
            if r.transform == "permute":
                out = unpermute_rows(out, self._heads[name])
            elif r.transform == "norm1":
                out = out.float() - 1.0   # exact: (1 + w) and 1 are within a factor 2 for |w| <= 1/2
            elif r.transform == "a_log":
                out = _undo_neg_exp(out)
            elif r.transform == "conv":
                out = out.reshape(logical)
        return out.to(device=device, dtype=dtype or out.dtype).contiguous()

    def _qkvz_rows(self, n_qkv: int, n_gate: int) -> torch.Tensor:
        """Row order turning [q all | k all | v all] + [z all] (llama.cpp's attn_qkv, attn_gate) back into
        HF's in_proj_qkvz, per key-head group [q_g | k_g | v_g | z_g] (the inverse of the converter's split)."""
        hk, dk = self._gdn
        v_per = (n_qkv - 2 * hk * dk) // hk
        z_per = n_gate // hk
        rows = []
        for g in range(hk):
            rows += list(range(g * dk, (g + 1) * dk))
            rows += list(range(hk * dk + g * dk, hk * dk + (g + 1) * dk))
            rows += list(range(2 * hk * dk + g * v_per, 2 * hk * dk + (g + 1) * v_per))
            rows += list(range(n_qkv + g * z_per, n_qkv + (g + 1) * z_per))
        return torch.tensor(rows)

    def _qkvz(self, qkv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if qkv.dtype != gate.dtype:
            qkv, gate = qkv.float(), gate.float()
        return torch.cat([qkv, gate])[self._qkvz_rows(qkv.shape[0], gate.shape[0])]

    def _blocks_of(self, gname: str):
        from ds4t.kernels.quant_blocks import GGUFWeight

        t = self._t(gname)
        logical = self._gshape(gname)
        kind = t.tensor_type.name
        try:
            data = torch.from_numpy(np.array(np.asarray(t.data), dtype=np.uint8)).reshape(*logical[:-1], -1)
            return GGUFWeight.from_blocks(data, kind, logical[-1])   # repacked once, here
        except (ValueError, RuntimeError) as e:
            raise CheckpointError(f"{self.origin}: tensor {gname!r} ({kind}) does not hold {logical} in "
                                  f"{kind} blocks ({e})") from None

    def blocks(self, name: str, shape=None, device="cpu"):
        """``name`` as a :class:`~ds4t.kernels.quant_blocks.GGUFWeight` when it is stored in a kernel type
        (:data:`~ds4t.kernels.quant_blocks.QTYPES`) and ``dequantize`` is off (rows may move: llama's q/k,
        Qwen3-Next's qkvz; blocks run along K), else None. A qkvz whose attn_qkv and attn_gate differ in
        type is a :class:`~ds4t.kernels.weights.RowParts` of both (rows interleaved per key-head group)."""
        from ds4t.kernels.quant_blocks import QTYPES

        if name not in self._recipes or self.dequantize:
            return None
        r = self._complete(name)
        kinds = {self._t(g).tensor_type.name for g in r.gnames}
        # qkvz of two types (llama.cpp's Q4_K_M writes attn_qkv in Q5_K beside a Q4_K attn_gate) stays two
        # row blocks: interleaved here per key-head group, which the model's own row order undoes again
        if not kinds <= set(QTYPES) or (len(kinds) != 1 and r.kind != "qkvz") or r.kind == "kv_b" \
                or r.transform in ("norm1", "a_log", "conv"):
            return None
        logical = self._check_shape(name, shape)
        if r.kind == "expert":
            w = self._blocks_of(r.gnames[0])[r.index]
        elif r.kind == "qkvz":
            from ds4t.kernels import weights

            a, b = self._blocks_of(r.gnames[0]), self._blocks_of(r.gnames[1])
            w = weights.cat([a, b])[self._qkvz_rows(a.shape[0], b.shape[0])]
        else:
            w = self._blocks_of(r.gnames[0])
            if r.transform == "permute":
                rows = torch.arange(logical[0])[:, None]
                w = w[unpermute_rows(rows, self._heads[name])[:, 0]]
        for kind in kinds:   # the file types it holds (a qkvz of two types counts under each)
            self.kept[kind] += 1
        return w.to(device).contiguous()

    def stacked(self, names, shapes, device, dtype):
        """Experts ``names`` (entries lo..hi-1 of one stacked GGUF tensor, in order: all of them, or a tensor
        parallel rank's run) as that tensor's entries: blocks when stored in a kernel type (one GGUFWeight
        [hi - lo, N, K], the file's bytes), else float in ``dtype``; None when ``names`` are not such a run."""
        from ds4t.kernels.quant_blocks import QTYPES
        from ds4t.models.loading import keeps_blocks

        rs = [self._recipes.get(n) for n in names]
        if not rs or any(r is None or r.kind != "expert" for r in rs):
            return None
        g, lo = rs[0].gnames[0], rs[0].index
        hi = lo + len(rs)
        if any(r.gnames[0] != g for r in rs) or [r.index for r in rs] != list(range(lo, hi)) \
                or self._gshape(g)[0] < hi:
            return None
        for n, s in zip(names, shapes):
            self._check_shape(n, s)
        if self._t(g).tensor_type.name in QTYPES and keeps_blocks(names[0]) and not self.dequantize:
            w = self._blocks_of(g)
            self.kept[w.qtype] += 1
            return w[lo:hi].to(device).contiguous().with_act_dtype(dtype)
        out = self._read(g)
        self._cache = (None, None)
        return out[lo:hi].to(device=device, dtype=dtype).contiguous()

    def default_dtype(self) -> torch.dtype:
        """bf16 / fp16 when every matrix is stored so, else fp32 (what dequantized types need)."""
        kinds = {t.tensor_type.name for t in self._tensors_by_gname.values() if len(t.shape) >= 2}
        if kinds == {"BF16"}:
            return torch.bfloat16
        if kinds == {"F16"}:
            return torch.float16
        return torch.float32

    def log_dequantized(self, dtype: torch.dtype, device: Optional[torch.device] = None) -> None:
        """The one log line of a load that kept or dequantized quantized tensors (nothing when none was). Blocks
        kept for a GPU with fp32 activations (a quantized file's default dtype) get a hint: there the block kernels
        take their exact route, fp32 dots on the FMA units, where bf16 activations take the fold route on the
        tensor cores (an H100, Qwen3-Next-80B-4l in Q4_K at N = 16: 17.6 ms a step with fp32 activations,
        bench/results/2026-12-07-h100-batched-blocks-fp8-barrier.md; 1.3 ms with bf16 in an earlier run,
        bench/results/2026-12-06-h100-gguf-row-tiles.md). Blocks kept on the CPU get the other hint: the
        interpreter pays per op, and a 32-block costs its block kernel ~35 ops (measured on 2 cores: the SmolLM2-135M
        GGUF ~38 s a decode step on its Q4_1 blocks, ~6 s dequantized)."""
        def kinds(c):
            return ", ".join(f"{k} ({n} tensors)" for k, n in sorted(c.items()))

        parts = []
        if self.kept:
            parts.append(f"kept {kinds(self.kept)} as blocks (quantized kernels)")
            on = None if device is None else torch.device(device).type
            if dtype == torch.float32 and on == "cuda":
                parts.append("activations in float32, so the block kernels take their exact route (fp32 FMA dots): "
                             "load with dtype='bf16' for the tensor-core fold route, many times faster on a GPU")
            elif on == "cpu":
                parts.append("the CPU interpreter runs block kernels several times slower than float weights "
                             "(SmolLM2-135M: ~38 s a decode step against ~6 s): dequantize=True (--dequantize) "
                             "for speed")
        if self.dequantized:
            why = "dequantize=True" if self.dequantize else "no kernel reads those blocks"
            parts.append(f"dequantized {kinds(self.dequantized)} to {str(dtype).replace('torch.', '')} at load ({why})")
        if parts:
            log.warning("%s: %s", os.path.basename(self.origin), "; ".join(parts))


_FLOAT_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _expected_gguf_name(arch: str, hf: str) -> Optional[str]:
    """The GGUF name(s) an HF tensor the file lacks would have (for 'missing tensor' messages)."""
    import gguf

    for key, h in _GLOBAL_TENSORS:
        for sfx in ("weight", "bias"):
            if hf == f"{h}.{sfx}":
                return repr(f"{gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[key]]}.{sfx}")
    m = re.match(r"^(?:model\.layers\.(\d+)|mtp\.layers\.(\d+))\.(.+)$", hf)
    if not m:
        return None
    i, sub = m.group(1) or m.group(2), m.group(3)
    e = re.match(r"^mlp\.experts\.\d+\.(\w+)\.weight$", sub)
    for g, (kind, h) in _layer_table(arch).items():
        if (kind == "plain" and h == sub) or (kind == "nextn" and h + ".weight" == sub) \
                or (kind == "experts" and e and e.group(1) == h) or (kind in ("qkvz", "kv_b") and h == sub):
            return repr(f"blk.{i}.{g}")
    return None


def _check_blocks(a: str, blocks: int, shapes: Dict[str, tuple], path: str) -> None:
    """block_count must match the file's ``blk.N.*`` tensors (a larger count would build tables for layers
    that are not there; a smaller one would leave tensors unread)."""
    ids = {int(m.group(1)) for m in (re.match(r"^blk\.(\d+)\.", k) for k in shapes) if m}
    have = max(ids) + 1 if ids else 0
    if blocks != have:
        raise CheckpointError(f"{path}: metadata '{a}block_count' = {blocks} but the file's tensors are blocks "
                              f"0..{have - 1} ({have} blocks)")


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


# The metadata key (after "{arch}.") each HF config field is read from, for error messages; fields
# derived from tensors or from several keys name them in words.
_FIELD_KEYS = {
    "num_hidden_layers": "block_count", "hidden_size": "embedding_length",
    "num_attention_heads": "attention.head_count", "num_key_value_heads": "attention.head_count_kv",
    "head_dim": "attention.key_length", "intermediate_size": "feed_forward_length",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon", "max_position_embeddings": "context_length",
    "rope_parameters.rope_theta": "rope.freq_base", "rope_parameters.factor": "rope.scaling.factor",
    "rope_parameters.original_max_position_embeddings": "rope.scaling.original_context_length",
    "rope_parameters.beta_fast": "rope.scaling.yarn_beta_fast", "rope_parameters.beta_slow": "rope.scaling.yarn_beta_slow",
    "rope_parameters.attention_factor": "rope.scaling.yarn_attn_factor",
    "num_experts": "expert_count", "n_routed_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
    "moe_intermediate_size": "expert_feed_forward_length",
    "shared_expert_intermediate_size": "expert_shared_feed_forward_length", "n_shared_experts": "expert_shared_count",
    "n_group": "expert_group_count", "topk_group": "expert_group_used_count",
    "routed_scaling_factor": "expert_weights_scale", "first_k_dense_replace": "leading_dense_block_count",
    "linear_num_key_heads": "ssm.group_count", "linear_key_head_dim": "ssm.state_size",
    "linear_num_value_heads": "ssm.time_step_rank", "linear_conv_kernel_dim": "ssm.conv_kernel",
    "q_lora_rank": "attention.q_lora_rank", "kv_lora_rank": "attention.kv_lora_rank",
    "qk_rope_head_dim": "rope.dimension_count", "v_head_dim": "attention.value_length(_mla)",
}


def field_origin(cfg: dict):
    """For :func:`ds4t.models.checkpoint.check_fields`: HF field -> "metadata '{arch}.{key}'" of a config
    :func:`hf_config` made (None where no single key holds it)."""
    arch = next(a for a, t in MODEL_TYPES.items() if t == cfg["model_type"])
    named = {"vocab_size": "the rows of 'token_embd.weight'"}

    def origin(field: str):
        if field in named:
            return named[field]
        key = _FIELD_KEYS.get(field)
        return f"metadata '{arch}.{key}'" if key else None

    return origin


def hf_config(meta: dict, tensor_shapes: Dict[str, tuple], path: str) -> dict:
    """The HF config dict of a GGUF model from its metadata (and, for what metadata leaves implicit,
    which tensors it holds: tied embeddings, attention bias, vocabulary size)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported "
                              f"(supported: {list(ARCHITECTURES)})")
    if arch in MOE_ARCHITECTURES:
        return _moe_config(arch, meta, tensor_shapes, path)
    a = arch + "."
    n = _get(meta, a + "block_count", int, path)
    _check_blocks(a, n, tensor_shapes, path)
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


def _f32(v: float) -> float:
    """A float32 metadata value as the shortest decimal that reads back as it (what the converter wrote:
    ``0.1`` rather than 0.10000000149...), so that config arithmetic (YaRN's mscale) matches the source."""
    return float(str(np.float32(v)))


def _moe_config(arch: str, meta: dict, shapes: Dict[str, tuple], path: str) -> dict:
    """The HF config dict (qwen3_next / deepseek_v3 / glm4_moe) of a ``qwen3next`` / ``deepseek2`` /
    ``glm4moe`` file, from the keys llama.cpp's converter writes for it."""
    a = arch + "."

    def get(key, kind, default=None):
        return _get(meta, a + key, kind, path, default)

    def opt(key, kind):
        return get(key, kind) if a + key in meta else None

    blocks = get("block_count", int)
    _check_blocks(a, blocks, shapes, path)
    nextn = get("nextn_predict_layers", int, 0) if a + "nextn_predict_layers" in meta else 0
    n = blocks - nextn
    if n < 1:
        raise CheckpointError(f"{path}: {a}block_count {blocks} leaves no decoder layer besides "
                              f"{nextn} nextn_predict_layers")
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight'")
    vocab = shapes["token_embd.weight"][0]
    if a + "vocab_size" in meta and meta[a + "vocab_size"] != vocab:
        raise CheckpointError(f"{path}: {a}vocab_size {meta[a + 'vocab_size']} but token_embd has {vocab} rows")
    hidden, heads = get("embedding_length", int), get("attention.head_count", int)
    scaling = get("rope.scaling.type", str, "none")
    rope = {"rope_type": "default", "rope_theta": _f32(get("rope.freq_base", float, 10000.0))}
    cfg = dict(model_type=MODEL_TYPES[arch], vocab_size=vocab, hidden_size=hidden, num_hidden_layers=n,
               num_attention_heads=heads, rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", float)),
               max_position_embeddings=get("context_length", int, 4096),
               tie_word_embeddings="output.weight" not in shapes, hidden_act="silu", rope_parameters=rope)
    if arch == "qwen3next":
        head_dim = get("attention.key_length", int, hidden // heads if heads else 0)
        if get("attention.value_length", int, head_dim) != head_dim:
            raise CheckpointError(f"{path}: {a}attention.value_length != key_length is not supported")
        rot = get("rope.dimension_count", int, head_dim)
        if scaling != "none":
            raise CheckpointError(f"{path}: {a}rope.scaling.type {scaling!r} is not supported for qwen3next")
        lv = get("ssm.time_step_rank", int)
        inner = get("ssm.inner_size", int)
        if lv < 1 or inner % lv:
            raise CheckpointError(f"{path}: {a}ssm.inner_size {inner} is not a multiple of ssm.time_step_rank {lv}")
        interval = get("full_attention_interval", int, 4)
        if interval < 1:
            raise CheckpointError(f"{path}: {a}full_attention_interval {interval} must be >= 1")
        rope["partial_rotary_factor"] = rot / head_dim
        cfg.update(
            num_key_value_heads=get("attention.head_count_kv", int, heads), head_dim=head_dim,
            layer_types=["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)],
            linear_num_key_heads=get("ssm.group_count", int), linear_key_head_dim=get("ssm.state_size", int),
            linear_num_value_heads=lv, linear_value_head_dim=inner // lv,
            linear_conv_kernel_dim=get("ssm.conv_kernel", int),
            intermediate_size=get("feed_forward_length", int, 0), num_experts=get("expert_count", int),
            num_experts_per_tok=get("expert_used_count", int), moe_intermediate_size=get("expert_feed_forward_length", int),
            shared_expert_intermediate_size=get("expert_shared_feed_forward_length", int, 0)
            if a + "expert_shared_feed_forward_length" in meta else 0,
            decoder_sparse_step=1, norm_topk_prob=get("expert_weights_norm", bool, True)
            if a + "expert_weights_norm" in meta else True,
            attention_bias=any(k.endswith(".attn_q.bias") for k in shapes), mtp_num_hidden_layers=nextn)
        return cfg
    # deepseek2 / glm4moe: the grouped sigmoid router of SigmoidMoEConfig
    gating = opt("expert_gating_func", int)
    if gating is None and arch == "deepseek2":
        raise CheckpointError(f"{path}: missing metadata {a + 'expert_gating_func'!r} (llama.cpp then assumes the "
                              f"softmax router of DeepSeek-V2 files; ds4t runs DeepSeek-V3's sigmoid router, 2)")
    if gating not in (None, 2):
        raise CheckpointError(f"{path}: {a}expert_gating_func = {gating} (softmax) is not supported: ds4t runs "
                              f"the sigmoid router (2)")
    cfg.update(
        intermediate_size=get("feed_forward_length", int), first_k_dense_replace=get("leading_dense_block_count", int, 0)
        if a + "leading_dense_block_count" in meta else 0,
        n_routed_experts=get("expert_count", int), num_experts_per_tok=get("expert_used_count", int),
        moe_intermediate_size=get("expert_feed_forward_length", int),
        n_shared_experts=get("expert_shared_count", int, 0) if a + "expert_shared_count" in meta else 0,
        n_group=get("expert_group_count", int, 1) if a + "expert_group_count" in meta else 1,
        topk_group=get("expert_group_used_count", int, 1) if a + "expert_group_used_count" in meta else 1,
        routed_scaling_factor=_f32(get("expert_weights_scale", float, 1.0)),
        norm_topk_prob=bool(opt("expert_weights_norm", bool)), scoring_func="sigmoid", topk_method="noaux_tc",
        num_nextn_predict_layers=nextn)
    if arch == "glm4moe":
        head_dim = get("attention.key_length", int, hidden // heads if heads else 0)
        rot = get("rope.dimension_count", int, head_dim // 2)
        if scaling != "none":
            raise CheckpointError(f"{path}: {a}rope.scaling.type {scaling!r} is not supported for glm4moe")
        rope["partial_rotary_factor"] = rot / head_dim
        cfg.update(num_key_value_heads=get("attention.head_count_kv", int, heads), head_dim=head_dim,
                   attention_bias="blk.0.attn_q.bias" in shapes, use_qk_norm="blk.0.attn_q_norm.weight" in shapes)
        return cfg
    # deepseek2: MLA sizes (newer files: key_length_mla / value_length_mla; older: key_length / value_length)
    rope_dim = get("rope.dimension_count", int)
    kv_lora = get("attention.kv_lora_rank", int)
    if a + "attention.key_length_mla" in meta:
        qk, v = get("attention.key_length_mla", int), get("attention.value_length_mla", int)
    else:
        qk, v = get("attention.key_length", int), get("attention.value_length", int)
    if qk <= rope_dim:
        raise CheckpointError(f"{path}: MLA key length {qk} must exceed rope.dimension_count {rope_dim}")
    if scaling == "yarn":
        rope.update(rope_type="yarn", factor=_f32(get("rope.scaling.factor", float)),
                    original_max_position_embeddings=get("rope.scaling.original_context_length", int))
        for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                           ("yarn_attn_factor", "attention_factor")):
            if a + "rope.scaling." + key in meta:
                rope[field] = _f32(get("rope.scaling." + key, float))
        if a + "rope.scaling.yarn_log_multiplier" in meta:   # the converter writes 0.1 * mscale_all_dim
            m = _f32(get("rope.scaling.yarn_log_multiplier", float) / 0.1)
            rope.update(mscale=m, mscale_all_dim=m)
    elif scaling != "none":
        raise CheckpointError(f"{path}: {a}rope.scaling.type {scaling!r} is not supported for deepseek2 "
                              f"(supported: none, yarn)")
    cfg.update(num_key_value_heads=heads, q_lora_rank=opt("attention.q_lora_rank", int), kv_lora_rank=kv_lora,
               qk_rope_head_dim=rope_dim, qk_nope_head_dim=qk - rope_dim, v_head_dim=v, rope_interleave=True,
               attention_bias="blk.0.attn_kv_a_mqa.bias" in shapes)
    return cfg


# ----------------------------------------------------------------------------------------------
# tokenizer
# ----------------------------------------------------------------------------------------------
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2's (Qwen3-Next's files say "qwen2"): llama3's with single digits.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek-V3's three, in order: digit runs of up to 3, CJK / kana runs, then words and punctuation.
_DEEPSEEK3_SPLITS = [
    r"\p{N}{1,3}",
    "[一-龥぀-ゟ゠-ヿ]+",   # U+4E00-9FA5, U+3040-309F, U+30A0-30FF
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
# tokenizer.ggml.pre -> the regex splits llama.cpp applies in order (llama-vocab.cpp), before byte-level BPE.
_PRE_SPLITS = {
    "gpt2": [_GPT2_SPLIT], "default": [_GPT2_SPLIT], "mpt": [_GPT2_SPLIT], "olmo": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT], "starcoder": [r"\p{N}", _GPT2_SPLIT], "refact": [r"\p{N}", _GPT2_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT], "llama3": [_LLAMA3_SPLIT], "llama-v3": [_LLAMA3_SPLIT],
    "dbrx": [_LLAMA3_SPLIT], "smaug-bpe": [_LLAMA3_SPLIT],
    "glm4": [_LLAMA3_SPLIT], "chatglm-bpe": [_LLAMA3_SPLIT],          # GLM-4.5 (llama.cpp's CHATGLM4)
    "qwen2": [_QWEN2_SPLIT], "deepseek-r1-qwen": [_QWEN2_SPLIT], "stablelm2": [_QWEN2_SPLIT],
    "deepseek-v3": _DEEPSEEK3_SPLITS,
}
# pre-tokenizers whose vocabulary llama.cpp gives no BOS token, whatever add_bos_token says
_NO_BOS_PRE = ("glm4", "chatglm-bpe")
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4   # llama.cpp's token types


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
    if kind not in ("gpt2", "llama"):
        warnings.warn(f"{path}: tokenizer model {kind!r} is not built yet (only 'gpt2', byte-level BPE, and "
                      f"'llama', SentencePiece BPE): model.tokenizer is None, pass token ids", stacklevel=3)
        return None, text
    from tokenizers import AddedToken, processors

    types = meta.get("tokenizer.ggml.token_type") or []
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if kind == "llama":
        tok = _spm_tokenizer(meta, tokens, types, vocab, path)
        pre = None
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)   # llama.cpp's default for SentencePiece
    else:
        tok, pre = _byte_level_bpe(meta, vocab, path)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    bos = text.special.get("bos_token")
    if pre in _NO_BOS_PRE:   # GLM's chat template writes its own [gMASK]<sop> prefix
        bos = None
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab[bos])])
    return tok, text


def _spm_tokenizer(meta: dict, tokens, types, vocab: dict, path: str):
    """The ``Tokenizer`` of a SentencePiece BPE vocabulary (``tokenizer.ggml.model`` "llama"), tokenizing
    as llama.cpp's SPM tokenizer does: spaces become U+2581 (one prefixed when ``add_space_prefix``, the
    default), then adjacent pieces merge best-score-first while the merged piece is in the vocabulary, and a
    character no piece covers becomes its UTF-8 byte tokens ``<0xXX>``. The merges are the vocabulary's own:
    every split of a normal token into two tokens, ranked by the merged token's score."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise CheckpointError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores, one per token "
                              f"({len(tokens)}), got {None if scores is None else len(scores)}")
    if types and len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    mergeable = {t for i, t in enumerate(tokens) if not types or types[i] in (_NORMAL, _USER_DEFINED)}
    ranked = []
    for t in mergeable:
        for cut in range(1, len(t)):
            a, b = t[:cut], t[cut:]
            if a in mergeable and b in mergeable:
                ranked.append((-float(scores[vocab[t]]), vocab[t], cut, a, b))
    merges = [(a, b) for *_, a, b in sorted(ranked)]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=byte_fallback))
    space = "\u2581"
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(space)] if prefix else [])
                                          + [normalizers.Replace(" ", space)])
    tok.decoder = decoders.Sequence([decoders.Replace(space, " "), decoders.ByteFallback(), decoders.Fuse()]
                                    + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tok


def _byte_level_bpe(meta: dict, vocab: dict, path: str):
    """``(Tokenizer, pre)`` of a GPT-2 style byte-level BPE vocabulary (``tokenizer.ggml.model``
    "gpt2"), split before BPE as llama.cpp does for ``tokenizer.ggml.pre``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges") or []
    pairs = []
    for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
            raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {m!r} is not 'left right'")
        pairs.append((a, b))
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
    return tok, pre


def open_gguf(path: str):
    """``(hf config dict, GGUFSource, tokenizer or None, TextMeta)`` of the GGUF model at ``path``."""
    files = split_files(path)
    readers = [_open(f) for f in files]
    meta = _meta(readers[0], files[0])
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
    arch = meta["general.architecture"]
    n_mtp = cfg.get("num_nextn_predict_layers", cfg.get("mtp_num_hidden_layers", 0)) or 0
    gdn = (cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]) if arch == "qwen3next" else None
    source = GGUFSource(path, readers, arch, cfg["num_attention_heads"], cfg.get("num_key_value_heads", 0),
                        cfg["num_hidden_layers"] + n_mtp, num_main_layers=cfg["num_hidden_layers"], gdn=gdn)
    tokenizer, text = build_tokenizer(meta, path)
    return cfg, source, tokenizer, text
