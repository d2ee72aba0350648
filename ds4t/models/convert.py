"""``ds4t convert SRC DST.gguf --type T``: write a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes
it, from an HF checkpoint directory or a preset (families ``llama`` and ``qwen3`` so far).

What is written (checked against the converter's ``LlamaModel`` / ``Qwen3Model`` and gguf-py 0.19):

* metadata ``general.architecture`` = ``llama`` | ``qwen3``, ``general.name``, ``general.file_type``, and
  ``{arch}.block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.key_length / value_length, attention.layer_norm_rms_epsilon,
  rope.freq_base, rope.dimension_count, vocab_size`` (+ ``rope.scaling.type / factor`` for linear RoPE
  scaling); llama3 RoPE scaling as the converter writes it, a ``rope_freqs.weight`` tensor of per-pair
  frequency divisors;
* tensors under gguf-py's names (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output``; no
  ``output`` when embeddings are tied), llama's q/k rows permuted as ``LlamaModel.permute`` does;
* types: 1-D tensors F32; matrices in ``--type`` (F32, F16, BF16, Q8_0, Q4_K, Q6_K). A matrix whose
  row length the type does not fit falls back as llama.cpp does (K-quants -> Q8_0 -> F16). Q8_0 is
  gguf-py's (bit-exact with ggml); Q4_K / Q6_K are ds4t's quantizers (:mod:`ds4t.kernels.quant_blocks`);
* a tokenizer: a preset's byte-level one as ``tokenizer.ggml.model`` "gpt2" (one token per byte).
"""
from __future__ import annotations

import logging
import math
import os
from typing import Dict, Optional

import numpy as np
import torch

from ds4t.models.checkpoint import CheckpointError

log = logging.getLogger("ds4t.convert")

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_K", "Q6_K")
_FILE_TYPE = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 15, "Q6_K": 18, "BF16": 32}   # llama_ftype (MOSTLY_*)
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(hf: str) -> str:
    """llama.cpp's name of the HF tensor ``hf`` (dense llama / qwen3)."""
    base, _, suffix = hf.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    parts = base.split(".")
    sub = ".".join(parts[3:])
    if parts[:2] != ["model", "layers"] or sub not in _LAYER:
        raise CheckpointError(f"convert: no GGUF name for tensor {hf!r}")
    return f"blk.{parts[2]}.{_LAYER[sub]}.{suffix}"


def _llama3_rope_factors(head_dim: int, p: dict) -> torch.Tensor:
    """The converter's ``rope_freqs`` for llama3 scaling: per RoPE pair, the divisor of its frequency."""
    base = float(p["rope_theta"])
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old = float(p["original_max_position_embeddings"])
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _matrix(a: np.ndarray, qtype: str):
    """(data, raw gguf type or None) of a float32 matrix in ``qtype``, with llama.cpp's fallback."""
    import gguf

    from ds4t.kernels.quant_blocks import fallback_type, quantize_numpy

    if qtype == "F32":
        return a.astype(np.float32), None
    if qtype == "F16":
        return a.astype(np.float16), None
    if qtype == "BF16":
        return gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16), gguf.GGMLQuantizationType.BF16
    t = fallback_type(qtype, a.shape[-1])
    if t is None:
        return a.astype(np.float16), None
    return quantize_numpy(a, t), gguf.GGMLQuantizationType[t]


def _source(src: str, seed: int):
    """(hf config dict, TensorSource, expected shapes, name) of a preset or an HF directory."""
    from ds4t.models import registry
    from ds4t.models.checkpoint import TensorSource, read_config

    if src in registry._preset_configs():
        cfg, source = registry.preset_source(src, seed)
        name = src
    elif os.path.isdir(src):
        cfg = read_config(src)
        source = TensorSource.from_dir(src)
        name = os.path.basename(os.path.abspath(src))
    else:
        raise CheckpointError(f"convert: {src!r} is neither a checkpoint directory nor a preset")
    mt = cfg.get("model_type")
    if mt not in ("llama", "qwen3"):
        raise CheckpointError(f"convert: model_type {mt!r} cannot be written yet (supported: llama, qwen3)")
    _, parse, expected, _ = registry._families()[mt]
    return cfg, source, expected(parse(cfg)), parse(cfg), name


def convert(src: str, dst: str, qtype: str = "F32", seed: int = 0) -> Dict[str, str]:
    """Write ``src`` (preset or HF directory) as the GGUF file ``dst`` with matrices in ``qtype``.
    Returns {gguf tensor name: the type it was written in}."""
    import gguf

    qtype = qtype.upper()
    if qtype not in TYPES:
        raise ValueError(f"convert: --type {qtype!r} is not one of {list(TYPES)}")
    cfg, source, expected, c, name = _source(src, seed)
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(dst, arch)
    w.add_name(name)
    w.add_file_type(_FILE_TYPE[qtype])
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.eps))
    w.add_vocab_size(c.vocab_size)
    kind = c.rope.get("rope_type", "default")
    written: Dict[str, str] = {}
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(c.rope["factor"]))
    elif kind == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(c.head_dim, c.rope).numpy())
        written["rope_freqs.weight"] = "F32"
    elif kind != "default":
        raise CheckpointError(f"convert: rope_type {kind!r} cannot be written")
    if src in _preset_names():
        _byte_tokenizer(w, c.vocab_size)
    for hf in expected:
        a = source.get(hf, expected[hf], torch.float32).numpy()
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):
            from ds4t.models.gguf import permute_rows

            n = c.num_heads if ".q_proj." in hf else c.num_kv_heads
            a = permute_rows(torch.from_numpy(a), n).numpy()
        gname = gguf_name(hf)
        if a.ndim == 1:
            data, raw = a.astype(np.float32), None
        else:
            data, raw = _matrix(a, qtype)
        w.add_tensor(gname, data, raw_dtype=raw)
        written[gname] = raw.name if raw is not None else {np.float32: "F32", np.float16: "F16"}[data.dtype.type]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    fell = sorted({t for n, t in written.items() if t != qtype and not n.endswith("norm.weight")
                   and n != "rope_freqs.weight"})
    if fell and qtype not in ("F32",):
        log.warning("%s: some matrices do not fit %s rows and were written as %s", dst, qtype, ", ".join(fell))
    return written


def _preset_names():
    from ds4t.models import registry

    return registry._preset_configs()


def _byte_tokenizer(w, vocab: int) -> None:
    """A preset's byte-level tokenizer (token id = byte) as GPT-2 style BPE metadata with no merges."""
    from ds4t.models.tokenizer import _byte_symbols

    sym = _byte_symbols()
    tokens = [sym[b] if b < 256 else f"<|extra_{b}|>" for b in range(vocab)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1 if b < 256 else 3 for b in range(vocab)])
    w.add_token_merges([])
    w.add_add_bos_token(False)


def main(args) -> Optional[int]:
    """The ``ds4t convert`` command (argparse namespace: src, dst, type, seed)."""
    written = convert(args.src, args.dst, args.type, seed=args.seed)
    types = sorted(set(written.values()))
    size = os.path.getsize(args.dst)
    print(f"wrote {args.dst}: {len(written)} tensors ({', '.join(types)}), {size / 1e6:.1f} MB")
    return 0
