"""Weight formats the kernels read besides plain float tensors: block-scaled FP8 (weight-only, W8A16).

Published FP8 checkpoints (DeepSeek-V3, Qwen3-Next-80B-A3B-FP8, GLM-4.5-FP8) store a linear weight as
``float8_e4m3fn [N, K]`` plus ``weight_scale_inv`` fp32 ``[ceil(N/bn), ceil(K/bk)]``: the real weight is
``w[n, k] = fp8[n, k] * scale_inv[n // bn, k // bk]`` (despite its name, the scale multiplies), with
``(bn, bk) = quantization_config.weight_block_size`` (128, 128 in every release).

In memory, :class:`FP8Weight` keeps the fp8 values as they are and the scales per (row, K block):
``scale [N, ceil(K/bk)]``, the checkpoint's block scales repeated over the ``bn`` rows of each block. Same
values, 4 bytes per ``bk`` weights (3 % of the fp8 bytes at bk = 128); what it buys is that a row carries
its own scales, so load-time fusions that concatenate or permute rows (q/k/v into one matrix, Qwen's
per-head row order, MoE experts stacked: :func:`cat`, :func:`stack`, indexing) work for any N, including N that is not a multiple of ``bn``
(DeepSeek's ``kv_a_proj_with_mqa`` has 576 rows).

Kernels compute ``y = sum over K blocks j of scale[n, j] * (x[:, block j] . fp8[n, block j])`` with the
dot in fp32 (fp8 -> the activation dtype is exact), so a K tile never spans two scale blocks: a kernel's
BLOCK_K must divide ``block_k``. Every launch constant still comes from the shapes, never from the batch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ds4t.kernels.quant_blocks import GGUFWeight, same_format
from ds4t.kernels.tensors import TensorLike

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn


@dataclasses.dataclass(frozen=True, eq=False)
class FP8Weight(TensorLike):
    """A block-scaled FP8 weight: ``data`` float8_e4m3fn ``[..., N, K]`` (K contiguous), ``scale`` fp32
    ``[..., N, ceil(K / block_k)]``; leading dims (MoE experts) shared. ``w = data * scale`` per K block."""
    data: torch.Tensor
    scale: torch.Tensor
    block_k: int
    act_dtype: Optional[torch.dtype] = None
    """What activations are rounded to before the product (the model's dtype, set at load; None: the
    activations' own dtype). fp8 converts exactly to any of fp32 / bf16 / fp16."""

    def __post_init__(self):
        d, s = self.data, self.scale
        if d.dtype != FP8_DTYPE:
            raise ValueError(f"FP8Weight data must be {FP8_DTYPE}, got {d.dtype}")
        if s.dtype != torch.float32:
            raise ValueError(f"FP8Weight scale must be float32, got {s.dtype}")
        if not (isinstance(self.block_k, int) and self.block_k > 0):
            raise ValueError(f"FP8Weight block_k must be a positive int, got {self.block_k!r}")
        want = (*d.shape[:-1], math.ceil(d.shape[-1] / self.block_k))
        if tuple(s.shape) != want:
            raise ValueError(f"FP8Weight scale must be {want} for data {tuple(d.shape)} and block_k "
                             f"{self.block_k}, got {tuple(s.shape)}")
        if d.device != s.device:
            raise ValueError(f"FP8Weight data on {d.device}, scale on {s.device}")

    # -- what the code around a weight asks of it -------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: fp8 values plus scales."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * 4

    def contiguous(self) -> "FP8Weight":
        return dataclasses.replace(self, data=self.data.contiguous(), scale=self.scale.contiguous())

    def to(self, device) -> "FP8Weight":
        return dataclasses.replace(self, data=self.data.to(device), scale=self.scale.to(device))

    def with_act_dtype(self, dtype: Optional[torch.dtype]) -> "FP8Weight":
        return dataclasses.replace(self, act_dtype=dtype)

    def __getitem__(self, idx) -> "FP8Weight":
        """Rows (or leading-dim entries) selected by ``idx``; the K axis is never indexed."""
        return dataclasses.replace(self, data=self.data[idx], scale=self.scale[idx])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight ``data * scale`` (computed in fp32, then cast to ``dtype``)."""
        K = self.data.shape[-1]
        s = self.scale.repeat_interleave(self.block_k, dim=-1)[..., :K]
        return (self.data.float() * s).to(dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class RowParts:
    """A matrix ``[N, K]`` held as row blocks of different GGUF types, in row order: what :func:`cat` makes
    of a fusion whose parts differ in type (llama.cpp's Q4_K_M keeps some layers' ``attn_v`` in Q6_K beside
    Q4_K q / k), so that every part stays in its own blocks instead of the fusion being dequantized.
    :func:`ds4t.kernels.linear.linear` runs one launch a part into that part's output columns: each column
    block has the bits of a lone linear with its part (batch and chunk invariant as that one is). Parts
    share K and ``act_dtype``; two adjacent parts never share a format (:func:`cat` merges those)."""
    parts: Tuple[GGUFWeight, ...]

    def __post_init__(self):
        ps = self.parts
        if len(ps) < 2 or not all(isinstance(p, GGUFWeight) and p.dim() == 2 for p in ps):
            raise ValueError("RowParts: two or more 2-D GGUF weights")
        if len({(p.k, p.act_dtype, p.device) for p in ps}) != 1:
            raise ValueError(f"RowParts: parts differ in K, act_dtype or device "
                             f"{[(p.k, p.act_dtype, str(p.device)) for p in ps]}")
        if any(same_format([a, b]) for a, b in zip(ps, ps[1:])):
            raise ValueError("RowParts: adjacent parts of one format must be joined (weights.cat)")

    # -- what the code around a weight asks of it -------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size((sum(p.shape[0] for p in self.parts), self.parts[0].k))

    def dim(self) -> int:
        return 2

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def act_dtype(self) -> Optional[torch.dtype]:
        return self.parts[0].act_dtype

    @property
    def qtype(self) -> str:
        """The parts' types in row order, e.g. ``"Q4_K+Q6_K"`` (for messages)."""
        return "+".join(p.qtype for p in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def row_ranges(self) -> List[Tuple[int, int]]:
        """[start, end) of each part's rows."""
        out, n = [], 0
        for p in self.parts:
            out.append((n, n + p.shape[0]))
            n += p.shape[0]
        return out

    def contiguous(self) -> "RowParts":
        return RowParts(tuple(p.contiguous() for p in self.parts))

    def to(self, device) -> "RowParts":
        return RowParts(tuple(p.to(device) for p in self.parts))

    def with_act_dtype(self, dtype: Optional[torch.dtype]) -> "RowParts":
        return RowParts(tuple(p.with_act_dtype(dtype) for p in self.parts))

    def __getitem__(self, idx) -> Weight:
        """Rows selected by ``idx`` (a slice, an integer index tensor or list, or ``(..., rows, :)``), as
        one weight when they fall in one part, else a RowParts; the K axis is never indexed."""
        if isinstance(idx, tuple):
            if len(idx) == 3 and idx[0] is Ellipsis and idx[2] == slice(None):
                idx = idx[1]
            elif len(idx) == 2 and idx[1] == slice(None):
                idx = idx[0]
            else:
                raise IndexError("RowParts: index rows only (blocks run along K)")
        if isinstance(idx, torch.Tensor):
            idx = idx.cpu()
        rows = torch.arange(self.shape[0])[idx]
        if rows.dim() != 1:
            raise IndexError("RowParts: index rows with a slice or a 1-D index")
        starts = torch.tensor([a for a, _ in self.row_ranges()])
        which = torch.searchsorted(starts, rows, right=True) - 1
        pieces, i = [], 0
        while i < len(rows):   # runs of consecutive rows from one part
            j = i + 1
            while j < len(rows) and which[j] == which[i]:
                j += 1
            part = self.parts[int(which[i])]
            pieces.append(part[rows[i:j] - starts[which[i]]])
            i = j
        return cat(pieces) if pieces else self.parts[0][:0]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The rows of every part dequantized, in order: ``float [N, K]``."""
        return torch.cat([p.dequantize(dtype) for p in self.parts])


Weight = Union[torch.Tensor, FP8Weight, GGUFWeight, RowParts]
"""A float tensor, block-FP8 (above), GGUF blocks (:mod:`ds4t.kernels.quant_blocks`) or GGUF row blocks of
different types (:class:`RowParts`)."""
QuantWeight = (FP8Weight, GGUFWeight, RowParts)
"""The weight types whose activations round to ``act_dtype`` (not to the weight's own dtype)."""


def from_block_scales(data: torch.Tensor, scale_inv: torch.Tensor, block: Tuple[int, int]) -> FP8Weight:
    """The checkpoint layout (``data`` fp8 [N, K], ``scale_inv`` [ceil(N/bn), ceil(K/bk)]) -> FP8Weight.
    Raises ValueError on a scale of the wrong shape."""
    bn, bk = block
    N, K = data.shape[-2:]
    want = (*data.shape[:-2], math.ceil(N / bn), math.ceil(K / bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"weight_scale_inv must be {list(want)} for a weight of {list(data.shape)} in "
                         f"{bn}x{bk} blocks, got {list(scale_inv.shape)}")
    rows = scale_inv.float().repeat_interleave(bn, dim=-2)[..., :N, :]
    return FP8Weight(data, rows.contiguous(), bk)


def quantize(w: torch.Tensor, block: Tuple[int, int] = (128, 128)) -> FP8Weight:
    """Block-quantize a float weight [..., N, K] as published FP8 checkpoints are made: per (bn, bk) block,
    scale = amax / 448 and fp8 = round(w / scale) (saturating). Deterministic; on ``w``'s device."""
    bn, bk = block
    N, K = w.shape[-2:]
    nb, kb = math.ceil(N / bn), math.ceil(K / bk)
    if w.device.type == "meta":   # shapes only (memory plans of full-depth models): nothing to compute
        return FP8Weight(torch.empty(w.shape, dtype=FP8_DTYPE, device="meta"),
                         torch.empty(*w.shape[:-1], kb, dtype=torch.float32, device="meta"), bk)
    wf = w.float()
    pad = torch.zeros(*w.shape[:-2], nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    pad[..., :N, :K] = wf
    blocks = pad.unflatten(-2, (nb, bn)).unflatten(-1, (kb, bk))       # [..., nb, bn, kb, bk]
    amax = blocks.abs().amax(dim=(-3, -1))                              # [..., nb, kb]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = blocks / scale_inv[..., :, None, :, None]
    data = q.clamp(-FP8_MAX, FP8_MAX).flatten(-4, -3).flatten(-2, -1)[..., :N, :K].to(FP8_DTYPE)
    return from_block_scales(data.contiguous(), scale_inv, block)


def _gguf_joinable(what: str, parts: Sequence[GGUFWeight]) -> None:
    if not same_format(parts):
        raise ValueError(f"{what}: GGUF parts differ in type, K or act_dtype "
                         f"{[(p.qtype, p.k, p.act_dtype) for p in parts]} (check joinable() first)")


def joinable(parts: Sequence[Weight]) -> bool:
    """Can :func:`cat` / :func:`stack` join ``parts`` (one format: float tensors of one dtype, FP8 of one
    block, GGUF of one type)? GGUF files mix types within a layer (e.g. Q4_K_M keeps some ``attn_v`` and
    ``ffn_down`` in Q6_K): families fuse such weights only when this holds."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return len({p.dtype for p in parts}) == 1
    if all(isinstance(p, GGUFWeight) for p in parts):
        return same_format(parts)
    if all(isinstance(p, FP8Weight) for p in parts):
        return len({(p.block_k, p.act_dtype) for p in parts}) == 1
    return False


def _same(what: str, parts: Sequence[FP8Weight]) -> None:
    if len({p.act_dtype for p in parts}) != 1:
        raise ValueError(f"{what}: parts have different act_dtype {[p.act_dtype for p in parts]}")


def _cat_tensors(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat(tensors, dim)``; meta tensors of one dtype and joinable shapes answered from their shapes alone.

    torch's meta ``cat`` and ``stack`` are Python decompositions whose first call imports ``torch._dynamo``: ~2 s
    of a ``--device meta --plan-only`` process (a fifth of planning Qwen3-Next-80B). Anything else, mismatches
    included, goes to torch.cat, which joins or raises as it does."""
    t0 = tensors[0] if tensors else None
    if t0 is not None and -t0.dim() <= dim < t0.dim() and \
            all(t.is_meta and t.dtype == t0.dtype and t.dim() == t0.dim() for t in tensors):
        d = dim % t0.dim()
        if all(t.shape[:d] == t0.shape[:d] and t.shape[d + 1:] == t0.shape[d + 1:] for t in tensors):
            shape = list(t0.shape)
            shape[d] = sum(t.shape[d] for t in tensors)
            return torch.empty(shape, dtype=t0.dtype, device="meta")
    return torch.cat(list(tensors), dim=dim)


def _stack_tensors(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack(tensors)`` through :func:`_cat_tensors` (meta tensors from their shapes)."""
    if tensors and all(t.is_meta and t.shape == tensors[0].shape for t in tensors):
        return _cat_tensors([t.unsqueeze(0) for t in tensors])
    return torch.stack(list(tensors))


def cat(parts: Sequence[Weight], dim: int = 0) -> Weight:
    """Concatenate weights along ``dim`` (rows of [N, K], or experts of [E, N, K]; never K): plain
    tensors with torch.cat, FP8 weights with their row scales (all parts must share block_k), GGUF
    weights of one type as blocks. Matrices of GGUF blocks of different types (one K and act_dtype) join
    as a :class:`RowParts` (adjacent parts of one type merged), each part kept in its blocks. Other mixes
    (float and GGUF parts, expert stacks of different types) are dequantized and joined in float (check
    :func:`joinable` first where that would cost too much memory)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return _cat_tensors(parts, dim).contiguous()
    if any(isinstance(p, RowParts) for p in parts):   # flatten: a RowParts is its parts in row order
        parts = [q for p in parts for q in (p.parts if isinstance(p, RowParts) else (p,))]
    if any(isinstance(p, GGUFWeight) for p in parts):
        if dim % parts[0].dim() == parts[0].dim() - 1:
            raise ValueError("cat: GGUF weights cannot be joined along K (their blocks run along K)")
        if all(isinstance(p, GGUFWeight) for p in parts) and same_format(parts):
            return dataclasses.replace(parts[0], data=_cat_tensors([p.data for p in parts], dim).contiguous())
        if all(isinstance(p, GGUFWeight) and p.dim() == 2 for p in parts) \
                and len({(p.k, p.act_dtype, p.device) for p in parts}) == 1:
            runs = [[parts[0]]]
            for p in parts[1:]:
                if same_format([runs[-1][-1], p]):
                    runs[-1].append(p)
                else:
                    runs.append([p])
            joined = [cat(r) if len(r) > 1 else r[0].contiguous() for r in runs]
            return joined[0] if len(joined) == 1 else RowParts(tuple(joined))
        # Float parts beside blocks, or stacks of experts of different types: a kernel reads one format per
        # launch, so these run in float (the parts' activation dtype).
        dt = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), None)
        dt = dt or next((p.act_dtype for p in parts if p.act_dtype is not None), torch.float32)
        return _cat_tensors([as_float(p, dt) for p in parts], dim).contiguous()
    if not all(isinstance(p, FP8Weight) for p in parts):
        raise TypeError("cat: cannot mix FP8 and float weights in one fused matrix")
    nd = parts[0].dim()
    if dim % nd == nd - 1:
        raise ValueError("cat: FP8 weights cannot be joined along K (their scales run along K in blocks)")
    if len({p.block_k for p in parts}) != 1:
        raise ValueError(f"cat: parts have different block_k {[p.block_k for p in parts]}")
    _same("cat", parts)
    return dataclasses.replace(parts[0], data=_cat_tensors([p.data for p in parts], dim).contiguous(),
                               scale=_cat_tensors([p.scale for p in parts], dim).contiguous())


def stack(parts: Sequence[Weight]) -> Weight:
    """Stack weights along a new leading dim (MoE experts): [E, N, K] (and scales [E, N, KB])."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return _stack_tensors(parts).contiguous()
    if all(isinstance(p, GGUFWeight) for p in parts):
        _gguf_joinable("stack", parts)
        return dataclasses.replace(parts[0], data=_stack_tensors([p.data for p in parts]).contiguous())
    if not all(isinstance(p, FP8Weight) for p in parts):
        raise TypeError("stack: cannot mix FP8 and float weights")
    if len({p.block_k for p in parts}) != 1:
        raise ValueError(f"stack: parts have different block_k {[p.block_k for p in parts]}")
    _same("stack", parts)
    return dataclasses.replace(parts[0], data=_stack_tensors([p.data for p in parts]).contiguous(),
                               scale=_stack_tensors([p.scale for p in parts]).contiguous())


def activation_dtype(what: str, x: torch.Tensor, weight: Weight, act_dtype: Optional[torch.dtype]) -> torch.dtype:
    """What a kernel rounds its activations ``x`` to before the product with ``weight``: a float weight's
    own dtype (any other ``act_dtype`` is an error: ``what`` names the op); for an FP8 weight
    ``act_dtype``, else the weight's ``act_dtype`` (the model dtype, set at load), else x's dtype."""
    if isinstance(weight, QuantWeight):
        adt = act_dtype or weight.act_dtype or x.dtype
        if adt not in (torch.float32, torch.bfloat16, torch.float16):
            kind = "an FP8" if isinstance(weight, FP8Weight) else f"a {weight.qtype}"
            raise TypeError(f"{what}: activations must be fp32, bf16 or fp16 for {kind} weight, got {adt}")
        return adt
    if act_dtype is not None and act_dtype != weight.dtype:
        raise ValueError(f"{what}: act_dtype={act_dtype} is for FP8 weights; a {weight.dtype} weight rounds "
                         f"the activations to its own dtype")
    return weight.dtype


def as_float(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """A float tensor of ``w`` (dequantized if FP8 or GGUF blocks): for the few weights a model must
    rearrange beyond rows at load (DeepSeek's absorbed ``kv_b``), and for references."""
    return w.dequantize(dtype) if isinstance(w, QuantWeight) else w.to(dtype)
