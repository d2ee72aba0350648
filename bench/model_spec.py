"""How the bench scripts name a model: ``PRESET_OR_PATH[:QUANTIZE]`` -- a preset or checkpoint path, optionally
quantized at load (``deepseek-v3-4l:fp8``: ``ds4t.load(..., quantize="fp8")``), so a model that only fits the GPU
quantized can be timed from its preset."""
from __future__ import annotations

from typing import Optional, Tuple

import ds4t


def split(spec: str) -> Tuple[str, Optional[str]]:
    """(preset or path, quantize-at-load format or None) of ``spec``."""
    name, _, quant = spec.partition(":")
    return name, quant or None


def load(spec: str, device):
    """``ds4t.load`` of ``spec``'s preset or path on ``device``, quantized at load as the spec says."""
    name, quant = split(spec)
    return ds4t.load(name, device=device, quantize=quant)
