"""GGUF block-quantized weights kept as llama.cpp stores them: Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K.

A GGUF tensor of logical shape [N, K] is N rows of K / QK blocks, each block ``BPB`` bytes, K
contiguous (the ggml layout). ggml's blocks are 34, 18, 20, 144, 176 and 210 bytes: the quants inside a row sit at
offsets no wider load can assume aligned, so :class:`GGUFWeight` keeps the same bytes **repacked once at
load** (:func:`repack`; :meth:`GGUFWeight.blocks` gives the ggml bytes back, bit for bit): each row is the
format's *planes* one after another, a plane being one byte range of every block of the row, concatenated
in K order (leading dims: stacked MoE experts). Every plane starts 16-byte aligned and a row is padded to
a multiple of 16 bytes (zeros; only Q6_K rows with K / 256 not a multiple of 8 and rows of 32-element blocks
with K / 32 not a multiple of 8 -- Q4_1: of 4 -- need any), so a kernel (:mod:`ds4t.kernels.qlinear`,
:mod:`ds4t.kernels.qmoe`) reads the
quants of a sub-block with 16-byte vector loads and its scales with aligned 2- or 4-byte loads, and
decodes them in registers. Nothing is decoded at load: the planes hold ggml's own bytes (so the
dequantized values cannot change), only moved.

======  ==================================================================================
type    planes of a row (ggml byte range of each block -> plane; nb = K / QK blocks)
======  ==================================================================================
Q8_0    q int8 [K] (bytes 2..33)         | d fp16 [nb] (bytes 0..1)
Q4_0    qs 4-bit [K / 2] (bytes 2..17)    | d fp16 [nb] (bytes 0..1)
Q4_1    qs 4-bit [K / 2] (bytes 4..19)    | (d, m) fp16 [nb, 2] (bytes 0..3)
Q4_K    qs 4-bit [K / 2] (bytes 16..143) | header [nb, 16] (bytes 0..15: d, dmin, 12 packed scales)
Q5_K    qs 4-bit [K / 2] (bytes 48..175) | qh [K / 8] (bytes 16..47) | header [nb, 16] (bytes 0..15, as Q4_K)
Q6_K    ql [K / 2] (bytes 0..127) | qh [K / 4] (128..191) | sc int8 [K / 16] (192..207) | d fp16 [nb] (208..209)
======  ==================================================================================

Within a plane the bytes keep ggml's order, which already suits 16-byte loads: a Q4_K 32-byte run holds
two sub-blocks (low and high nibbles), a Q5_K 32-byte qh run the fifth bits of the whole block, a Q6_K
16-byte ql run two sub-blocks and a 16-byte qh run four.

The formats (ggml-common.h; offsets in bytes within one block):

======  ====  ====  ===  ===========================================================================
type     QK   BPB   SB   block layout and value of element i
======  ====  ====  ===  ===========================================================================
Q8_0     32    34   32   d fp16 @0, q int8[32] @2.             w_i = d * q_i
Q4_0     32    18   32   d fp16 @0, q 4-bit[32] @2 (byte 2 + l: low nibble element l, high nibble l + 16).
                         w_i = d * (q_i - 8)
Q4_1     32    20   32   d fp16 @0, m fp16 @2, q 4-bit[32] @4 (as Q4_0).   w_i = d * q_i + m
Q4_K    256   144   32   d fp16 @0, dmin fp16 @2, 8 x (6-bit scale sc_j, 6-bit min m_j) packed in
                         12 bytes @4, q 4-bit[256] @16 (byte 16 + 32c + l: low nibble element 64c + l,
                         high nibble element 64c + 32 + l).   w_i = (d * sc_j) * q_i - (dmin * m_j),
                         j = i // 32
Q5_K    256   176   32   d, dmin, scales as Q4_K @0..15, qh[32] @16, qs 4-bit[256] @48: Q4_K's nibble
                         (byte 48 + 32c + l) plus 16 * bit (2c + h) of qh[l] for element 64c + 32h + l.
                         w_i = (d * sc_j) * q_i - (dmin * m_j), q_i in 0..31
Q6_K    256   210   16   ql 4-bit[256] @0, qh 2-bit[256] @128, sc int8[16] @192, d fp16 @208
                         (element 128h + e: low 4 bits from ql byte 64h + e % 64, nibble e // 64; high
                         2 bits from qh byte 32h + e % 32, bits 2 (e // 32)).  w_i = (d * sc_j) *
                         (q_i - 32), j = i // 16
======  ====  ====  ===  ===========================================================================

**What a kernel computes** (one definition for every format; SB = the sub-block of one scale): per row n,
sub-blocks j of SB columns in K order,

    acc = fma(s[n, j], x_j . q_j, acc)                                   (every sub-block)
    acc = fma(-dmin[n, b], sum over j in block b of m[n, j] * sum(x_j), acc)   (Q4_K / Q5_K, once per 256-block b)
    acc = fma(m[n, j], sum(x_j), acc)                                    (Q4_1, every block)

with ``x_j`` the activations of the sub-block rounded to the activation dtype A (``act_dtype``, the
model dtype; never to an integer format), ``q_j`` the sub-block's integers (exact in A: at most 8 bits),
``x_j . q_j`` summed in fp32 from zero (Q4_0's integers are ``q - 8``), ``s = d * sc`` (Q8_0, Q4_0, Q4_1:
``d``) in fp32; Q4_1's min ``m`` (fp16) meets the block's ``sum(x_j)`` (an fp32 MMA against ones); Q4_K's
and Q5_K's mins ``m`` (6-bit integers, exact in A) meet the activations in one MMA chain per block (every product ``m * x`` exact,
the sums in fp32) that is scaled by the block's ``dmin`` once. Every fp32 scale is exact (an 11-bit fp16
mantissa times an integer of at most 7 bits), and so is each dequantized weight ``s * q - dmin * m`` up
to its one final rounding: the weights the kernels use are bitwise the values ``gguf.quants.dequantize``
returns (fp32; the identity-matrix test checks it). The kernel's result differs from
``x . dequantize(w)`` only by fp32 summation order, so tests hold it to fp32 tolerances. A row's bits
never depend on the other rows (the sums run along the row's own K in a fixed order; launch constants
come from shapes and the format only), so batch and chunk invariance hold as for float weights.

**The fold route** (bf16 activations; a launch constant, ``QLinearConfig.fold`` / ``QMoEConfig.fold``, the
default for every type but Q6_K): each weight is dequantized in bf16 arithmetic as ``q * bf16(s) - bf16(mn)``
rounded once (one packed ``fma.rn.bf16x2`` per two weights), and the dequantized sub-blocks of a loop step
meet one fp32 accumulator in one MMA. Its weights are :func:`fold_weights` bit for bit -- within ~1.5 bf16
ulps of gguf-py's value, what any bf16 model holding the dequantized weight multiplies -- and cost a third of
the exact route's instructions (H200: Q8_0 66-83 % of copy bandwidth against 39-55 %;
bench/results/2026-12-02-h200-gguf-fold.md). Like every launch constant it comes from shapes, type and
activation dtype, never from the batch; fp32 and fp16 activations always take the exact route.

**The scale plane** (Q4_K and Q5_K, a load-time layout: :data:`GGUF_LAYOUTS`): a row may end with ``K / 8`` more bytes,
16 bf16 a block -- ``bf16(s_j)`` then ``-bf16(mn_j)`` for the sub-blocks in :data:`PLANE_ORDER`
(:func:`make_scale_plane`) -- which the fold route loads instead of decoding the packed header: the values
it would have computed, so the same weights, for fewer instructions a weight (the header stays: the exact route
and :meth:`GGUFWeight.blocks` read it). The same bits too, in the interpreter and at the GPU's wgmma tiles (64
weight rows); at smaller tiles (mma.sync) Triton 3.6 gives the two routes' weight operands different layouts
(kWidth 8 for values made from 8-bit loads, 4 from 16-bit ones), which orders the K sums differently, so they
agree only to fp32 summation order there -- each fixed per launch config, never per batch.

Other GGUF types are dequantized at load (:mod:`ds4t.models.gguf`).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Tuple

import numpy as np
import torch

from ds4t.kernels.config import ConfigTable
from ds4t.kernels.tensors import TensorLike

QTYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
"""GGUF types the kernels read as blocks."""


ALIGN = 16
"""Bytes every plane start and every repacked row length is a multiple of (one vector load)."""


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    name: str
    qk: int    # elements per block (along K)
    bpb: int   # bytes per block
    sb: int    # elements per scale (sub-block)
    code: int  # the kernels' constexpr FMT
    planes: Tuple[Tuple[int, int], ...]
    """The repacked row's planes in order: (first byte, end byte) of each ggml block that goes to it."""

    def plane_offsets(self, K: int) -> Tuple[int, ...]:
        """Byte offset of each plane in a repacked row of K columns (all multiples of :data:`ALIGN`; the
        kernels compute the same numbers from K)."""
        nb, out, at = K // self.qk, [], 0
        for lo, hi in self.planes:
            out.append(at)
            at = _up(at + nb * (hi - lo))
        return tuple(out)

    def row_bytes(self, K: int) -> int:
        """Bytes of a repacked row: the block bytes, each plane padded to :data:`ALIGN`."""
        lo, hi = self.planes[-1]
        return _up(self.plane_offsets(K)[-1] + K // self.qk * (hi - lo))


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


FORMATS = {
    "Q8_0": BlockFormat("Q8_0", 32, 34, 32, 0, planes=((2, 34), (0, 2))),
    "Q4_K": BlockFormat("Q4_K", 256, 144, 32, 1, planes=((16, 144), (0, 16))),
    "Q6_K": BlockFormat("Q6_K", 256, 210, 16, 2, planes=((0, 128), (128, 192), (192, 208), (208, 210))),
    # qh before the header: the 32-byte qh runs of a block start 32-byte aligned (KW / 2 = 128 nb)
    "Q5_K": BlockFormat("Q5_K", 256, 176, 32, 4, planes=((48, 176), (16, 48), (0, 16))),
    "Q4_0": BlockFormat("Q4_0", 32, 18, 32, 6, planes=((2, 18), (0, 2))),
    "Q4_1": BlockFormat("Q4_1", 32, 20, 32, 7, planes=((4, 20), (0, 4))),
}
BLOCKS_32 = ("Q8_0", "Q4_0", "Q4_1")
"""Types of 32-element blocks, one scale each: a kernel's loop step takes G of them (the config's ``group``)."""
K_HEADER = ("Q4_K", "Q5_K")
"""Types whose blocks open with the 16-byte K-quant header (d, dmin, 8 packed 6-bit scales and mins): the ones
that may carry a scale plane."""
for _f in FORMATS.values():   # the planes partition the block; quant planes of a whole block are 16-aligned
    assert sorted(b for p in _f.planes for b in range(*p)) == list(range(_f.bpb)), _f.name
del _f


def block_format(qtype: str) -> BlockFormat:
    try:
        return FORMATS[qtype]
    except KeyError:
        raise ValueError(f"GGUF type {qtype!r} is not read as blocks (kernel types: {list(QTYPES)})") from None


def fits(qtype: str, K: int) -> bool:
    """Can a weight with K columns be stored as ``qtype`` (K a multiple of its block)?"""
    return K > 0 and K % block_format(qtype).qk == 0


def repack(blocks: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """ggml blocks ``uint8 [..., N, K / QK * BPB]`` -> the repacked rows ``uint8 [..., N, row_bytes(K)]``
    (module docstring), on ``blocks``' device. A byte permutation plus zero padding: :func:`unpack` inverts it."""
    f = block_format(qtype)
    nb = K // f.qk
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != nb * f.bpb:
        raise ValueError(f"{qtype}: K={K} needs uint8 [..., N, {nb * f.bpb}] blocks, got {blocks.dtype} "
                         f"{tuple(blocks.shape)}")
    lead = blocks.shape[:-1]
    b = blocks.reshape(*lead, nb, f.bpb)
    out = blocks.new_zeros(*lead, f.row_bytes(K))
    for (lo, hi), at in zip(f.planes, f.plane_offsets(K)):
        out[..., at:at + nb * (hi - lo)] = b[..., lo:hi].reshape(*lead, nb * (hi - lo))
    return out


def unpack(data: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """Repacked rows ``uint8 [..., N, row_bytes(K)]`` -> ggml blocks ``uint8 [..., N, K / QK * BPB]``
    (the file's bytes, as gguf-py and the GGUF writer take them)."""
    f = block_format(qtype)
    nb = K // f.qk
    lead = data.shape[:-1]
    parts = [data[..., at:at + nb * (hi - lo)].reshape(*lead, nb, hi - lo)
             for (lo, hi), at in zip(f.planes, f.plane_offsets(K))]
    b = torch.empty(*lead, nb, f.bpb, dtype=torch.uint8, device=data.device)
    for (lo, hi), p in zip(f.planes, parts):
        b[..., lo:hi] = p
    return b.reshape(*lead, nb * f.bpb)


@dataclasses.dataclass(frozen=True, eq=False)
class GGUFWeight(TensorLike):
    """A GGUF block-quantized weight of logical shape ``[..., N, K]``: ``data`` uint8 ``[..., N,
    row_bytes(K)]``, each row its K / QK blocks **repacked** into aligned planes (module docstring). Build
    one from ggml bytes with :meth:`from_blocks` (or :func:`quantize`); :meth:`blocks` gives the ggml bytes
    back. Leading dims (MoE experts) and rows index like a tensor; the K axis never does (:meth:`cols`
    cuts it on block boundaries)."""
    data: torch.Tensor
    qtype: str
    k: int
    act_dtype: Optional[torch.dtype] = None
    """What activations are rounded to before the products (the model dtype, set at load; None: the
    activations' own dtype). The block integers convert exactly to fp32, bf16 or fp16."""
    scale_plane: bool = False
    """Q4_K / Q5_K only: each row ends with a scale plane (:func:`make_scale_plane`, ``K / 8`` bytes more), which the
    fold route reads instead of decoding the packed header (the same values, so the same bits). Set by
    :meth:`with_act_dtype` from :data:`GGUF_LAYOUTS`."""

    def __post_init__(self):
        f = block_format(self.qtype)
        if self.data.dtype != torch.uint8:
            raise ValueError(f"GGUFWeight data must be uint8, got {self.data.dtype}")
        if self.data.dim() < 2:
            raise ValueError(f"GGUFWeight data must be [..., N, bytes], got {tuple(self.data.shape)}")
        if not (isinstance(self.k, int) and self.k > 0 and self.k % f.qk == 0):
            raise ValueError(f"GGUFWeight {self.qtype}: K={self.k!r} must be a positive multiple of {f.qk}")
        if self.scale_plane and self.qtype not in K_HEADER:
            raise ValueError(f"GGUFWeight {self.qtype}: only {' / '.join(K_HEADER)} rows carry a scale plane")
        if self.data.shape[-1] != self.row_bytes:
            raise ValueError(f"GGUFWeight {self.qtype}: K={self.k} needs {self.row_bytes} bytes a "
                             f"repacked row{' with its scale plane' if self.scale_plane else ''}, data has "
                             f"{self.data.shape[-1]}")

    @classmethod
    def from_blocks(cls, blocks: torch.Tensor, qtype: str, k: int,
                    act_dtype: Optional[torch.dtype] = None) -> "GGUFWeight":
        """The weight of ggml blocks ``uint8 [..., N, K / QK * BPB]`` (a GGUF file's bytes), repacked."""
        return cls(repack(blocks, qtype, k), qtype, k, act_dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of a stored row: the repacked blocks, plus the scale plane when there is one."""
        return self.format.row_bytes(self.k) + (scale_plane_bytes(self.k) if self.scale_plane else 0)

    def blocks(self) -> torch.Tensor:
        """The ggml blocks ``uint8 [..., N, K / QK * BPB]``, bit for bit what :meth:`from_blocks` took."""
        return unpack(self.data, self.qtype, self.k)

    def with_scale_plane(self, on: bool = True) -> "GGUFWeight":
        """The same weight with (``on``) or without the Q4_K / Q5_K scale plane (a no-op when it already is so)."""
        if on == self.scale_plane:
            return self
        if not on:
            return dataclasses.replace(self, data=self.data[..., :self.format.row_bytes(self.k)].contiguous(),
                                       scale_plane=False)
        if self.qtype not in K_HEADER:
            raise ValueError(f"GGUFWeight {self.qtype}: only {' / '.join(K_HEADER)} rows carry a scale plane")
        plane = make_scale_plane(self.blocks(), self.k, self.qtype)
        return dataclasses.replace(self, data=torch.cat([self.data, plane], -1),
                                   scale_plane=True)

    @property
    def format(self) -> BlockFormat:
        return FORMATS[self.qtype]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.data.shape[:-1], self.k))

    @property
    def nbytes(self) -> int:
        """Bytes held: the repacked rows (the blocks plus any row padding and scale plane). A launch reads a
        row's plane on the fold route and its packed header otherwise, never both."""
        return self.data.numel()

    def contiguous(self) -> "GGUFWeight":
        return dataclasses.replace(self, data=self.data.contiguous())

    def to(self, device) -> "GGUFWeight":
        return dataclasses.replace(self, data=self.data.to(device))

    def with_act_dtype(self, dtype: Optional[torch.dtype]) -> "GGUFWeight":
        """The weight for a model of activation dtype ``dtype`` (what load calls), laid out as
        :data:`GGUF_LAYOUTS` says for (type, dtype)."""
        w = dataclasses.replace(self, act_dtype=dtype)
        return w.with_scale_plane(GGUF_LAYOUTS(self.qtype, dtype).scale_plane)

    def __getitem__(self, idx) -> "GGUFWeight":
        """Rows (or leading-dim entries) selected by ``idx``; the K axis is never indexed."""
        d = self.data[idx]
        if d.dim() < 2 or d.shape[-1] != self.data.shape[-1]:
            raise IndexError("GGUFWeight: index rows or leading dims only (blocks run along K)")
        return dataclasses.replace(self, data=d)

    def cols(self, a: int, b: int) -> "GGUFWeight":
        """Columns [a, b) in storage of its own; a and b multiples of the block (ValueError otherwise)."""
        qk, bpb = self.format.qk, self.format.bpb
        if a % qk or b % qk or not 0 <= a < b <= self.k:
            raise ValueError(f"GGUFWeight {self.qtype}: columns [{a}, {b}) do not fall on its {qk}-column blocks")
        return GGUFWeight.from_blocks(self.blocks()[..., a // qk * bpb: b // qk * bpb].contiguous(), self.qtype,
                                      b - a, self.act_dtype).with_scale_plane(self.scale_plane)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The real weight, as ``gguf.quants.dequantize`` computes it (fp32), cast to ``dtype``."""
        return dequantize(self.blocks(), self.qtype, self.k).to(dtype)


def dequantize(data: torch.Tensor, qtype: str, K: int) -> torch.Tensor:
    """fp32 ``[..., N, K]`` of ggml blocks ``data`` uint8 ``[..., N, K / QK * BPB]`` with gguf-py (the
    reference; :meth:`GGUFWeight.dequantize` for a weight)."""
    import gguf

    raw = data.detach().cpu().contiguous().numpy()
    out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32)).reshape(*data.shape[:-1], K).to(data.device)


def block_terms(data: torch.Tensor, qtype: str, K: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The terms of every element of ggml blocks ``data`` uint8 ``[..., N, K / QK * BPB]``: (q, s, mn) fp64
    ``[..., N, K]`` with the dequantized value ``s * q - mn`` (q the integer, s = d * sc and mn = dmin * m
    its sub-block's fp32-exact scale and min; mn = 0 but for Q4_K / Q5_K). On ``data``'s device."""
    f = block_format(qtype)
    lead = data.shape[:-1]
    b = data.reshape(-1, f.bpb)
    n = b.shape[0]

    def f16(lo):
        return b[:, lo:lo + 2].contiguous().view(torch.float16).double()   # [n, 1]

    if qtype == "Q8_0":
        q = b[:, 2:].view(torch.int8).double()
        s = f16(0).expand(n, 32)
        mn = torch.zeros_like(q)
    elif qtype in ("Q4_0", "Q4_1"):
        qs = b[:, f.bpb - 16:].int()
        q = torch.cat([qs & 15, qs >> 4], 1).double()
        s = f16(0).expand(n, 32)
        if qtype == "Q4_0":
            q, mn = q - 8, torch.zeros_like(q)
        else:
            mn = -f16(2).expand(n, 32)   # w = d q + m
    elif qtype in K_HEADER:
        qs = b[:, f.bpb - 128:].reshape(n, 4, 1, 32).int()
        q = torch.cat([qs & 15, qs >> 4], 2)                        # [n, 4 runs, 2 halves, 32]
        if qtype == "Q5_K":   # bit 2c + h of qh byte l: the fifth bit of element 64c + 32h + l
            bit = 2 * torch.arange(4, device=b.device)[:, None] + torch.arange(2, device=b.device)[None, :]
            q = q | (((b[:, 16:48].int()[:, None, None, :] >> bit[None, :, :, None]) & 1) << 4)
        q = q.reshape(n, 256).double()
        s, mn = (t.repeat_interleave(32, 1) for t in _q4_k_scales(b))
    else:
        e = torch.arange(128, device=b.device)
        ql = b[:, :128].reshape(n, 2, 64).int()[:, :, e % 64]
        qh = b[:, 128:192].reshape(n, 2, 32).int()[:, :, e % 32]
        q = (((ql >> (4 * (e // 64))) & 15) | (((qh >> (2 * (e // 32))) & 3) << 4)).reshape(n, 256).double() - 32
        s = (f16(208) * b[:, 192:208].view(torch.int8).double()).repeat_interleave(16, 1)
        mn = torch.zeros_like(q)
    return tuple(t.reshape(*lead, K) for t in (q, s, mn))


def _q4_k_scales(b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K blocks ``uint8 [n, 144 | 176]`` -> (s, mn) fp64 ``[n, 8]``: each sub-block's scale ``d * sc``
    and min ``dmin * m`` from the block's 16-byte header (ggml's ``get_scale_min_k4``; both exact in fp32)."""
    p = b[:, 4:16].int()
    j = torch.arange(4, device=b.device)
    sc = torch.cat([p[:, j] & 63, (p[:, 8 + j] & 15) | ((p[:, j] >> 6) << 4)], 1)
    m = torch.cat([p[:, 4 + j] & 63, (p[:, 8 + j] >> 4) | ((p[:, 4 + j] >> 6) << 4)], 1)
    d, dmin = (b[:, lo:lo + 2].contiguous().view(torch.float16).double() for lo in (0, 2))
    return d * sc.double(), dmin * m.double()


PLANE_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""Sub-blocks in a scale plane's block: the low nibbles' four (bytes 32 c + l hold sub-blocks 2 c and 2 c + 1),
then the high nibbles' four: the order of the fold route's two MMAs."""


def scale_plane_bytes(K: int) -> int:
    """Bytes a Q4_K / Q5_K row of K columns adds with a scale plane: 16 bf16 a block."""
    return K // 256 * 32


def make_scale_plane(blocks: torch.Tensor, K: int, qtype: str = "Q4_K") -> torch.Tensor:
    """Q4_K / Q5_K blocks ``uint8 [..., N, K / 256 * BPB]`` -> the scale plane ``uint8 [..., N, K / 8]``: per block
    16 bf16, ``bf16(s_j)`` for j in :data:`PLANE_ORDER`, then ``-bf16(mn_j)`` in the same order (s = d sc and
    mn = dmin m exact in fp32, each rounded once to bf16, nearest-even): the values the fold route's
    packed FMA takes, made once at load instead of on every read."""
    lead, nb = blocks.shape[:-1], K // 256
    s, mn = _q4_k_scales(blocks.reshape(-1, block_format(qtype).bpb))
    order = torch.tensor(PLANE_ORDER, device=blocks.device)
    plane = torch.cat([s[:, order], -mn[:, order]], 1).float().to(torch.bfloat16)   # fp64 -> fp32 exact
    return plane.reshape(*lead, nb * 16).view(torch.uint8)


def bf16_of_f64(v: torch.Tensor) -> torch.Tensor:
    """fp64 ``v`` rounded once to bf16 (nearest, ties to even; normal range), from its bits."""
    bits = v.contiguous().view(torch.int64)
    bits = (bits + (((bits >> 45) & 1) + (1 << 44) - 1)) & ~((1 << 45) - 1)
    return bits.view(torch.float64).float().to(torch.bfloat16)


def fold_weights(w: "GGUFWeight") -> torch.Tensor:
    """bf16 ``[..., N, K]``: the weights the fold route multiplies (:mod:`ds4t.kernels.qlinear`): per
    element ``q * bf16(s) - bf16(mn)`` rounded once to bf16, what one packed ``fma.rn.bf16x2`` gives."""
    q, s, mn = block_terms(w.blocks(), w.qtype, w.k)
    s16, mn16 = (t.float().to(torch.bfloat16).double() for t in (s, mn))
    return bf16_of_f64(q * s16 - mn16)


# ----------------------------------------------------------------------------------------------
# Quantizing (the converter, tests, load-time quantization), in torch on the weight's device. Q8_0 is
# ggml's reference, as are Q4_0 and Q4_1 (bit-exact with gguf-py's ``quants.quantize``); gguf-py has no K-quant
# quantizer, so
# Q4_K / Q5_K / Q6_K use plain min/max (Q4_K, Q5_K) and absmax (Q6_K) scales per sub-block, not llama.cpp's
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


def _nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 32] values 0..15 -> [n, 16]: byte l holds element l (low nibble) and l + 16 (high)."""
    return q[:, :16] | (q[:, 16:] << 4)


def _quantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, 18] (ggml's quantize_row_q4_0_ref: bit-exact with gguf-py's)."""
    top = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))   # the value of largest magnitude, first
    d = top / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d[:, 0]), _nibble_pairs(q)], 1)


def _quantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 32] -> uint8 [n, 20] (ggml's quantize_row_q4_1_ref: bit-exact with gguf-py's)."""
    hi, lo = b.amax(-1, keepdim=True), b.amin(-1, keepdim=True)
    d = (hi - lo) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((b - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    return torch.cat([_f16_bytes(d[:, 0]), _f16_bytes(lo[:, 0]), _nibble_pairs(q)], 1)


def _quantize_k_header(b: torch.Tensor, bits: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 [n, 256] -> (header uint8 [n, 16], q uint8 [n, 4, 2, 32] in 0 .. 2^bits - 1, element 64c + 32h + l at
    [c, h, l]): Q4_K's (bits 4) and Q5_K's (bits 5) shared part, min/max scales per 32-element sub-block."""
    n, top = b.shape[0], 2 ** bits - 1
    sub = b.reshape(n, 8, 32)
    lo = sub.amin(-1).clamp(max=0.0)                   # min <= 0, as ggml's (w = s q - mn, mn >= 0)
    scale = (sub.amax(-1) - lo) / top
    d = (scale.amax(-1) / 63).half().float()[:, None]
    dmin = ((-lo).amax(-1) / 63).half().float()[:, None]
    sc = torch.where(d > 0, _round_away(scale / d), 0.0).clamp(0, 63)
    m = torch.where(dmin > 0, _round_away(-lo / dmin), 0.0).clamp(0, 63)
    s, mn = (d * sc)[..., None], (dmin * m)[..., None]
    q = torch.where(s > 0, _round_away((sub + mn) / s), 0.0).clamp(0, top).to(torch.uint8).reshape(n, 4, 2, 32)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    packed = torch.cat([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6), (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                        (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], 1)
    return torch.cat([_f16_bytes(d[:, 0]), _f16_bytes(dmin[:, 0]), packed], 1), q


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """q uint8 [n, 4, 2, 32] -> the qs bytes [n, 128]: byte 32c + l holds [c, 0, l] low and [c, 1, l] high."""
    return ((q[:, :, 0] & 15) | ((q[:, :, 1] & 15) << 4)).reshape(q.shape[0], 128)


def _quantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> uint8 [n, 144]."""
    header, q = _quantize_k_header(b, 4)
    return torch.cat([header, _nibbles(q)], 1)


def _quantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    """float32 [n, 256] -> uint8 [n, 176]: the header, qh (bit 2c + h of byte l: bit 4 of [c, h, l]), qs."""
    header, q = _quantize_k_header(b, 5)
    bit = (2 * torch.arange(4, device=b.device)[:, None] + torch.arange(2, device=b.device)[None, :]).to(torch.uint8)
    qh = ((q >> 4) << bit[None, :, :, None]).sum((1, 2), dtype=torch.uint8)   # distinct bits: the sum is an OR
    return torch.cat([header, qh, _nibbles(q)], 1)


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


_QUANTIZERS = {"Q8_0": _quantize_q8_0, "Q4_0": _quantize_q4_0, "Q4_1": _quantize_q4_1, "Q4_K": _quantize_q4_k,
               "Q5_K": _quantize_q5_k, "Q6_K": _quantize_q6_k}
_CHUNK = 1 << 24   # blocks' elements quantized at a time (bounds the temporaries of big expert stacks)


def quantize_blocks(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """float ``[..., K]`` -> uint8 ``[..., K / QK * BPB]`` blocks of ``qtype`` (K a multiple of its block),
    on ``w``'s device. Deterministic."""
    f = block_format(qtype)
    K = w.shape[-1]
    if not fits(qtype, K):
        raise ValueError(f"{qtype}: K={K} is not a multiple of its block ({f.qk})")
    if w.device.type == "meta":   # shapes only (memory plans of full-depth models): nothing to compute
        return torch.empty(*w.shape[:-1], K // f.qk * f.bpb, dtype=torch.uint8, device="meta")
    blocks = w.detach().reshape(-1, f.qk)
    step = max(1, _CHUNK // f.qk)
    out = torch.cat([_QUANTIZERS[qtype](blocks[i:i + step].float()) for i in range(0, blocks.shape[0], step)])
    return out.reshape(*w.shape[:-1], K // f.qk * f.bpb)


def quantize_numpy(w: np.ndarray, qtype: str) -> np.ndarray:
    """:func:`quantize_blocks` of a numpy array (what GGUFWriter takes)."""
    return quantize_blocks(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)), qtype).numpy()


def quantize(w: torch.Tensor, qtype: str, act_dtype: Optional[torch.dtype] = None) -> GGUFWeight:
    """A float weight ``[..., N, K]`` as a :class:`GGUFWeight` of ``qtype`` (on ``w``'s device)."""
    return GGUFWeight.from_blocks(quantize_blocks(w, qtype), qtype, int(w.shape[-1])).with_act_dtype(act_dtype)


def fallback_type(qtype: str, K: int) -> Optional[str]:
    """The kernel type a K-column weight can take when ``qtype`` does not fit it (as llama-quantize falls
    back for rows that are not a multiple of 256): Q4_K / Q5_K / Q6_K -> Q8_0 -> None (keep it float)."""
    for t in (qtype, "Q8_0"):
        if fits(t, K):
            return t
    return None


def same_format(parts: Sequence[GGUFWeight]) -> bool:
    """Can ``parts`` be joined into one weight (rows or experts): one type, one K, one act_dtype, one
    layout."""
    return len({(p.qtype, p.k, p.act_dtype, p.scale_plane) for p in parts}) == 1


# ----------------------------------------------------------------------------------------------
# Layout at load: a function of (type, activation dtype), in the one config idiom
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GGUFLayout:
    scale_plane: bool = False   # Q4_K / Q5_K with bf16 activations: append the bf16 scale plane to every row


def _layout_interp(qtype: str, act_dtype) -> GGUFLayout:
    # on wherever the fold route could read it, so every CPU test of a bf16 Q4_K / Q5_K model runs it
    return GGUFLayout(scale_plane=qtype in K_HEADER and act_dtype == torch.bfloat16)


GGUF_LAYOUTS: ConfigTable[GGUFLayout] = ConfigTable(
    "gguf_layout", gpu={}, gpu_rule=lambda qtype, act_dtype: GGUFLayout(), interp_rule=_layout_interp,
    source="off on the GPU: timed slower there (H100, bench/results/2026-12-05-h100-gguf-types.md: Q4_K linear "
           "42 / 53 % of copy bandwidth with the plane against 49 / 56 % without at B = 1; Q5_K 30 / 34 against "
           "34 / 43 %) although ~26 % fewer instructions a fold step offline: 11 % more bytes read a Q4_K block")
"""Keyed on (GGUF type, activation dtype); read when a weight is given its activation dtype at load, so an
override (``ds4t.kernels.config.overridden``) must be in force while the model loads."""
