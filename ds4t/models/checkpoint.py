"""Reading HF-style checkpoints: config.json + safetensors (single file or sharded index).

Every error names the file, tensor or config field at fault, so a broken checkpoint is fixed in
one look.
"""
from __future__ import annotations

import json
import os
from typing import Dict, Iterable, Mapping, Optional

import torch


class CheckpointError(ValueError):
    """A checkpoint is missing something, or holds something ds4t cannot use."""


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
        return json.load(open(cfg_path))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from None


def require(cfg: dict, field: str, kind=None, where: str = "config.json"):
    """cfg[field], with a clear error when it is missing or of the wrong type."""
    if field not in cfg or cfg[field] is None:
        raise CheckpointError(f"{where}: missing field {field!r}")
    v = cfg[field]
    if kind is not None and not isinstance(v, kind):
        raise CheckpointError(f"{where}: field {field!r} = {v!r} should be {kind}")
    return v


def attention_heads(cfg: dict):
    """(num_attention_heads, num_key_value_heads, head_dim, hidden_size) of a GQA config, checked:
    kv heads default to q heads and must divide them; head_dim defaults to hidden / heads."""
    heads = require(cfg, "num_attention_heads", int)
    hidden = require(cfg, "hidden_size", int)
    kv = cfg.get("num_key_value_heads") or heads
    if heads % kv:
        raise CheckpointError(f"config.json: num_attention_heads {heads} not a multiple of num_key_value_heads {kv}")
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
