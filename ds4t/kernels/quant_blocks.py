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

from ds4t.kernels.tensors import TensorLike

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
class GGUFWeight(TensorLike):
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
# Quantizing (the converter, tests, load-time quantization), in torch on the weight's device. Q8_0 is
# ggml's reference (bit-exact with gguf-py's ``quants.quantize``); gguf-py has no K-quant quantizer, so
# Q4_K / Q6_K use plain min/max (Q4_K) and absmax (Q6_K) scales per sub-block, not llama.cpp's
# error-minimising search: valid ggml blocks that every reader decodes the same way, somewhat less
# accurate than llama-quantize's.
# ----------------------------------------------------------------------------------------------
def _round_away(x: torch.Tensor) -> torch.Tensor:
    """ggml's roundf (half away from zero), which torch.round (half to even) is not."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


def _f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [n] -> uint8 [n, 2]: the fp16 value, little endian (as ggml writes it)."""
    return x.to(torch.float16).view(torch.uint8).reshape(-1, 2)


def _quantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, 34] (ggml's quantize_row_q8_0_ref)."""
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _round_away(b * inv).to(torch.int8).view(torch.uint8)
    return torch.cat([_f16_bytes(d[:, 0]), q], 1)


def _quantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> uint8 [n, 144]."""
    n = b.shape[0]
    sub = b.reshape(n, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)                   # min <= 0, as ggml's (w = s q - mn, mn >= 0)
    scale = (sub.amax(-1) - lo) / 15
    d = (scale.amax(-1) / 63).half().float()[:, None]
    dmin = ((-lo).amax(-1) / 63).half().float()[:, None]
    sc = torch.where(d > 0, _round_away(scale / d), 0.0).clamp(0, 63)
    m = torch.where(dmin > 0, _round_away(-lo / dmin), 0.0).clamp(0, 63)
    s, mn = (d * sc)[..., None], (dmin * m)[..., None]
    q = torch.where(s > 0, _round_away((sub + mn) / s), 0.0).clamp(0, 15).to(torch.uint8).reshape(n, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, 128)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    packed = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)
    return torch.cat([_f16_bytes(d[:, 0]), _f16_bytes(dmin[:, 0]), packed, qs], 1)


def _quantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> uint8 [n, 210]."""
    n = b.shape[0]
    sub = b.reshape(n, 16, 16)
    scale = sub.abs().amax(-1) / 31                    # q - 32 in [-32, 31]
    d = (scale.amax(-1) / 127).half().float()[:, None]
    sc = torch.where(d > 0, _round_away(scale / d), 0.0).clamp(0, 127)
    s = (d * sc)[..., None]
    q = (torch.where(s > 0, _round_away(sub / s), 0.0).clamp(-32, 31) + 32).to(torch.uint8).reshape(n, 2, 128)
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(n, 128)
    h4 = high.reshape(n, 2, 4, 32)
    qh = (h4[:, :, 0] | (h4[:, :, 1] << 2) | (h4[:, :, 2] << 4) | (h4[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _f16_bytes(d[:, 0])], 1)


_QUANTIZERS = {"Q8_0": _quantize_q8_0, "Q4_K": _quantize_q4_k, "Q6_K": _quantize_q6_k}
_CHUNK = 1 << 24   # blocks' elements quantized at a time (bounds the temporaries of big expert stacks)


def quantize_blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float ``[..., K]`` -> uint8 ``[..., K / QK * BPB]`` blocks of ``qtype`` (K a multiple of its block),
    on ``w``'s device. Deterministic."""
    f = block_format(qtype)
    K = w.shape[-1]
    if not fits(qtype, K):
        raise ValueError(f"{qtype}: K={K} is not a multiple of its block ({f.qk})")
    blocks = w.detach().reshape(-1, f.qk)
    step = max(1, _CHUNK // f.qk)
    out = torch.cat([_QUANTIZERS[qtype](blocks[i:i + step].float()) for i in range(0, blocks.shape[0], step)])
    return out.reshape(*w.shape[:-1], K // f.qk * f.bpb)


def quantize_numpy(w: np.ndarray, qtype: str) -> np.ndarray:
    """:func:`quantize_blocks` of a numpy array (what GGUFWriter takes)."""
    return quantize_blocks(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), qtype).numpy()


def quantize(w: torch.Tensor, qtype: str, act_dtype: Optional[torch.dtype] = None) -> GGUFWeight:
    """A float weight ``[..., N, K]`` as a :class:`GGUFWeight` of ``qtype`` (on ``w``'s device)."""
    return GGUFWeight(quantize_blocks(w, qtype), qtype, int(w.shape[-1]), act_dtype)


def fallback_type(qtype: str, K: int) -> Optional[str]:
    """The kernel type a K-column weight can take when ``qtype`` does not fit it (as llama-quantize falls
    back for rows that are not a multiple of 256): Q4_K / Q6_K -> Q8_0 -> None (keep it float)."""
    for t in (qtype, "Q8_0"):
        if fits(t, K):
            return t
    return None


def same_format(parts: Sequence[GGUFWeight]) -> bool:
    """Can ``parts`` be joined into one weight (rows or experts): one type, one K, one act_dtype."""
    return len({(p.qtype, p.k, p.act_dtype) for p in parts}) == 1
