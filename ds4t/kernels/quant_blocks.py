"""GGUF block-quantized weights kept as llama.cpp stores them: Q8_0, Q4_K and Q6_K.

A GGUF tensor of logical shape [N, K] is N rows of K / QK blocks, each block ``BPB`` bytes, K
contiguous (the ggml layout). :class:`GGUFWeight` holds exactly those bytes, ``uint8 [..., N, K / QK *
BPB]`` (leading dims: stacked MoE experts), so a weight takes the file's bytes in memory and the
kernels (:mod:`ds4t.kernels.qlinear`, :mod:`ds4t.kernels.qmoe`) decode blocks in registers.

The formats (ggml-common.h; offsets in bytes within one block):

======  ====  ====  ===  ===========================================================================
type     QK   BPB   SB   block layout and value of element i
======  ====  ====  ===  ===========================================================================
Q8_0     32    34   32   d fp16 @0, q int8[32] @2.             w_i = d * q_i
Q4_K    256   144   32   d fp16 @0, dmin fp16 @2, 8 x (6-bit scale sc_j, 6-bit min m_j) packed in
                         12 bytes @4, q 4-bit[256] @16 (byte 16 + 32c + l: low nibble element 64c + l,
                         high nibble element 64c + 32 + l).   w_i = (d * sc_j) * q_i - (dmin * m_j),
                         j = i // 32
Q6_K    256   210   16   ql 4-bit[256] @0, qh 2-bit[256] @128, sc int8[16] @192, d fp16 @208
                         (element 128h + e: low 4 bits from ql byte 64h + e % 64, nibble e // 64; high
                         2 bits from qh byte 32h + e % 32, bits 2 (e // 32)).  w_i = (d * sc_j) *
                         (q_i - 32), j = i // 16
======  ====  ====  ===  ===========================================================================

**What a kernel computes** (one definition for every format; SB = the sub-block of one scale): per row n
and sub-block j of SB columns,

    y[b, n] = sum over j in K order of  s[n, j] * (x_j . q_j)  -  mn[n, j] * sum(x_j)

with ``x_j`` the activations of the sub-block rounded to the activation dtype A (``act_dtype``, the
model dtype; never to an integer format), ``q_j`` the sub-block's integers (exact in A: at most 8 bits),
``x_j . q_j`` and ``sum(x_j)`` summed in fp32 from zero, ``s = d * sc`` (Q8_0: ``d``) and ``mn = dmin * m``
(Q4_K only; 0 otherwise) in fp32. Every one of those fp32 scales is exact (an 11-bit fp16 mantissa times
an integer of at most 7 bits), and so is each dequantized weight ``s * q - mn`` up to its one final
rounding: the weights the kernels use are bitwise the values ``gguf.quants.dequantize`` returns (fp32).
The kernel's result differs from ``x . dequantize(w)`` only by fp32 summation order, so tests hold it
to fp32 tolerances. A row's bits never depend on the other rows (the sums run along the row's own K in
a fixed order; launch constants come from shapes and the format only), so batch and chunk invariance
hold as for float weights.

Other GGUF types are dequantized at load (:mod:`ds4t.models.gguf`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np
import torch

QTYPES = ("Q8_0", "Q4_K", "Q6_K")
"""GGUF types the kernels read as blocks."""


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    name: str
    qk: int    # elements per block (along K)
    bpb: int   # bytes per block
    sb: int    # elements per scale (sub-block)
    code: int  # the kernels' constexpr FMT


FORMATS = {
    "Q8_0": BlockFormat("Q8_0", 32, 34, 32, 0),
    "Q4_K": BlockFormat("Q4_K", 256, 144, 32, 1),
    "Q6_K": BlockFormat("Q6_K", 256, 210, 16, 2),
}


def block_format(qtype: str) -> BlockFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        raise ValueError(f"GGUF type {qtype!r} is not read as blocks (kernel types: {list(QTYPES)})") from None


def fits(qtype: str, K: int) -> bool:
    """Can a weight with K columns be stored as ``qtype`` (K a multiple of its block)?"""
    return K > 0 and K % block_format(qtype).qk == 0


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFWeight:
    """A GGUF block-quantized weight of logical shape ``[..., N, K]``: ``data`` uint8 ``[..., N, K / QK * BPB]``,
    each row its K / QK blocks in ggml's layout. Leading dims (MoE experts) and rows index like a tensor;
    the K axis never does (blocks run along it)."""
    data: torch.Tensor
    qtype: str
    k: int
    act_dtype: Optional[torch.dtype] = None
    """What activations are rounded to before the products (the model dtype, set at load; None: the
    activations' own dtype). The block integers convert exactly to fp32, bf16 or fp16."""

    def __post_init__(self):
        f = block_format(self.qtype)
        if self.data.dtype != torch.uint8:
            raise ValueError(f"GGUFWeight data must be uint8, got {self.data.dtype}")
        if self.data.dim() < 2:
            raise ValueError(f"GGUFWeight data must be [..., N, bytes], got {tuple(self.data.shape)}")
        if not (isinstance(self.k, int) and self.k > 0 and self.k % f.qk == 0):
            raise ValueError(f"GGUFWeight {self.qtype}: K={self.k!r} must be a positive multiple of {f.qk}")
        if self.data.shape[-1] != self.k // f.qk * f.bpb:
            raise ValueError(f"GGUFWeight {self.qtype}: K={self.k} needs {self.k // f.qk * f.bpb} bytes a row, "
                             f"data has {self.data.shape[-1]}")

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.k))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def dim(self) -> int:
        return self.data.dim()

    @property
    def nbytes(self) -> int:
        """Bytes a kernel reads: the blocks."""
        return self.data.numel()

    def contiguous(self) -> "GGUFWeight":
        return dataclasses.replace(self, data=self.data.contiguous())

    def to(self, device) -> "GGUFWeight":
        return dataclasses.replace(self, data=self.data.to(device))

    def with_act_dtype(self, dtype: Optional[torch.dtype]) -> "GGUFWeight":
        return dataclasses.replace(self, act_dtype=dtype)

    def __getitem__(self, idx) -> "GGUFWeight":
        """Rows (or leading-dim entries) selected by ``idx``; the K axis is never indexed."""
        d = self.data[idx]
        if d.dim() < 2 or d.shape[-1] != self.data.shape[-1]:
            raise IndexError("GGUFWeight: index rows or leading dims only (blocks run along K)")
        return dataclasses.replace(self, data=d)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight, as ``gguf.quants.dequantize`` computes it (fp32), cast to ``dtype``."""
        return dequantize(self.data, self.qtype, self.k).to(dtype)


def dequantize(data: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """fp32 ``[..., N, K]`` of raw blocks ``data`` uint8 ``[..., N, bytes]`` with gguf-py (the reference)."""
    import gguf

    raw = data.detach().cpu().contiguous().numpy()
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(*data.shape[:-1], K).to(data.device)


# ----------------------------------------------------------------------------------------------
# Quantizing (the converter, tests, load-time quantization). Q8_0 is gguf-py's (bit-exact with ggml's
# reference); gguf-py has no K-quant quantizer, so Q4_K / Q6_K are made here: plain min/max (Q4_K) and
# absmax (Q6_K) scales per sub-block, not llama.cpp's error-minimising search. The blocks are valid
# ggml blocks, every reader decodes them the same way; they are only somewhat less accurate than
# llama-quantize's.
# ----------------------------------------------------------------------------------------------
def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _bytes16(x: np.ndarray) -> np.ndarray:
    """fp16 [n] -> uint8 [n, 2] (little endian, as ggml writes)."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 144]."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo = np.minimum(sub.min(axis=-1), 0.0)                    # min <= 0, as ggml's (w = s q - mn, mn >= 0)
    hi = sub.max(axis=-1)
    scale = (hi - lo) / 15.0
    d = _f16(scale.max(axis=-1) / 63.0).astype(np.float32)
    dmin = _f16((-lo).max(axis=-1) / 63.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 63).astype(np.uint8)
        m = np.where(dmin[:, None] > 0, np.rint(-lo / dmin[:, None]), 0).clip(0, 63).astype(np.uint8)
        s = d[:, None] * sc.astype(np.float32)
        mn = dmin[:, None] * m.astype(np.float32)
        q = np.where(s[..., None] > 0, np.rint((sub + mn[..., None]) / s[..., None]), 0)
    q = q.clip(0, 15).astype(np.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    packed = np.empty((n, 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return np.concatenate([_bytes16(d), _bytes16(dmin), packed, qs], axis=1)


def _quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> uint8 [n, 210]."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    scale = np.abs(sub).max(axis=-1) / 31.0                    # q - 32 in [-32, 31]
    d = _f16(scale.max(axis=-1) / 127.0).astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d[:, None] > 0, np.rint(scale / d[:, None]), 0).clip(0, 127).astype(np.int8)
        s = d[:, None] * sc.astype(np.float32)
        q = np.where(s[..., None] > 0, np.rint(sub / s[..., None]), 0)
    q = (q.clip(-32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)       # [n, half, e]
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    h4 = high.reshape(n, 2, 4, 32)
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _bytes16(d)], axis=1)


def quantize_numpy(w: np.ndarray, qtype: str) -> np.ndarray:
    """float ``[..., K]`` -> uint8 ``[..., K / QK * BPB]`` blocks of ``qtype`` (K a multiple of its block).
    Deterministic."""
    f = block_format(qtype)
    w = np.ascontiguousarray(w, dtype=np.float32)
    K = w.shape[-1]
    if not fits(qtype, K):
        raise ValueError(f"{qtype}: K={K} is not a multiple of its block ({f.qk})")
    if qtype == "Q8_0":
        import gguf

        return gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    blocks = w.reshape(-1, f.qk)
    out = _quantize_q4_k(blocks) if qtype == "Q4_K" else _quantize_q6_k(blocks)
    return out.reshape(*w.shape[:-1], K // f.qk * f.bpb)


def quantize(w: torch.Tensor, qtype: str, act_dtype: Optional[torch.dtype] = None) -> GGUFWeight:
    """A float weight ``[..., N, K]`` as a :class:`GGUFWeight` of ``qtype`` (on ``w``'s device)."""
    raw = quantize_numpy(w.detach().float().cpu().numpy(), qtype)
    return GGUFWeight(torch.from_numpy(raw).to(w.device), qtype, int(w.shape[-1]), act_dtype)


def same_format(parts: Sequence[GGUFWeight]) -> bool:
    """Can ``parts`` be joined into one weight (rows or experts): one type, one K, one act_dtype."""
    return len({(p.qtype, p.k, p.act_dtype) for p in parts}) == 1
