"""Tiny block-FP8 checkpoints in the published layout, made from a float HF checkpoint, and the float
checkpoint HF runs as the oracle: exactly the weights they encode, dequantized, in fp32 (HF's own FP8
loader mis-scales dims that are not multiples of the block, so it is not the oracle)."""
from __future__ import annotations

import json
import os
from typing import Dict, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from ds4t.kernels.weights import quantize
from ds4t.models.quant import SCALE_SUFFIX, is_quantized_linear


def fp8_tensors(tensors: Dict[str, torch.Tensor], block, skip: Sequence[str] = ()) -> Dict[str, torch.Tensor]:
    """The published layout: every decoder linear weight as float8_e4m3fn + ``*_scale_inv`` fp32 per block
    (block-shaped, as a release stores it); everything else unchanged."""
    out = {}
    for name, t in tensors.items():
        if is_quantized_linear(name) and not any(name.startswith(m + ".") for m in skip):
            q = quantize(t, tuple(block))
            bn = block[0]
            out[name] = q.data
            out[name + SCALE_SUFFIX] = q.scale[..., ::bn, :].contiguous()  # one row per block of bn rows
        else:
            out[name] = t
    return out


def write_fp8_checkpoint(src: str, dst: str, block=(128, 128), skip: Sequence[str] = (),
                         quantization_config: Optional[dict] = None, edit=None) -> Dict[str, torch.Tensor]:
    """Copy the HF checkpoint ``src`` to ``dst`` in block-FP8 (``edit(tensors, config)`` may break it on
    purpose). Returns the tensors written."""
    os.makedirs(dst, exist_ok=True)
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    tensors = fp8_tensors(tensors, block, skip)
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = quantization_config if quantization_config is not None else {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
        **({"modules_to_not_convert": list(skip)} if skip else {})}
    if edit is not None:
        edit(tensors, cfg)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    return tensors


def write_dequantized_checkpoint(tensors: Dict[str, torch.Tensor], src: str, dst: str, block) -> None:
    """The oracle's checkpoint: the real weights a block-FP8 tensor dict encodes (fp8 x scale_inv, fp32),
    under the same names, with ``src``'s config minus its quantization_config (HF loads it as float)."""
    bn, bk = block
    out = {}
    for name, t in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            s = tensors[name + SCALE_SUFFIX].float()
            N, K = t.shape
            t = t.float() * s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
        out[name] = t.float() if t.is_floating_point() else t
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg.pop("quantization_config", None)
    cfg["dtype"] = cfg["torch_dtype"] = "float32"
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
