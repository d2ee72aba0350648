"""Host-side argument checks the launchers share, and the tensor face of wrapped weights (no kernels here)."""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class SplitPartials:
    """A linear's output before its split-K sum: ``y = part[0] + part[1] + ... + part[S-1] (+ bias)``, added
    left to right in fp32 (:func:`ds4t.backend.split_sum`, the order of the linear's sum kernel), then the
    bias. ``part`` fp32 [S, B, N] contiguous; ``bias`` [N] (any float) or None. A consumer
    that adds them so reads the bits the two-launch linear would have stored, one launch sooner
    (:func:`ds4t.kernels.linear_norm.linear_add_rms_norm`). S = 1: ``part[0]`` is the finished product,
    bias included, and ``bias`` is None."""
    part: torch.Tensor
    bias: Optional[torch.Tensor]

    @property
    def splits(self) -> int:
        return self.part.shape[0]


@dataclasses.dataclass(frozen=True)
class MoEPartials:
    """The grouped MoE's per-pair outputs before the rank-ordered combine: row b's result is
    ``0 + w[b, 0] * y[b KT + 0] + w[b, 1] * y[b KT + 1] + ...`` over its KT = k (+ 1 shared) ranks, in fp32,
    each ``y`` row the down kernel's split partials added in split order when ``y`` is [S, B KT, D]
    (:func:`ds4t.kernels.moe.combine_rows`, the arithmetic of ``_moe_combine_kernel``). A pair whose expert
    id is -1 adds 0 and its ``y`` row is never read. A consumer that combines the rows so reads the bits
    ``moe_experts`` would have stored, one launch sooner (:func:`ds4t.kernels.moe_norm.moe_add_rms_norm`).

    ``y`` fp32 [B KT, D] or [S, B KT, D] (pair rows unit-strided along D); ``weights`` fp32 [B, k];
    ``ids`` int [B, k]; ``gate`` fp32 [B] (the shared expert's router logit; ``weights`` when ``gated`` is
    False, never read then); ``shared`` the shared expert's index or -1."""
    y: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    gate: torch.Tensor
    shared: int
    gated: bool

    @property
    def rows(self) -> int:
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]

    @property
    def ranks(self) -> int:
        """KT: the routed ranks plus the shared expert's."""
        return self.top_k + (self.shared >= 0)

    @property
    def splits(self) -> int:
        return self.y.shape[0] if self.y.dim() == 3 else 1


def rows_view(t: torch.Tensor, name: str) -> torch.Tensor:
    """``t`` as a 2-D [rows, D] float tensor with unit column stride (a copy only when its column
    stride is not 1); ValueError / TypeError naming ``name`` otherwise."""
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, D], got shape {tuple(t.shape)}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: unsupported dtype {t.dtype}")
    return t if t.stride(1) == 1 else t.contiguous()


def float_out(out: Optional[torch.Tensor], shape: Sequence[int], device, name: str = "out",
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new ``dtype`` (fp32 unless asked) tensor of ``shape``, or ``out`` checked to be one (unit last
    stride; other strides free, e.g. a column slice of a wider buffer)."""
    shape = tuple(shape)
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or (len(shape) and out.stride(-1) != 1):
        raise ValueError(f"{name} must be {dtype} {list(shape)} with unit last stride, got {out.dtype} "
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


def check_segments(segments: torch.Tensor, what: str) -> int:
    """``segments``: an integer [M, 4] table (first row, rows, slot, states row or -1) on the kernels'
    device, contiguous (:attr:`ds4t.step.StepBatch.multi_segments`); returns M. Only its shape is checked
    (its values are on the device: reading them would stall the host)."""
    if segments.dim() != 2 or segments.shape[1] != 4 or segments.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{what}: segments must be an int32/int64 [M, 4] table (first row, rows, slot, states row), "
                         f"got {segments.dtype} {tuple(segments.shape)}")
    if segments.shape[0] and (segments.stride(1) != 1 or segments.stride(0) != 4):
        raise ValueError(f"{what}: segments must be contiguous")
    return int(segments.shape[0])


def one_segment(rows: int, slot: int, device, keep: bool = False) -> torch.Tensor:
    """The segments table of one session's ``rows`` tokens from row 0 (``keep``: its states from row 0
    of the kept-states buffer)."""
    return torch.tensor([[0, rows, int(slot), 0 if keep else -1]], dtype=torch.int64, device=device)
