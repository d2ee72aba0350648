"""Batch-invariant decode linear: ``y = round_to(w.dtype)(x) @ w^T (+ bias)`` with fp32 accumulation.

Shapes and dtypes
    x       [B, K]  fp32 / bf16 / fp16 (activations; rounded to the weight dtype inside the kernel)
    weight  [N, K]  fp32 / bf16 / fp16 (row-major, K contiguous, as stored by nn.Linear)
    bias    [N] or None, any float dtype, added in fp32
    returns [B, N]  fp32

Batch invariance (the rules: docs/kernel-conventions.md): every launch parameter -- BLOCK_N,
BLOCK_K, the split-K count, warps, stages and whether the product is computed as ``x @ w^T`` or
``(w @ x^T)^T`` -- comes from :func:`linear_config`, a function of ``(K, N, weight dtype, x dtype)``
only, never of B. Rows are
tiled in fixed tiles of ``BLOCK_M = 16``; more rows only add M tiles. One measured exception: a
launch of at least a :class:`RowTile`'s ``min_rows`` rows (a prefill chunk; 16-bit weights on the GPU)
runs that bigger tile with the decode config's split and K order, which on an H200 gives every row
the same bits (:data:`LINEAR_ROW_TILES`). With a split-K count S > 1
each of the S programs of an output tile writes its fp32 partial sum to a workspace and a second
kernel adds the S partials in the fixed order 0..S-1 (no atomics). So a row's bits never depend
on how many rows share the launch or where the row sits.

Rows per program: a program may own M_SUB (1, 2, 4) 16-row sub-tiles, each with its own 16-row
dot, so a row's arithmetic does not depend on which sub-tile it lands in (checked on an H200 for
B = 1..64). The table uses M_SUB = 1: on the H200, M_SUB = 2 is ~20% faster at B = 64 but 5-45%
slower at B <= 16 (bench/results/2026-11-29-h200-kernels.md).

GPU configs of the four decode weight shapes were swept on an H200 (bench/bench_kernels.py
--sweep; bench/results/2026-11-29-h200-kernels.md): 88-107% of the 4.1-4.2 TB/s copy bandwidth
for B <= 16 on the >= 100 MB weights, on par with or ahead of cuBLAS, bitwise batch-invariant
for B = 1..64. Other shapes use a heuristic that also reads only (K, N). Known gap: 16 < B < 128
runs one program per 16-row tile, each re-reading its weight tile (B = 64: ~40% of copy bandwidth;
cuBLAS ~85%); from 128 rows the row tile reaches 325-485 TFLOP/s (bench/mma_shapes.py).

On the GPU, BLOCK_K does not change a row's bits (tl.dot accumulates into one accumulator in K
order); the split-K count does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from ds4t.backend import (FP8_LAYOUT_BARRIER, INTERPRET, LAUNCH, TMA, cast, f16_rows, fp8_operand, fp8_pieces,
                          fp8_route, grid_dependency, mma, mma_fp8_pieces, mma_rows, mma_tf32_exact, round_in_f32,
                          scaled_add, split_sum, split_sum_bias, timer, tl_dtype, tma_aligned)
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import GPU, INTERP, CheckResult, register_check, register_op, rows_invariant, variant
from ds4t.kernels import qlinear
from ds4t.kernels.quant_blocks import GGUFWeight
from ds4t.kernels.tensors import SplitPartials
from ds4t.kernels.weights import FP8_DTYPE, FP8Weight, RowParts, Weight, activation_dtype, as_float, quantize

__all__ = ["linear", "linear_ref", "linear_heads", "linear_heads_ref", "linear_config", "LinearConfig", "BLOCK_M"]

BLOCK_M = 16
"""Rows per tile: a fixed constant (tl.dot needs M >= 16 on the GPU)."""


def _clamp_rows(op_name: str) -> bool:
    """The ``"interp"`` variant of linear / linear_heads (M_SUB = 1): rows past B read row B-1
    rather than a masked load (a masked load costs the interpreter about twice an unmasked one;
    those rows are never stored). The ``"gpu"`` variant keeps the masked load; the tests run both
    in the interpreter (:func:`ds4t.kernels.registry.use_variants`)."""
    return variant(op_name) == INTERP


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
@triton.jit
def _sub_tile_dot(x_ptrs, m_mask, k_ok, wt, acc,
                  W_DTYPE: tl.constexpr, SWAP: tl.constexpr, EVEN_K: tl.constexpr, ROW_MASK: tl.constexpr,
                  ROUTE: tl.constexpr = 0):
    """acc += one 16-row x sub-tile times the weight tile (x rounded to the weight dtype).

    ROW_MASK False: the rows are clamped in bounds already (x_ptrs), no mask needed for them.
    ROUTE (FP8 weights: :data:`ds4t.backend.FP8_ROUTES`; 0 otherwise) decides what x meets: 2 ("tf32"): wt
    is fp32, x rounded to W_DTYPE and held in fp32, TF32 MMA (exact products); 4 ("x2"): wt is the fp8
    tile, x rounded to W_DTYPE meets it as two fp8 pieces; 5 ("f16"): wt is fp16, x rounded to W_DTYPE
    meets it as row-scaled fp16; else x rounded to W_DTYPE, an MMA in that dtype."""
    if EVEN_K:
        if ROW_MASK:
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:
            xt = tl.load(x_ptrs)
    else:
        if ROW_MASK:
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & k_ok[None, :], other=0.0)
        else:
            xt = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
    # Round the activation to the weight dtype (nearest even), as a bf16 model would.
    if ROUTE == 4:
        x1, x2, inv = fp8_pieces(cast(xt.to(tl.float32), W_DTYPE))
        acc += mma_fp8_pieces(wt, x1, x2, inv, SWAP)
    elif ROUTE == 5:
        x16, inv = f16_rows(cast(xt.to(tl.float32), W_DTYPE))
        acc += mma_rows(wt, x16, inv, SWAP)
    elif ROUTE == 2:
        xt = round_in_f32(xt.to(tl.float32), W_DTYPE)
        if SWAP:
            acc = mma_tf32_exact(wt, tl.trans(xt), acc)
        else:
            acc = mma_tf32_exact(xt, wt, acc)
    else:
        xt = cast(xt.to(tl.float32), W_DTYPE)
        # mma: tensor cores on the GPU; in the interpreter a broadcast product summed over K (not
        # np.matmul, whose OpenBLAS row panels make a row's bits depend on its position in the tile).
        if SWAP:
            acc = mma(wt, tl.trans(xt), acc)
        else:
            acc = mma(xt, wt, acc)
    return acc


@triton.jit
def _tma_split_dot(x_desc, w_desc, m0, n0, k0, part, K_PER_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr):
    """part + x[m0 : m0 + BM, k0 : k0 + K_PER_SPLIT] @ w[n0 : n0 + BN, same columns]^T, loaded through tensor
    descriptors (zeros past either tensor's end, as the pointer path's masked loads give), one MMA a BLOCK_K step
    in K order: the pointer path's arithmetic on the same operands (x already in the weight dtype)."""
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        xt = x_desc.load([m0, k0 + kk])
        wt = w_desc.load([n0, k0 + kk])
        part = mma(xt, tl.trans(wt), part)
    return part


@triton.jit
def _load_w(ptrs, EVICT: tl.constexpr):
    """Weight tile load; EVICT (a cache hint, no effect on values): 0 none, 1 evict_first, 2 evict_last."""
    if EVICT == 1:
        w = tl.load(ptrs, eviction_policy="evict_first")
    elif EVICT == 2:
        w = tl.load(ptrs, eviction_policy="evict_last")
    else:
        w = tl.load(ptrs)
    return w


@triton.jit
def _load_w_step(ptrs, k_ok, EVEN_K: tl.constexpr, SWAP: tl.constexpr, EVICT: tl.constexpr):
    """One K step's weight tile: unmasked when EVEN_K (``k_ok`` None), else zero at the columns ``k_ok`` rules out
    ([BK] along the tile's K axis: its columns with SWAP, its rows without)."""
    if EVEN_K:
        w = _load_w(ptrs, EVICT)
    elif SWAP:
        w = _load_w_masked(ptrs, k_ok[None, :], EVICT)
    else:
        w = _load_w_masked(ptrs, k_ok[:, None], EVICT)
    return w


@triton.jit
def _ptr_split_dot(x_ptrs, w_ptrs, m_ok, rk, k0, part, K, K_PER_SPLIT: tl.constexpr, BLOCK_K: tl.constexpr,
                   W_DTYPE: tl.constexpr, EVEN_K: tl.constexpr, EVICT: tl.constexpr):
    """:func:`_tma_split_dot` through pointer loads (a row tile: x @ w^T, one 16-bit x tile, row mask ``m_ok``):
    ``x_ptrs`` / ``w_ptrs`` at the split's first column k0."""
    for kk in range(0, K_PER_SPLIT, BLOCK_K):
        k_ok = None
        if not EVEN_K:
            k_ok = (k0 + kk + rk) < K
        wt = _load_w_step(w_ptrs, k_ok, EVEN_K, False, EVICT)
        part = _sub_tile_dot(x_ptrs, m_ok, k_ok, wt, part, W_DTYPE, False, EVEN_K, True)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return part


@triton.jit
def _load_w_masked(ptrs, mask, EVICT: tl.constexpr):
    if EVICT == 1:
        w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    elif EVICT == 2:
        w = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_last")
    else:
        w = tl.load(ptrs, mask=mask, other=0.0)
    return w


@triton.jit
def _store_sub_tile(acc, b_ptr, y_ptr, rm, rn, B, stride_ym, N: tl.constexpr,
                    HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, EVEN_N: tl.constexpr, rows64=None):
    """rows64: optional [BLOCK_M, 1] int64 row indices to address y with (rows past B may be
    clamped: they are masked by rm < B). A 16-bit y (``linear_heads(out_dtype=)``) gets the fp32 result
    rounded to nearest even, as :func:`ds4t.backend.cast` rounds a linear's input; an fp32 y is stored
    as is (the cast is the identity: the same code)."""
    if SWAP:
        acc = tl.trans(acc)
    if HAS_BIAS:
        if EVEN_N:
            bias = tl.load(b_ptr + rn).to(tl.float32)
        else:
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        acc = acc + bias[None, :]
    if rows64 is None:
        y_ptrs = y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :]
    else:
        y_ptrs = y_ptr + rows64 * stride_ym + rn[None, :]
    acc = cast(acc, y_ptr.dtype.element_ty)
    if EVEN_N:
        tl.store(y_ptrs, acc, mask=(rm < B)[:, None])
    else:
        tl.store(y_ptrs, acc, mask=(rm < B)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["B"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    B, stride_xm, stride_wn, stride_ys, stride_ym,
    N: tl.constexpr, K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    W_DTYPE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWAP: tl.constexpr,
    EVEN_K: tl.constexpr,
    M_SUB: tl.constexpr,
    EVICT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    CLAMP_ROWS: tl.constexpr = False,
    HEADS: tl.constexpr = False, SX_H: tl.constexpr = 0, SW_H: tl.constexpr = 0, SY_H: tl.constexpr = 0,
    s_ptr=None, SCALE_BK: tl.constexpr = 0, KSTEP: tl.constexpr = 0, SS_H: tl.constexpr = 0,
    FP8_ROUTE: tl.constexpr = 0, SCALE_BLOCKS: tl.constexpr = 1,
    FUSED_SUM: tl.constexpr = False, out_ptr=None, stride_om=0, cnt_ptr=None,
    FOLD_SPLITS: tl.constexpr = 1, x_desc=None, w_desc=None, USE_TMA: tl.constexpr = False,
):
    """One (row block, N tile, K split) of y. Grid: (cdiv(B, M_SUB*BLOCK_M), cdiv(N, BLOCK_N), SPLIT).

    HEADS (:func:`linear_heads`, no split-K): grid axis 2 is the head g instead, and x, w, y start
    at g * SX_H, g * SW_H, g * SY_H elements: head g's tiles are exactly those of a lone
    ``linear(x[:, g], w[g])`` launch.

    A program owns M_SUB (1, 2 or 4; fixed per weight shape) sub-tiles of BLOCK_M = 16 rows and
    reads each weight tile once for all of them; every sub-tile has its own accumulator and its
    own 16-row dot, so a row's arithmetic is the same whichever sub-tile it lands in. The K loop
    always runs k = s*K_PER_SPLIT, +BLOCK_K, ... whatever B is. With SWAP the tile is computed as
    w_tile @ x_tile^T (the weight is the MMA's M operand); the per-element K order is fixed by
    the config either way. CLAMP_ROWS (interpreter, M_SUB = 1): rows past B read row B-1 instead
    of a masked load (cheaper there; those rows are never stored).

    FP8 (SCALE_BK > 0, :class:`ds4t.kernels.weights.FP8Weight`): w holds float8_e4m3fn, s_ptr its
    fp32 scales [N, KB] (KB = cdiv(K, SCALE_BK), contiguous; head g at g * SS_H). W_DTYPE is then
    the activation dtype: x is rounded to it and each fp8 tile converted to it (exact). The K loop
    runs over scale blocks of KSTEP = min(SCALE_BK, K rounded up to BLOCK_K) columns; each block's
    dot starts from zero, sums its BLOCK_K sub-tiles in K order in fp32, and is then added to the
    accumulator times that block's per-row scale: ``acc += scale[n, j] * dot_j``. Split-K splits
    on scale-block boundaries (K_PER_SPLIT is a multiple of KSTEP). SCALE_BLOCKS > 1: a loop step takes that
    many scale blocks, one after the other with the one-block step's operations (so the bits of one-block
    steps over the same splits); the pipeline then keeps more bytes of each weight row in flight.

    FUSED_SUM (split-K only; ``LinearConfig.fused_sum``): y holds the fp32 partials; the program that
    finishes a tile's last split (a ticket from an atomic counter per tile, ``cnt_ptr``) adds the
    tile's partials in split order 0..S-1, then the bias, into ``out`` -- the sums and order of
    :func:`_splitk_sum_kernel`, without its launch -- and resets the counter for the next launch.

    FOLD_SPLITS = S > 1 (a row tile's ``fold_splits``; 16-bit / fp32 weights, M_SUB 1, no SWAP, grid axis 2 of
    size 1, K_PER_SPLIT the config's): the program runs all S splits of its tile itself, each from zero over its
    K_PER_SPLIT columns, and adds them in split order into y -- the bits of the S programs and the split-K sum
    (:func:`ds4t.backend.split_sum`), without writing or reading the fp32 partials.

    USE_TMA (a row tile's ``tma``; 16-bit weights with x in their dtype, M_SUB 1, no SWAP): x and w tiles come
    through the tensor descriptors ``x_desc`` [B, K] (block BLOCK_M x BLOCK_K) and ``w_desc`` [N, K] (block
    BLOCK_N x BLOCK_K) instead of pointer loads: the same operands, the same MMA steps, so the same bits.
    With FP8 (a decode config's ``tma``, SWAP) only the fp8 weight tiles come through ``w_desc``; rows past N
    load zeros there instead of row N - 1, and with SWAP a weight row is its own MMA row, never stored.
    """
    grid_dependency()
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    SPLIT_K: tl.constexpr = K_PER_SPLIT < K and FOLD_SPLITS == 1   # a grid axis of splits
    EVEN_N: tl.constexpr = N % BLOCK_N == 0
    ONE_STEP: tl.constexpr = K_PER_SPLIT <= BLOCK_K

    rm0 = pid_m * (M_SUB * BLOCK_M) + tl.arange(0, BLOCK_M)
    if M_SUB >= 2:
        rm1 = rm0 + BLOCK_M
    if M_SUB >= 4:
        rm2 = rm0 + 2 * BLOCK_M
        rm3 = rm0 + 3 * BLOCK_M
    if N <= BLOCK_N:
        rn = tl.arange(0, BLOCK_N)
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range weight rows are clamped (loads stay in bounds and unmasked, so they vectorise);
    # their results are never stored.
    if EVEN_N:
        rn_ld = rn.to(tl.int64)
    else:
        rn_ld = tl.minimum(rn, N - 1).to(tl.int64)
    if HEADS:
        hid = tl.program_id(2).to(tl.int64)
        x_ptr += hid * SX_H
        w_ptr += hid * SW_H
        y_ptr += hid * SY_H
    if SPLIT_K:
        pid_s = tl.program_id(2)
        k0 = pid_s * K_PER_SPLIT
        rk0 = k0 + rk
    else:
        k0 = 0
        rk0 = rk

    if CLAMP_ROWS:
        rl = tl.minimum(rm0, B - 1).to(tl.int64)[:, None]
        x_ptrs = x_ptr + rl * stride_xm + rk0[None, :]
    else:
        rl = None
        x_ptrs = x_ptr + rm0.to(tl.int64)[:, None] * stride_xm + rk0[None, :]
    if M_SUB >= 2:
        x_step = BLOCK_M * stride_xm
    if SWAP:
        w_ptrs = w_ptr + rn_ld[:, None] * stride_wn + rk0[None, :]      # [BN, BK]
        acc0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        w_ptrs = w_ptr + rn_ld[None, :] * stride_wn + rk0[:, None]      # [BK, BN]
        acc0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0

    if SCALE_BK > 0:
        KB: tl.constexpr = (K + SCALE_BK - 1) // SCALE_BK
        if HEADS:
            s_ptr += hid * SS_H
        s_rows = s_ptr + rn_ld * KB                                        # [BN] row starts
        FOLD: tl.constexpr = FP8_ROUTE == 3
        for kb0 in range(0, K_PER_SPLIT, KSTEP * SCALE_BLOCKS):
            for sb in tl.static_range(SCALE_BLOCKS):
                kb = kb0 + sb * KSTEP
                j = (k0 + kb) // SCALE_BK
                if not EVEN_K:
                    j = tl.minimum(j, KB - 1)   # a ragged last split may run past K: its products are 0
                sc = tl.load(s_rows + j)
                if SWAP:
                    sc2 = sc[:, None]
                else:
                    sc2 = sc[None, :]
                if FOLD:   # the scaled weight meets the accumulator directly: one MMA chain over K
                    p0 = acc0
                    p1 = acc1
                    p2 = acc2
                    p3 = acc3
                else:
                    p0 = tl.zeros(acc0.shape, dtype=tl.float32)
                    p1 = p0
                    p2 = p0
                    p3 = p0
                for ks in tl.static_range(0, KSTEP, BLOCK_K):
                    k_ok = None
                    if not EVEN_K:
                        k_ok = (k0 + kb + ks + rk) < K
                    if USE_TMA:   # SWAP: the descriptor's [BLOCK_N, BLOCK_K] box is the tile (zeros past K)
                        wt = w_desc.load([pid_n * BLOCK_N, k0 + kb + ks])
                    else:
                        wt = _load_w_step(w_ptrs, k_ok, EVEN_K, SWAP, EVICT)
                    wt = fp8_operand(wt, sc2, W_DTYPE, FP8_ROUTE)   # exact but for "fold" (backend.FP8_ROUTES)
                    if CLAMP_ROWS:
                        p0 = _sub_tile_dot(x_ptrs, None, k_ok, wt, p0, W_DTYPE, SWAP, EVEN_K, False, FP8_ROUTE)
                    else:
                        p0 = _sub_tile_dot(x_ptrs, rm0 < B, k_ok, wt, p0, W_DTYPE, SWAP, EVEN_K, True, FP8_ROUTE)
                    if M_SUB >= 2:
                        p1 = _sub_tile_dot(x_ptrs + x_step, rm1 < B, k_ok, wt, p1, W_DTYPE, SWAP, EVEN_K, True,
                                           FP8_ROUTE)
                    if M_SUB >= 4:
                        p2 = _sub_tile_dot(x_ptrs + 2 * x_step, rm2 < B, k_ok, wt, p2, W_DTYPE, SWAP, EVEN_K, True,
                                           FP8_ROUTE)
                        p3 = _sub_tile_dot(x_ptrs + 3 * x_step, rm3 < B, k_ok, wt, p3, W_DTYPE, SWAP, EVEN_K, True,
                                           FP8_ROUTE)
                    x_ptrs += BLOCK_K
                    w_ptrs += BLOCK_K
                if FOLD:
                    acc0 = p0
                    acc1 = p1
                    acc2 = p2
                    acc3 = p3
                else:
                    acc0 = scaled_add(acc0, p0, sc2)
                    if M_SUB >= 2:
                        acc1 = scaled_add(acc1, p1, sc2)
                    if M_SUB >= 4:
                        acc2 = scaled_add(acc2, p2, sc2)
                        acc3 = scaled_add(acc3, p3, sc2)
    elif FOLD_SPLITS > 1:
        # The S splits one after another in this program, each summed from zero in K order as its own
        # program would, then added left to right: split_sum's ((p0 + p1) + p2) + ..., no partials stored.
        # The sum starts at -0.0, the identity of IEEE addition (-0.0 + p0 is p0 bit for bit, -0.0 included),
        # so the splits run as a loop rather than unrolled (an unrolled loop of pipelined loops spills).
        acc0 = tl.full(acc0.shape, -0.0, tl.float32)
        for ks0 in range(0, FOLD_SPLITS * K_PER_SPLIT, K_PER_SPLIT):
            part = tl.zeros(acc0.shape, dtype=tl.float32)
            if USE_TMA:
                part = _tma_split_dot(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, ks0, part, K_PER_SPLIT,
                                      BLOCK_K)
            else:
                part = _ptr_split_dot(x_ptrs + ks0, w_ptrs + ks0, rm0 < B, rk, ks0, part, K, K_PER_SPLIT, BLOCK_K,
                                      W_DTYPE, EVEN_K, EVICT)
            acc0 = acc0 + part
    elif USE_TMA:
        acc0 = _tma_split_dot(x_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, k0, acc0, K_PER_SPLIT, BLOCK_K)
    else:
        for kk in range(0, K_PER_SPLIT, BLOCK_K):
            k_ok = None
            if not EVEN_K:
                k_ok = (k0 + kk + rk) < K
            wt = _load_w_step(w_ptrs, k_ok, EVEN_K, SWAP, EVICT)
            if CLAMP_ROWS:
                acc0 = _sub_tile_dot(x_ptrs, None, k_ok, wt, acc0, W_DTYPE, SWAP, EVEN_K, False)
            else:
                acc0 = _sub_tile_dot(x_ptrs, rm0 < B, k_ok, wt, acc0, W_DTYPE, SWAP, EVEN_K, True)
            if M_SUB >= 2:
                acc1 = _sub_tile_dot(x_ptrs + x_step, rm1 < B, k_ok, wt, acc1, W_DTYPE, SWAP, EVEN_K, True)
            if M_SUB >= 4:
                acc2 = _sub_tile_dot(x_ptrs + 2 * x_step, rm2 < B, k_ok, wt, acc2, W_DTYPE, SWAP, EVEN_K, True)
                acc3 = _sub_tile_dot(x_ptrs + 3 * x_step, rm3 < B, k_ok, wt, acc3, W_DTYPE, SWAP, EVEN_K, True)
            if not ONE_STEP:
                x_ptrs += BLOCK_K
                w_ptrs += BLOCK_K

    PART_BIAS: tl.constexpr = HAS_BIAS and not FUSED_SUM   # fused: the bias is added to the sum
    part_ptr = y_ptr
    if SPLIT_K:
        y_ptr += pid_s * stride_ys
    _store_sub_tile(acc0, b_ptr, y_ptr, rm0, rn, B, stride_ym, N, PART_BIAS, SWAP, EVEN_N, rl)
    if M_SUB >= 2:
        _store_sub_tile(acc1, b_ptr, y_ptr, rm1, rn, B, stride_ym, N, PART_BIAS, SWAP, EVEN_N)
    if M_SUB >= 4:
        _store_sub_tile(acc2, b_ptr, y_ptr, rm2, rn, B, stride_ym, N, PART_BIAS, SWAP, EVEN_N)
        _store_sub_tile(acc3, b_ptr, y_ptr, rm3, rn, B, stride_ym, N, PART_BIAS, SWAP, EVEN_N)
    if FUSED_SUM:
        SPLIT: tl.constexpr = (K + K_PER_SPLIT - 1) // K_PER_SPLIT
        tl.debug_barrier()   # every thread's partial stores precede the ticket (released with it)
        tile = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.debug_barrier()
            _sum_splits(part_ptr, stride_ys, stride_ym, b_ptr, out_ptr, stride_om, rm0, rn, B, N, SPLIT,
                        HAS_BIAS, EVEN_N)
            if M_SUB >= 2:
                _sum_splits(part_ptr, stride_ys, stride_ym, b_ptr, out_ptr, stride_om, rm1, rn, B, N, SPLIT,
                            HAS_BIAS, EVEN_N)
            if M_SUB >= 4:
                _sum_splits(part_ptr, stride_ys, stride_ym, b_ptr, out_ptr, stride_om, rm2, rn, B, N, SPLIT,
                            HAS_BIAS, EVEN_N)
                _sum_splits(part_ptr, stride_ys, stride_ym, b_ptr, out_ptr, stride_om, rm3, rn, B, N, SPLIT,
                            HAS_BIAS, EVEN_N)
            tl.atomic_xchg(tile, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits(p_ptr, stride_ps, stride_pm, b_ptr, y_ptr, stride_ym, rm, rn, B, N: tl.constexpr,
                SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_N: tl.constexpr):
    """y[rm, rn] = ((p[0] + p[1]) + p[2]) + ... (+ bias): :func:`_splitk_sum_kernel`'s sum of one
    [BLOCK_M, BLOCK_N] tile, stored as :func:`_store_sub_tile` stores a tile. The partials come from other
    programs: loaded past L1 (``.cg``)."""
    if EVEN_N:
        m = (rm < B)[:, None]
    else:
        m = (rm < B)[:, None] & (rn < N)[None, :]
    acc = split_sum(p_ptr + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :], m, stride_ps, SPLIT, True)
    _store_sub_tile(acc, b_ptr, y_ptr, rm, rn, B, stride_ym, N, HAS_BIAS, False, EVEN_N)


@triton.jit
def _splitk_sum_kernel(p_ptr, b_ptr, y_ptr, total, stride_ps, stride_ym,
                       N: tl.constexpr, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y[i] = ((p[0,i] + p[1,i]) + p[2,i]) + ... (+ bias): the split partials in a fixed order.
    p is contiguous [SPLIT, B, N]; y [B, N] may have any row stride (e.g. a column slice)."""
    grid_dependency()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = split_sum_bias(p_ptr + offs, mask, stride_ps, SPLIT, b_ptr + offs % N, HAS_BIAS)
    tl.store(y_ptr + (offs // N).to(tl.int64) * stride_ym + offs % N, acc, mask=mask)


# ----------------------------------------------------------------------------------------------
# Config: a function of the weight shape and dtypes only
# ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LinearConfig:
    block_n: int
    block_k: int
    split: int          # number of K splits (1: no split-K)
    num_warps: int = 4
    num_stages: int = 4
    swap: bool = False  # compute (w @ x^T)^T
    m_sub: int = 1      # most 16-row sub-tiles a program takes (1, 2, 4): one weight-tile read (launch_m_sub)
    evict: int = 1      # weight-load cache hint: 0 none, 1 evict_first, 2 evict_last (values unaffected)
    fused_sum: bool = False  # split-K: the tile's last split sums the partials (same bits; 2-25 % slower on the H200)
    fp8_route: str = "direct"  # FP8 weights: how fp8 tiles become MMA operands (ds4t.backend.FP8_ROUTES)
    scale_blocks: int = 1   # FP8: scale blocks a K-loop step takes in turn (the one-block steps' operations)
    tma: bool = False       # weight tiles through a tensor descriptor (the same values, the same bits): FP8 with
                            # swap; 16-bit launches of one sub-tile without swap (x tiles too, when x has w's dtype)

    def k_step(self, K: int, scale_bk: int = 0) -> int:
        """Columns per K-loop step: BLOCK_K, or for FP8 one scale block (min(scale_bk, K rounded up
        to BLOCK_K)), which BLOCK_K must divide."""
        if not scale_bk:
            return self.block_k
        if scale_bk % self.block_k:
            raise ValueError(f"linear: BLOCK_K={self.block_k} must divide the FP8 weight's block_k={scale_bk} "
                             "(a K tile may not span two scale blocks)")
        return min(scale_bk, triton.cdiv(K, self.block_k) * self.block_k)

    def k_per_split(self, K: int, scale_bk: int = 0) -> int:
        """K columns per split: a multiple of :meth:`k_step` (FP8: splits on scale-block boundaries, whole
        loop steps of ``scale_blocks`` blocks)."""
        if scale_bk and (not isinstance(self.scale_blocks, int) or self.scale_blocks < 1):
            raise ValueError(f"linear: scale_blocks must be a positive int, got {self.scale_blocks!r}")
        step = self.k_step(K, scale_bk) * (self.scale_blocks if scale_bk else 1)
        return triton.cdiv(triton.cdiv(K, self.split), step) * step

    def programs_per_m_tile(self, K: int, N: int, scale_bk: int = 0) -> int:
        return triton.cdiv(N, self.block_n) * triton.cdiv(K, self.k_per_split(K, scale_bk))


# Measured on one H200 (bf16 weights, fp32 x), keyed on (K, N, weight dtype): the best of ~50
# configs per shape swept by bench/bench_kernels.py --sweep (time at B=1, then max(B=1, B=16) among
# the 4 fastest). See bench/results/2026-11-29-h200-kernels.md. Copy bandwidth 4.18 TB/s.
#   K x N          B=1 TB/s  B=16 TB/s   (cuBLAS bf16 B=1 / B=16)
#   4096 x 14336     3.85      3.83       3.87 / 3.91
#   14336 x 4096     3.82      3.68       3.75 / 3.67
#   2048 x 12288     3.48      3.31       3.34 / 3.27
#   2048 x 151936    4.45      4.27       4.29 / 4.20
_GPU_TABLE: dict = {
    (4096, 14336, torch.bfloat16): LinearConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=3, swap=True),
    (14336, 4096, torch.bfloat16): LinearConfig(block_n=128, block_k=128, split=4, num_warps=4, num_stages=4, swap=True),
    (2048, 12288, torch.bfloat16): LinearConfig(block_n=32, block_k=128, split=1, num_warps=4, num_stages=4, swap=True),
    (2048, 151936, torch.bfloat16): LinearConfig(block_n=64, block_k=128, split=1, num_warps=4, num_stages=3, swap=True),
}
# FP8 weights (128-column scale blocks, bf16 activations, x fp32), keyed on (K, N, float8_e4m3fn,
# block_k, activation dtype): the best of 48-168 configs per shape (bench/bench_kernels.py --fp8
# --sweep, four rounds; bench/results/2026-11-30-h200-fp8-round2.md). Copy bandwidth ~4.2 TB/s;
# bytes = fp8 + scales. What won: the "f32" route (ds4t.backend.FP8_ROUTES), 2 warps, 32-64-row tiles.
#   K x N          B=1 TB/s  B=16 TB/s   (cuBLAS on the dequantized bf16 weight, B=1 / B=16)
#   7168 x 18432     2.83      2.90       3.72 / 3.72
#   18432 x 7168     3.40      3.30       3.93 / 3.79   (x in bf16, as swiglu stores the down input: a
#                    bf16-x sweep, bench/results/2026-12-01-h200-fp8-options.md, call 5; the entry before it
#                    3.17 / 3.01 in that sweep; cuBLAS from call 1 of the same session)
#   16384 x 7168     3.38      3.29       3.76 / 3.51   (x in bf16, as DeepSeek's MLA stores o_proj's input: a
#                    bf16-x sweep, bench/results/2026-12-01-h200-fp8-x2-32k.md; the entry before it 3.13 / 3.02
#                    in that run, chosen with fp32 x)
#   1536 x 24576     2.62      2.74       3.48 / 3.56
#   2048 x 12288     2.06      2.16       3.27 / 3.19
#   The three big entries then take two scale blocks a K step in two stages (the same splits and bits: the
#   one-block step's operations on each block), each shape's best same-bits cell on an H100 in two calls,
#   B = 1 / 16: 7168 x 18432 88.9 / 81.0 -> 90.7 / 85.9 %, 18432 x 7168 89.1 / 85.2 -> 88.9 / 86.4 %,
#   16384 x 7168 89.3 / 84.8 -> 88.9 / 85.5 % (bench/results/2026-12-06-h100-fp8-waves.md). Timed on an H200
#   (bench/results/2026-12-07-h200-fp8-table-80b-n1.md, bf16 x, the sweep's best cells B = 1 / 16): two blocks in two
#   stages stay the best of 7168 x 18432 (3.50 / 3.37 TB/s, 84 / 80 %), but lose to one block in three stages at
#   18432 x 7168 (3.30 / 3.21 against 3.47 / 3.36) and 16384 x 7168 (3.29 / 3.20 against 3.43 / 3.35), where the
#   H100 had them level within its spread: those two entries are one block a step again.
#   Every FP8 entry (and the rule) runs two 16-row sub-tiles a program once a launch has more than 16 rows
#   (m_sub 2: the weight tile converted once for both; each sub-tile its own dot, the same bits -- rows alone
#   == in the launch, checked): on an H100 (bench/results/2026-12-06-h100-gguf-row-tiles.md) 64 rows 8-21 %
#   faster at the six shapes timed (2048 x 12352 ... 18432 x 7168), 1024 rows 15-17 % (4 sub-tiles: 15-24 % at
#   1024 rows but slower than 2 at 64), Qwen3-Next-4l's 4k prompt in FP8 -2.9 %. B <= 16 launches are unchanged.
_FP8_BF16 = (torch.float8_e4m3fn, 128, torch.bfloat16)
_GPU_TABLE.update({
    (7168, 18432, *_FP8_BF16): LinearConfig(block_n=32, block_k=128, split=2, num_warps=2, num_stages=2, swap=True,
                                            fp8_route="f32", scale_blocks=2, m_sub=2),
    (18432, 7168, *_FP8_BF16): LinearConfig(block_n=32, block_k=128, split=4, num_warps=2, num_stages=3, swap=True,
                                            fp8_route="f32", m_sub=2),
    (16384, 7168, *_FP8_BF16): LinearConfig(block_n=32, block_k=128, split=4, num_warps=2, num_stages=3, swap=True,
                                            fp8_route="f32", m_sub=2),
    (1536, 24576, *_FP8_BF16): LinearConfig(block_n=32, block_k=128, split=1, num_warps=2, num_stages=3, swap=True,
                                            fp8_route="f32", m_sub=2),
    (2048, 12288, *_FP8_BF16): LinearConfig(block_n=64, block_k=64, split=2, num_warps=2, num_stages=3, swap=True,
                                            fp8_route="f32", m_sub=2),
})


ROUTER_SIZED = (1024, 8 << 20)
"""(K at least, bytes at most) of a latency-bound weight at decode, a router: a few programs, each
with a long K loop, take many times the weight's bytes' worth (see :func:`_gpu_heuristic`). Per-head
weights (``linear_heads``: K of 128-512) and every weight above 8 MiB keep the bandwidth rule."""


def _latency_bound(K: int, N: int, wbytes: int) -> bool:
    """A router-sized weight (:data:`ROUTER_SIZED`): long rows, few of them."""
    return K >= ROUTER_SIZED[0] and K * N * wbytes <= ROUTER_SIZED[1]


def _gpu_heuristic(K: int, N: int, wbytes: int) -> LinearConfig:
    """What the sweep found for bf16 weights, generalised: 256-byte weight rows per tile
    (BLOCK_K = 128 bf16), swapped operands, 64-row weight tiles, >= ~192 programs. Split K (by
    K alone) only while each split keeps >= 16 K blocks; if that is not enough, 32-row tiles.

    A router-sized weight (:func:`_latency_bound`) narrows its tiles to 16 rows and splits K down to
    4 blocks a split first: GLM-4.5's fp32 router (5120 x 160; an IEEE fp32 product, on the FMA units)
    took 49 us a step on 20 programs on the H200 (bench/results/2026-12-02-h200-n1-steps.md)."""
    block_k = max(16, min(256 // wbytes, triton.next_power_of_2(K)))
    block_n = max(16, min(64, triton.next_power_of_2(N)))
    k_blocks = triton.cdiv(K, block_k)
    latency = _latency_bound(K, N, wbytes)
    min_blocks, narrowest = (4, 16) if latency else (16, 32)
    while latency and triton.cdiv(N, block_n) < 192 and block_n > narrowest:
        block_n //= 2
    split = 1
    while triton.cdiv(N, block_n) * split < 192 and k_blocks >= 2 * min_blocks * split:
        split *= 2
    if triton.cdiv(N, block_n) * split < 192 and block_n > narrowest:
        block_n = narrowest
    cfg = LinearConfig(block_n=block_n, block_k=block_k, split=split, num_warps=4, num_stages=4, swap=True)
    if latency and wbytes == 4:
        # An fp32 router's IEEE product runs as FMA chains, each output summing its split's K in order whatever
        # the K tile, so a narrower tile keeps the bits while the split's columns stay the same. 16 columns a
        # step: DeepSeek-V3's 7168 x 256 router 19.3 -> 12.9 us, GLM-4.5's 5120 x 160 14.1 -> 9.5 us at one row
        # (the best of 55 same-split tiles, all bitwise the old; 16 rows the same), N = 1 steps 1.0-1.1 % faster
        # (an H100, bench/results/2026-12-07-h100-router-tiles.md; not timed on an H200).
        narrow = dataclasses.replace(cfg, block_k=16)
        if narrow.k_per_split(K) == cfg.k_per_split(K):
            return narrow
    return cfg


def _fp8_block_k(K: int, scale_bk: int, cap: int) -> int:
    """The largest power-of-two BLOCK_K <= min(cap, next_pow2(K)) that divides the scale block."""
    block_k = max(16, min(cap, triton.next_power_of_2(K)))
    while block_k > 16 and scale_bk % block_k:
        block_k //= 2
    if scale_bk % block_k:
        raise ValueError(f"linear: no BLOCK_K >= 16 divides the FP8 weight's block_k={scale_bk}")
    return block_k


def _gpu_fp8_heuristic(K: int, N: int, scale_bk: int) -> LinearConfig:
    """FP8 weights, shapes not in the table: what the sweep's winners share -- one scale block of
    columns per step (BLOCK_K 128), 32-row weight tiles, 2 warps, the "f32" conversion route, two row
    sub-tiles a program past 16 rows (m_sub 2, the table's note) -- and
    enough programs: split K (on scale-block boundaries, by K alone) while there are fewer than ~512
    programs and each split keeps >= 8 scale blocks."""
    block_k = _fp8_block_k(K, scale_bk, 128)
    block_n = max(16, min(32, triton.next_power_of_2(N)))
    k_blocks = triton.cdiv(K, max(block_k, scale_bk))
    split = 1
    while triton.cdiv(N, block_n) * split < 512 and k_blocks >= 16 * split:
        split *= 2
    return LinearConfig(block_n=block_n, block_k=block_k, split=split, num_warps=2, num_stages=3, swap=True,
                        fp8_route="f32", m_sub=2)


def _interpret_config(K: int, N: int, scale_bk: int = 0) -> LinearConfig:
    # Interpreter: few programs, big tiles (its cost is per program and per op, not per element).
    # (The interpreter's mma materialises the [BLOCK_M, BLOCK_K, BLOCK_N] product: keep it <= 4 MB.)
    block_k = max(16, min(128, triton.next_power_of_2(K))) if not scale_bk else _fp8_block_k(K, scale_bk, 128)
    block_n = max(16, min(512, triton.next_power_of_2(N)))
    return LinearConfig(block_n=block_n, block_k=block_k, split=1, num_warps=4, num_stages=1)


def _gpu_rule(K: int, N: int, w_dtype: torch.dtype, scale_bk: int = 0, act_dtype=None) -> LinearConfig:
    if w_dtype == FP8_DTYPE:
        return _gpu_fp8_heuristic(K, N, scale_bk)
    return _gpu_heuristic(K, N, torch.empty((), dtype=w_dtype).element_size())


LINEAR_CONFIGS: ConfigTable[LinearConfig] = ConfigTable(
    "linear", gpu=_GPU_TABLE, gpu_rule=_gpu_rule,
    interp_rule=lambda K, N, w_dtype, scale_bk=0, act_dtype=None: _interpret_config(K, N, scale_bk),
    source="bench/results/2026-11-29-h200-kernels.md (float weights), "
           "bench/results/2026-11-30-h200-fp8-round2.md (FP8 weights), "
           "bench/results/2026-12-01-h200-fp8-options.md (FP8 18432 x 7168 with bf16 x), "
           "bench/results/2026-12-01-h200-fp8-x2-32k.md (FP8 16384 x 7168 with bf16 x), "
           "bench/results/2026-12-06-h100-fp8-waves.md (two scale blocks a step, same bits; H100), "
           "bench/results/2026-12-06-h100-gguf-row-tiles.md (FP8 m_sub 2; H100), "
           "bench/results/2026-12-07-h100-router-tiles.md (fp32 routers' 16-column K steps, same bits; H100)")
"""Launch configs keyed on (K, N, weight dtype) for float weights and on (K, N, float8_e4m3fn,
block_k, activation dtype) for FP8 weights: the H200 sweep above, else the heuristics."""


@dataclasses.dataclass(frozen=True)
class RowTile:
    """The tile of a launch with many rows (a prefill chunk): ``block_m`` rows x ``block_n`` columns
    per program, ``block_k`` columns per MMA step, computed as ``x @ w^T`` (wgmma-sized on Hopper).
    Used when the launch has at least ``min_rows`` rows.

    Why a row's bits do not change: the split-K count, the columns per split and (FP8) the scale-block
    steps stay the decode config's; only how many rows and columns a program computes and the MMA
    instruction change. On an H200 every tile shape tried (16-256 rows, 32-256 columns, BLOCK_K 64 /
    128, mma.sync and wgmma, 2-8 warps) gave bit-identical rows (bench/mma_shapes.py). The
    interpreter's MMA sums each BLOCK_K step before adding it, so there a row tile keeps the decode
    config's BLOCK_K (:func:`_row_launch`)."""
    min_rows: int
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 8
    num_stages: int = 3
    fold_splits: bool = False   # a split-K config's splits run in one program, summed in split order there
                                # (the split-K sum's bits; no partials written: ``_linear_kernel`` FOLD_SPLITS)
    tma: bool = False           # x and w tiles through tensor descriptors where the launch allows it
                                # (:func:`_tma_descriptors`; the same operands, so the same bits)


def _gpu_row_tiles(K: int, N: int, w_dtype: torch.dtype, scale_bk: int = 0, act_dtype=None) -> tuple:
    """Row tiles by size, smallest ``min_rows`` first: 128 x 256 x 64, 8 warps, 3 stages for 16-bit
    weights from 128 rows (bench/mma_shapes.py on an H200: 389-485 TFLOP/s at 1024-4096 rows, 1.5-5.3x
    the decode tiles, bitwise equal; below 128 rows no faster), loading through tensor descriptors where x
    is in the weight's dtype (an H100: 7-25 % faster at every family's prefill linear, the same bits). fp32
    weights (the MoE routers: an IEEE fp32 dot, which Triton lowers to FMA chains, each output element summing
    its K in order whatever the tile) 128 x 64 x 64, 4 warps from 128 rows: at a 1024-row chunk DeepSeek-V3's
    7168 x 256 router 1117 -> 241 us, GLM-4.5's 5120 x 160 497 -> 165 us, Qwen3-Next's 2048 x 513 98 -> 99 us,
    bitwise the decode config's rows (bench/results/2026-12-04-h200-prefill-attention.md, section 4). None for
    FP8 weights: there the same sweep found rows whose bits change with the tile (wgmma tiles against the
    decode config's mma.sync ones, and in the grouped MoE kernels 32- against 16-row tiles), so FP8 launches
    keep the decode config at every size. Cause
    (``bench/mma_shapes.py --kwidth``): a dot fed from 8-bit loads gets operand layouts with kWidth 4 on
    mma.sync, which permute the K order inside the MMA steps, and kWidth 2 on wgmma (``DS4T_FP8_BARRIER=1`` gives
    them kWidth 2 everywhere and FP8 weights :data:`_ROW_TILES_FP8`; an experiment, see the backend)."""
    if w_dtype == FP8_DTYPE:
        return _ROW_TILES_FP8 if FP8_LAYOUT_BARRIER else ()
    return _ROW_TILES_FP32 if w_dtype == torch.float32 else _ROW_TILES_16BIT


_ROW_TILES_16BIT = (RowTile(min_rows=128, block_m=128, block_n=256, block_k=64, tma=True),)
"""One object, not one a call: every linear launch looks its row tiles up."""
_ROW_TILES_FP32 = (RowTile(min_rows=128, block_m=128, block_n=64, block_k=64, num_warps=4),)
_ROW_TILES_FP8 = (RowTile(min_rows=128, block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3),)
"""FP8 row tiles, only under ``DS4T_FP8_BARRIER=1`` (:data:`ds4t.backend.FP8_LAYOUT_BARRIER`: converted fp8 tiles in
the 16-bit operand layout): each row's bits the decode tiles' on an H100 (the row-tile tests); 31-39 % faster than the
decode tiles at 1024 rows, but the barrier slows every decode launch 20-56 %
(bench/results/2026-12-07-h100-fp8-barrier-row-tiles.md)."""


def _row_tile(block_m: int, block_n: int, num_warps: int, num_stages: int, fold_splits: bool = False,
              tma: bool = True) -> tuple:
    """A table entry: one RowTile from 128 rows, 64 columns a K step."""
    return (RowTile(min_rows=128, block_m=block_m, block_n=block_n, block_k=64, num_warps=num_warps,
                    num_stages=num_stages, fold_splits=fold_splits, tma=tma),)


# Per-shape row tiles (bf16 weights), the best same-bits tile of bench/linear_rows.py at 1024 rows on an H100
# where it beat the rule's 128 x 256 x 64, 8 warps, 3 stages, descriptor loads by more than the runs' spread
# (bench/results/2026-12-06-h100-tma-row-tiles.md; the figures below are against that rule, which itself beat the
# entries it replaced: GLM-4.5 qkv, Qwen3-Next GDN in_proj). Descriptor loads (``tma``) took 7-25 % off each of the
# three families' prefill linears, the same bits. Folded splits (``fold_splits``) pay where a split-K config's
# partials are large beside the product (Qwen3-Next's 4096 x 2048 and its router) and lose where the tile must
# shrink to hold two accumulators (GLM-4.5's 12288 x 5120: +2 % as a kernel; its 4k prompt folded with descriptors
# 5 % slower than unfolded without). DeepSeek-V3's o_proj and dense down folded at 128 x 256 were -11 % / -17 % as
# kernels; its bf16 model does not fit an H100 to confirm them on a prompt.
_GPU_ROW_TILES = {
    (2048, 9216, torch.bfloat16): _row_tile(128, 128, 4, 4),             # Qwen3-Next attention qkv: -3 %
    (4096, 2048, torch.bfloat16): _row_tile(128, 128, 8, 4, True),       # Qwen3-Next o_proj / GDN out_proj: -21 %
    (2048, 513, torch.bfloat16): _row_tile(128, 128, 8, 4, True),        # Qwen3-Next router: -29 %
}

LINEAR_ROW_TILES: ConfigTable[tuple] = ConfigTable(
    "linear_rows", gpu=_GPU_ROW_TILES, gpu_rule=_gpu_row_tiles,
    interp_rule=lambda K, N, w_dtype, scale_bk=0, act_dtype=None: (),
    source="bench/mma_shapes.py (tile shape vs bits and TFLOP/s on an H200); bench/linear_rows.py (per-shape "
           "tiles, folded splits; bench/results/2026-12-06-h100-linear-rows.md; descriptor loads: "
           "bench/results/2026-12-06-h100-tma-row-tiles.md)")
"""Keyed like :data:`LINEAR_CONFIGS`: the :class:`RowTile` s of a weight shape (empty: every launch
uses the decode config). The interpreter has none by default (tests force them)."""


@dataclasses.dataclass(frozen=True)
class SplitKSumConfig:
    """Launch constants of the split-K sum: elements per program are
    ``max(min_block, min(max_block, next_pow2(B * N)))``. The sum is elementwise (each element adds
    its S partials in the order 0..S-1), so the block never changes an element's bits."""
    min_block: int
    max_block: int
    num_warps: int = 4


SPLITK_SUM_CONFIGS: ConfigTable[SplitKSumConfig] = ConfigTable(
    "splitk_sum", gpu={},
    gpu_rule=lambda N: SplitKSumConfig(min_block=1024, max_block=1024),
    interp_rule=lambda N: SplitKSumConfig(min_block=16, max_block=1 << 16),   # few, big programs
    source="rule: 1024 elements per program, 4 warps; not swept")
"""Keyed on the output width N (the rule does not read it)."""


@functools.lru_cache(maxsize=None)
def linear_config(K: int, N: int, w_dtype: torch.dtype, x_dtype: torch.dtype = torch.float32,
                  w_block_k: int = 0) -> LinearConfig:
    """The launch config for a weight [N, K]: depends on (K, N, dtypes, the FP8 weight's block_k)
    and the backend, never on B. For FP8 weights ``x_dtype`` is the activation (compute) dtype."""
    if w_dtype == FP8_DTYPE:
        if w_block_k <= 0:
            raise ValueError("linear_config: an FP8 weight needs its block_k (w_block_k)")
        return LINEAR_CONFIGS(K, N, w_dtype, w_block_k, x_dtype)
    return LINEAR_CONFIGS(K, N, w_dtype)


LINEAR_CONFIGS.caches.append(linear_config)


def linear_row_tiles(K: int, N: int, w_dtype: torch.dtype, x_dtype: torch.dtype = torch.float32,
                     w_block_k: int = 0) -> tuple:
    """The :class:`RowTile` s of a weight [N, K], keyed as :func:`linear_config`."""
    if w_dtype == FP8_DTYPE:
        return LINEAR_ROW_TILES(K, N, w_dtype, w_block_k, x_dtype)
    return LINEAR_ROW_TILES(K, N, w_dtype)


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------
def _fp8_parts(weight):
    """(data tensor, scale tensor or None, scale block or 0) of a weight."""
    if isinstance(weight, FP8Weight):
        return weight.data, weight.scale, weight.block_k
    return weight, None, 0


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """What one launch of ``_linear_kernel`` uses: the decode config's, or a row tile's."""
    block_m: int
    block_n: int
    block_k: int
    m_sub: int
    swap: bool
    clamp_rows: bool
    num_warps: int
    num_stages: int
    fold: bool = False
    tma: bool = False
    scale_blocks: int = 1   # FP8 scale blocks a loop step: the decode config's; a row tile takes one (same bits)


def launch_m_sub(m_sub: int, B: int) -> int:
    """Row sub-tiles per program for a B-row launch: ``m_sub`` (the config's most) or fewer, as many
    16-row sub-tiles as B fills (1, 2 or 4). A row's bits do not depend on it: every sub-tile runs the
    same 16-row dot with its own accumulator. Why not always ``m_sub``: at B <= 16 the other sub-tiles
    would be all padding, and cost 5-45 % (bench/results/2026-11-29-h200-kernels.md)."""
    m = 1
    while m < m_sub and m * BLOCK_M < B:
        m *= 2
    return m


def _row_launch(cfg: LinearConfig, tiles: tuple, B: int, kps: int, kstep: int, op_name: str) -> _Tiles:
    """The tiles of a B-row launch: the largest row tile whose ``min_rows`` B reaches, else the decode
    config's. Only the tile shape changes; the split and K order are ``cfg``'s (:class:`RowTile`). A
    row tile whose BLOCK_K does not divide the columns per split (per scale block for FP8) takes the
    decode BLOCK_K, as it always does in the interpreter. A row tile steps one FP8 scale block at a time
    (``LinearConfig.scale_blocks`` is a decode latency knob, the same bits either way): two blocks a step of a
    128 x 128 FP8 tile ask sm_90 for 344 KB of shared memory (one: 176 KB; the H100 / H200 hold 227 KB)."""
    tile = None
    for t in tiles:
        if B >= t.min_rows:
            tile = t
    if tile is None:
        m_sub = launch_m_sub(cfg.m_sub, B)
        return _Tiles(BLOCK_M, cfg.block_n, cfg.block_k, m_sub, cfg.swap,
                      _clamp_rows(op_name) and m_sub == 1, cfg.num_warps, cfg.num_stages,
                      tma=cfg.tma, scale_blocks=cfg.scale_blocks)
    bk = tile.block_k
    if INTERPRET or kps % bk or kstep % bk:
        bk = cfg.block_k
    return _Tiles(tile.block_m, tile.block_n, bk, 1, False, False, tile.num_warps, tile.num_stages, tile.fold_splits,
                  tile.tma)


def _tma_descriptors(x: torch.Tensor, w: torch.Tensor, t: _Tiles) -> dict:
    """The kernel keywords of a tensor-descriptor launch (``x_desc``, ``w_desc``, ``USE_TMA``), or {} where the
    launch cannot take one: the tile does not ask for it, x is not in the weight's dtype (fp32 x is rounded in
    registers), or a base or row stride is not a multiple of 16 bytes (what the TMA needs)."""
    if not (t.tma and TMA) or t.swap or t.m_sub != 1 or t.clamp_rows or x.dtype != w.dtype \
            or w.dtype not in (torch.bfloat16, torch.float16):
        return {}   # (the descriptor path computes one sub-tile, x @ w^T, from unclamped rows)
    if not (tma_aligned(x) and tma_aligned(w)):
        return {}
    from triton.tools.tensor_descriptor import TensorDescriptor

    return dict(x_desc=TensorDescriptor.from_tensor(x, [t.block_m, t.block_k]),
                w_desc=TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]), USE_TMA=True)


def _fp8_tma_descriptor(w: torch.Tensor, t: _Tiles) -> dict:
    """The keywords of an FP8 launch whose weight tiles come through a tensor descriptor (``w_desc``, ``USE_TMA``):
    a decode config with ``tma`` and ``swap`` on fp8 data whose base and row stride are multiples of 16 bytes;
    else {} (pointer loads, the same bits)."""
    if not (t.tma and TMA and t.swap) or not tma_aligned(w):
        return {}
    from triton.tools.tensor_descriptor import TensorDescriptor

    return dict(w_desc=TensorDescriptor.from_tensor(w, [t.block_n, t.block_k]), USE_TMA=True)


def _launch(x, weight, bias, out, cfg: LinearConfig, act_dtype=None, row_tiles: tuple = (), defer_sum: bool = False):
    """``weight``: a float tensor [N, K] or an FP8Weight (``act_dtype``: its activation dtype);
    ``row_tiles``: the weight shape's :class:`RowTile` s. ``defer_sum``: a split-K launch returns its
    :class:`SplitPartials` instead of adding them (an unsplit one, or one whose row tile folds its splits,
    returns the finished ``out``)."""
    w, scale, sbk = _fp8_parts(weight)
    B, K = x.shape
    N = w.shape[0]
    kps = cfg.k_per_split(K, sbk)
    kstep = cfg.k_step(K, sbk)
    split = triton.cdiv(K, kps)
    if cfg.m_sub not in (1, 2, 4):
        raise ValueError(f"m_sub must be 1, 2 or 4, got {cfg.m_sub}")
    t = _row_launch(cfg, row_tiles, B, kps, kstep, "linear")
    even_k = (K % kps == 0) and (kps % t.block_k == 0)
    m_tiles = triton.cdiv(B, t.block_m * t.m_sub)
    has_bias = bias is not None
    b_arg = bias if has_bias else w  # unused pointer when HAS_BIAS is False
    w_dt = tl_dtype(w.dtype if scale is None else act_dtype)
    fp8 = {} if scale is None else dict(s_ptr=scale, SCALE_BK=sbk, KSTEP=kstep, FP8_ROUTE=_fp8_route(cfg, act_dtype),
                                        SCALE_BLOCKS=t.scale_blocks)
    tiles = dict(SWAP=t.swap, EVEN_K=even_k, M_SUB=t.m_sub, EVICT=cfg.evict, BLOCK_M=t.block_m, BLOCK_N=t.block_n,
                 BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages)
    if B == 0:
        return out
    if scale is None:
        tiles.update(_tma_descriptors(x, w, t))
    else:
        tiles.update(_fp8_tma_descriptor(w, t))
    if split == 1:
        grid = (m_tiles, triton.cdiv(N, t.block_n), 1)
        _linear_kernel[grid](
            x, w, b_arg, out, B, x.stride(0), w.stride(0), 0, out.stride(0),
            N=N, K=K, K_PER_SPLIT=kps, W_DTYPE=w_dt, HAS_BIAS=has_bias, CLAMP_ROWS=t.clamp_rows, **tiles, **fp8,
            **LAUNCH,
        )
        return out
    if t.fold and scale is None:   # every split of a tile in its program, summed there: the result, finished
        _linear_kernel[(m_tiles, triton.cdiv(N, t.block_n), 1)](
            x, w, b_arg, out, B, x.stride(0), w.stride(0), 0, out.stride(0),
            N=N, K=K, K_PER_SPLIT=kps, W_DTYPE=w_dt, HAS_BIAS=has_bias, FOLD_SPLITS=split, **tiles, **LAUNCH,
        )
        return out
    part = torch.empty((split, B, N), dtype=torch.float32, device=x.device)
    grid = (m_tiles, triton.cdiv(N, t.block_n), split)
    counters = _tile_counters(x.device, grid[0] * grid[1]) if cfg.fused_sum and not defer_sum else None
    fused = {} if counters is None else dict(FUSED_SUM=True, out_ptr=out, stride_om=out.stride(0), cnt_ptr=counters)
    _linear_kernel[grid](
        x, w, b_arg, part, B, x.stride(0), w.stride(0), part.stride(0), part.stride(1),
        N=N, K=K, K_PER_SPLIT=kps, W_DTYPE=w_dt, HAS_BIAS=has_bias and counters is not None, **tiles, **fp8,
        **fused, **LAUNCH,
    )
    if counters is not None:   # the kernel summed the partials into out
        return out
    return finish_splits(part, bias, out, defer_sum)


def finish_splits(part: torch.Tensor, bias: Optional[torch.Tensor], out: torch.Tensor, defer_sum: bool = False):
    """The end of a split-K launch (float, FP8 and GGUF weights alike): ``part`` fp32 [S, B, N] holds
    the splits' partials. ``defer_sum``: hand them back unsummed as :class:`SplitPartials` (the consumer
    adds them in this order, e.g. :func:`ds4t.kernels.linear_norm.linear_add_rms_norm`); else
    ``out [B, N] = ((part[0] + part[1]) + ...) (+ bias)`` by :func:`_splitk_sum_kernel` and ``out``
    is returned."""
    if defer_sum:
        return SplitPartials(part, bias)
    S, B, N = part.shape
    total = B * N
    sum_cfg = SPLITK_SUM_CONFIGS(N)
    block = max(sum_cfg.min_block, min(sum_cfg.max_block, triton.next_power_of_2(total)))
    _splitk_sum_kernel[(triton.cdiv(total, block),)](
        part, out if bias is None else bias, out, total, part.stride(0), out.stride(0), N=N, SPLIT=S,
        HAS_BIAS=bias is not None, BLOCK=block, num_warps=sum_cfg.num_warps, **LAUNCH,
    )
    return out


def _fp8_route(cfg: LinearConfig, act_dtype) -> int:
    return fp8_route("linear", cfg.fp8_route, act_dtype)


TILE_COUNTERS = 1 << 16
"""Tiles a fused split-K launch may have (``LinearConfig.fused_sum``); a launch with more (a long prefill
chunk on a wide weight) takes the two-kernel sum, which gives the same bits."""
_COUNTERS: dict = {}


def _tile_counters(device: torch.device, tiles: int) -> Optional[torch.Tensor]:
    """The zeroed int32 ticket counters of ``device`` and the current stream (kernels of one stream run
    one after another, and each launch leaves its counters at 0), or None when ``tiles`` exceeds them.
    Allocated once and kept: a captured CUDA graph holds their address."""
    if tiles > TILE_COUNTERS:
        return None
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    if key not in _COUNTERS:
        _COUNTERS[key] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return _COUNTERS[key]


def _check_args(x, weight, bias, out):
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"linear: x must be [B, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    B, K = x.shape
    N, Kw = weight.shape
    if K != Kw:
        raise ValueError(f"linear: x has K={K} but weight has K={Kw}")
    if bias is not None and bias.shape != (N,):
        raise ValueError(f"linear: bias must be [{N}], got {tuple(bias.shape)}")
    if out is not None and (out.shape != (B, N) or out.dtype != torch.float32 or out.stride(1) != 1):
        raise ValueError(f"linear: out must be fp32 [{B}, {N}] with unit column stride")


def _contiguous_fp8(w: FP8Weight) -> FP8Weight:
    """The kernels read an FP8 weight's data with unit K stride and its scales [..., N, KB] dense."""
    d, s = w.data, w.scale
    KB = s.shape[-1]
    if d.stride(-1) == 1 and d.stride(-2) == d.shape[-1] and s.stride(-1) == 1 and s.stride(-2) == KB:
        return w
    return w.contiguous()


def linear(x: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None, *,
           out: Optional[torch.Tensor] = None, config: Optional[LinearConfig] = None,
           act_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """fp32 ``[B, N] = round_to(A)(x) @ W^T (+ bias)``, fp32 accumulation.

    x [B, K] fp32/bf16/fp16; bias [N] (any float) or None; ``out``: optional fp32 [B, N] buffer to
    write. ``weight`` is either

    * a float tensor [N, K] fp32/bf16/fp16: W = weight, A = weight.dtype (``act_dtype`` must be
      None or that dtype); or
    * an :class:`~ds4t.kernels.weights.FP8Weight` [N, K] (weight-only FP8, W8A16):
      A = ``act_dtype`` or x's own dtype (x is never rounded to fp8), and per K block j of
      ``weight.block_k`` columns ``y += scale[n, j] * dot(x[:, block j], fp8[n, block j])`` with the
      fp8 values converted exactly to A and the block's dot summed in fp32 from zero; or
    * a :class:`~ds4t.kernels.quant_blocks.GGUFWeight` [N, K] (Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K blocks as stored):
      A as for FP8, and per sub-block j ``y += s[n, j] * dot(x_j, q_j) - mn[n, j] * sum(x_j)``
      (:mod:`ds4t.kernels.qlinear`; ``config`` then a :class:`~ds4t.kernels.qlinear.QLinearConfig`); or
    * a :class:`~ds4t.kernels.weights.RowParts` [N, K] (GGUF row blocks of different types): each part's
      columns are that part's lone linear, one launch a part (no ``config``).

    Batch invariant: row i's bits do not depend on B or on the other rows. ``config`` overrides
    :func:`linear_config` (benchmarks only; the override must itself not depend on B; for FP8 its
    BLOCK_K must divide ``weight.block_k``).
    """
    return _linear(x, weight, bias, out, config, act_dtype, False)


def linear_parts(x: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None, *,
                 act_dtype: Optional[torch.dtype] = None) -> SplitPartials:
    """:func:`linear` up to its split-K sum: the same launch (config, tiles, K order) without the second
    kernel. Returns :class:`SplitPartials` (S = 1 when the weight's config does not split K: the finished
    fp32 [B, N] as ``part[0]``). Arguments as :func:`linear`."""
    y = _linear(x, weight, bias, None, None, act_dtype, True)
    return y if isinstance(y, SplitPartials) else SplitPartials(y.unsqueeze(0), None)


def _linear(x, weight, bias, out, config, act_dtype, defer_sum: bool):
    _check_args(x, weight, bias, out)
    adt = activation_dtype("linear", x, weight, act_dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if isinstance(weight, RowParts):
        return _row_parts(x, weight, bias, out, config, adt)
    if isinstance(weight, GGUFWeight):
        if bias is not None and not bias.is_contiguous():
            bias = bias.contiguous()
        if out is None:
            out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
        return qlinear.launch(x, weight, bias, out, adt, config, defer_sum=defer_sum)
    if isinstance(weight, FP8Weight):
        weight = _contiguous_fp8(weight)
    elif weight.stride(-1) != 1:
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    B, K = x.shape
    N = weight.shape[0]
    if out is None:
        out = torch.empty((B, N), dtype=torch.float32, device=x.device)
    if isinstance(weight, FP8Weight):
        key = (K, N, FP8_DTYPE, adt, weight.block_k)
    else:
        key = (K, N, weight.dtype, x.dtype)
    if config is not None:
        return _launch(x, weight, bias, out, config, adt, defer_sum=defer_sum)
    return _launch(x, weight, bias, out, linear_config(*key), adt, linear_row_tiles(*key), defer_sum=defer_sum)


def _row_parts(x, weight: RowParts, bias, out, config, adt):
    """A :class:`RowParts` weight: each part a lone linear into its columns of ``out`` (fp32 [B, N]), its
    split-K sum finished there (so a deferred sum has nothing left: one partial, the result)."""
    if config is not None:
        raise ValueError("linear: a RowParts weight takes each part's own config (no override)")
    if out is None:
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.float32, device=x.device)
    for part, (a, b) in zip(weight.parts, weight.row_ranges()):
        _linear(x, part, None if bias is None else bias[a:b], out[:, a:b], None, adt, False)
    return out


def linear_ref(x: torch.Tensor, weight: Weight, bias: Optional[torch.Tensor] = None, *,
               act_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Plain-torch reference: fp32 ``round_to(A)(x) @ W^T (+ bias)``; an FP8 weight is dequantized
    (``as_float``: fp8 * scale in fp32) and A is as in :func:`linear`."""
    adt = activation_dtype("linear_ref", x, weight, act_dtype)
    xr = x.to(adt).float()
    y = xr @ as_float(weight, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y


def linear_heads(x: torch.Tensor, weight: Weight, *, out: Optional[torch.Tensor] = None,
                 act_dtype: Optional[torch.dtype] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One launch of G independent linears: ``out[:, g] = linear(x[:, g], weight[g])``, stored as
    ``out_dtype`` (fp32; or bf16 / fp16, the fp32 result rounded to nearest even -- for a caller whose
    only reader is a linear that rounds its input so, e.g. MLA's W_UV output feeding o_proj).

    x [B, G, K] fp32/bf16/fp16 (any row and head strides, unit K stride: e.g. a view of a
    projection); weight [G, N, K] (contiguous per head), a float tensor or an FP8Weight (data
    [G, N, K], scale [G, N, ceil(K / block_k)]; ``act_dtype`` as in :func:`linear`); ``out``:
    optional fp32 [B, G, N] with unit N stride (e.g. a view of a wider buffer). Each head runs the
    tiles, config and K order of a lone :func:`linear` call on its slice, so the result equals the
    per-head loop bit for bit and is batch invariant the same way. For per-head weights such as
    MLA's absorbed W_UK / W_UV (DeepSeek-V3: 128 heads per layer), where a loop would launch G kernels.
    """
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"linear_heads: x must be [B, G, K] and weight [G, N, K], got {tuple(x.shape)} "
                         f"and {tuple(weight.shape)}")
    if isinstance(weight, GGUFWeight):
        raise TypeError("linear_heads: GGUF block weights are not supported (per-head weights are dequantized at load)")
    adt = activation_dtype("linear_heads", x, weight, act_dtype)
    B, G, K = x.shape
    N = weight.shape[1]
    if x.stride(2) != 1:
        x = x.contiguous()
    fp8 = isinstance(weight, FP8Weight)
    if fp8:
        weight = _contiguous_fp8(weight)
        w, scale, sbk = weight.data, weight.scale, weight.block_k
    else:
        if weight.stride(2) != 1 or weight.stride(1) != K:
            weight = weight.contiguous()
        w, scale, sbk = weight, None, 0
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"linear_heads: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    if out is None:
        out = torch.empty((B, G, N), dtype=out_dtype, device=x.device)
    elif out.shape != (B, G, N) or out.dtype != out_dtype or out.stride(2) != 1:
        raise ValueError(f"linear_heads: out must be {out_dtype} [{B}, {G}, {N}] with unit last stride")
    cfg = linear_config(K, N, FP8_DTYPE, adt, sbk) if fp8 else linear_config(K, N, weight.dtype, x.dtype)
    kps = cfg.k_per_split(K, sbk)
    if triton.cdiv(K, kps) != 1 or cfg.m_sub != 1:
        # Split-K would need a per-head workspace; the per-head loop gives the same bits (a 16-bit out
        # rounded by torch: nearest even too, but the interpreter's cast flushes fp32 denormals and torch
        # does not -- no table config of a per-head weight takes this path).
        for g in range(G):
            if out_dtype == torch.float32:
                linear(x[:, g], weight[g], out=out[:, g], act_dtype=act_dtype)
            else:
                out[:, g] = linear(x[:, g], weight[g], act_dtype=act_dtype)
        return out
    if B == 0 or G == 0:
        return out
    extra = {} if not fp8 else dict(s_ptr=scale, SCALE_BK=sbk, KSTEP=cfg.k_step(K, sbk), SS_H=scale.stride(0),
                                     FP8_ROUTE=_fp8_route(cfg, adt), SCALE_BLOCKS=cfg.scale_blocks)
    grid = (triton.cdiv(B, BLOCK_M), triton.cdiv(N, cfg.block_n), G)
    _linear_kernel[grid](
        x, w, w, out, B, x.stride(0), w.stride(1), 0, out.stride(0),
        N=N, K=K, K_PER_SPLIT=kps, W_DTYPE=tl_dtype(adt), HAS_BIAS=False, SWAP=cfg.swap,
        EVEN_K=(K % kps == 0) and (kps % cfg.block_k == 0), M_SUB=1, EVICT=cfg.evict, BLOCK_M=BLOCK_M,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, CLAMP_ROWS=_clamp_rows("linear_heads"),
        HEADS=True, SX_H=x.stride(1), SW_H=w.stride(0), SY_H=out.stride(1),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra, **LAUNCH,
    )
    return out


def linear_heads_ref(x: torch.Tensor, weight: Weight, *, act_dtype: Optional[torch.dtype] = None,
                     out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Plain-torch reference: ``[B, G, N]``, head g = ``linear_ref(x[:, g], weight[g])``, as ``out_dtype``."""
    adt = activation_dtype("linear_heads_ref", x, weight, act_dtype)
    return torch.einsum("bgk,gnk->bgn", x.to(adt).float(), as_float(weight, torch.float32)).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Self-check for `ds4t check`
# ----------------------------------------------------------------------------------------------
_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-4, torch.float16: 2e-4}
"""Max |kernel - reference| / max|reference|: both sum exact products in fp32, in different orders."""
_TOL_FP8 = {torch.float32: 1e-5, torch.bfloat16: 2e-4, torch.float16: 2e-4}
"""FP8 weights, keyed on the activation dtype: the kernel sums scale * (x . fp8) per block, the
reference x . (fp8 * scale); both round in fp32 (products of fp32 x are not exact), in different orders."""


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(1)
    results = []
    B, K, N = 5, 200, 333
    for wdt in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(B, K, generator=g).to(device)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to(wdt).to(device)
        b = torch.randn(N, generator=g).to(device)
        ref = linear_ref(x, w, b)
        y = linear(x, w, b)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        inv = rows_invariant(lambda t: linear(t, w, b), x)
        ms = timer(lambda: linear(x, w, b), warmup=1, iters=3)
        cfg = linear_config(K, N, wdt, x.dtype)
        results.append(CheckResult(f"linear {str(wdt).replace('torch.', '')}", f"B={B} K={K} N={N}",
                                   err, _TOL[wdt], inv, ms, note=f"relative to max|ref|; {cfg}"))
    # FP8 weights (W8A16, 128-column scale blocks; K = 200: a ragged last block), fp32 and bf16 activations
    w8 = quantize(torch.randn(N, K, generator=g) / K ** 0.5, (128, 128)).to(device)
    for adt in (torch.float32, torch.bfloat16):
        x = torch.randn(B, K, generator=g).to(device)
        b = torch.randn(N, generator=g).to(device)
        ref = linear_ref(x, w8, b, act_dtype=adt)
        y = linear(x, w8, b, act_dtype=adt)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        inv = rows_invariant(lambda t: linear(t, w8, b, act_dtype=adt), x)
        ms = timer(lambda: linear(x, w8, b, act_dtype=adt), warmup=1, iters=3)
        cfg = linear_config(K, N, FP8_DTYPE, adt, w8.block_k)
        results.append(CheckResult(f"linear fp8 x {str(adt).replace('torch.', '')}", f"B={B} K={K} N={N}",
                                   err, _TOL_FP8[adt], inv, ms, note=f"relative to max|ref|; {cfg}"))
    G, K, N = 6, 64, 96   # per-head weights, e.g. MLA's absorbed W_UK
    x = torch.randn(B, G, K, generator=g).to(device)
    w = (torch.randn(G, N, K, generator=g) / K ** 0.5).to(torch.bfloat16).to(device)
    ref = linear_heads_ref(x, w)
    y = linear_heads(x, w)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    inv = rows_invariant(lambda t: linear_heads(t, w), x)
    ms = timer(lambda: linear_heads(x, w), warmup=1, iters=3)
    results.append(CheckResult("linear_heads bfloat16", f"B={B} G={G} K={K} N={N}", err, _TOL[torch.bfloat16],
                               inv, ms, note="one launch for G per-head linears"))
    w8 = quantize(torch.randn(G, N, K, generator=g) / K ** 0.5, (128, 128)).to(device)
    ref = linear_heads_ref(x, w8)
    y = linear_heads(x, w8)
    err = ((y - ref).abs().max() / ref.abs().max()).item()
    inv = rows_invariant(lambda t: linear_heads(t, w8), x)
    ms = timer(lambda: linear_heads(x, w8), warmup=1, iters=3)
    results.append(CheckResult("linear_heads fp8 x float32", f"B={B} G={G} K={K} N={N}", err,
                               _TOL_FP8[torch.float32], inv, ms, note="FP8 per-head weights"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(linear, reference=linear_ref, variants=(GPU, INTERP))
register_op(linear_heads, reference=linear_heads_ref, variants=(GPU, INTERP))
