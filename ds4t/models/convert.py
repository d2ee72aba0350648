"""``ds4t convert SRC DST.gguf --type T``: write a GGUF file as llama.cpp's ``convert_hf_to_gguf.py`` writes
it, from an HF checkpoint directory or a preset (families ``llama``, ``qwen3``, and the MoE families
``qwen3_next`` / ``deepseek_v3`` / ``glm4_moe`` as ``qwen3next`` / ``deepseek2`` / ``glm4moe``: :func:`_convert_moe`).

What is written (checked against the converter's ``LlamaModel`` / ``Qwen3Model`` and gguf-py 0.19):

* metadata ``general.architecture`` = ``llama`` | ``qwen3``, ``general.name``, ``general.file_type``, and
  ``{arch}.block_count, context_length, embedding_length, feed_forward_length, attention.head_count,
  attention.head_count_kv, attention.key_length / value_length, attention.layer_norm_rms_epsilon,
  rope.freq_base, rope.dimension_count, vocab_size`` (+ ``rope.scaling.type / factor`` for linear RoPE
  scaling); llama3 RoPE scaling as the converter writes it, a ``rope_freqs.weight`` tensor of per-pair
  frequency divisors;
* tensors under gguf-py's names (``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output``; no
  ``output`` when embeddings are tied), llama's q/k rows permuted as ``LlamaModel.permute`` does;
* types: 1-D tensors F32; matrices in ``--type`` (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K). A matrix whose
  row length the type does not fit falls back as llama.cpp does (K-quants -> Q8_0 -> F16). Q8_0 is
  as are Q4_0 / Q4_1 (bit-exact with ggml); Q4_K / Q5_K / Q6_K are ds4t's quantizers (:mod:`ds4t.kernels.quant_blocks`);
* ``--tensor-type PATTERN=TYPE`` (llama.cpp's ``llama-quantize`` option of that name, repeatable): matrices whose
  GGUF name matches the regular expression PATTERN (``re.search``; the first matching option wins) are written in
  TYPE instead, e.g. ``--type Q4_K --tensor-type attn_v=Q6_K --tensor-type ffn_down=Q6_K`` for the mix of types
  within a layer that llama.cpp's Q4_K_M files hold;
* a tokenizer: a preset's byte-level one as ``tokenizer.ggml.model`` "gpt2" (one token per byte).
"""
from __future__ import annotations

import logging
import math
import os
import re
from typing import Dict, Mapping, Optional

import numpy as np
import torch

from ds4t.models.checkpoint import CheckpointError

log = logging.getLogger("ds4t.convert")

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# llama_ftype (MOSTLY_*): the K-quants as their _M mixes name them (Q4_K_M 15, Q5_K_M 17)
_FILE_TYPE = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q4_K": 15, "Q5_K": 17, "Q6_K": 18, "BF16": 32}
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
    if mt not in ("llama", "qwen3", *MOE_ARCH):
        raise CheckpointError(f"convert: model_type {mt!r} cannot be written (supported: llama, qwen3, "
                              f"{', '.join(MOE_ARCH)})")
    _, parse, expected, _ = registry._families()[mt]
    return cfg, source, expected(parse(cfg)), parse(cfg), name


def tensor_type_rules(specs) -> Dict[str, str]:
    """``--tensor-type`` values ``"PATTERN=TYPE"`` as {pattern: TYPE}, checked (ValueError naming the bad one)."""
    rules: Dict[str, str] = {}
    for spec in specs or ():
        pattern, eq, t = spec.rpartition("=")
        if not eq or not pattern:
            raise ValueError(f"convert: --tensor-type {spec!r} is not PATTERN=TYPE")
        rules[pattern] = t
    return rules


def _typer(qtype: str, tensor_types: Optional[Mapping[str, str]]):
    """gguf name -> the type its matrix is written in: the first ``tensor_types`` pattern it matches, else qtype."""
    rules = []
    for pattern, t in (tensor_types or {}).items():
        if t.upper() not in TYPES:
            raise ValueError(f"convert: --tensor-type {pattern}={t}: {t!r} is not one of {list(TYPES)}")
        try:
            rules.append((re.compile(pattern), t.upper()))
        except re.error as e:
            raise ValueError(f"convert: --tensor-type {pattern}={t}: bad pattern ({e})") from None
    return lambda gname: next((t for r, t in rules if r.search(gname)), qtype)


def check_tensor_types(qtype: str, tensor_types: Optional[Mapping[str, str]]) -> None:
    """ValueError naming the first bad ``tensor_types`` entry (unknown type, bad pattern); what
    :func:`convert` checks before it writes anything."""
    _typer(qtype, tensor_types)


def convert(src: str, dst: str, qtype: str = "F32", seed: int = 0, mtp: Optional[bool] = None,
            tensor_types: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    """Write ``src`` (preset or HF directory) as the GGUF file ``dst`` with matrices in ``qtype``, those whose
    GGUF name matches a ``tensor_types`` pattern (``{regex: type}``) in that type.
    ``mtp``: write the MTP layers as nextn blocks (default: as llama.cpp does, GLM only; True also for
    DeepSeek-V3 / Qwen3-Next in the naming of newer converters). Returns {gguf tensor name: its type}."""
    import gguf

    qtype = qtype.upper()
    if qtype not in TYPES:
        raise ValueError(f"convert: --type {qtype!r} is not one of {list(TYPES)}")
    type_of = _typer(qtype, tensor_types)
    cfg, source, expected, c, name = _source(src, seed)
    arch = cfg["model_type"]
    written: Dict[str, str] = {}
    if arch in MOE_ARCH:
        w = gguf.GGUFWriter(dst, MOE_ARCH[arch])
        w.add_name(name)
        w.add_file_type(_FILE_TYPE[qtype])
        try:
            _convert_moe(w, arch, cfg, c, source, expected, type_of, written, mtp)
            if src in _preset_names():
                _byte_tokenizer(w, c.vocab_size)
            _finish(w)
        except BaseException:
            w.close()
            if os.path.exists(dst):
                os.remove(dst)
            raise
        return written
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
            data, raw = _matrix(a, type_of(gname))
        w.add_tensor(gname, data, raw_dtype=raw)
        written[gname] = raw.name if raw is not None else {np.float32: "F32", np.float16: "F16"}[data.dtype.type]
    _finish(w)
    fell = sorted({t for n, t in written.items() if t != type_of(n) and not n.endswith("norm.weight")
                   and n != "rope_freqs.weight"})
    if fell and qtype not in ("F32",):
        log.warning("%s: some matrices do not fit %s rows and were written as %s", dst, qtype, ", ".join(fell))
    return written


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    written = convert(args.src, args.dst, args.type, seed=args.seed, tensor_types=tensor_type_rules(args.tensor_type))
    types = sorted(set(written.values()))
    size = os.path.getsize(args.dst)
    print(f"wrote {args.dst}: {len(written)} tensors ({', '.join(types)}), {size / 1e6:.1f} MB")
    return 0


# ----------------------------------------------------------------------------------------------
# the MoE families: qwen3_next -> qwen3next, deepseek_v3 -> deepseek2, glm4_moe -> glm4moe
# ----------------------------------------------------------------------------------------------
MOE_ARCH = {"qwen3_next": "qwen3next", "deepseek_v3": "deepseek2", "glm4_moe": "glm4moe"}
_F32_TENSORS = (".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")
"""Matrices llama.cpp's converter always writes in F32 (its FFN_GATE_INP / _SHEXP / SSM_CONV1D rule)."""


def _moe_metadata(w, mt: str, cfg: dict, c, block_count: int) -> None:
    """The metadata llama.cpp's converter writes for the family (``TextModel.set_gguf_parameters`` and
    the family's own: ``Qwen2MoeModel`` + ``Qwen3NextModel``, ``DeepseekV2Model``, ``Glm4MoeModel``)."""
    import gguf

    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    w.add_block_count(block_count)
    w.add_context_length(int(cfg.get("max_position_embeddings", c.max_position)))
    w.add_embedding_length(c.hidden_size)
    if cfg.get("intermediate_size") is not None:
        w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(1 if mt == "deepseek_v3" else c.num_kv_heads)   # deepseek2: MLA as MQA
    if rp.get("rope_type", "default") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rp["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rp["original_max_position_embeddings"]))
        if rp.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(rp["beta_fast"]))
        if rp.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(rp["beta_slow"]))
        if rp.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rp["attention_factor"]))
    elif rp.get("rope_type", "default") != "default":
        raise CheckpointError(f"convert: rope_type {rp['rope_type']!r} cannot be written for {mt}")
    w.add_rope_freq_base(float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(c.eps))
    if mt == "qwen3_next":
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.top_k)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if c.shared_intermediate_size:
            w.add_expert_shared_feed_forward_length(c.shared_intermediate_size)
        w.add_ssm_conv_kernel(c.conv_kernel)
        w.add_ssm_state_size(c.lin_k_dim)
        w.add_ssm_group_count(c.lin_k_heads)
        w.add_ssm_time_step_rank(c.lin_v_heads)
        w.add_ssm_inner_size(c.lin_v_dim * c.lin_v_heads)
        w.add_full_attention_interval(_attention_interval(c))
        w.add_rope_dimension_count(c.rotary_dim)
        return
    f = c.ffn
    w.add_expert_used_count(f.top_k)
    w.add_expert_group_count(f.n_group)
    w.add_expert_group_used_count(f.topk_group)
    if mt == "deepseek_v3":
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)   # scoring_func (checked: sigmoid)
        w.add_leading_dense_block_count(f.first_k_dense_replace)
        w.add_vocab_size(c.vocab_size)
        if c.q_lora_rank:
            w.add_q_lora_rank(c.q_lora_rank)
        w.add_kv_lora_rank(c.kv_lora_rank)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
        w.add_expert_feed_forward_length(f.moe_intermediate_size)
        w.add_expert_count(f.num_experts)
        w.add_expert_shared_count(f.n_shared_experts)
        w.add_expert_weights_scale(float(f.routed_scaling_factor))
        if f.norm_topk_prob:
            w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(c.qk_rope_head_dim)
        if rp.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rp["mscale_all_dim"]))
        return
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.rotary_dim)
    w.add_expert_count(f.num_experts)
    w.add_expert_feed_forward_length(f.moe_intermediate_size)
    w.add_expert_shared_count(f.n_shared_experts)
    w.add_leading_dense_block_count(f.first_k_dense_replace)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_weights_scale(float(f.routed_scaling_factor))
    w.add_expert_weights_norm(bool(f.norm_topk_prob))
    if c.mtp_layers and block_count > c.num_layers:
        w.add_nextn_predict_layers(block_count - c.num_layers)


def _attention_interval(c) -> int:
    """Qwen3-Next's full_attention_interval: llama.cpp reads the layer kinds from it alone (every
    interval-th layer full attention), so other layer_types cannot be written."""
    types = c.layer_types
    interval = types.index("full_attention") + 1 if "full_attention" in types else len(types) + 1
    want = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(types))]
    if types != want:
        raise CheckpointError(f"convert: layer_types {types} are not every {interval}-th layer full attention, "
                              f"which is all llama.cpp's qwen3next metadata (full_attention_interval) can say")
    return interval


def _moe_check(mt: str, cfg: dict, c) -> None:
    """What a llama.cpp file of the family cannot express is refused rather than written wrong."""
    if mt == "qwen3_next":
        if not all(c.sparse_layers):
            raise CheckpointError("convert: qwen3next files hold experts in every layer (decoder_sparse_step 1, "
                                  "no mlp_only_layers)")
        if not c.norm_topk_prob:
            raise CheckpointError("convert: qwen3next files always renormalise the top-k weights (norm_topk_prob)")
        _attention_interval(c)
    else:
        if cfg.get("scoring_func", "sigmoid") != "sigmoid":
            raise CheckpointError(f"convert: scoring_func {cfg['scoring_func']!r} cannot be written")
    if mt == "deepseek_v3" and not c.rope_interleave:
        raise CheckpointError("convert: deepseek2 files rotate interleaved pairs (rope_interleave true)")


_NEXTN_HF = {"eh_proj": "NEXTN_EH_PROJ", "enorm": "NEXTN_ENORM", "hnorm": "NEXTN_HNORM",
             "shared_head.norm": "NEXTN_SHARED_HEAD_NORM", "shared_head.head": "NEXTN_SHARED_HEAD_HEAD",
             "embed_tokens": "NEXTN_EMBED_TOKENS"}
_QWEN_MTP = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm", "norm": "shared_head.norm"}


def _mtp_default(mt: str) -> bool:
    """Does llama.cpp's converter write the family's MTP layers? GLM-4.5: yes (nextn blocks); DeepSeek-V3
    (``DeepseekV2Model.skip_mtp``) and Qwen3-Next (``mtp.*`` filtered out): not yet."""
    return mt == "glm4_moe"


def _moe_tensors(mt: str, c, source, expected: Dict[str, tuple], block_count: int, mtp: bool):
    """(HF name, float32 array, the name llama.cpp gives it) for every tensor of the file, transformed as
    the converter transforms them. MTP: GLM's nextn layer is written (as llama.cpp does: extra blocks with
    ``nextn.*`` tensors); DeepSeek's (``skip_mtp``) and Qwen3-Next's (``mtp.*`` filtered out) are not."""
    import re

    import gguf

    arch = gguf.MODEL_ARCH[MOE_ARCH[mt].upper().replace("GLM4MOE", "GLM4_MOE")]
    tmap = gguf.get_tensor_name_map(arch, block_count)
    experts: Dict[str, list] = {}
    n = c.num_layers
    for hf, shape in expected.items():
        m = re.match(r"^model\.layers\.(\d+)\.", hf)
        if not mtp and (hf.startswith("mtp.") or (m and int(m.group(1)) >= n)):
            continue
        a = source.get(hf, shape, torch.float32)
        if hf.startswith("mtp."):   # newer converters' naming (_Qwen35MtpMixin): the layer after the decoder
            parts = hf.split(".", 3)
            hf = (f"model.layers.{n + int(parts[2])}.{parts[3]}" if parts[1] == "layers"
                  else f"model.layers.{n}.{_QWEN_MTP[parts[1]]}.{parts[2]}")
            m = re.match(r"^model\.layers\.(\d+)\.", hf)
        e = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight$", hf)
        if e:
            key = f"{e.group(1)}.{e.group(3)}.weight"
            experts.setdefault(key, []).append(a)
            if len(experts[key]) == c.num_experts if mt == "qwen3_next" else len(experts[key]) == c.ffn.num_experts:
                stacked = torch.stack(experts.pop(key))
                yield key, stacked.numpy(), tmap.get_name(key, try_suffixes=(".weight",))
            continue
        name = hf
        if mt == "qwen3_next":
            if name.endswith(".A_log"):
                a = -torch.exp(a)
            elif name.endswith(".dt_bias"):
                name = name[: -len(".dt_bias")] + ".dt_proj.bias"
            elif "conv1d" in name:
                a = a.squeeze()
            elif name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                a = a + 1
            if "in_proj_qkvz.weight" in name:
                hk, dk, dv, hv = c.lin_k_heads, c.lin_k_dim, c.lin_v_dim, c.lin_v_heads
                split = [dk, dk, hv // hk * dv, hv // hk * dv]
                t = a.permute(1, 0).contiguous().view(-1, hk, sum(split))
                q, k, v, z = torch.split(t, split, dim=-1)
                D = c.hidden_size
                qkv = torch.cat([x.contiguous().view(D, -1) for x in (q, k, v)], dim=-1).permute(1, 0).contiguous()
                z = z.contiguous().view(D, -1).permute(1, 0).contiguous()
                i = m.group(1)
                yield name, qkv.numpy(), f"blk.{i}.attn_qkv.weight"
                yield name, z.numpy(), f"blk.{i}.attn_gate.weight"
                continue
        if name.endswith("e_score_correction_bias"):
            name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        if mt == "deepseek_v3" and name.endswith("kv_b_proj.weight"):
            H, dn, dv = c.num_heads, c.qk_nope_head_dim, c.v_head_dim
            kv_b = a.view(H, dn + dv, a.shape[-1])
            k_b, v_b = torch.split(kv_b, [dn, dv], dim=1)
            yield name, k_b.transpose(1, 2).contiguous().numpy(), \
                tmap.get_name(name.replace("kv_b_proj", "k_b_proj"), try_suffixes=(".weight",))
            yield name, v_b.contiguous().numpy(), \
                tmap.get_name(name.replace("kv_b_proj", "v_b_proj"), try_suffixes=(".weight",))
            continue
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        else:
            g = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
            sub = name[len(m.group(0)):-len(".weight")] if m and name.endswith(".weight") else None
            if g is None and sub in _NEXTN_HF and int(m.group(1)) >= n:   # gguf-py knows no nextn names here
                g = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR[_NEXTN_HF[sub]]].format(bid=m.group(1)) + ".weight"
        if g is None:
            raise CheckpointError(f"convert: no {MOE_ARCH[mt]} name for tensor {hf!r} (llama.cpp cannot map it)")
        yield hf, a.contiguous().numpy(), g
    if experts:
        raise CheckpointError(f"convert: incomplete experts {sorted(experts)}")


def _convert_moe(w, mt, cfg, c, source, expected, type_of, written, mtp=None) -> None:
    """The MoE families' tensors; ``type_of``: gguf name -> the type a matrix is written in."""
    _moe_check(mt, cfg, c)
    mtp = (_mtp_default(mt) if mtp is None else mtp) and bool(c.mtp_layers)
    block_count = c.num_layers + (1 if mtp else 0)
    _moe_metadata(w, mt, cfg, c, block_count)
    if mtp and mt != "glm4_moe":
        w.add_nextn_predict_layers(1)
    for hf, a, gname in _moe_tensors(mt, c, source, expected, block_count, mtp):
        if a.ndim <= 1 or gname.endswith("_norm.weight") or not gname.endswith(".weight") \
                or gname.endswith(_F32_TENSORS):
            data, raw = a.astype(np.float32), None
        else:
            data, raw = _matrix(a, type_of(gname))
        w.add_tensor(gname, data, raw_dtype=raw)
        written[gname] = raw.name if raw is not None else {np.float32: "F32", np.float16: "F16"}[data.dtype.type]
