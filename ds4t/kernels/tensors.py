"""Host-side argument checks the launchers share, and the tensor face of wrapped weights (no kernels here)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as a 2-D [rows, D] float tensor with unit column stride (a copy only when its column
    stride is not 1); ValueError / TypeError naming ``name`` otherwise."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, D], got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}")
    return t if t.stride(1) == 1 else t.contiguous()


def fp32_out(out: Optional[torch.Tensor], shape: Sequence[int], device, name: str = "out") -> torch.Tensor:
    """A new fp32 tensor of ``shape``, or ``out`` checked to be one (unit last stride; other
    strides free, e.g. a column slice of a wider buffer)."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or (len(shape) and out.stride(-1) != 1):
        raise ValueError(f"{name} must be fp32 {list(shape)} with unit last stride, got {out.dtype} "
                         f"{list(out.shape)}")
    return out


class TensorLike:
    """What the code around a weight asks of it, for weights that wrap a ``data`` tensor (FP8, GGUF
    blocks): its device, storage dtype and rank; ``shape`` is the logical [..., N, K] (each wrapper's own)."""

    data: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dim(self) -> int:
        return self.data.dim()
