"""Decode linear over GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K), read as stored: what
:func:`ds4t.kernels.linear.linear` launches for a :class:`~ds4t.kernels.quant_blocks.GGUFWeight`.

Shapes and dtypes
    x       [B, K]  fp32 / bf16 / fp16, rounded to the activation dtype A inside the kernel
    weight  GGUFWeight [N, K]: uint8 [N, row_bytes], the blocks repacked in aligned planes (a Q4_K / Q5_K row may
            end with its scale plane, read on the fold route instead of the header: FMT 3 / 5)
    bias    [N] or None, any float dtype, added in fp32
    returns [B, N]  fp32

Arithmetic (defined in :mod:`ds4t.kernels.quant_blocks`): per row n and sub-block j of SB columns, in K
order, ``acc = fma(s[n, j], x_j . q_j, acc)``, each dot in fp32 from zero (Q4_K: the mins once per block,
``- dmin * sum_j m_j sum(x_j)`` from one MMA chain; Q5_K likewise; Q4_1: ``+ m * sum(x_j)`` a block), the
block's integers converted exactly to A (packed bit tricks on the GPU: :func:`ds4t.backend.int8_to`,
``nibbles_to``, ``five_bits_to``, ``six_bit_to``) and the fp32 scales decoded from the block bytes in registers.
:func:`qdot` is that loop, shared with the MoE kernels (:mod:`ds4t.kernels.qmoe`). It reads the repacked
planes (:func:`ds4t.kernels.quant_blocks.repack`): a sub-block's quants with 16-byte vector loads (32 or
16 contiguous, aligned bytes a row), its scales with aligned 2- or 4-byte loads.

Fold route (``QLinearConfig.fold``, bf16 activations only): per loop step the integers, converted the same
way, become weights ``fma(q, bf16(s), -bf16(mn))`` in one packed bf16 FMA (:func:`ds4t.backend.fma_bf16`),
the sub-blocks of the step side by side with their scales spread along their columns and the activation
columns gathered in the same order, and meet ``acc`` in one MMA (Q8_0: G blocks; Q4_0 / Q4_1: two of 16 G
columns, low and high nibbles; Q4_K: two of 128, low and high nibbles; Q5_K and Q6_K: eight of 32). The weights are :func:`ds4t.kernels.quant_blocks.fold_weights`.

Batch invariance: launch constants (:data:`QLINEAR_CONFIGS`) come from (K, N, type, A) and the backend,
never from B (one measured exception: a launch of many rows -- a prefill chunk -- may take a rows entry whose
tiles hold more activation rows, ``block_m``, every row's operations unchanged: :func:`qlinear_launch_config`);
rows sit in fixed tiles (clamped loads, masked stores), each with its own dot per sub-block; a split-K count
S > 1 (splits on block boundaries, fixed by K) writes fp32 partials that
:func:`ds4t.kernels.linear._splitk_sum_kernel` adds in the order 0..S-1. No atomics.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ds4t.backend import (LAUNCH, cast, five_bits_to, fma_bf16, grid_dependency, int8_to, mma, nibbles_to,
                          prefetch_l2, scaled_add, six_bit_to, tl_dtype)
from ds4t.kernels.config import ConfigTable, differs_only_in, launch_kwargs
from ds4t.kernels.quant_blocks import BLOCKS_32, GGUFWeight, block_format

BLOCK_M = 16
"""Activation rows per tile of a decode launch (tl.dot needs M >= 16 on the GPU); a rows entry may hold more."""


# ----------------------------------------------------------------------------------------------
# Block decoding and the sub-block dot (jit helpers, also used by the MoE kernels). A row pointer is the
# start of a repacked row (ds4t.kernels.quant_blocks): the plane offsets below are those of
# BlockFormat.plane_offsets, computed from the weight's K (KW, a constexpr).
# ----------------------------------------------------------------------------------------------
@triton.jit
def _f16_bits(w):
    """The fp16 whose bits are ``w``'s low 16 (int32 [BN]), as fp32 (exact)."""
    return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_scale_min(w1, w2, w3, J: tl.constexpr):
    """Q4_K sub-block J's 6-bit (scale, min) as int32 [BN] (ggml's ``get_scale_min_k4``) from the packed
    scale bytes 4..15 of the block header, read as three little-endian int32 words w1, w2, w3."""
    if J < 4:
        sc = (w1 >> (8 * J)) & 63
        m = (w2 >> (8 * J)) & 63
    else:
        sc = ((w3 >> (8 * (J - 4))) & 15) | (((w1 >> (8 * (J - 4) + 6)) & 3) << 4)
        m = ((w3 >> (8 * (J - 4) + 4)) & 15) | (((w2 >> (8 * (J - 4) + 6)) & 3) << 4)
    return sc, m


@triton.jit
def _k_header(w_row, at):
    """A K-quant block header (16 bytes at byte ``at`` of each row: d, dmin fp16, 12 packed 6-bit scales and
    mins) as (d, dmin) fp32 [BN] and the scale bytes as three little-endian int32 words w1, w2, w3 [BN]
    (:func:`_q4k_scale_min` decodes them)."""
    hdr = (w_row + at).to(tl.pointer_type(tl.int32))
    w0 = tl.load(hdr)
    return _f16_bits(w0), _f16_bits(w0 >> 16), tl.load(hdr + 1), tl.load(hdr + 2), tl.load(hdr + 3)


@triton.jit
def _pick(i: tl.constexpr, a, b, c, d):
    """The i-th of a, b, c, d (i a constexpr: resolved at compile time, no select in the code)."""
    r = a
    if i == 1:
        r = b
    if i == 2:
        r = c
    if i == 3:
        r = d
    return r


@triton.jit
def _raw_bytes(p, OFF, W: tl.constexpr):
    """uint8 [BN, W] at ``p[:, None] + OFF + (0 .. W-1)``: W contiguous bytes a row from an offset that
    is a multiple of W (W = 16 or 32; rows 16-byte aligned), so 16-byte vector loads."""
    cols = tl.max_contiguous(tl.multiple_of(OFF + tl.arange(0, W), W), W)
    return tl.load(p[:, None] + cols[None, :])


@triton.jit
def _x_tile(x_row, k, SB: tl.constexpr, ADT: tl.constexpr):
    """Activations [SB, BM] of columns k .. k + SB, rounded to ADT; x_row [BM] pointers to each row's
    column 0 (rows in bounds)."""
    return _x_cols(x_row, k + tl.arange(0, SB), ADT)


@triton.jit
def _scaled_dot(acc, q, xt, s):
    """acc [BN, BM] + s * (q . xt), rounded once (an FMA): q [BN, SB] a sub-block's integers in the
    activation dtype (exact), xt [SB, BM] its activations (:func:`_x_tile`), s [BN] fp32. The dot starts
    from zero in fp32."""
    p = mma(q, xt, tl.zeros(acc.shape, dtype=tl.float32))
    return scaled_add(acc, p, s[:, None])


@triton.jit
def _q8_0_step(acc, w_row, x_row, k, ADT: tl.constexpr, G: tl.constexpr, KW: tl.constexpr):
    """acc + the G Q8_0 blocks of columns k .. k + 32 G, in K order. Planes: q int8 [KW] @0, d fp16
    [KW / 32] @KW."""
    for g in tl.static_range(G):
        kg = k + 32 * g
        d = tl.load((w_row + KW + kg // 16).to(tl.pointer_type(tl.float16))).to(tl.float32)
        acc = _scaled_dot(acc, int8_to(_raw_bytes(w_row, kg, 32), ADT), _x_tile(x_row, kg, 32, ADT), d)
    return acc


@triton.constexpr_function
def _k_header_at(KW, QH):
    """Byte offset of the header plane in a Q4_K (QH False) or Q5_K (QH True: after its qh plane) row (a
    constexpr function, as :func:`_loop_step`)."""
    return KW // 2 + KW // 8 if QH else KW // 2


@triton.jit
def _q4_k_step(acc, w_row, x_row, k, ADT: tl.constexpr, KW: tl.constexpr, QH: tl.constexpr = False):
    """acc + the Q4_K 256-block at column k. Planes: qs [KW / 2] @0 (32-byte run c of a block: sub-blocks
    2c low nibbles, 2c + 1 high), header [KW / 256, 16] @KW / 2 (d, dmin fp16, 12 packed 6-bit scales
    and mins). QH (Q5_K): each sub-block 2c + h takes bit 2c + h of the block's 32 qh bytes (plane [KW / 8]
    @KW / 2, the header after it) as its values' fifth bit."""
    d, dmin, w1, w2, w3 = _k_header(w_row, _k_header_at(KW, QH) + (k // 256) * 16)
    # the mins: sum_j m_j * (x_j . 1) as one MMA chain over the block (m_j broadcast along its
    # sub-block; small integers, exact in ADT), scaled by dmin once per block
    acc_m = tl.zeros(acc.shape, dtype=tl.float32)
    if QH:
        qh = _raw_bytes(w_row, KW // 2 + (k // 256) * 32, 32)
    for c in tl.static_range(4):
        qs = _raw_bytes(w_row, k // 2 + 32 * c, 32)
        if QH:
            lo, hi = five_bits_to(qs, qh, 2 * c, ADT)
        else:
            lo, hi = nibbles_to(qs, ADT)   # exact in ADT
        for h in tl.static_range(2):
            sc, m = _q4k_scale_min(w1, w2, w3, 2 * c + h)
            xt = _x_tile(x_row, k + 64 * c + 32 * h, 32, ADT)
            q = lo if h == 0 else hi
            acc = _scaled_dot(acc, q, xt, d * sc.to(tl.float32))
            acc_m = mma(tl.broadcast_to(cast(m.to(tl.float32), ADT)[:, None], q.shape), xt, acc_m)
    return scaled_add(acc, acc_m, -dmin[:, None])


@triton.jit
def _q4_x_step(acc, w_row, x_row, k, ADT: tl.constexpr, G: tl.constexpr, KW: tl.constexpr, MIN: tl.constexpr,
               NP: tl.constexpr):
    """acc + the G Q4_0 (MIN False) or Q4_1 (MIN True) blocks of columns k .. k + 32 G, in K order. Planes: qs
    [KW / 2] @0 (byte l of a block: element l low nibble, l + 16 high), then d fp16 [KW / 32] (Q4_0) or
    (d, m) fp16 pairs [KW / 32, 2] (Q4_1) @KW / 2. Q4_0's integers are nibble - 8; Q4_1 adds m * sum(x_j),
    the sum an MMA of the block's activations against ones."""
    for g in tl.static_range(G):
        kg = k + 32 * g
        lo, hi = nibbles_to(_raw_bytes(w_row, kg // 2, 16), ADT, not MIN, NP)
        xl = _x_tile(x_row, kg, 16, ADT)
        xh = _x_tile(x_row, kg + 16, 16, ADT)
        p = mma(hi, xh, mma(lo, xl, tl.zeros(acc.shape, dtype=tl.float32)))
        if MIN:
            dm = tl.load((w_row + KW // 2 + 4 * (kg // 32)).to(tl.pointer_type(tl.int32)))
            acc = scaled_add(acc, p, _f16_bits(dm)[:, None])
            one = tl.full(lo.shape, 1.0, ADT)
            sx = mma(one, xh, mma(one, xl, tl.zeros(acc.shape, dtype=tl.float32)))
            acc = scaled_add(acc, sx, _f16_bits(dm >> 16)[:, None])
        else:
            d = tl.load((w_row + KW // 2 + 2 * (kg // 32)).to(tl.pointer_type(tl.float16))).to(tl.float32)
            acc = scaled_add(acc, p, d[:, None])
    return acc


@triton.jit
def _q6_k_step(acc, w_row, x_row, k, ADT: tl.constexpr, KW: tl.constexpr, NP: tl.constexpr = 2):
    """acc + the Q6_K 256-block at column k. Planes: ql [KW / 2] @0, qh [KW / 4] @KW / 2, sc int8
    [KW / 16] @3 KW / 4, d fp16 [KW / 256] after. Element e of half hf of a block: low 4 bits in ql byte
    64 hf + e % 64 (nibble e // 64), high 2 in qh byte 32 hf + e % 32 (bits 2 (e // 32)): sub-block
    i = e // 16 of the half reads 16-byte ql run i % 4 and qh run i % 2, each loaded once per half."""
    blk = k // 256
    d = tl.load((w_row + (3 * KW // 4 + KW // 16) + blk * 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    scw = (w_row + 3 * KW // 4 + blk * 16).to(tl.pointer_type(tl.int32))
    for hf in tl.static_range(2):
        sw0 = tl.load(scw + 2 * hf)
        sw1 = tl.load(scw + 2 * hf + 1)
        ql0 = _raw_bytes(w_row, blk * 128 + 64 * hf, 16)
        ql1 = _raw_bytes(w_row, blk * 128 + 64 * hf + 16, 16)
        ql2 = _raw_bytes(w_row, blk * 128 + 64 * hf + 32, 16)
        ql3 = _raw_bytes(w_row, blk * 128 + 64 * hf + 48, 16)
        qh0 = _raw_bytes(w_row, KW // 2 + blk * 64 + 32 * hf, 16)
        qh1 = _raw_bytes(w_row, KW // 2 + blk * 64 + 32 * hf + 16, 16)
        for i in tl.static_range(8):
            lo = _pick(i % 4, ql0, ql1, ql2, ql3)
            hi = _pick(i % 2, qh0, qh1, qh0, qh1)
            sw = _pick(i // 4, sw0, sw1, sw0, sw1)
            sc = ((((sw >> (8 * (i % 4))) & 255) ^ 128) - 128).to(tl.float32)   # the int8 scale
            acc = _scaled_dot(acc, six_bit_to(lo, hi, i // 4, i // 2, ADT, NP),
                              _x_tile(x_row, k + 128 * hf + 16 * i, 16, ADT), d * sc)
    return acc


@triton.jit
def x_rows(x_ptr, rows, ok, stride):
    """Row pointers [BM] of x for a tile's ``rows`` (int [BM]); a row that is not ``ok`` (a tile's padding) gets
    the null pointer, which :func:`_x_cols` reads as zeros without a memory access. Why: padding rows pointed
    at a real row are loaded like real ones -- 16 rows of every program asking L2 for the same bytes made the
    Q4_0 / Q4_1 linear 3-5x slower at B = 1 than at B = 16 (bench/results/2026-12-05-h100-gguf-padding-rows.md).
    Rows must start 16-byte aligned (:func:`rows_aligned`): the null pointer hides the alignment the launcher's
    specialization proved, so the tile states it (else the activation loads go scalar)."""
    null = tl.zeros_like(rows).to(tl.int64).to(x_ptr.dtype)
    return tl.multiple_of(tl.where(ok, x_ptr + rows.to(tl.int64) * stride, null), 16)


def rows_16b_aligned(x: torch.Tensor) -> bool:
    """Does every row of ``x`` [B, K] start 16-byte aligned (what :func:`x_rows` promises the compiler)?"""
    return x.data_ptr() % 16 == 0 and (x.stride(0) * x.element_size()) % 16 == 0


def rows_aligned(x: torch.Tensor) -> torch.Tensor:
    """``x`` [B, K] (unit K stride), copied if its rows do not all start 16-byte aligned: what :func:`x_rows`
    promises the compiler (the 16-byte vector loads of an activation tile)."""
    return x if rows_16b_aligned(x) else x.clone(memory_format=torch.contiguous_format)


@triton.jit
def _x_cols(x_row, cols, ADT: tl.constexpr):
    """Activations [len(cols), BM] of columns ``cols`` (any order), rounded to ADT; zeros for a null row
    (:func:`x_rows`)."""
    ok = x_row.to(tl.int64) != 0
    return cast(tl.load(x_row[None, :] + cols[:, None], mask=ok[None, :], other=0.0).to(tl.float32), ADT)


@triton.jit
def _spread(v, RUN: tl.constexpr):
    """[BN, J] -> [BN, J * RUN]: column j repeated RUN times (a sub-block's scale along its columns)."""
    BN: tl.constexpr = v.shape[0]
    J: tl.constexpr = v.shape[1]
    return tl.reshape(tl.broadcast_to(v[:, :, None], (BN, J, RUN)), (BN, J * RUN))


@triton.jit
def _columns4(a0, a1, a2, a3):
    """[BN, 4] with columns a0, a1, a2, a3 ([BN] each)."""
    t = tl.join(tl.join(a0, a2), tl.join(a1, a3))   # [BN, 2, 2]: [n, i, j] = a_{2 i + j}
    return tl.reshape(t, (a0.shape[0], 4))


@triton.jit
def _fold_dot(acc, q, s, mn, xt):
    """Fold route: acc + (q * s - mn) . xt, the weight ``fma(q, s, -mn)`` rounded once to bf16 (one packed
    FMA per two weights), one MMA into acc. q [BN, SB] bf16 integers (exact), s / mn fp32 [BN, SB] (each
    rounded to bf16 first), xt [SB, BM] bf16."""
    return _fold_dot16(acc, q, cast(s, tl.bfloat16), cast(0.0 - mn, tl.bfloat16), xt)


@triton.jit
def _fold_dot16(acc, q, s16, nmn16, xt):
    """:func:`_fold_dot` with the scales already rounded: s16 = bf16(s), nmn16 = bf16(-mn), bf16 [BN, SB]."""
    return mma(fma_bf16(q, s16, nmn16), xt, acc)


@triton.jit
def _q8_0_fold(acc, w_row, x_row, k, G: tl.constexpr, KW: tl.constexpr):
    """Fold route, Q8_0: the G blocks of columns k .. k + 32 G in one MMA."""
    dp = (w_row + KW + 2 * (k // 32)).to(tl.pointer_type(tl.float16))
    d = _spread(tl.load(dp[:, None] + tl.arange(0, G)[None, :]).to(tl.float32), 32)
    q = int8_to(_raw_bytes(w_row, k, 32 * G), tl.bfloat16)
    return _fold_dot(acc, q, d, tl.zeros_like(d), _x_tile(x_row, k, 32 * G, tl.bfloat16))


@triton.jit
def _q4_x_fold(acc, w_row, x_row, k, G: tl.constexpr, KW: tl.constexpr, MIN: tl.constexpr, NP: tl.constexpr):
    """Fold route, Q4_0 / Q4_1 (MIN): the G blocks of columns k .. k + 32 G in two MMAs, the low nibbles (column
    32 g + l of block g) and the high ones (32 g + 16 + l); weights ``q * bf16(d)`` (Q4_0, q = nibble - 8) or
    ``q * bf16(d) + bf16(m)`` (Q4_1), each scale spread along its 16 columns of a tile."""
    lo, hi = nibbles_to(_raw_bytes(w_row, k // 2, 16 * G), tl.bfloat16, not MIN, NP)
    j = tl.arange(0, 16 * G)
    cols = k + (j // 16) * 32 + j % 16
    blk = k // 32 + tl.arange(0, G)
    if MIN:
        dm = tl.load((w_row + KW // 2).to(tl.pointer_type(tl.int32))[:, None] + blk[None, :])
        d16 = _spread(cast(_f16_bits(dm), tl.bfloat16), 16)
        m16 = _spread(cast(_f16_bits(dm >> 16), tl.bfloat16), 16)
    else:
        d = tl.load((w_row + KW // 2).to(tl.pointer_type(tl.float16))[:, None] + blk[None, :]).to(tl.float32)
        d16 = _spread(cast(d, tl.bfloat16), 16)
        m16 = tl.zeros_like(d16)
    acc = _fold_dot16(acc, lo, d16, m16, _x_cols(x_row, cols, tl.bfloat16))
    return _fold_dot16(acc, hi, d16, m16, _x_cols(x_row, cols + 16, tl.bfloat16))


@triton.jit
def _q4_k_fold(acc, w_row, x_row, k, KW: tl.constexpr, NP: tl.constexpr):
    """Fold route, Q4_K: the 256-block at k in two MMAs (low nibbles: sub-blocks 0, 2, 4, 6; high nibbles:
    1, 3, 5, 7; each over its 128 columns)."""
    d, dmin, w1, w2, w3 = _k_header(w_row, KW // 2 + (k // 256) * 16)
    d = d[:, None]
    dmin = dmin[:, None]
    s0, m0 = _q4k_scale_min(w1, w2, w3, 0)
    s1, m1 = _q4k_scale_min(w1, w2, w3, 1)
    s2, m2 = _q4k_scale_min(w1, w2, w3, 2)
    s3, m3 = _q4k_scale_min(w1, w2, w3, 3)
    s4, m4 = _q4k_scale_min(w1, w2, w3, 4)
    s5, m5 = _q4k_scale_min(w1, w2, w3, 5)
    s6, m6 = _q4k_scale_min(w1, w2, w3, 6)
    s7, m7 = _q4k_scale_min(w1, w2, w3, 7)
    lo, hi = nibbles_to(_raw_bytes(w_row, k // 2, 128), tl.bfloat16, False, NP)
    j = tl.arange(0, 128)
    cols = k + (j // 32) * 64 + j % 32      # byte 32 c + l: low nibble column 64 c + l, high 64 c + 32 + l
    acc = _fold_dot(acc, lo, _spread(_columns4(s0, s2, s4, s6).to(tl.float32) * d, 32),
                    _spread(_columns4(m0, m2, m4, m6).to(tl.float32) * dmin, 32), _x_cols(x_row, cols, tl.bfloat16))
    return _fold_dot(acc, hi, _spread(_columns4(s1, s3, s5, s7).to(tl.float32) * d, 32),
                     _spread(_columns4(m1, m3, m5, m7).to(tl.float32) * dmin, 32),
                     _x_cols(x_row, cols + 32, tl.bfloat16))


@triton.jit
def _plane4(p, i: tl.constexpr):
    """bf16 [BN, 4]: entries 4 i .. 4 i + 3 of each row's 16 (p [BN] bf16 pointers; one 8-byte load a row)."""
    return tl.load(p[:, None] + (4 * i + tl.arange(0, 4))[None, :])


@triton.jit
def _q4_k_fold_plane(acc, w_row, x_row, k, KW: tl.constexpr, NP: tl.constexpr):
    """Fold route, Q4_K rows with a scale plane (:func:`ds4t.kernels.quant_blocks.make_scale_plane`, after
    the repacked row at byte KW / 2 + KW / 16, 32 bytes a block): :func:`_q4_k_fold`'s two MMAs on the same
    bf16 scales and negated mins, loaded instead of decoded from the header (the same weights; the same bits
    but at mma.sync tiles, :mod:`ds4t.kernels.quant_blocks`)."""
    p = (w_row + (KW // 2 + KW // 16) + (k // 256) * 32).to(tl.pointer_type(tl.bfloat16))
    lo, hi = nibbles_to(_raw_bytes(w_row, k // 2, 128), tl.bfloat16, False, NP)
    j = tl.arange(0, 128)
    cols = k + (j // 32) * 64 + j % 32      # byte 32 c + l: low nibble column 64 c + l, high 64 c + 32 + l
    acc = _fold_dot16(acc, lo, _spread(_plane4(p, 0), 32), _spread(_plane4(p, 2), 32),
                      _x_cols(x_row, cols, tl.bfloat16))
    return _fold_dot16(acc, hi, _spread(_plane4(p, 1), 32), _spread(_plane4(p, 3), 32),
                       _x_cols(x_row, cols + 32, tl.bfloat16))


@triton.jit
def _q5_k_fold(acc, w_row, x_row, k, KW: tl.constexpr, PLANE: tl.constexpr):
    """Fold route, Q5_K: the 256-block at k in eight MMAs of 32 columns, sub-block 2c + h (h: nibble) of qs run
    c with fifth bit 2c + h of the block's 32 qh bytes, a bit position fixed in each MMA (two MMAs of 128
    columns, as Q4_K's, must shift each qh byte by its run: 964 against 742 instructions a step with the scale
    plane at K = 7168, sm_90 SASS). The scales ``bf16(d sc)`` and ``-bf16(dmin m)`` decoded from the header or (PLANE) loaded from
    the scale plane (:func:`ds4t.kernels.quant_blocks.make_scale_plane`, after the repacked row): the same
    values, so the same bits."""
    hdr_at: tl.constexpr = _k_header_at(KW, True)
    qh = _raw_bytes(w_row, KW // 2 + (k // 256) * 32, 32)
    if PLANE:
        p = (w_row + (hdr_at + KW // 16) + (k // 256) * 32).to(tl.pointer_type(tl.bfloat16))
    else:
        d, dmin, w1, w2, w3 = _k_header(w_row, hdr_at + (k // 256) * 16)
    for c in tl.static_range(4):
        lo, hi = five_bits_to(_raw_bytes(w_row, k // 2 + 32 * c, 32), qh, 2 * c, tl.bfloat16)
        for h in tl.static_range(2):
            q = lo if h == 0 else hi
            if PLANE:   # PLANE_ORDER: the low nibbles' sub-blocks (run c at c), then the high ones'
                s16 = tl.load(p + 4 * h + c)
                nmn16 = tl.load(p + 8 + 4 * h + c)
            else:
                sc, m = _q4k_scale_min(w1, w2, w3, 2 * c + h)
                s16 = cast(sc.to(tl.float32) * d, tl.bfloat16)
                nmn16 = cast(0.0 - m.to(tl.float32) * dmin, tl.bfloat16)
            acc = _fold_dot16(acc, q, tl.broadcast_to(s16[:, None], q.shape), tl.broadcast_to(nmn16[:, None], q.shape),
                              _x_tile(x_row, k + 64 * c + 32 * h, 32, tl.bfloat16))
    return acc


@triton.jit
def _q6_k_fold(acc, w_row, x_row, k, KW: tl.constexpr, NP: tl.constexpr = 2):
    """Fold route, Q6_K: the 256-block at k in eight MMAs of 32 columns (two 16-column sub-blocks each).
    Half hf, quarter t: ql bytes 64 hf + 32 (t % 2) .. + 32, nibble t // 2; qh bytes 32 hf .. + 32, bit
    pair t; columns 128 hf + 32 t .. + 32; sub-blocks 8 hf + 2 t, + 1."""
    blk = k // 256
    d = tl.load((w_row + (3 * KW // 4 + KW // 16) + blk * 2).to(tl.pointer_type(tl.float16))).to(tl.float32)
    scp = (w_row + 3 * KW // 4 + blk * 16).to(tl.pointer_type(tl.int8))
    for hf in tl.static_range(2):
        qh = _raw_bytes(w_row, KW // 2 + blk * 64 + 32 * hf, 32)
        qa = _raw_bytes(w_row, blk * 128 + 64 * hf, 32)
        qb = _raw_bytes(w_row, blk * 128 + 64 * hf + 32, 32)
        for t in tl.static_range(4):
            ql = qa if t % 2 == 0 else qb
            sc = tl.load(scp[:, None] + (8 * hf + 2 * t + tl.arange(0, 2))[None, :]).to(tl.float32)
            s = _spread(sc * d[:, None], 16)
            acc = _fold_dot(acc, six_bit_to(ql, qh, t // 2, t, tl.bfloat16, NP), s, tl.zeros_like(s),
                            _x_tile(x_row, k + 128 * hf + 32 * t, 32, tl.bfloat16))
    return acc


@triton.jit
def _q_step(acc, w_row, x_row, k, FMT: tl.constexpr, ADT: tl.constexpr, G: tl.constexpr, KW: tl.constexpr,
            FOLD: tl.constexpr = False, NP: tl.constexpr = 2):
    """One K-loop step of :func:`qdot` for format FMT (0 Q8_0, 6 Q4_0, 7 Q4_1: G blocks of 32; 1 Q4_K, 2 Q6_K,
    4 Q5_K: one 256-block; 3 Q4_K and 5 Q5_K read through their scale plane, fold route only), by the exact or
    (FOLD) the fold route."""
    QH: tl.constexpr = FMT == 4 or FMT == 5
    if FOLD:
        if FMT == 0:
            acc = _q8_0_fold(acc, w_row, x_row, k, G, KW)
        elif FMT == 6 or FMT == 7:
            acc = _q4_x_fold(acc, w_row, x_row, k, G, KW, FMT == 7, NP)
        elif FMT == 1:
            acc = _q4_k_fold(acc, w_row, x_row, k, KW, NP)
        elif FMT == 3:
            acc = _q4_k_fold_plane(acc, w_row, x_row, k, KW, NP)
        elif FMT == 4 or FMT == 5:
            acc = _q5_k_fold(acc, w_row, x_row, k, KW, FMT == 5)
        else:
            acc = _q6_k_fold(acc, w_row, x_row, k, KW, NP)
    elif FMT == 0:
        acc = _q8_0_step(acc, w_row, x_row, k, ADT, G, KW)
    elif FMT == 6 or FMT == 7:
        acc = _q4_x_step(acc, w_row, x_row, k, ADT, G, KW, FMT == 7, NP)
    elif FMT == 1 or FMT == 4:
        acc = _q4_k_step(acc, w_row, x_row, k, ADT, KW, QH)
    else:
        acc = _q6_k_step(acc, w_row, x_row, k, ADT, KW, NP)
    return acc


@triton.constexpr_function
def _loop_step(FMT, G):
    """Columns a K-loop step covers: G blocks of 32 (FMT 0 Q8_0, 6 Q4_0, 7 Q4_1), else one 256-block. A
    constexpr function: a jit function's result is a runtime value to Triton 3.6 (the GPU machines'), which refuses
    it as a loop step."""
    return 32 * G if FMT in (0, 6, 7) else 256


@triton.jit
def _prefetch_step(w_row, k, FMT: tl.constexpr, G: tl.constexpr):
    """L2 prefetch of the quant bytes (each format's first plane: the bulk of its bytes) the K step at k reads
    in rows w_row [BN]: a step's span of each row, its first and last line and every 128 bytes between."""
    SPAN: tl.constexpr = _loop_step(FMT, G) // (1 if FMT == 0 else 2)
    NL: tl.constexpr = 2 if SPAN <= 128 else (4 if SPAN <= 384 else 8)
    offs = tl.minimum(tl.arange(0, NL) * 128, SPAN - 1)
    prefetch_l2(w_row[:, None] + ((k if FMT == 0 else k // 2) + offs)[None, :])


@triton.jit
def qdot(acc, w_row, x_row, k_lo, k_hi, FMT: tl.constexpr, ADT: tl.constexpr, G: tl.constexpr,
         KW: tl.constexpr, FOLD: tl.constexpr = False, AHEAD: tl.constexpr = 0, NP: tl.constexpr = 2):
    """acc [BN, BM] fp32 + (x . w) over columns k_lo .. k_hi (multiples of the format's step, k_hi > k_lo).

    w_row [BN] uint8 pointers to each weight row's repacked row (rows in bounds, 16-byte aligned); KW the
    weight's K (where its planes start); x_row [BM] pointers to each activation row's column 0. FMT: 0
    Q8_0 (G blocks of 32 per loop step), 1 Q4_K, 2 Q6_K, 4 Q5_K (one 256-block per step; 3 / 5: Q4_K / Q5_K
    through the scale plane). Sub-blocks run in K
    order; see :mod:`ds4t.kernels.quant_blocks` for the arithmetic and the planes. The integers become
    ADT values through :func:`ds4t.backend.int8_to` / ``nibbles_to`` / ``five_bits_to`` / ``six_bit_to`` (packed bit tricks
    on the GPU, plain conversions in the interpreter: the same exact values). FOLD (ADT bf16 only): the
    fold route, one packed FMA a weight pair and one MMA a step (module docstring). AHEAD > 0: each step first
    asks L2 for the quant bytes of the step AHEAD steps later (:func:`_prefetch_step`; a hint: no register,
    no value changes). NP: quant bytes a nibble bit trick takes at once (:func:`nibble_pack`; the same
    values either way)."""
    STEP: tl.constexpr = _loop_step(FMT, G)
    for k in range(k_lo, k_hi, STEP):
        if AHEAD > 0:
            _prefetch_step(w_row, tl.minimum(k + AHEAD * STEP, k_hi - STEP), FMT, G)
        acc = _q_step(acc, w_row, x_row, k, FMT, ADT, G, KW, FOLD, NP)
    return acc


@triton.jit
def qdot_pair(acc, acc2, w_row, w2_row, x_row, k_lo, k_hi, FMT: tl.constexpr, ADT: tl.constexpr,
              G: tl.constexpr, KW: tl.constexpr, FOLD: tl.constexpr = False, AHEAD: tl.constexpr = 0,
              NP: tl.constexpr = 2):
    """(:func:`qdot` of w_row, :func:`qdot` of w2_row) in one loop: each K step of the one weight, then
    of the other, on the same activation tiles. Each accumulator sees exactly qdot's operations in qdot's
    order (the same bits); the two independent MMA / scale chains interleave (what the MoE gate / up
    kernel computes). AHEAD as in :func:`qdot`, for both weights."""
    STEP: tl.constexpr = _loop_step(FMT, G)
    for k in range(k_lo, k_hi, STEP):
        if AHEAD > 0:
            kp = tl.minimum(k + AHEAD * STEP, k_hi - STEP)
            _prefetch_step(w_row, kp, FMT, G)
            _prefetch_step(w2_row, kp, FMT, G)
        acc = _q_step(acc, w_row, x_row, k, FMT, ADT, G, KW, FOLD, NP)
        acc2 = _q_step(acc2, w2_row, x_row, k, FMT, ADT, G, KW, FOLD, NP)
    return acc, acc2


@triton.jit(do_not_specialize=["B"])
def _qlinear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    B, stride_xm, stride_wn, stride_ys, stride_ym,
    N: tl.constexpr, K: tl.constexpr, K_PER_SPLIT: tl.constexpr,
    FMT: tl.constexpr, ADT: tl.constexpr, G: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAIR: tl.constexpr = False, FOLD: tl.constexpr = False,
    AHEAD: tl.constexpr = 0, NP: tl.constexpr = 2,
):
    """One (row tile, N tile, K split) of y. Grid (cdiv(B, BLOCK_M), cdiv(N, BLOCK_N * (1 + PAIR)), SPLIT).
    Rows past B read zeros (no memory: :func:`x_rows`), weight rows past N load in-bounds rows (clamped); neither
    is stored. PAIR: the
    program owns two adjacent N tiles and steps through K on both at once (:func:`qdot_pair`: two
    independent MMA / scale chains on the same activation tiles; each tile's bits as alone)."""
    grid_dependency()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    x_row = x_rows(x_ptr, rm, rm < B, stride_xm)
    k_lo = pid_s * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    zero = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if PAIR:
        rn = 2 * pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rn2 = rn + BLOCK_N
        acc, acc2 = qdot_pair(zero, zero, _w_rows(w_ptr, rn, N, stride_wn), _w_rows(w_ptr, rn2, N, stride_wn),
                              x_row, k_lo, k_hi, FMT, ADT, G, K, FOLD, AHEAD, NP)
        _store_tile(acc2, b_ptr, y_ptr, pid_s, stride_ys, stride_ym, rm, rn2, B, N, HAS_BIAS)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = qdot(zero, _w_rows(w_ptr, rn, N, stride_wn), x_row, k_lo, k_hi, FMT, ADT, G, K, FOLD, AHEAD, NP)
    _store_tile(acc, b_ptr, y_ptr, pid_s, stride_ys, stride_ym, rm, rn, B, N, HAS_BIAS)


@triton.jit
def _w_rows(w_ptr, rn, N: tl.constexpr, stride_wn):
    """Row starts of weight rows rn, rows past N clamped to the last (loads stay in bounds; never stored)."""
    return w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn


@triton.jit
def _store_tile(acc, b_ptr, y_ptr, pid_s, stride_ys, stride_ym, rm, rn, B, N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """y[split pid_s][rm, rn] = acc^T (+ bias[rn]) for rows < B, weight rows < N."""
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + tl.minimum(rn, N - 1)).to(tl.float32)[:, None]
    y = y_ptr + pid_s * stride_ys + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
    tl.store(y, acc, mask=(rm < B)[None, :] & (rn < N)[:, None])


def nibble_pack(num_warps: int, rows: int) -> int:
    """Quant bytes a nibble or six-bit trick takes at once (:func:`ds4t.backend.nibbles_to`'s and ``six_bit_to``'s
    PACK) in a program of
    ``num_warps`` warps over ``rows`` weight rows: 2 at the tiles Triton gives Hopper's wgmma (warpgroups of 4
    warps, 64 rows each), whose operand layout hands a thread its bytes in pairs; else 4 (mma.sync tiles: four
    consecutive bytes in one register). A launch constant like the tile itself (never from B), and the same
    values either way (bits equal in the H200 / H100 A/Bs, bench/results/2026-12-05-h200-q4-nibbles.md)."""
    return 2 if num_warps % 4 == 0 and rows >= 16 * num_warps else 4


# ----------------------------------------------------------------------------------------------
# Config: a function of (K, N, type, activation dtype) only
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class QLinearConfig:
    block_n: int
    split: int          # K splits (1: none); splits fall on loop-step boundaries
    group: int = 1      # 32-element blocks (Q8_0, Q4_0, Q4_1) per K-loop step (must divide K / 32); 1 for the K-quants
    num_warps: int = 4
    num_stages: int = 3
    pair: bool = False  # a program owns two adjacent N tiles, interleaved (same bits)
    fold: bool = False  # bf16 activations: the fold route (module docstring); other dtypes: exact
    prefetch_l2: int = 0    # each step asks L2 for the quant bytes this many steps ahead (0: never; same bits)
    block_m: int = BLOCK_M  # activation rows a program's tile holds (a rows entry's, for long launches)
    min_rows: int = 0       # a ("rows",) entry applies to launches of at least this many rows

    def k_step(self, qtype: str) -> int:
        return 32 * self.group if qtype in BLOCKS_32 else 256

    def k_per_split(self, K: int, qtype: str) -> int:
        step = self.k_step(qtype)
        return triton.cdiv(triton.cdiv(K, self.split), step) * step


def _q8_group(K: int, cap: int) -> int:
    """32-element blocks per loop step: the largest power of two <= cap dividing K / 32."""
    g = cap
    while g > 1 and (K // 32) % g:
        g //= 2
    return g


ROWS_FIELDS = ("block_m", "min_rows", "num_stages")
"""The fields a ("rows",) entry may change (:func:`qlinear_launch_config`). Not the warps: on an H100 4-warp
64-row tiles over 2-warp decode entries (2048 x 12352 Q8_0 / Q4_K) gave other bits."""
ROWS_BLOCK_M = {"Q6_K": 64}
"""Activation rows a tile of the GPU rule's ("rows",) entries holds, by type (others: ROWS_BLOCK_M_DEFAULT).
A 1024-row launch on an H100 (bench/results/2026-12-06-h100-gguf-row-tiles.md; the decode entries' warps, the
same bits): 7168 x 36864 / 2048 x 12352, 16 -> 32 rows: Q8_0 -2 % / -19 %, Q4_K -25 % / -27 %; Q6_K 16 -> 64
rows -45 % / -34 % (32: -34 % / -31 %); 64-row Q8_0 / Q4_K tiles spill (Q8_0 3x slower at 7168 x 36864)."""
ROWS_BLOCK_M_DEFAULT = 32
ROWS_MIN_ROWS = 128
"""Launches of at least this many rows take the rows entry."""


def _gpu_rule(K: int, N: int, qtype: str, act_dtype=None, *rows) -> Optional[QLinearConfig]:
    """("rows",): the decode entry with the type's ROWS_BLOCK_M-row tiles from ROWS_MIN_ROWS rows.
    Decode: 64-row weight tiles; split K (by K alone) while the grid has fewer than ~2 programs per SM of an
    H200 (264) and each split keeps >= 8 loop steps. bf16 activations, every type but Q6_K: the fold route with
    the swept shapes' winners (8 Q8_0 blocks a step, 2 warps, 3 stages; Q4_K the same warps and stages, its
    nibbles four bytes a trick at those mma.sync tiles; untimed: Q4_0 / Q4_1 as Q8_0, Q5_K 4 warps, 1 stage, as
    Q4_K had before); otherwise the exact route, 4 blocks of 32 a step, 4 warps, 3 stages."""
    if rows:
        bm = ROWS_BLOCK_M.get(qtype, ROWS_BLOCK_M_DEFAULT)
        if bm <= BLOCK_M:
            return None
        dec = QLINEAR_CONFIGS.gpu_config(K, N, qtype, act_dtype)
        return dataclasses.replace(dec, block_m=bm, min_rows=ROWS_MIN_ROWS)
    fold = act_dtype == torch.bfloat16 and qtype in FOLD_TYPES
    group = _q8_group(K, 8 if fold else 4) if qtype in BLOCKS_32 else 1
    step = 32 * group if qtype in BLOCKS_32 else 256
    block_n = max(16, min(64, triton.next_power_of_2(N)))
    split = 1
    while triton.cdiv(N, block_n) * split < 264 and K // step >= 16 * split:
        split *= 2
    warps, stages = ((4, 1) if qtype == "Q5_K" else (2, 3)) if fold else (4, 3)
    return QLinearConfig(block_n=block_n, split=split, group=group, num_warps=warps, num_stages=stages, fold=fold)


def _interp_rule(K: int, N: int, qtype: str, act_dtype=None, *rows) -> Optional[QLinearConfig]:
    if rows:   # no rows entry in the interpreter (tests force them)
        return None
    # few, big programs (the interpreter pays per program and per op); mma materialises [BN, SB, 16];
    # the GPU's route, so a bf16 model computes the same arithmetic on either backend
    group = _q8_group(K, 8) if qtype in BLOCKS_32 else 1
    return QLinearConfig(block_n=max(16, min(256, triton.next_power_of_2(N))), split=1, group=group,
                         num_warps=4, num_stages=1, fold=act_dtype == torch.bfloat16 and qtype in FOLD_TYPES)


def folds(cfg, act_dtype: torch.dtype) -> bool:
    """Does a launch with ``cfg`` (a QLinearConfig or qmoe.QMoEConfig) take the fold route? Only with bf16
    activations: fp32 and fp16 always take the exact route."""
    return cfg.fold and act_dtype == torch.bfloat16


PLANE_FORMATS = {"Q4_K": 3, "Q5_K": 5}
"""The kernels' FMT of a type's rows read through their scale plane (fold route)."""


def kernel_format(weight: GGUFWeight, fold: bool) -> int:
    """The kernels' constexpr FMT for ``weight`` on the fold route or not: its format's code, or
    :data:`PLANE_FORMATS`' for a weight with a scale plane on the fold route (the exact route reads the
    header, whose fp32 scales the plane's bf16 ones cannot give back)."""
    return PLANE_FORMATS[weight.qtype] if fold and weight.scale_plane else block_format(weight.qtype).code


FOLD_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K")
"""Types whose rule takes the fold route for bf16 activations: faster on the H200 in every swept shape for
Q8_0 and Q4_K; Q6_K's fold was slower than its exact route (bench/results/2026-12-02-h200-gguf-fold.md).
Untimed: Q5_K (Q4_K's loop plus one 32-byte plane a block) follows Q4_K, Q4_0 / Q4_1 (Q8_0's blocks with
half the quant bytes) follow Q8_0."""

_GPU_TABLE = {
    # H200 sweeps (bench/results/2026-12-02-h200-gguf-fold.md; Q6_K: 2026-11-30-h200-gguf-round3.md): the
    # least summed time over B = 1, 4, 16 per (shape, type); 7168 x 36864 Q8_0 re-timed with the 8-instruction
    # int8 conversion (2026-12-04-h200-gguf-int8.md: paired 32-row tiles, 4 stages, 6 % less; the same bits)
    (7168, 36864, 'Q8_0', torch.bfloat16): QLinearConfig(block_n=32, split=2, group=8, num_warps=2, num_stages=4,
                                                         pair=True, fold=True),
    # Q4_K: 2-warp mma.sync tiles, nibbles four bytes a trick (2026-12-05-h200-q4-nibbles.md: 22 % / 10 % less
    # summed time than the 4-warp wgmma tiles before, 4-warp 1-stage 64-row tiles)
    (7168, 36864, 'Q4_K', torch.bfloat16): QLinearConfig(block_n=32, split=2, group=1, num_warps=2, num_stages=3, fold=True),
    (7168, 36864, 'Q6_K', torch.bfloat16): QLinearConfig(block_n=64, split=2, group=1, num_warps=4, num_stages=3),
    (2048, 151936, 'Q8_0', torch.bfloat16): QLinearConfig(block_n=64, split=1, group=8, num_warps=2, num_stages=3, fold=True),
    (2048, 151936, 'Q4_K', torch.bfloat16): QLinearConfig(block_n=64, split=1, group=1, num_warps=2, num_stages=3, fold=True),
    (2048, 151936, 'Q6_K', torch.bfloat16): QLinearConfig(block_n=64, split=1, group=1, num_warps=4, num_stages=3),
}

QLINEAR_CONFIGS: ConfigTable[QLinearConfig] = ConfigTable(
    "qlinear", gpu=_GPU_TABLE, gpu_rule=_gpu_rule, interp_rule=_interp_rule,
    source="bench/results/2026-12-02-h200-gguf-fold.md, 2026-11-30-h200-gguf-round3.md (python bench/bench_gguf.py "
           "--sweep), 2026-12-04-h200-gguf-int8.md, 2026-12-05-h200-q4-nibbles.md; other shapes: the rule (64-row "
           "tiles, split-K to ~264 programs, fold for bf16 but Q6_K; untimed: Q5_K at Q4_K's former 4 warps, Q4_0 / "
           "Q4_1 as Q8_0); rows entries: bench/results/2026-12-06-h100-gguf-row-tiles.md")
"""Keyed on (K, N, GGUF type, activation dtype), plus (K, N, type, activation dtype, "rows") entries for
launches of at least ``min_rows`` rows (prefill chunks), which may differ from the decode entry in ``block_m``
and launch fields alone (:data:`ROWS_FIELDS`, :func:`qlinear_launch_config`)."""


@functools.lru_cache(maxsize=None)
def qlinear_config(K: int, N: int, qtype: str, act_dtype: torch.dtype) -> QLinearConfig:
    """The decode entry of a weight [N, K] of ``qtype`` with ``act_dtype`` activations."""
    return QLINEAR_CONFIGS(K, N, qtype, act_dtype)


@functools.lru_cache(maxsize=None)
def _rows_config(K: int, N: int, qtype: str, act_dtype: torch.dtype) -> tuple:
    """(the rows entry or None, whether it differs from the decode entry in ROWS_FIELDS alone)."""
    cfg = qlinear_config(K, N, qtype, act_dtype)
    rows = QLINEAR_CONFIGS(K, N, qtype, act_dtype, "rows")
    return rows, rows is None or differs_only_in(rows, cfg, ROWS_FIELDS)


def qlinear_launch_config(K: int, N: int, qtype: str, act_dtype: torch.dtype, B: int) -> QLinearConfig:
    """The config of a B-row launch: the ("rows",) entry from its ``min_rows`` on, else the decode entry.
    Why a rows entry keeps the bits: it changes only how many activation rows a program's tile holds (and its
    pipeline depth, :data:`ROWS_FIELDS`); each row still meets the same weight tile in the same MMA steps, its
    sums in the same K order, so a prefill chunk's rows equal the same rows decoded -- on an H100 at every type
    and shape timed, and in the interpreter (tests/kernels/test_quant_blocks.py). ValueError if a rows entry
    changes another field."""
    rows, ok = _rows_config(K, N, qtype, act_dtype)
    if rows is None or B < rows.min_rows:
        return qlinear_config(K, N, qtype, act_dtype)
    if not ok:
        raise ValueError(f"qlinear {K}x{N} {qtype}: a rows entry may change {', '.join(ROWS_FIELDS)} only ({rows} vs "
                         f"{qlinear_config(K, N, qtype, act_dtype)})")
    return rows


QLINEAR_CONFIGS.caches += [qlinear_config, _rows_config]


# ----------------------------------------------------------------------------------------------
# Launcher (called by ds4t.kernels.linear.linear)
# ----------------------------------------------------------------------------------------------
def launch(x: torch.Tensor, weight: GGUFWeight, bias: Optional[torch.Tensor], out: torch.Tensor,
           act_dtype: torch.dtype, config: Optional[QLinearConfig] = None, defer_sum: bool = False):
    """fp32 ``out [B, N] = x @ W^T (+ bias)`` for checked arguments: x [B, K] with unit K stride, weight
    rows contiguous (repacked rows are multiples of 16 bytes, so every row starts as aligned as the
    weight), ``out`` fp32 [B, N] with unit column stride. ``config`` overrides the table
    (tests and benchmarks; it must not depend on B). ``defer_sum``: a split-K launch returns its
    :class:`ds4t.kernels.tensors.SplitPartials` instead of adding them."""
    from ds4t.kernels.linear import finish_splits

    x = rows_aligned(x)
    B, K = x.shape
    N = weight.shape[0]
    w = weight.data
    if w.stride(-1) != 1:
        w = w.contiguous()
    cfg = config or qlinear_launch_config(K, N, weight.qtype, act_dtype, B)
    kps = cfg.k_per_split(K, weight.qtype)
    if kps % cfg.k_step(weight.qtype) or (weight.qtype in BLOCKS_32 and (K // 32) % cfg.group):
        raise ValueError(f"qlinear: config {cfg} does not tile K={K} of {weight.qtype}")
    split = triton.cdiv(K, kps)
    if B == 0:
        return out
    fold = folds(cfg, act_dtype)
    has_bias = bias is not None
    b_arg = bias if has_bias else out
    consts = dict(N=N, K=K, K_PER_SPLIT=kps, FMT=kernel_format(weight, fold), ADT=tl_dtype(act_dtype), G=cfg.group,
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, PAIR=cfg.pair, FOLD=fold, AHEAD=cfg.prefetch_l2,
                  NP=nibble_pack(cfg.num_warps, cfg.block_n), **launch_kwargs(cfg))
    grid = (triton.cdiv(B, cfg.block_m), triton.cdiv(N, cfg.block_n * (2 if cfg.pair else 1)), split)
    if split == 1:
        _qlinear_kernel[grid](x, w, b_arg, out, B, x.stride(0), w.stride(0), 0, out.stride(0),
                              HAS_BIAS=has_bias, **consts, **LAUNCH)
        return out
    part = torch.empty((split, B, N), dtype=torch.float32, device=x.device)
    _qlinear_kernel[grid](x, w, b_arg, part, B, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
                          HAS_BIAS=False, **consts, **LAUNCH)
    return finish_splits(part, bias, out, defer_sum)
