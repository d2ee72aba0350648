"""Reading HF-style checkpoints: config.json + safetensors (single file or sharded index).

Every error names the file, tensor or config field at fault, so a broken checkpoint is fixed in
one look.
"""
from __future__ import annotations

import json
import math
import os
from typing import Dict, Iterable, Mapping, Optional

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing something, or holds something ds4t cannot use."""


class ConfigError(CheckpointError):
    """A config value ds4t cannot use, found where the config is read (a family's config check, the
    quantization settings): ``detail`` names the field, not the file. Its message says ``config.json: ...``;
    :func:`ds4t.load` raises it again as a CheckpointError naming where the config really came from (a
    checkpoint directory's config.json, a GGUF file's metadata, a preset)."""

    def __init__(self, detail: str):
        self.detail = detail
        super().__init__(f"config.json: {detail}")


DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "f32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "f16": torch.float16, "half": torch.float16,
}


def parse_dtype(dtype) -> Optional[torch.dtype]:
    """None, a torch float dtype, or a name such as "bf16" -> torch dtype (None stays None)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        if dtype is not None and dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise CheckpointError(f"unsupported dtype {dtype}: use float32, bfloat16 or float16")
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise CheckpointError(f"unsupported dtype {dtype!r}: use one of {sorted(DTYPES)}") from None


_ST_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "BF16": torch.bfloat16,
              "F16": torch.float16, "F32": torch.float32, "F64": torch.float64, "I64": torch.int64,
              "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}


class TensorSource:
    """A name -> tensor store that knows where each tensor came from (for error messages)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, origin: str = "in-memory weights"):
        self._tensors = dict(tensors or {})
        self._files: Dict[str, str] = {}
        self._dtypes: Dict[str, Optional[torch.dtype]] = {}
        self.origin = origin
        self.fp8 = None        # the checkpoint's block-FP8 settings (ds4t.models.quant.FP8Config), set by load()
        self.quantize = None   # FP8Config when load(quantize="fp8") quantizes float weights as they are read

    @classmethod
    def from_dir(cls, path: str) -> "TensorSource":
        """Index the safetensors of an HF checkpoint directory without reading tensor data."""
        from safetensors import safe_open

        src = cls(origin=path)
        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            try:
                weight_map = json.load(open(index))["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: not a safetensors index ({e})") from None
            files = sorted(set(weight_map.values()))
            for f in files:
                if not os.path.exists(os.path.join(path, f)):
                    raise CheckpointError(f"{index} names shard {f!r}, which is missing from {path}")
        else:
            files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
        for f in files:
            full = os.path.join(path, f)
            try:
                with safe_open(full, "pt") as h:
                    for k in h.keys():
                        src._files[k] = full
                        src._dtypes[k] = _ST_DTYPES.get(h.get_slice(k).get_dtype())
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{full}: cannot read safetensors header ({e})") from None
        return src

    def keys(self) -> Iterable[str]:
        return list(self._tensors.keys()) + list(self._files.keys())

    def __contains__(self, name: str) -> bool:
        return name in self._tensors or name in self._files

    def stored_dtype(self, name: str) -> Optional[torch.dtype]:
        """The dtype ``name`` is stored in, without reading it (None: a dtype torch has no name for)."""
        if name in self._tensors:
            return self._tensors[name].dtype
        return self._dtypes.get(name)

    def shape(self, name: str):
        if name in self._tensors:
            return tuple(self._tensors[name].shape)
        from safetensors import safe_open

        with safe_open(self._files[name], "pt") as h:
            return tuple(h.get_slice(name).get_shape())

    def get(self, name: str, shape=None, dtype: Optional[torch.dtype] = None, device="cpu") -> torch.Tensor:
        """The tensor ``name`` cast to ``dtype`` on ``device``; checks ``shape`` when given."""
        if name in self._tensors:
            t = self._tensors[name]
        elif name in self._files:
            from safetensors import safe_open

            with safe_open(self._files[name], "pt") as h:
                t = h.get_tensor(name)
        else:
            raise CheckpointError(f"{self.origin}: missing tensor {name!r}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.origin}: tensor {name!r} has shape {tuple(t.shape)}, config implies {tuple(shape)}")
        if not t.is_floating_point():
            raise CheckpointError(f"{self.origin}: tensor {name!r} has non-float dtype {t.dtype}")
        return t.to(device=device, dtype=dtype or t.dtype).contiguous()


def read_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.exists(cfg_path):
        raise CheckpointError(f"{path}: no config.json")
    try:
        with open(cfg_path) as f:
            cfg = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{cfg_path}: should hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _is_int(v) -> bool:
    """An integer and not a bool (JSON true is Python's int too)."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v) -> bool:
    """A number (int or float, not a bool) that is a finite float: an int past the float range is not."""
    return (_is_int(v) and abs(v) < 2 ** 1024) or (isinstance(v, float) and math.isfinite(v))


def require(cfg: dict, field: str, kind=None, default=None):
    """cfg[field] (``default`` where it is absent or null), with a ConfigError when there is neither or it is
    of the wrong type (``int`` excludes bool; ``float`` takes an int, as a float)."""
    v = cfg.get(field)
    if v is None:
        v = default
    if v is None:
        raise ConfigError(f"missing field {field!r}")
    if kind is float and _is_int(v):
        v = float(v)
    if kind is int:
        ok = _is_int(v)
    else:   # a JSON true is no float or string, but it is a bool
        ok = kind is None or isinstance(v, kind) and (kind is bool or not isinstance(v, bool))
    if not ok:
        raise ConfigError(f"field {field!r} = {v!r} should be {kind.__name__}")
    return v


# The numeric and boolean fields of the configs ds4t reads (HF names), each with what a value must be. A
# field that is absent or null keeps the family's default; a present one must fit, else the model would be
# built from a string, a bool or a negative size and fail far from the cause (or allocate without bound).
_COUNTS = ("num_hidden_layers", "vocab_size", "hidden_size", "num_attention_heads",
           "num_key_value_heads", "head_dim", "max_position_embeddings", "n_routed_experts",
           "num_experts", "num_experts_per_tok", "n_group", "topk_group", "moe_layer_freq", "linear_num_key_heads",
           "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
           "full_attention_interval", "decoder_sparse_step", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
           "qk_rope_head_dim", "v_head_dim", "original_max_position_embeddings")
# 0 is a setting here: no dense layers first, no shared expert, no MTP; an MLP width of 0 where a family
# has no such MLP (the tensors' shapes then decide)
_ZERO_OR_MORE = ("first_k_dense_replace", "n_shared_experts", "num_nextn_predict_layers", "mtp_num_hidden_layers",
                 "shared_expert_intermediate_size", "intermediate_size", "moe_intermediate_size")
_POSITIVE_REALS = ("rms_norm_eps", "rope_theta", "routed_scaling_factor", "factor", "attention_factor",
                   "low_freq_factor", "high_freq_factor")
_NONNEGATIVE_REALS = ("beta_fast", "beta_slow", "mscale", "mscale_all_dim")   # yarn: 0 is a valid setting
_MOST = 2 ** 24   # a size or count past this is a corrupt field, not a model (vocabularies are ~2^18)
_FLAGS = ("tie_word_embeddings", "attention_bias", "use_qk_norm", "norm_topk_prob", "rope_interleave", "mlp_bias",
          "use_sliding_window")
_LISTS = {"layer_types": str, "mlp_only_layers": int}   # lists of that element type
_KNOWN = frozenset(_COUNTS + _ZERO_OR_MORE + _POSITIVE_REALS + _NONNEGATIVE_REALS + _FLAGS + tuple(_LISTS)
                   + ("partial_rotary_factor",))


def _field_problem(field: str, v) -> Optional[str]:
    """Why ``v`` cannot be config field ``field`` (None when it can, or the field is not in the tables)."""
    if field in _COUNTS or field in _ZERO_OR_MORE:
        least = 1 if field in _COUNTS else 0
        most = 2 ** 31 - 1 if field.endswith("max_position_embeddings") else _MOST
        if not _is_int(v) or not least <= v <= most:
            return f"should be an integer in [{least}, {most}]"
    elif field in _POSITIVE_REALS or field in _NONNEGATIVE_REALS:
        positive = field in _POSITIVE_REALS
        if not _is_real(v) or v < 0 or (positive and v == 0):
            return f"should be a finite number {'>' if positive else '>='} 0"
    elif field == "partial_rotary_factor":
        if not _is_real(v) or not 0 < v <= 1:
            return "should be a number in (0, 1]"
    elif field in _FLAGS:
        if not isinstance(v, bool):
            return "should be true or false"
    elif field in _LISTS:
        ok = _is_int if _LISTS[field] is int else (lambda x: isinstance(x, str))
        if not isinstance(v, list) or not all(ok(x) for x in v):
            return f"should be a list of {'integers' if _LISTS[field] is int else 'strings'}"
    return None


def check_fields(cfg: dict, where: str = "config.json", origin=None) -> None:
    """Every known numeric / boolean field of ``cfg`` (and of its ``rope_parameters`` / ``rope_scaling``)
    holds a value of its kind, else a CheckpointError naming the field and the value. Known fields that
    are null are removed (in place): null means the family's default, as an absent field does.
    ``origin`` (optional): field name (``"rope_parameters.rope_theta"`` style) -> where its value came from
    in the file, or None -- a GGUF's metadata key, so the message names what the user can look up."""
    for scope, d in (("", cfg), ("rope_parameters.", cfg.get("rope_parameters")),
                     ("rope_scaling.", cfg.get("rope_scaling"))):
        if d is None:
            continue
        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: field {scope[:-1]!r} = {d!r} should be an object")
        for field, v in list(d.items()):
            if v is None:
                if field in _KNOWN:
                    del d[field]
                continue
            why = _field_problem(field, v)
            if why:
                src = origin(scope + field) if origin is not None else None
                src = f" ({src})" if src else ""
                raise CheckpointError(f"{where}: field {scope + field!r}{src} = {v!r} {why}")


def attention_heads(cfg: dict):
    """(num_attention_heads, num_key_value_heads, head_dim, hidden_size) of a GQA config, checked:
    kv heads default to q heads and must divide them; head_dim defaults to hidden / heads."""
    heads = require(cfg, "num_attention_heads", int)
    hidden = require(cfg, "hidden_size", int)
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise ConfigError(f"num_attention_heads {heads} not a multiple of num_key_value_heads {kv}")
    return heads, kv, cfg.get("head_dim") or hidden // heads, hidden


def rope_params(cfg: dict) -> dict:
    """HF 5.x keeps RoPE settings in ``rope_parameters``; older configs use rope_theta/rope_scaling."""
    p = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    for k, v in scaling.items():
        p.setdefault(k, v)
    if "type" in p and "rope_type" not in p:
        p["rope_type"] = p["type"]
    p.setdefault("rope_type", "default")
    p.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg:
        p.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    return p
