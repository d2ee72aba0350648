"""Routed MoE experts (SwiGLU), natively batched: each chosen expert's weights are read once for all
the (row, rank) pairs that chose it.

    out[b] = sum_{j = 0..KT-1, in rank order} weight[b, j] * down_e(silu(gate_e(h_b)) * up_e(h_b)),
    e = expert[b, j]

Shapes: h [B, D] (fp32; bf16/fp16 upcast), ids [B, k] int32/int64 in [0, E) (from
:mod:`ds4t.kernels.router`), or -1: that pair is skipped and contributes exactly 0 whatever its weight
(expert parallelism: a rank holds some of the experts, ``ds4t.parallel``),
weights [B, k] fp32, w_gate / w_up [E, I, D], w_down [E, D, I] (fp32, bf16 or fp16, all one dtype;
HF's fused ``gate_up_proj`` [E, 2I, D] splits into ``[:, :I]`` and ``[:, I:]`` views, which work as is).
Ranks 0..k-1 are the routed pairs (ids, weights). With ``shared_expert=s`` every row has one more
rank, k (KT = k + 1): expert s with weight sigmoid(shared_gate[b]) (fp32 [B], any stride: Qwen3-Next
gates its shared expert by a router row), or 1 without a gate. A shared expert therefore costs no
host-side concatenation of ids and weights, and is combined last, in the same order everywhere.

Numerics: the activation is rounded to the weight dtype before each product (h before gate/up,
silu(g)·u before down); products accumulate in fp32 (``ds4t.backend.mma``); silu, the product g·u,
the routing weight and the rank sum are fp32. Returns fp32 [B, D].

How it runs (no host synchronisation; every grid comes from shapes):

1. ``_moe_group_kernel``, grid (E,): program e scans the P = B·KT pairs and lists the pairs that chose
   e, in pair order, at ``order[bounds[e]:bounds[e+1]]`` (``bounds[e]`` = pairs with a smaller expert
   id). One launch; it replaces a sort, a search and their casts, which cost more than the experts
   themselves at decode sizes (H200 profile, bench/results). A launch of at most
   :data:`SELF_GROUP_PAIRS` pairs over 16-bit / fp32 experts (a one-row step) skips it: each program of
   steps 2 and 3 finds its slot's expert and pairs from the ids (:func:`_self_slot`).
2. ``_moe_gate_up_kernel``, grid (min(E, P), cdiv(I, BN)): program (i, n) takes the i-th chosen
   expert (from ``bounds``; slots past the chosen experts run zero iterations), loops over its pairs in
   tiles of BLOCK_M = 16 rows, K (= D) in fixed BK steps, and writes silu(g)·u for its I columns to a
   per-pair buffer act [P, I]; programs (i, 0) also write slot i's expert (-1: none) to ``slots``.
3. ``_moe_down_kernel``, grid (min(E, P), cdiv(D, BN)): the same over I, its expert read from ``slots``
   (no second scan of ``bounds``), writes y [P, D] (= [B, KT, D]).
   With ``MoEConfig.swap`` (the FP8 table's choice) both kernels compute a tile as w [BN, BK] @ h^T
   [BK, BM]: a decode tile has one or two real pairs, and the weight rows fill the MMA's M side.
   With ``MoEConfig.split = S`` a kernel's grid gets an axis of S splits of its K (whole loop steps);
   each stores fp32 partials that are added in split order (gate_up's: ``_moe_act_kernel``, before
   silu(g)·u; down's: the combine, before the routing weight): more programs, each with a shorter K
   chain, for the few experts of a decode step. Like every field it is fixed per key, never per batch.
   With ``MoEConfig.row_programs`` (launches of many rows) a kernel's grid axis 0 is row tiles, not
   slots: program t runs the t-th tile of BLOCK_M pairs in (expert, pair order) order
   (:func:`_program_tile`) -- the same tiles the per-expert program loops over, so the same bits, with a
   chunk's big experts (a shared expert holds every row) spread over many programs.
4. ``_moe_combine_kernel``: out[b] = 0 + w[b,0]·y[b,0] + w[b,1]·y[b,1] + ... in rank order.

Batch invariance: a pair's value depends only on its own row of h, the expert's weights and the
fixed tile constants (BM, BN, BK depend on the weight shapes and the backend, never on B or on
how many pairs share an expert); a tile row's dot product does not depend on the other rows of the
tile; the rank combine is per row in a fixed order. No atomics.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Union

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ds4t.backend import (INTERPRET, LAUNCH, TMA, cast, f16_scaled, fp8_operand, fp8_pieces, fp8_route,
                          grid_dependency, mma, mma_fp8_pieces, mma_tf32_exact, pow2_scale, round_in_f32, scaled_add,
                          sigmoid, split_sum, timer, tl_dtype, tma_aligned)
from ds4t.backend import silu as _silu
from ds4t.kernels.config import ConfigTable, differs_only_in, launch_kwargs
from ds4t.kernels.registry import GPU, HOST_LIST, INTERP, CheckResult, register_check, register_op, variant
from ds4t.kernels.quant_blocks import GGUFWeight
from ds4t.kernels.tensors import MoEPartials, float_out
from ds4t.kernels.weights import FP8Weight, activation_dtype, as_float, quantize

BLOCK_M = 16  # pairs per tile: fixed (GPU dots need M >= 16)

SELF_GROUP_PAIRS = BLOCK_M
"""A launch of at most this many (row, rank) pairs (a one-row decode step: k + 1 of them) over 16-bit or
fp32 experts skips the grouping kernel: each grouped-kernel program finds its slot's expert and pairs from
the ids (:func:`_self_slot`), the pairs and tiles the grouping would give, so the same bits. One launch
fewer a MoE layer at N = 1: on an H200 GLM-4.5-4l's step -1.8 %, Qwen3-Next-4l's -0.7 %, DeepSeek-V3-4l's
-0.2 %; FP8 experts (2-warp programs) keep the grouping kernel: with it Qwen3-Next-80B-FP8's step was 0.7 %
slower (bench/results/2026-12-03-h200-launches.md). 0 turns it off (tests compare the two)."""


@triton.jit
def _pair_expert(ids_ptr, si_b, b, j, mask, KTOP: tl.constexpr, SHARED):
    """Expert of pair (row b, rank j): ids[b, j] for the routed ranks j < KTOP, the shared expert
    ``SHARED`` at rank KTOP. Masked-off pairs give -1."""
    e = tl.load(ids_ptr + b * si_b + j, mask=mask & (j < KTOP), other=0).to(tl.int32)
    e = tl.where(j < KTOP, e, SHARED)
    return tl.where(mask, e, -1)


@triton.jit
def _pair_weight(w_ptr, sw_b, gate_ptr, sg_b, b, j, mask, KTOP: tl.constexpr, GATED: tl.constexpr):
    """Weight of pair (b, j): weights[b, j] for j < KTOP; at rank KTOP (the shared expert)
    sigmoid(gate[b]) when GATED, else 1. Masked-off pairs give 0."""
    w = tl.load(w_ptr + b * sw_b + j, mask=mask & (j < KTOP), other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(gate_ptr + b * sg_b, mask=mask & (j >= KTOP), other=0.0).to(tl.float32)
        ws = sigmoid(g)
    else:
        ws = 1.0
    return tl.where(mask, tl.where(j < KTOP, w, ws), 0.0)


@triton.jit
def _pair_dot(a, w, acc, SWAP: tl.constexpr, TF32: tl.constexpr):
    """acc + the dot of a pair tile a [BM, BK] with a weight tile: w [BK, BN] -> acc [BM, BN], or with
    SWAP w [BN, BK] -> acc [BN, BM] (the weight rows are the MMA's M operand: a decode tile has few
    pairs, and a weight tile can fill the instruction's M side). TF32: fp32 tiles exact in TF32
    (FP8 route "tf32"), else tiles of one 16-bit dtype (or IEEE fp32)."""
    if SWAP:
        if TF32:
            acc = mma_tf32_exact(w, tl.trans(a), acc)
        else:
            acc = mma(w, tl.trans(a), acc)
    else:
        if TF32:
            acc = mma_tf32_exact(a, w, acc)
        else:
            acc = mma(a, w, acc)
    return acc


@triton.jit
def _w_tile(w_ptr, base, n, nm, kk, km, sw_n, sw_k, SWAP: tl.constexpr, EVEN: tl.constexpr = False):
    """The weight tile of rows n, columns kk: [BK, BN], or [BN, BK] with SWAP; masked entries 0. EVEN: every
    row and column is in range (the launcher knows it from the shapes), so the load is not masked -- the
    same values, without a predicate per element."""
    if SWAP:
        ptrs = w_ptr + base + n[:, None] * sw_n + kk[None, :] * sw_k
        m = nm[:, None] & km[None, :]
    else:
        ptrs = w_ptr + base + n[None, :] * sw_n + kk[:, None] * sw_k
        m = km[:, None] & nm[None, :]
    if EVEN:
        w = tl.load(ptrs)
    else:
        w = tl.load(ptrs, mask=m, other=0.0)
    return w


@triton.jit
def _w_desc_tile(desc, e, n0, k0, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr):
    """:func:`_w_tile` of rows n0 .. n0 + BN, columns k0 .. k0 + BK through a tensor descriptor over the
    [E, N, K] weights (block [1, BN, BK]; zeros past N and K, the masked loads' values): the same operand."""
    w = desc.load([e, n0, k0]).reshape(BN, BK)
    if not SWAP:
        w = tl.trans(w)
    return w


@triton.jit
def _pairs_mask(qm, km, EVEN_K: tl.constexpr):
    """The mask of a pair tile [BM, BK]: valid pairs, and (unless EVEN_K) columns in range."""
    if EVEN_K:
        m = qm[:, None]
    else:
        m = qm[:, None] & km[None, :]
    return m


@triton.jit
def _row_scales(s_ptr, nm, SWAP: tl.constexpr, EVEN_N: tl.constexpr):
    """A K block's fp32 scale per weight row (rows past N masked to 0 unless EVEN_N), broadcast against
    the accumulator as :func:`_row_vec`."""
    if EVEN_N:
        s = tl.load(s_ptr)
    else:
        s = tl.load(s_ptr, mask=nm, other=0.0)
    return _row_vec(s, SWAP)


@triton.jit
def _row_vec(v, SWAP: tl.constexpr):
    """A per-weight-row vector [BN] broadcast against the accumulator ([BM, BN], or [BN, BM] with SWAP)."""
    if SWAP:
        out = v[:, None]
    else:
        out = v[None, :]
    return out


@triton.jit
def _pair_vec(v, SWAP: tl.constexpr):
    """A per-pair vector [BM] broadcast against the accumulator ([BM, BN], or [BN, BM] with SWAP)."""
    if SWAP:
        out = v[None, :]
    else:
        out = v[:, None]
    return out


@triton.jit
def _f16_scale(amax, a):
    """(FP8 route "f16") amax [BM] raised to the largest |a| of each row of tile a [BM, BK]."""
    return tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), axis=1))


@triton.jit
def _store_tile(ptr, p, sp, n, qm, nm, val, SWAP: tl.constexpr):
    """out[p, n] = val for the tile's pairs p (rows of the buffer) and weight rows n."""
    if SWAP:
        tl.store(ptr + p[None, :] * sp + n[:, None], val, mask=qm[None, :] & nm[:, None])
    else:
        tl.store(ptr + p[:, None] * sp + n[None, :], val, mask=qm[:, None] & nm[None, :])


@triton.jit
def _split_range(K, SPLIT: tl.constexpr, K_PER_SPLIT: tl.constexpr):
    """Columns [k_lo, k_hi) of K this program sums: split program_id(2) of SPLIT, or all of K."""
    if SPLIT > 1:
        k_lo = tl.program_id(2) * K_PER_SPLIT
        k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    else:
        k_lo = 0
        k_hi = K
    return k_lo, k_hi


@triton.jit
def _h_tile(h_ptr, sh_b, b, qm, kk, km, EVEN_K: tl.constexpr):
    """[BM, BK] rows b, columns kk of a row-major buffer (row stride sh_b) for the tile's pairs, as stored;
    masked 0: the hidden states h[b] for the gate/up product (b = a pair's row), or :func:`_act_tile`'s."""
    return tl.load(h_ptr + b[:, None] * sh_b + kk[None, :], mask=_pairs_mask(qm, km, EVEN_K), other=0.0)


@triton.jit
def _act_tile(act_ptr, sa_p, p, qm, kk, km, EVEN_K: tl.constexpr = False):
    """fp32 [BM, BK] activations silu(g) * u of pairs p, columns kk, for the down product, as the gate/up
    kernel (or, after a split gate/up, :func:`_moe_act_kernel`) stored them."""
    return _h_tile(act_ptr, sa_p, p, qm, kk, km, EVEN_K).to(tl.float32)


@triton.jit
def _moe_act_kernel(part_ptr, sp_s, sp_p, act_ptr, sa_p, order_ptr, bounds_ptr, E, I,
                    SPLIT: tl.constexpr, ACT_ROUNDED: tl.constexpr, WDT: tl.constexpr, BI: tl.constexpr,
                    sg_ptr=None, su_ptr=None, ss_e=0, ss_n=0, ids_ptr=None, si_b=0, KT=1, SHARED=-1,
                    KTOP: tl.constexpr = 0, NBLK: tl.constexpr = 0):
    """After a split gate/up (``MoEConfig.split`` = SPLIT): act[p, i] = silu(g) * u with g = part[0, p, i] +
    part[1, p, i] + ... and u likewise at column I + i, added in split order (:func:`ds4t.backend.split_sum`),
    rounded to WDT when ACT_ROUNDED -- what the unsplit gate/up kernel stores. Grid (P, cdiv(I, BI)):
    program q takes the q-th grouped pair (order[q]); pairs past bounds[E] (ids -1: no expert) have no
    partials and are skipped. A separate launch, so the down kernel reads one activation tile as after
    an unsplit gate/up (reading and adding the partials there took it 96 KB of shared memory).

    NBLK > 0 (an ordered split, ``MoEConfig.ordered_split``): part holds every FP8 scale block's dot
    [NBLK, P, 2I]; g = fma(dot_j, scale_j, g) for j = 0 .. NBLK-1 from g = 0 (scales sg / su [E, I, NBLK] of
    the pair's expert, found from ``ids``), the unsplit kernel's :func:`_block_end` in its order."""
    grid_dependency()
    q = tl.program_id(0)
    if q < tl.load(bounds_ptr + E):
        p = tl.load(order_ptr + q).to(tl.int64)
        i = tl.program_id(1) * BI + tl.arange(0, BI)
        m = i < I
        ptrs = part_ptr + p * sp_p + i
        if NBLK > 0:
            e = _pair_expert(ids_ptr, si_b, p // KT, p % KT, True, KTOP, SHARED).to(tl.int64)
            s_row = e * ss_e + i * ss_n
            g = tl.zeros([BI], tl.float32)
            u = tl.zeros([BI], tl.float32)
            for j in tl.static_range(NBLK):   # unrolled: every block's loads issue before the FMA chain
                g = scaled_add(g, tl.load(ptrs + j * sp_s, mask=m, other=0.0),
                               tl.load(sg_ptr + s_row + j, mask=m, other=0.0))
                u = scaled_add(u, tl.load(ptrs + j * sp_s + I, mask=m, other=0.0),
                               tl.load(su_ptr + s_row + j, mask=m, other=0.0))
            act = _silu(g) * u
        else:
            act = _silu(split_sum(ptrs, m, sp_s, SPLIT)) * split_sum(ptrs + I, m, sp_s, SPLIT)
        if ACT_ROUNDED:
            act = cast(act, WDT)
        tl.store(act_ptr + p * sa_p + i, act, mask=m)


@triton.jit
def _moe_group_kernel(
    ids_ptr, si_b, order_ptr, bounds_ptr, P, SHARED,
    KTOP: tl.constexpr, KT: tl.constexpr, BP: tl.constexpr,
):
    """Program e: bounds[e] = #pairs with expert < e, bounds[e+1] (last program) = P, and the pairs
    of expert e in pair order at order[bounds[e]:]. Two scans of the pairs; nothing shared between
    programs, so no atomics and no ordering between programs."""
    grid_dependency()
    e = tl.program_id(0)
    start = 0
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        pe = _pair_expert(ids_ptr, si_b, (p // KT).to(tl.int64), p % KT, p < P, KTOP, SHARED)
        start += tl.sum(((pe >= 0) & (pe < e)).to(tl.int32), axis=0)
    tl.store(bounds_ptr + e, start)
    pos = start
    for p0 in range(0, P, BP):
        p = p0 + tl.arange(0, BP)
        pe = _pair_expert(ids_ptr, si_b, (p // KT).to(tl.int64), p % KT, p < P, KTOP, SHARED)
        hit = (pe == e).to(tl.int32)
        at = pos + tl.cumsum(hit, axis=0) - 1
        tl.store(order_ptr + at, p, mask=hit > 0)
        pos += tl.sum(hit, axis=0)
    if e == tl.num_programs(0) - 1:
        tl.store(bounds_ptr + e + 1, pos)   # pairs with a valid expert: skipped ones (-1) are never listed


@triton.jit
def _program_expert(experts_ptr, bounds_ptr, E, DEVICE_LIST: tl.constexpr, BE: tl.constexpr):
    """(expert, first pair, end pair) of this program (program_id(0) = slot i).

    DEVICE_LIST: slot i runs the i-th chosen expert in id order, found from ``bounds`` on the device
    (a grid of min(E, P) slots, not E: at decode sizes most experts are unchosen, and thousands of
    programs that only exit cost the H200 more than the work itself). A slot past the chosen experts
    runs zero iterations. Otherwise slot i runs ``experts[i]`` (-1: none, zero iterations): the
    interpreter's host-made list, or the ``slots`` the gate/up kernel wrote for the down kernel.
    Either way an expert's arithmetic does not depend on the slot that runs it."""
    i = tl.program_id(0)
    if DEVICE_LIST:
        ev = tl.arange(0, BE)
        lo = tl.load(bounds_ptr + ev, mask=ev < E, other=0)
        hi = tl.load(bounds_ptr + ev + 1, mask=ev < E, other=0)
        chosen = (hi > lo).to(tl.int32)
        slot = tl.cumsum(chosen, axis=0) - 1
        e = tl.max(tl.where((chosen > 0) & (slot == i), ev, -1), axis=0)
        ok = e >= 0
        e = tl.maximum(e, 0)
    else:
        e = tl.load(experts_ptr + i)
        ok = e >= 0
        e = tl.maximum(e, 0)
    start = tl.load(bounds_ptr + e).to(tl.int32)
    end = tl.load(bounds_ptr + e + 1).to(tl.int32)
    end = tl.where(ok, end, start)
    return e, start, end


@triton.jit
def _program_tile(bounds_ptr, E, BE: tl.constexpr, BM: tl.constexpr):
    """(expert, first pair, end pair) of this program when every program takes one row tile of BM pairs
    (``MoEConfig.row_programs``): program_id(0) = t runs the t-th tile in (expert id, pair order) order, an
    expert of c pairs having cdiv(c, BM) tiles; a program past the last tile runs zero iterations. The tiles
    are the ones a per-expert program would loop over (the same pairs in the same tile positions), so the
    same bits; a chunk's big experts (a shared expert holds every row) no longer run their tiles one after
    another in one program while the others have finished. Grid: min(E, P) + cdiv(P, BM) programs bound
    the tiles of P pairs."""
    t = tl.program_id(0)
    ev = tl.arange(0, BE)
    lo = tl.load(bounds_ptr + ev, mask=ev < E, other=0).to(tl.int32)
    hi = tl.load(bounds_ptr + ev + 1, mask=ev < E, other=0).to(tl.int32)
    tiles = (hi - lo + BM - 1) // BM
    last = tl.cumsum(tiles, axis=0)                  # tiles up to and including each expert's
    e = tl.sum((last <= t).to(tl.int32), axis=0)     # the first expert whose tiles reach past t (E: none)
    mine = ev == e
    start = tl.sum(tl.where(mine, lo + (t - (last - tiles)) * BM, 0), axis=0)
    end = tl.minimum(tl.sum(tl.where(mine, hi, 0), axis=0), start + BM)
    end = tl.where(e < E, end, start)
    return tl.minimum(e, E - 1), start, end


def row_program_count(E: int, P: int, BM: int) -> int:
    """Programs of a ``row_programs`` launch: an upper bound on the row tiles of P pairs over E experts
    (at most min(E, P) experts hold pairs, each with at most one partial tile)."""
    return min(E, P) + triton.cdiv(P, BM)


def down_finder(gu_rows: bool, dn_rows: bool, BE: int) -> dict:
    """How a grouped down kernel (this module's or :mod:`ds4t.kernels.qmoe`'s) finds its work: one row tile
    a program (``dn_rows``); per slot, its expert found from ``bounds`` when the gate/up kernel ran row
    programs and so wrote no slots (``gu_rows``); else from the slot list it is given ({})."""
    if dn_rows:
        return dict(ROW_PROGRAMS=True, BE=BE)
    return dict(DEVICE_LIST=True, BE=BE) if gu_rows else {}


@triton.jit
def _store_slot(slots_ptr, e, start, end, writer):
    """slots[i] = slot i's expert, -1 when it has none (``end == start``), stored by one program of the slot
    (``writer``): a gate/up kernel hands its scan of ``bounds`` (:func:`_program_expert`) to the down kernel."""
    if writer:
        tl.store(slots_ptr + tl.program_id(0), tl.where(end > start, e, -1))


@triton.jit
def _self_slot(ids_ptr, si_b, P, KT, SHARED, KR: tl.constexpr, BM: tl.constexpr):
    """A launch of P <= BM pairs, without the grouping kernel: (expert, pairs int64 [BM], count) of slot
    program_id(0) -- the slot's expert is the i-th smallest chosen one and its pairs are listed in pair
    order, as ``order`` / ``bounds`` would list them (count 0: the slot has no expert). P pairs of KT ranks
    per row, KR of them routed (``ids``), the last the shared expert SHARED when KT > KR."""
    pp = tl.arange(0, BM)
    pe = _pair_expert(ids_ptr, si_b, (pp // KT).to(tl.int64), pp % KT, pp < P, KR, SHARED)   # -1: none
    same_before = (pe[None, :] == pe[:, None]) & (pp[None, :] < pp[:, None])                 # [p, q]
    first = (pe >= 0) & (tl.sum(same_before.to(tl.int32), axis=1) == 0)                     # expert's first pair
    rank = tl.sum((first[None, :] & (pe[None, :] < pe[:, None])).to(tl.int32), axis=1)      # of its expert
    e = tl.max(tl.where(first & (rank == tl.program_id(0)), pe, -1), axis=0)
    hit = (pe == e) & (e >= 0)
    pos = tl.cumsum(hit.to(tl.int32), axis=0) - 1
    pairs = tl.sum(tl.where(hit[None, :] & (pos[None, :] == pp[:, None]), pp[None, :], 0), axis=1)
    return tl.maximum(e, 0), pairs.to(tl.int64), tl.sum(hit.to(tl.int32), axis=0)


@triton.jit
def _f16_row_scales(x_ptr, sx, rows, qm, k_lo, k_hi, K, BK: tl.constexpr, EVEN_K: tl.constexpr, WDT: tl.constexpr,
                    BM: tl.constexpr):
    """(FP8 route "f16") (scale, 1 / scale) [BM]: the power of two that puts the largest |x| of each pair's
    activations (rows ``rows`` of x, columns k_lo..k_hi, rounded to WDT) in [2^14, 2^15)."""
    amax = tl.zeros([BM], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        kk = k0 + tl.arange(0, BK)
        a = _h_tile(x_ptr, sx, rows, qm, kk, kk < K, EVEN_K)
        amax = _f16_scale(amax, cast(a.to(tl.float32), WDT))
    return pow2_scale(amax, 14)


@triton.jit
def _program_pairs(ids_ptr, si_b, P, KT, SHARED, KR: tl.constexpr, BM: tl.constexpr, bounds_ptr, experts_ptr, E,
                   BE: tl.constexpr, SELF: tl.constexpr, ROW_PROGRAMS: tl.constexpr, DEVICE_LIST: tl.constexpr):
    """(expert, first pair, end pair, pairs) of a grouped kernel's program: SELF from the ids
    (:func:`_self_slot`; ``pairs`` int64 [BM] lists them), ROW_PROGRAMS one row tile (:func:`_program_tile`),
    else a slot's expert (:func:`_program_expert`); ``pairs`` is read under SELF only."""
    if SELF:
        e, pairs, end = _self_slot(ids_ptr, si_b, P, KT, SHARED, KR, BM)
        start = 0
    elif ROW_PROGRAMS:
        e, start, end = _program_tile(bounds_ptr, E, BE, BM)
        pairs = start
    else:
        e, start, end = _program_expert(experts_ptr, bounds_ptr, E, DEVICE_LIST, BE)
        pairs = start
    return e, start, end, pairs


@triton.jit
def _tile_pairs(m0, end, order_ptr, pairs, SELF: tl.constexpr, BM: tl.constexpr):
    """(mask, pair ids int64 [BM]) of the pair tile starting at grouped position m0 (positions < end valid):
    ``order[m0:m0 + BM]``, or under SELF the slot's own ``pairs``."""
    q = m0 + tl.arange(0, BM)
    qm = q < end
    if SELF:
        p = pairs
    else:
        p = tl.load(order_ptr + q, mask=qm, other=0).to(tl.int64)
    return qm, p


@triton.jit
def _acc_tile(BM: tl.constexpr, BN: tl.constexpr, SWAP: tl.constexpr):
    """A zero fp32 accumulator of a tile: [BM, BN], or [BN, BM] with SWAP."""
    if SWAP:
        acc = tl.zeros([BN, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, BN], dtype=tl.float32)
    return acc


@triton.jit
def _block_start(acc, FOLD: tl.constexpr):
    """The sum an FP8 scale block's dots start from: the accumulator itself on the "fold" route (the
    weights carry their scales), else zero (the block's dot is scaled once, :func:`_block_end`)."""
    if FOLD:
        pd = acc
    else:
        pd = tl.zeros(acc.shape, dtype=tl.float32)
    return pd


@triton.jit
def _block_end(acc, pd, s, FOLD: tl.constexpr):
    """The accumulator after an FP8 scale block: its dot ``pd`` (the running sum on "fold"), or
    ``acc + s * pd`` (:func:`ds4t.backend.scaled_add`, s the block's per-row scales)."""
    if FOLD:
        out = pd
    else:
        out = scaled_add(acc, pd, s)
    return out


@triton.jit
def _route_act(a, WDT: tl.constexpr, TF32: tl.constexpr):
    """A pair tile's activations (any float dtype) as the MMA operand of an FP8 route: rounded to WDT and
    held in fp32 for "tf32", else cast to WDT."""
    if TF32:
        out = round_in_f32(a.to(tl.float32), WDT)
    else:
        out = cast(a.to(tl.float32), WDT)
    return out


@triton.jit
def _route_dot(a, w, acc, a_scale, FP8_ROUTE: tl.constexpr, SWAP: tl.constexpr):
    """acc + the dot of activation tile a (:func:`_route_act`) with an FP8 weight tile as route FP8_ROUTE made it
    (:func:`ds4t.backend.fp8_operand`): "x2" meets the weight with a's two fp8 pieces, "f16" with a scaled
    into fp16 by ``a_scale`` (read on that route only), the others by :func:`_pair_dot`."""
    if FP8_ROUTE == 4:
        x1, x2, inv = fp8_pieces(a)
        acc += mma_fp8_pieces(w, x1, x2, inv, SWAP)
    elif FP8_ROUTE == 5:
        acc = _pair_dot(f16_scaled(a, a_scale), w, acc, SWAP, False)
    else:
        acc = _pair_dot(a, w, acc, SWAP, FP8_ROUTE == 2)
    return acc


@triton.jit
def _moe_gate_up_kernel(
    h_ptr, sh_b, order_ptr, bounds_ptr, experts_ptr,
    wg_ptr, wu_ptr, sw_e, sw_n, sw_k,
    act_ptr, sa_p,
    D, I, KTOP, E,
    WDT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    DEVICE_LIST: tl.constexpr, BE: tl.constexpr, ACT_ROUNDED: tl.constexpr,
    sg_ptr=None, su_ptr=None, ss_e=0, ss_n=0, SBK: tl.constexpr = 0, KSTEP: tl.constexpr = 0,
    FP8_ROUTE: tl.constexpr = 0, SWAP: tl.constexpr = False,
    SPLIT: tl.constexpr = 1, K_PER_SPLIT: tl.constexpr = 0, sa_s=0,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False, slots_ptr=None,
    ids_ptr=None, si_b=0, P=0, SHARED=-1, KR: tl.constexpr = 0, SELF: tl.constexpr = False,
    ROW_PROGRAMS: tl.constexpr = False, SB: tl.constexpr = 1, M_SUB: tl.constexpr = 1,
    ORDERED: tl.constexpr = False, wg_desc=None, wu_desc=None, USE_TMA: tl.constexpr = False,
):
    """EVEN_K / EVEN_N (from the shapes): D is a whole number of loop steps / I of N tiles, so no weight,
    scale or activation load needs a column or row mask (the same values).

    SELF (a launch of at most BM pairs, :data:`SELF_GROUP_PAIRS`): no grouping kernel ran; each program
    finds its slot's expert and pairs from the ids (``ids`` [B, KR], row stride si_b; P pairs; the shared
    expert SHARED at rank KR when KTOP > KR) (:func:`_self_slot`).

    ``slots`` (int32 [grid 0], or None): program (i, 0, 0) stores slot i's expert there, -1 when the slot
    has none, for the down kernel.

    FP8 weights (SBK > 0): wg/wu hold float8_e4m3fn, sg/su their fp32 scales [E, I, cdiv(D, SBK)]
    (strides ss_e, ss_n, 1) and WDT is the activation dtype. D runs in scale blocks of KSTEP
    columns (BK sub-tiles each, BK divides SBK); a block's dot starts from zero and is added to the
    accumulator times its per-row scale, as in :func:`ds4t.kernels.linear.linear`. SB (> 1: each split a
    whole number of SB-block steps, :func:`blocks_a_step`): a loop step takes SB blocks in turn, each with
    the one-block step's operations. SWAP: the tiles are computed transposed (:func:`_pair_dot`); a pair's
    K order is the same.

    SPLIT > 1 (grid axis 2 = split s): the program sums columns s*K_PER_SPLIT .. (s+1)*K_PER_SPLIT of D
    (whole loop steps) and stores its fp32 partials g, u at act[s, p, :I], act[s, p, I:] (strides sa_s,
    sa_p); :func:`_moe_act_kernel` adds the SPLIT partials in split order and applies silu(g) * u.
    ORDERED (FP8, a route whose blocks start from zero): the program stores each scale block's dots instead,
    at act[j] for block j (stride sa_s), and :func:`_moe_act_kernel` adds them in block order times their
    scales -- this kernel's own operations, so the bits are the unsplit launch's at every SPLIT.

    ROW_PROGRAMS: program_id(0) is a row tile, not a slot (:func:`_program_tile`); no ``slots``.

    M_SUB (2; FP8 weights, not SELF, not the "f16" route): a program's tile is two BM-pair sub-tiles, each with
    its own dots on the same converted weight tiles (``MoEConfig.m_sub``): each pair's operations as with M_SUB 1.

    USE_TMA (``MoEConfig.tma``): the weight tiles (16-bit, or fp8 before their conversion) come through the tensor
    descriptors wg_desc / wu_desc (:func:`_w_desc_tile`) instead of pointer loads -- the same operands, so the same
    bits."""
    grid_dependency()
    tl.static_assert(M_SUB == 1 or (M_SUB == 2 and SBK > 0 and not SELF and FP8_ROUTE != 5))
    tl.static_assert(not ORDERED or (SBK > 0 and FP8_ROUTE != 3 and FP8_ROUTE != 5))
    TILE: tl.constexpr = BM * M_SUB
    e, start, end, pairs = _program_pairs(ids_ptr, si_b, P, KTOP, SHARED, KR, TILE, bounds_ptr, experts_ptr, E, BE,
                                          SELF, ROW_PROGRAMS, DEVICE_LIST)
    pid_n = tl.program_id(1)
    if slots_ptr is not None:
        _store_slot(slots_ptr, e, start, end, (pid_n == 0) & (tl.program_id(2) == 0))
    k_lo, k_hi = _split_range(D, SPLIT, K_PER_SPLIT)
    EVEN_W: tl.constexpr = EVEN_K and EVEN_N   # weight tiles need no mask
    FOLD: tl.constexpr = FP8_ROUTE == 3        # "fold": one accumulator over D
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < I
    wbase = e.to(tl.int64) * sw_e
    for m0 in range(start, end, TILE):
        qm, p = _tile_pairs(m0, end, order_ptr, pairs, SELF, BM)
        b = p // KTOP
        acc_g = _acc_tile(BM, BN, SWAP)
        acc_u = acc_g
        if M_SUB == 2:
            qm1, p1 = _tile_pairs(m0 + BM, end, order_ptr, pairs, SELF, BM)
            b1 = p1 // KTOP
            acc_g1 = acc_g
            acc_u1 = acc_g
        if SBK > 0:
            s_row = e.to(tl.int64) * ss_e + n * ss_n
            if FP8_ROUTE == 5:   # "f16": one power-of-two scale per pair over this program's columns
                a_scale, a_inv = _f16_row_scales(h_ptr, sh_b, b, qm, k_lo, k_hi, D, BK, EVEN_K, WDT, BM)
            else:
                a_scale = 1.0
            for kb0 in range(k_lo, k_hi, KSTEP * SB):
                for sbi in tl.static_range(SB):
                    kb = kb0 + sbi * KSTEP
                    j = kb // SBK
                    sg = _row_scales(sg_ptr + s_row + j, nm, SWAP, EVEN_N)
                    su = _row_scales(su_ptr + s_row + j, nm, SWAP, EVEN_N)
                    pg = _block_start(acc_g, FOLD)
                    pu = _block_start(acc_u, FOLD)
                    if M_SUB == 2:
                        pg1 = _block_start(acc_g1, FOLD)
                        pu1 = _block_start(acc_u1, FOLD)
                    for ks in tl.static_range(0, KSTEP, BK):
                        kk = kb + ks + tl.arange(0, BK)
                        km = kk < D
                        a = _h_tile(h_ptr, sh_b, b, qm, kk, km, EVEN_K)
                        if USE_TMA:
                            wg = _w_desc_tile(wg_desc, e, pid_n * BN, kb + ks, BN, BK, SWAP)
                            wu = _w_desc_tile(wu_desc, e, pid_n * BN, kb + ks, BN, BK, SWAP)
                        else:
                            wg = _w_tile(wg_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                            wu = _w_tile(wu_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                        wg = fp8_operand(wg, sg, WDT, FP8_ROUTE)
                        wu = fp8_operand(wu, su, WDT, FP8_ROUTE)
                        a = _route_act(a, WDT, FP8_ROUTE == 2)
                        pg = _route_dot(a, wg, pg, a_scale, FP8_ROUTE, SWAP)
                        pu = _route_dot(a, wu, pu, a_scale, FP8_ROUTE, SWAP)
                        if M_SUB == 2:
                            a1 = _route_act(_h_tile(h_ptr, sh_b, b1, qm1, kk, km, EVEN_K), WDT, FP8_ROUTE == 2)
                            pg1 = _route_dot(a1, wg, pg1, a_scale, FP8_ROUTE, SWAP)
                            pu1 = _route_dot(a1, wu, pu1, a_scale, FP8_ROUTE, SWAP)
                    if ORDERED:   # the block's dots, for _moe_act_kernel to add in block order
                        blk = act_ptr + j * sa_s
                        _store_tile(blk, p, sa_p, n, qm, nm, pg, SWAP)
                        _store_tile(blk + I, p, sa_p, n, qm, nm, pu, SWAP)
                        if M_SUB == 2:
                            _store_tile(blk, p1, sa_p, n, qm1, nm, pg1, SWAP)
                            _store_tile(blk + I, p1, sa_p, n, qm1, nm, pu1, SWAP)
                    else:
                        acc_g = _block_end(acc_g, pg, sg, FOLD)
                        acc_u = _block_end(acc_u, pu, su, FOLD)
                        if M_SUB == 2:
                            acc_g1 = _block_end(acc_g1, pg1, sg, FOLD)
                            acc_u1 = _block_end(acc_u1, pu1, su, FOLD)
            if FP8_ROUTE == 5:
                acc_g = acc_g * _pair_vec(a_inv, SWAP)
                acc_u = acc_u * _pair_vec(a_inv, SWAP)
        else:
            for k0 in range(k_lo, k_hi, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < D
                a = _h_tile(h_ptr, sh_b, b, qm, kk, km, EVEN_K)
                a = cast(a.to(tl.float32), WDT)
                if USE_TMA:
                    wg = _w_desc_tile(wg_desc, e, pid_n * BN, k0, BN, BK, SWAP)
                    wu = _w_desc_tile(wu_desc, e, pid_n * BN, k0, BN, BK, SWAP)
                else:
                    wg = _w_tile(wg_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                    wu = _w_tile(wu_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                acc_g = _pair_dot(a, wg, acc_g, SWAP, False)
                acc_u = _pair_dot(a, wu, acc_u, SWAP, False)
        if not ORDERED:
            _store_gate_up(act_ptr, sa_s, sa_p, I, p, n, qm, nm, acc_g, acc_u, SPLIT, ACT_ROUNDED, WDT, SWAP)
            if M_SUB == 2:
                _store_gate_up(act_ptr, sa_s, sa_p, I, p1, n, qm1, nm, acc_g1, acc_u1, SPLIT, ACT_ROUNDED, WDT,
                               SWAP)


@triton.jit
def _store_gate_up(act_ptr, sa_s, sa_p, I, p, n, qm, nm, acc_g, acc_u, SPLIT: tl.constexpr, ACT_ROUNDED: tl.constexpr,
                   WDT: tl.constexpr, SWAP: tl.constexpr):
    """A gate/up tile's result: its split's fp32 partials g, u (SPLIT > 1), else silu(g) * u (rounded to WDT for a
    16-bit act buffer, as the down kernel would round each load)."""
    if SPLIT > 1:
        part = act_ptr + tl.program_id(2) * sa_s
        _store_tile(part, p, sa_p, n, qm, nm, acc_g, SWAP)
        _store_tile(part + I, p, sa_p, n, qm, nm, acc_u, SWAP)
    else:
        act = _silu(acc_g) * acc_u
        if ACT_ROUNDED:
            act = cast(act, WDT)
        _store_tile(act_ptr, p, sa_p, n, qm, nm, act, SWAP)


@triton.jit
def _moe_down_kernel(
    act_ptr, sa_p, order_ptr, bounds_ptr, experts_ptr,
    wd_ptr, sw_e, sw_n, sw_k,
    y_ptr, sy_p,
    D, I, E,
    WDT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    sd_ptr=None, ss_e=0, ss_n=0, SBK: tl.constexpr = 0, KSTEP: tl.constexpr = 0,
    FP8_ROUTE: tl.constexpr = 0, SWAP: tl.constexpr = False,
    SPLIT: tl.constexpr = 1, K_PER_SPLIT: tl.constexpr = 0, sy_s=0,
    EVEN_K: tl.constexpr = False, EVEN_N: tl.constexpr = False,
    ids_ptr=None, si_b=0, P=0, KT=1, SHARED=-1, KR: tl.constexpr = 0, SELF: tl.constexpr = False,
    DEVICE_LIST: tl.constexpr = False, BE: tl.constexpr = 1, ROW_PROGRAMS: tl.constexpr = False,
    SB: tl.constexpr = 1, M_SUB: tl.constexpr = 1, wd_desc=None, USE_TMA: tl.constexpr = False,
):
    """FP8 weights (SBK > 0): as :func:`_moe_gate_up_kernel`, over I, scales [E, D, cdiv(I, SBK)], SB blocks a
    loop step as there; EVEN_K /
    EVEN_N as there (I a whole number of loop steps, D of N tiles). SELF as there.
    SPLIT > 1 (grid axis 2): the program sums its split of I and stores fp32 partials at y + split * sy_s, which the combine
    kernel adds in split order. ``experts`` lists each slot's expert (-1: none): the gate/up kernel's ``slots``
    or the host-made list; DEVICE_LIST: found from ``bounds`` as the gate/up kernel does (when that kernel ran
    row programs and wrote no slots); ROW_PROGRAMS: one row tile a program (:func:`_program_tile`). M_SUB and
    USE_TMA (wd_desc) as there."""
    grid_dependency()
    tl.static_assert(M_SUB == 1 or (M_SUB == 2 and SBK > 0 and not SELF and FP8_ROUTE != 5))
    TILE: tl.constexpr = BM * M_SUB
    e, start, end, pairs = _program_pairs(ids_ptr, si_b, P, KT, SHARED, KR, TILE, bounds_ptr, experts_ptr, E, BE,
                                          SELF, ROW_PROGRAMS, DEVICE_LIST)
    pid_n = tl.program_id(1)
    n = pid_n * BN + tl.arange(0, BN)
    nm = n < D
    wbase = e.to(tl.int64) * sw_e
    k_lo, k_hi = _split_range(I, SPLIT, K_PER_SPLIT)
    EVEN_W: tl.constexpr = EVEN_K and EVEN_N   # weight tiles need no mask
    FOLD: tl.constexpr = FP8_ROUTE == 3        # "fold": one accumulator over I
    for m0 in range(start, end, TILE):
        qm, p = _tile_pairs(m0, end, order_ptr, pairs, SELF, BM)
        acc = _acc_tile(BM, BN, SWAP)
        if M_SUB == 2:
            qm1, p1 = _tile_pairs(m0 + BM, end, order_ptr, pairs, SELF, BM)
            acc1 = acc
        if SBK > 0:
            s_row = e.to(tl.int64) * ss_e + n * ss_n
            if FP8_ROUTE == 5:   # "f16": one power-of-two scale per pair over this program's columns
                a_scale, a_inv = _f16_row_scales(act_ptr, sa_p, p, qm, k_lo, k_hi, I, BK, EVEN_K, WDT, BM)
            else:
                a_scale = 1.0
            for kb0 in range(k_lo, k_hi, KSTEP * SB):
                for sbi in tl.static_range(SB):
                    kb = kb0 + sbi * KSTEP
                    sd = _row_scales(sd_ptr + s_row + kb // SBK, nm, SWAP, EVEN_N)
                    pd = _block_start(acc, FOLD)
                    if M_SUB == 2:
                        pd1 = _block_start(acc1, FOLD)
                    for ks in tl.static_range(0, KSTEP, BK):
                        kk = kb + ks + tl.arange(0, BK)
                        km = kk < I
                        a = _act_tile(act_ptr, sa_p, p, qm, kk, km, EVEN_K)
                        if USE_TMA:
                            w = _w_desc_tile(wd_desc, e, pid_n * BN, kb + ks, BN, BK, SWAP)
                        else:
                            w = _w_tile(wd_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                        w = fp8_operand(w, sd, WDT, FP8_ROUTE)
                        pd = _route_dot(_route_act(a, WDT, FP8_ROUTE == 2), w, pd, a_scale, FP8_ROUTE, SWAP)
                        if M_SUB == 2:
                            a1 = _act_tile(act_ptr, sa_p, p1, qm1, kk, km, EVEN_K)
                            pd1 = _route_dot(_route_act(a1, WDT, FP8_ROUTE == 2), w, pd1, a_scale, FP8_ROUTE, SWAP)
                    acc = _block_end(acc, pd, sd, FOLD)
                    if M_SUB == 2:
                        acc1 = _block_end(acc1, pd1, sd, FOLD)
            if FP8_ROUTE == 5:
                acc = acc * _pair_vec(a_inv, SWAP)
        else:
            for k0 in range(k_lo, k_hi, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < I
                a = cast(_act_tile(act_ptr, sa_p, p, qm, kk, km, EVEN_K), WDT)
                if USE_TMA:
                    w = _w_desc_tile(wd_desc, e, pid_n * BN, k0, BN, BK, SWAP)
                else:
                    w = _w_tile(wd_ptr, wbase, n, nm, kk, km, sw_n, sw_k, SWAP, EVEN_W)
                acc = _pair_dot(a, w, acc, SWAP, False)
        _store_tile(y_ptr + tl.program_id(2) * sy_s, p, sy_p, n, qm, nm, acc, SWAP)
        if M_SUB == 2:
            _store_tile(y_ptr + tl.program_id(2) * sy_s, p1, sy_p, n, qm1, nm, acc1, SWAP)


@triton.jit
def combine_rows(y_ptr, sy_p, r64, rm, cc, m, w_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED,
                 KTOP: tl.constexpr, KT: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, sy_s):
    """fp32 [ROWS, BD]: rows r64 [ROWS] (mask rm) combined over their KT ranks in order,
    ``0 + w[r, 0] * y[r KT + 0, cc] + w[r, 1] * y[r KT + 1, cc] + ...``, cc [1, BD] the columns, m [ROWS, BD]
    (or broadcastable) the element mask. A skipped pair (expert -1) adds 0 and its y row, never written, is not
    read. SPLIT > 1: y[p] = y_0 + y_1 + ..., the down kernel's split partials (stride sy_s) in split order.
    The one definition of the combine: ``_moe_combine_kernel`` and the norm that takes the combine in
    (:func:`ds4t.kernels.norm._load_x`) both call it, so the two give the same bits."""
    acc = tl.zeros([r64.shape[0], cc.shape[1]], dtype=tl.float32)
    for j in tl.static_range(KT):
        wj = _pair_weight(w_ptr, sw_b, gate_ptr, sg_b, r64, j, rm, KTOP, GATED)
        ok = _pair_expert(ids_ptr, si_b, r64, j, rm, KTOP, SHARED) >= 0
        yj = split_sum(y_ptr + (r64 * KT + j)[:, None] * sy_p + cc, m & ok[:, None], sy_s, SPLIT)
        acc = acc + tl.where(ok, wj, 0.0)[:, None] * yj
    return acc


@triton.jit
def _moe_combine_kernel(
    y_ptr, sy_p, w_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED, out_ptr, so_b, B, D,
    KTOP: tl.constexpr, KT: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr, BD: tl.constexpr,
    SPLIT: tl.constexpr = 1, sy_s=0,
):
    """out[b] = sum over ranks j in order of w[b, j] * y[b, j] (:func:`combine_rows`)."""
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    n = tl.program_id(1) * BD + tl.arange(0, BD)
    rm = r < B
    m2 = rm[:, None] & (n < D)[None, :]
    r64 = r.to(tl.int64)
    acc = combine_rows(y_ptr, sy_p, r64, rm, n[None, :], m2, w_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED,
                       KTOP, KT, GATED, SPLIT, sy_s)
    tl.store(out_ptr + r64[:, None] * so_b + n[None, :], acc, mask=m2)


def _check_args(h, ids, weights, w_gate, w_up, w_down, shared_expert, shared_gate):
    if h.dim() != 2 or ids.dim() != 2 or weights.shape != ids.shape or ids.shape[0] != h.shape[0]:
        raise ValueError(f"h [B, D], ids [B, k], weights [B, k] expected; got {tuple(h.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(weights.shape)}")
    E, I, D = w_gate.shape
    if h.shape[1] != D or w_up.shape != (E, I, D) or w_down.shape != (E, D, I):
        raise ValueError(f"weights must be w_gate/w_up [E, I, D], w_down [E, D, I] with D={h.shape[1]}; got "
                         f"{tuple(w_gate.shape)}, {tuple(w_up.shape)}, {tuple(w_down.shape)}")
    gguf = [isinstance(w, GGUFWeight) for w in (w_gate, w_up, w_down)]
    if any(gguf):
        from ds4t.kernels import qmoe

        qmoe.check_weights(w_gate, w_up, w_down)
    elif not (w_gate.dtype == w_up.dtype == w_down.dtype):
        raise TypeError("w_gate, w_up, w_down must share one dtype (all float of one dtype, or all FP8Weight)")
    fp8 = [isinstance(w, FP8Weight) for w in (w_gate, w_up, w_down)]
    if any(fp8) and not all(fp8):
        raise TypeError("w_gate, w_up, w_down: cannot mix FP8Weight and float weights")
    if all(fp8) and len({w.block_k for w in (w_gate, w_up, w_down)}) != 1:
        raise ValueError(f"w_gate, w_up, w_down must share one block_k, got "
                         f"{[w.block_k for w in (w_gate, w_up, w_down)]}")
    if shared_expert is None:
        if shared_gate is not None:
            raise ValueError("shared_gate without shared_expert")
        if ids.shape[1] == 0:
            raise ValueError("ids [B, 0]: no expert to run (k = 0 needs a shared_expert)")
    else:
        if not 0 <= int(shared_expert) < E:
            raise ValueError(f"shared_expert={shared_expert} is not an expert index in [0, {E})")
        if shared_gate is not None and (shared_gate.dim() != 1 or shared_gate.shape[0] != h.shape[0]):
            raise ValueError(f"shared_gate must be [B={h.shape[0]}], got {tuple(shared_gate.shape)}")
    return E, I, D


def _unit_k(w: FP8Weight) -> FP8Weight:
    """The grouped kernels take any expert and row strides, but a unit stride along K."""
    return w if w.data.stride(-1) == 1 and w.scale.stride(-1) == 1 else w.contiguous()


def _fp8_route(cfg: MoEConfig, act_dtype) -> int:
    return fp8_route("moe_experts", cfg.fp8_route, act_dtype)


def weight_descriptors(cfg: "MoEConfig", weights: dict, BN: int, BK: int) -> dict:
    """The kernel keywords of a launch whose weight tiles come through tensor descriptors (``weights``: keyword ->
    [E, N, K] tensor; block [1, BN, BK]) plus ``USE_TMA``, or {} where the launch cannot take them: the config
    does not ask (``MoEConfig.tma``), the backend has no tensor descriptors, the weights are neither 16-bit nor
    fp8 (the fp8 tiles are converted in registers after the load), or a base or outer stride is not a multiple of
    16 bytes."""
    if not (cfg.tma and TMA):
        return {}
    wanted = (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
    if not all(w.dtype in wanted and tma_aligned(w) for w in weights.values()):
        return {}
    from triton.tools.tensor_descriptor import TensorDescriptor

    return dict({k: TensorDescriptor(w, list(w.shape), list(w.stride()), [1, BN, BK]) for k, w in weights.items()},
                USE_TMA=True)


def group_pairs(ids: torch.Tensor, num_experts: int, shared_expert: Optional[int] = None):
    """The (row, rank) pairs grouped by expert, on the device, in one launch.

    ids [B, k] int32/int64 (row stride any, unit column stride when k > 1); with ``shared_expert``
    every row has one more pair, rank k, naming that expert. Pairs are numbered p = b·KT + j.
    Returns (order int32 [B·KT], bounds int32 [E+1]): the pairs of expert e, in pair order, are
    ``order[bounds[e]:bounds[e+1]]`` (a stable sort of the pairs by expert)."""
    B, k = ids.shape
    KT = k + (shared_expert is not None)
    P = B * KT
    order = torch.empty((P,), dtype=torch.int32, device=ids.device)
    bounds = torch.empty((num_experts + 1,), dtype=torch.int32, device=ids.device)
    if P == 0:
        bounds.zero_()
        return order, bounds
    _moe_group_kernel[(num_experts,)](
        ids, ids.stride(0), order, bounds, P, -1 if shared_expert is None else int(shared_expert),
        KTOP=k, KT=KT, BP=min(1024, triton.next_power_of_2(P)), **LAUNCH,
    )
    return order, bounds


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Launch constants of a grouped kernel: caps on its N and K tiles (the tile is
    max(16, min(cap, next_pow2(size)))), warps and pipeline stages (None: Triton's default)."""
    tile_n: int
    tile_k: int
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    fp8_route: str = "direct"   # FP8 weights: how fp8 tiles become MMA operands (ds4t.backend.FP8_ROUTES)
    block_m: int = BLOCK_M      # pairs per tile (a row tile: more pairs share one weight-tile read)
    min_rows: int = 0           # a row-tile entry applies to launches of at least this many rows
    max_rows: int = 0           # a few-rows entry applies to launches of at most this many rows
    swap: bool = False          # compute the tiles as w @ h^T: the weight rows fill the MMA's M side
    split: int = 1              # K splits (whole loop steps), their partials summed in split order after it
    row_programs: bool = False  # one program per (expert, row tile) instead of per expert (_program_tile)
    scale_blocks: int = 1       # FP8: scale blocks a K-loop step, each with the one-block step's operations (same
                                # bits); a launch whose splits are not whole steps of them takes one (blocks_a_step)
    m_sub: int = 1              # FP8: block_m-pair sub-tiles a program (1 or 2), each its own dots on the same
                                # converted weight tiles (the same bits; a row tile for FP8: sub_tiles())
    m_sub_pairs: int = 0        # m_sub applies to launches of at least this many pairs an expert on average
    ordered_split: bool = False  # FP8 gate/up: the K splits store each scale block's dot, added in block order
                                 # after (the unsplit bits at any split count: sum_order())
    tma: bool = False           # weight tiles through tensor descriptors where the launch allows it
                                # (:func:`weight_descriptors`; the same operands, so the same bits)

    def tiles(self, N: int, K: int, scale_bk: int = 0):
        """(BN, BK) for an [N, K] weight: from the weight shape only (and for FP8 weights the scale
        block, which BK must divide: BK halves until it does)."""
        bk = max(16, min(self.tile_k, triton.next_power_of_2(K)))
        while scale_bk and bk > 16 and scale_bk % bk:
            bk //= 2
        if scale_bk and scale_bk % bk:
            raise ValueError(f"moe_experts: no K tile >= 16 divides the FP8 weights' block_k={scale_bk}")
        return max(16, min(self.tile_n, triton.next_power_of_2(N))), bk


def k_step(K: int, BK: int, scale_bk: int) -> int:
    """Columns per K-loop step of an FP8 grouped kernel: one scale block, min(scale_bk, K rounded up to BK)."""
    return min(scale_bk, triton.cdiv(K, BK) * BK)


FEW_ROWS_FREE = {"fp8": ("num_stages", "scale_blocks"),
                 "16-bit": ("num_stages", "num_warps", "tile_n", "tile_k", "tma")}
"""The fields a few-rows entry may change from the decode entry, per weight format (:func:`_config`).
16-bit weights: the fields a row tile may change as well -- on an H200 every bf16 tile shape, K tile and
warp count gives the decode tile's bits (bench/mma_shapes.py; bench/moe_tiles.py ``same-bits`` at one row).
FP8 weights: the pipeline depth only -- an 8-bit operand's layout follows the tile and the MMA it feeds,
and 4-warp tiles of the same sweep changed bits (bench/results/2026-12-02-h200-few-rows.md) -- and the scale
blocks a loop step (the same operations in the same order). In the
interpreter a K tile changes bits (its MMA sums each K tile before adding it); it has no few-rows entries."""


def blocks_a_step(cfg: MoEConfig, K: int, step: int, kps: int) -> int:
    """Scale blocks a K-loop step of an FP8 grouped launch: ``cfg.scale_blocks`` when K and each split's
    ``kps`` columns are whole steps of that many ``step``-column blocks, else 1. Either way a block's
    operations and their order are the same (the bits do not depend on it): what changes is how many
    weight bytes a loop step asks for, so the pipeline keeps more of them in flight."""
    if not isinstance(cfg.scale_blocks, int) or cfg.scale_blocks < 1:
        raise ValueError(f"moe_experts: scale_blocks must be a positive int, got {cfg.scale_blocks!r}")
    whole = step * cfg.scale_blocks
    return cfg.scale_blocks if K % whole == 0 and kps % whole == 0 else 1


def sub_tiles(cfg: MoEConfig, fp8: bool, self_group: bool, adt, P: int = 0, E: int = 1) -> int:
    """Pair sub-tiles a program of a grouped launch of P pairs over E experts runs on one converted weight
    tile (``MoEConfig.m_sub``): FP8 weights only (16-bit weights take bigger row tiles, ``block_m``,
    instead), never in a self-grouped launch (its one tile is the slot's own pairs), not on the "f16" route
    (its scale is per tile), and only once the launch has ``cfg.m_sub_pairs`` pairs an expert on average
    (P >= m_sub_pairs * E: fewer leave the second sub-tile mostly empty and halve the programs; timed on an
    H100, bench/results/2026-12-06-h100-fp8-moe-sub-tiles.md). Each sub-tile's dots are a 1-sub-tile
    program's, so the bits do not depend on it. Not with fp32 activations either: compiled for sm_90 at
    Qwen3-Next's experts the two-sub-tile down kernel keeps 32 registers and 10.6 KB of stack a thread (one
    sub-tile: 1 KB; bf16 activations: 320 bytes; tests/test_gpu_compile.py). ValueError for another count."""
    if cfg.m_sub not in (1, 2):
        raise ValueError(f"moe_experts: m_sub must be 1 or 2, got {cfg.m_sub}")
    if cfg.m_sub == 1 or self_group or P < cfg.m_sub_pairs * E or adt == torch.float32:
        return 1
    if not fp8 or _fp8_route(cfg, adt) == 5:
        raise ValueError(f"moe_experts: m_sub 2 needs FP8 weights on a route other than 'f16' ({cfg})")
    return 2


def sum_order(cfg: MoEConfig, kernel: str, fp8: bool):
    """What a launch's bits depend on besides its tiles: "blocks" when every pair sums K in scale-block order
    from one accumulator -- an unsplit launch, or an FP8 gate/up whose K splits store each block's dot for
    :func:`_moe_act_kernel` to add in that order (``ordered_split``: split counts then change no bit) -- else
    the K split count. ValueError for an ordered split the kernel cannot run: 16-bit weights (their dot
    accumulates across blocks), the down kernel, or an FP8 route whose blocks do not start from zero
    ("fold", "f16")."""
    if cfg.ordered_split:
        if not fp8 or kernel != "gate_up" or cfg.fp8_route in ("fold", "f16"):
            raise ValueError(f"moe {kernel}: an ordered split needs FP8 gate/up weights on a route whose scale "
                             f"blocks start from zero ({cfg})")
        return "blocks"
    return "blocks" if cfg.split == 1 else ("split", cfg.split)


def few_entry_keeps_bits(few: MoEConfig, cfg: MoEConfig, kernel: str, fp8: bool) -> bool:
    """Whether a few-rows entry gives every pair the bits of its decode entry ``cfg``: it differs only in
    :data:`FEW_ROWS_FREE` and in an ordered K split (the same :func:`sum_order`)."""
    free = FEW_ROWS_FREE["fp8" if fp8 else "16-bit"]
    return (sum_order(few, kernel, fp8) == sum_order(cfg, kernel, fp8)
            and differs_only_in(few, cfg, ("max_rows", "split", "ordered_split", *free)))


def k_per_split(K: int, split: int, step: int) -> int:
    """Columns per split of a grouped kernel's K: whole loop steps of ``step`` columns (from K and the
    config only). Raises when the split would leave a split empty."""
    kps = triton.cdiv(triton.cdiv(K, split), step) * step
    if split > 1 and triton.cdiv(K, kps) != split:
        raise ValueError(f"moe_experts: split={split} of K={K} in steps of {step} leaves a split empty")
    return kps


_INTERP_CONFIG = MoEConfig(tile_n=128, tile_k=128)
"""The interpreter's: few, big programs (it pays per program and per op)."""


def _config(kernel: str, fmt: tuple, B: int, K: int = 0) -> MoEConfig:
    """The launch config of a B-row launch over a K-column weight: the few-rows entry (key + ("few", K))
    when B is at most its ``max_rows``, the row-tile entry when B reaches its ``min_rows``, else the decode
    entry. A few-rows entry may differ from the decode entry only in fields that leave a pair's bits alone
    (:data:`FEW_ROWS_FREE`, checked here): for FP8 weights the pipeline depth (``num_stages``: when loads
    are issued, not what is computed), for 16-bit weights also the N / K tiles and warps, which a row tile
    may change too (below). On an H200 every such config timed gave the default's bits (bench/moe_tiles.py
    ``same-bits``; bench/step_ab.py on whole steps). A row tile changes how many pairs share a weight-tile read and the MMA instruction,
    not a pair's bits: the K order and (FP8) the scale steps are the same, the conversion route must be
    (checked here), and on an H200 the tile shape does not change an MMA's bits (bench/mma_shapes.py,
    bench/moe_tiles.py --rows). The interpreter has one config for every key (its MMA sums each K tile
    before adding it, so there a row tile must keep the K tile: tests force one that does)."""
    cfg = MOE_CONFIGS(kernel, *fmt)
    few = _few_entry(kernel, fmt, K)
    fp8 = "fp8" in fmt
    if few is not None and B <= few.max_rows:
        if not few_entry_keeps_bits(few, cfg, kernel, fp8):
            free = FEW_ROWS_FREE["fp8" if fp8 else "16-bit"]
            raise ValueError(f"moe {kernel}: a few-rows entry may change {', '.join(free)} and an ordered K split "
                             f"only ({few} vs {cfg})")
        return few
    rows = MOE_CONFIGS(kernel, *fmt, "rows")
    if rows is None or B < rows.min_rows:
        return cfg
    same_sums = {"direct": "exact", "f32": "exact"}   # the exact 16-bit routes give the same bits
    if same_sums.get(rows.fp8_route, rows.fp8_route) != same_sums.get(cfg.fp8_route, cfg.fp8_route):
        raise ValueError(f"moe {kernel}: a row tile must keep the decode config's MMA route ({cfg.fp8_route})")
    if sum_order(rows, kernel, fp8) != sum_order(cfg, kernel, fp8):
        raise ValueError(f"moe {kernel}: a row tile must keep the decode config's K split ({cfg.split})")
    return rows


def evenness(K: int, step: int, N: int, BN: int) -> dict:
    """The grouped kernels' EVEN_K / EVEN_N for a weight [N, K]: K a whole number of loop steps, N of N
    tiles -- then no load needs a column / row mask. Every real expert shape is even (multiples of 128);
    the masks only select values that are in range either way, so a launch has the same bits with or
    without them."""
    return dict(EVEN_K=K % step == 0, EVEN_N=N % BN == 0)


def _few_default(kernel: str, fmt: tuple) -> MoEConfig:
    """A few-rows key without an entry: the decode entry, applying to no launch (max_rows 0) -- so that a
    benchmark's override (``config.overridden``: {"key": [kernel, ..., "few", K], "fields": {"num_stages": 8,
    "max_rows": 1}}) has a base to change."""
    return dataclasses.replace(MOE_CONFIGS(kernel, *fmt[:fmt.index("few")]), max_rows=0)


@functools.lru_cache(maxsize=None)
def _few_entry(kernel: str, fmt: tuple, K: int) -> Optional[MoEConfig]:
    """MOE_CONFIGS' few-rows entry of (kernel, fmt, K), looked up once per key (every launch asks; the
    entry-less answer is built by :func:`_few_default`). Cleared with the table (``MOE_CONFIGS.caches``)."""
    return MOE_CONFIGS(kernel, *fmt, "few", K)


def _unknown_kernel(kernel: str):
    raise KeyError(f"no MoE launch config for kernel {kernel!r}: the grouped kernels are 'gate_up' and 'down'")

_FP8_GATE_UP = MoEConfig(tile_n=32, tile_k=128, num_warps=2, num_stages=3, fp8_route="f32", swap=True)
_FP8_DOWN = MoEConfig(tile_n=128, tile_k=128, num_warps=2, num_stages=3, fp8_route="f32", swap=True)

MOE_CONFIGS: ConfigTable[MoEConfig] = ConfigTable(
    "moe", gpu={"gate_up": MoEConfig(tile_n=64, tile_k=128, num_warps=4, num_stages=3, row_programs=True),
                "down": MoEConfig(tile_n=128, tile_k=128, num_warps=4, num_stages=3, row_programs=True),
                ("gate_up", "fp8"): _FP8_GATE_UP,
                ("down", "fp8"): _FP8_DOWN,
                # launches of many rows (prefill chunks, big decode steps; MoEConfig.min_rows, _config()):
                # bf16 row tiles, FP8 the decode tiles in row programs (see below)
                ("gate_up", "rows"): MoEConfig(tile_n=64, tile_k=64, num_warps=4, num_stages=3, block_m=64,
                                               min_rows=128, row_programs=True),
                # down: 256 columns, 8 warps, 4 stages (GLM-4.5-4l's prompt -3.1 %, the same bits; see below)
                ("down", "rows"): MoEConfig(tile_n=256, tile_k=64, num_warps=8, num_stages=4, block_m=64,
                                            min_rows=128, row_programs=True),
                # FP8 rows: two 16-pair sub-tiles a program from 48 pairs an expert (GLM-4.5's 1024-row chunk
                # -5 %; fewer pairs an expert lost: Qwen3-Next's chunk +5.5 %, a 64-row step +16 %; same bits)
                ("gate_up", "fp8", "rows"): dataclasses.replace(_FP8_GATE_UP, row_programs=True, min_rows=64,
                                                                m_sub=2, m_sub_pairs=48),
                # one- and two-row launches over GLM-4.5's experts (K = 5120): two scale blocks a loop step in
                # two stages, the same bits (an H100, bench/results/2026-12-06-h100-n1-anatomy.md)
                ("gate_up", "fp8", "few", 5120): dataclasses.replace(_FP8_GATE_UP, num_stages=2, scale_blocks=2,
                                                                     max_rows=2),
                ("down", "fp8", "rows"): dataclasses.replace(_FP8_DOWN, row_programs=True, min_rows=64, m_sub=2,
                                                             m_sub_pairs=48)},
    gpu_rule=lambda kernel, *fmt: _few_default(kernel, fmt) if "few" in fmt else
    None if "rows" in fmt else _unknown_kernel(kernel),
    interp_rule=lambda kernel, *fmt: None if "few" in fmt else _INTERP_CONFIG,
    source="bench/results/2026-11-29-h200-moe-tiles.md (float weights), "
           "bench/results/2026-12-01-h200-fp8-moe-swap.md (FP8 weights), "
           "bench/results/2026-12-04-h200-moe-row-programs.md (row programs), "
           "bench/results/2026-12-06-h100-n1-anatomy.md (the few-rows entry), "
           "bench/results/2026-12-06-h100-fp8-moe-sub-tiles.md (FP8 sub-tiles), "
           "bench/results/2026-12-06-h100-prefill-norms-down.md (the bf16 down rows entry)")
"""Keyed on the grouped kernel ("gate_up", "down") for float weights and on (kernel, "fp8") for FP8
weights, plus a row-tile entry (key + ("rows",)) for launches of many rows; the tiles follow from the
weight shape (:meth:`MoEConfig.tiles`). Chosen by
``bench/moe_tiles.py`` on an H200 (2026-11-29, 48 configs per kernel at the three families' expert
shapes, N = 1 and 16): the best summed time; 4-15 % faster than 64/64 tiles. FP8 entries: swapped
tiles (``MoEConfig.swap``: 32 weight rows for gate_up, 128 for down, 2 warps, the "f32" route), the best
summed time of ``bench/moe_tiles.py --fp8 --swaps 1`` (2026-12-01, 8-48 configs per kernel): 5-13 % under
the unswapped 4-warp tiles at N = 16 (87-90 % of copy bandwidth at the GLM-4.5 / DeepSeek-V3 shapes), which
had beaten the bf16 tiles with direct conversion by 15-30 % (2026-11-30). Row entries: the best summed time of 16
configs per kernel at 1024 rows (``bench/moe_tiles.py --rows 1024``, 2026-11-30), every one bitwise
equal to the decode tiles in bf16; the down entry then 256 columns over 8 warps in 4 stages, from a wider sweep on
an H100 (2026-12-06, 16 configs at GLM-4.5's experts: the MoE call 3.29 -> 3.14 ms, Qwen3-Next's 1.29 -> 1.26,
DeepSeek-V3's 8.99 -> 8.65; GLM-4.5-4l's 4096-token prompt 3.1 % and Qwen3-Next-4l's 1.1 % faster, same bits);
no FP8 row tiles, where every row config of that sweep changed a row's bits (bench/results/2026-11-30-h200-prefill.md). Row programs (``MoEConfig.row_programs``: the same tiles,
one program each; 2026-12-04, ``bench/prefill_ab.py`` / ``bench/step_ab.py``, same process, every variant
the base's bits): a 4096-token prompt in chunks of 1024 7-15 % faster in bf16 (GLM-4.5-4l 102.5 -> 87.3 ms),
28 % in FP8 (Qwen3-Next-4l 55.0 -> 39.8 ms); decode at N = 64 3-5 % faster in both, N = 16 the same in bf16
and 1.8 % slower in FP8 -- so the bf16 decode entries take them and FP8 takes them from 64 rows (a
("rows",) entry that is the decode entry with ``row_programs``). Few-rows entries (key + ("few", K),
``max_rows``; the fields of :data:`FEW_ROWS_FREE` may differ, :func:`_config`): one, FP8 gate/up over
GLM-4.5's experts (K = 5120) at one and two rows, two scale blocks a step in two stages: on an H100 the MoE
call 108 -> 95 us at one row and the whole glm-4.5-4l:fp8 step 3.2 % faster at N = 1 and 2 in a same-process
A/B (``bench/step_ab.py``), every step's bits the base's; the same entry for Qwen3-Next's experts (K = 2048)
took 20 % off the call alone and nothing off the step, and DeepSeek-V3's (K = 7168) call was fastest with
the decode entry (bench/results/2026-12-06-h100-n1-anatomy.md; not timed on an H200). Measured on an H200 before:
the best one- and two-row configs made the MoE call alone 10-25 % faster (FP8 GLM-4.5 gate/up with 4 stages 96.6 -> 78.4 us, bf16
DeepSeek-V3 32 x 64 tiles 226.5 -> 200.7 us) and moved no whole step by more than 3 % either way, timed in
one process with ``bench/step_ab.py`` (full-depth Qwen3-Next-80B FP8, the 4-layer presets; every variant
kept the steps' bits) (bench/results/2026-12-02-h200-few-rows.md; earlier, 8 stages:
bench/results/2026-12-01-h200-real-gguf-moe-split.md)."""
MOE_CONFIGS.caches.append(_few_entry)


@dataclasses.dataclass(frozen=True)
class MoECombineConfig:
    """Launch constants of the rank-ordered combine: rows per program (rows never mix) and the D
    block. Warps: Triton's default."""
    rows: int
    block_d: int


# One row per program on the GPU: rows never mix, and a decode batch of 16 rows spreads over 16
# programs. Measured on an H200 (Qwen3-Next, N = 16, bench/results/2026-11-29-h200-decode.md):
# 29 us per call with 16-row programs, 9.4 us per step for 4 calls with one row per program.
MOE_COMBINE_CONFIGS: ConfigTable[MoECombineConfig] = ConfigTable(
    "moe_combine", gpu={},
    gpu_rule=lambda D: MoECombineConfig(rows=1, block_d=min(256, triton.next_power_of_2(D))),
    interp_rule=lambda D: MoECombineConfig(rows=16, block_d=triton.next_power_of_2(D)),
    source="rule: one row per program, D in blocks of <= 256 (bench/results/2026-11-29-h200-decode.md "
           "times the step with it); not swept")
"""Keyed on the hidden size D."""


def moe_experts(
    h: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    *,
    shared_expert: Optional[int] = None,
    shared_gate: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    act_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """Routed SwiGLU experts for B rows, each with its k (expert id, weight) pairs.

    h [B, D], ids [B, k] int32/int64 in [0, E) or -1 (the pair is skipped: it adds exactly 0),
    weights [B, k] fp32, w_gate/w_up [E, I, D],
    w_down [E, D, I]. ``shared_expert`` (an expert index) adds rank k to every row, weighted by
    sigmoid(``shared_gate`` fp32 [B]) or by 1 (k may then be 0). Returns fp32 [B, D] (``out`` if
    given). See the module docstring.

    The three weights are float tensors of one dtype (h and silu(g)·u rounded to it; ``act_dtype``
    must be None or that dtype) or three :class:`~ds4t.kernels.weights.FP8Weight` of one block_k
    (data [E, I, D] / [E, D, I], scales [E, I, cdiv(D, bk)] / [E, D, cdiv(I, bk)]; W8A16): h and
    silu(g)·u are rounded to A = ``act_dtype`` or h's dtype (never to fp8), each fp8 tile is
    converted exactly to A, and per K block j: ``acc += scale[e, n, j] * dot_j`` (the block's dot
    in fp32 from zero), as :func:`ds4t.kernels.linear.linear` does. Or three
    :class:`~ds4t.kernels.quant_blocks.GGUFWeight` (Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K blocks; gate and up of one type):
    A as for FP8, products per sub-block as :func:`ds4t.kernels.qlinear.qdot` defines them
    (:mod:`ds4t.kernels.qmoe`; every variant runs the grouped kernels).
    """
    r = moe_partials(h, ids, weights, w_gate, w_up, w_down, shared_expert=shared_expert, shared_gate=shared_gate,
                     out=out, act_dtype=act_dtype)
    return r if isinstance(r, torch.Tensor) else combine(r, out)


def moe_partials(h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate, w_up, w_down, *,
                 shared_expert: Optional[int] = None, shared_gate: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None, act_dtype: Optional[torch.dtype] = None
                 ) -> Union[torch.Tensor, MoEPartials]:
    """:func:`moe_experts` up to its last kernel: the per-pair outputs and what the combine reads
    (:class:`~ds4t.kernels.tensors.MoEPartials`), for a consumer that combines the rows itself
    (:func:`combine` launches the combine kernel on them). Arguments as :func:`moe_experts`;
    where no pair outputs are left to combine (B = 0, or the interpreter's rows path, which combines as it
    goes) the finished fp32 [B, D] result (``out`` if given)."""
    E, I, D = _check_args(h, ids, weights, w_gate, w_up, w_down, shared_expert, shared_gate)
    fp8 = isinstance(w_gate, FP8Weight)
    adt = activation_dtype("moe_experts", h, w_gate, act_dtype)
    B, k = ids.shape
    KT = k + (shared_expert is not None)
    SHARED = -1 if shared_expert is None else int(shared_expert)
    GATED = shared_gate is not None
    gate = shared_gate if GATED else weights   # any valid pointer when not gated (never read)
    dev = h.device
    if B == 0:
        return float_out(out, (B, D), dev)
    if h.stride(1) != 1:
        h = h.contiguous()
    ids = ids if ids.stride(1) == 1 or k <= 1 else ids.contiguous()
    weights = weights if weights.stride(1) == 1 or k <= 1 else weights.contiguous()
    gguf = isinstance(w_gate, GGUFWeight)
    if gguf:
        pass   # qmoe.launch takes the blocks as they are
    elif fp8:
        w_gate, w_up, w_down = (_unit_k(w) for w in (w_gate, w_up, w_down))
        if w_gate.data.stride() != w_up.data.stride() or w_gate.scale.stride() != w_up.scale.stride():
            w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    elif w_gate.stride() != w_up.stride():
        w_gate, w_up = w_gate.contiguous(), w_up.contiguous()
    path = variant("moe_experts")
    if path == INTERP and not gguf:
        # imported here: the twin uses this module's jit helpers (_pair_expert, _pair_weight)
        from ds4t.kernels.interp import moe_rows

        res = float_out(out, (B, D), dev)
        if moe_rows.launch(h, ids, weights, gate, w_gate, w_up, w_down, SHARED, GATED, res, adt):
            return res
    P = B * KT
    # silu(g)·u is rounded to A before the down product: with a 16-bit A the gate/up kernel stores it
    # rounded (half the bytes the down kernel reads once per D tile; same bits).
    act_rounded = not gguf and adt in (torch.bfloat16, torch.float16)
    fmt = ("fp8",) if fp8 else ()
    gu_cfg, dn_cfg = (None, None) if gguf else (_config("gate_up", fmt, B, D), _config("down", fmt, B, I))
    split = 1 if gguf else gu_cfg.split
    # 1. group pairs by expert on the device (pairs of an expert in pair order) -- or, for a launch of a
    # few pairs (a decode step of one row) over 16-bit / fp32 experts, let each program find its slot's
    # pairs from the ids itself (SELF_GROUP_PAIRS; no grouping launch, the same pairs in the same tiles)
    self_group = (path == GPU and not (fp8 or gguf) and k >= 1 and P <= SELF_GROUP_PAIRS and gu_cfg.split == 1
                  and dn_cfg.split == 1 and min(gu_cfg.block_m, dn_cfg.block_m) >= P)
    if self_group:
        order = bounds = ids   # unread
        sg_args = dict(ids_ptr=ids, si_b=ids.stride(0), P=P, SHARED=SHARED, KR=k, SELF=True)
    else:
        order, bounds = group_pairs(ids, E, shared_expert)
        sg_args = {}
    act = torch.empty((P, I), dtype=adt if act_rounded else torch.float32, device=dev)
    # a split gate/up's fp32 partials [split, P, 2I] (g, then u), summed by _moe_act_kernel; an ordered split's
    # dots of every scale block [cdiv(D, block_k), P, 2I], added in block order there
    ordered = split > 1 and gu_cfg.ordered_split
    if ordered:   # raises for an ordered split this launch cannot run (16-bit weights, the fold / f16 routes)
        sum_order(gu_cfg, "gate_up", fp8)
    n_part = triton.cdiv(D, w_gate.block_k) if ordered else split
    part = torch.empty((n_part, P, 2 * I), dtype=torch.float32, device=dev) if split > 1 else act
    dn_split = 1 if gguf else dn_cfg.split
    y = torch.empty((dn_split, P, D) if dn_split > 1 else (P, D), dtype=torch.float32, device=dev)
    WDT = tl_dtype(adt)
    sbk = w_gate.block_k if fp8 else 0
    wg_t, wu_t, wd_t = (w.data for w in (w_gate, w_up, w_down)) if fp8 else (w_gate, w_up, w_down)
    # Programs run over slots of chosen experts. Variant "gpu": min(E, P) slots, each gate/up program
    # finding its expert from ``bounds`` on the device (no host sync, so the step can be captured in a
    # CUDA graph); the gate/up kernel writes each slot's expert (-1: none) to ``slots``, which the down
    # kernel reads as a list instead of scanning ``bounds`` again (FP8 down kernel: 8.9 -> 7.5 us at
    # N = 1, 74 -> 63 us at N = 16 for Qwen3-Next's experts; GGUF Q4_K call -2.5 .. -4.3 %; bf16 unchanged;
    # same bits: bench/results/2026-12-03-h200-moe-slots.md). Variant "host_list" (and "interp" where its tiles
    # do not fit; tensors are on the host there): a host-made list of the chosen experts. Either way
    # each expert's computation is the same: exactness holds.
    device_list = path == GPU
    # row programs (MoEConfig.row_programs): one program per row tile, found from ``bounds`` on the
    # device -- only there, and never for a self-grouped launch (no bounds)
    row_ok = device_list and not self_group and not gguf
    gu_rows, dn_rows = row_ok and gu_cfg.row_programs, row_ok and dn_cfg.row_programs
    slots = None
    if device_list:
        experts, n_slots = bounds, min(E, P)
        if not (self_group or gu_rows or dn_rows):
            slots = torch.empty((n_slots,), dtype=torch.int32, device=dev)
    else:
        experts = torch.nonzero(bounds[1:] > bounds[:-1]).reshape(-1).to(torch.int32)
        n_slots = int(experts.shape[0])
    if gguf:   # 2. and 3. over GGUF blocks
        from ds4t.kernels import qmoe

        qmoe.launch(h, order, bounds, experts, n_slots, device_list, w_gate, w_up, w_down, act, y, KT, adt, slots)
        return MoEPartials(y, weights, ids, gate, SHARED, GATED)
    BE = triton.next_power_of_2(E)
    # 2. gate/up + activation
    cfg = gu_cfg
    BN, BK = cfg.tiles(I, D, sbk)
    if cfg.block_m > BLOCK_M and adt in (torch.bfloat16, torch.float16) and h.dtype == torch.float32:
        # A row tile reads h once per N tile: round it to A here, once (round to nearest even, what
        # the kernel's cast does to every load), and each program reads half the bytes; same bits.
        h = h.to(adt)
    kw = launch_kwargs(cfg)
    step = BK
    if fp8:
        step = k_step(D, BK, sbk)
        kw.update(sg_ptr=w_gate.scale, su_ptr=w_up.scale, ss_e=w_gate.scale.stride(0), ss_n=w_gate.scale.stride(1),
                  SBK=sbk, KSTEP=step, FP8_ROUTE=_fp8_route(cfg, adt))
    kps = k_per_split(D, split, step) if split > 1 else D
    if split > 1:
        kw.update(SPLIT=split, K_PER_SPLIT=kps, sa_s=part.stride(0), ORDERED=ordered)
    if fp8:
        kw.update(SB=blocks_a_step(cfg, D, step, kps))
    kw.update(evenness(D, step, I, BN))
    if gu_rows:
        kw.update(ROW_PROGRAMS=True)
    msub = sub_tiles(cfg, fp8, self_group, adt, P, E)
    if msub > 1:
        kw.update(M_SUB=msub)
    kw.update(weight_descriptors(cfg, dict(wg_desc=wg_t, wu_desc=wu_t), BN, BK))
    _moe_gate_up_kernel[(row_program_count(E, P, cfg.block_m * msub) if gu_rows else n_slots, triton.cdiv(I, BN),
                         split)](
        h, h.stride(0), order, bounds, experts,
        wg_t, wu_t, wg_t.stride(0), wg_t.stride(1), wg_t.stride(2),
        part, part.stride(-2),
        D, I, KT, E,
        WDT=WDT, BM=cfg.block_m, BN=BN, BK=BK, DEVICE_LIST=device_list, BE=BE, ACT_ROUNDED=act_rounded,
        SWAP=cfg.swap, slots_ptr=slots, **sg_args, **kw, **LAUNCH,
    )
    if split > 1:
        # an ordered split's chain over every block: narrower programs, more of them (a one-row launch has
        # a handful of pairs)
        BI = min(128 if ordered else 1024, triton.next_power_of_2(I))
        blocks = dict(sg_ptr=w_gate.scale, su_ptr=w_up.scale, ss_e=w_gate.scale.stride(0),
                      ss_n=w_gate.scale.stride(1), ids_ptr=ids, si_b=ids.stride(0), KT=KT, SHARED=SHARED, KTOP=k,
                      NBLK=n_part) if ordered else {}
        _moe_act_kernel[(P, triton.cdiv(I, BI))](
            part, part.stride(0), part.stride(1), act, act.stride(0), order, bounds, E, I,
            SPLIT=split, ACT_ROUNDED=act_rounded, WDT=WDT, BI=BI, **blocks, **LAUNCH,
        )
    # 3. down
    cfg = dn_cfg
    BN, BK = cfg.tiles(D, I, sbk)
    kw = launch_kwargs(cfg)
    step = BK
    if fp8:
        step = k_step(I, BK, sbk)
        kw.update(sd_ptr=w_down.scale, ss_e=w_down.scale.stride(0), ss_n=w_down.scale.stride(1),
                  SBK=sbk, KSTEP=step, FP8_ROUTE=_fp8_route(cfg, adt))
    kps = k_per_split(I, dn_split, step) if dn_split > 1 else I
    if dn_split > 1:
        kw.update(SPLIT=dn_split, K_PER_SPLIT=kps, sy_s=y.stride(0))
    if fp8:
        kw.update(SB=blocks_a_step(cfg, I, step, kps))
    kw.update(evenness(I, step, D, BN))
    kw.update(down_finder(gu_rows, dn_rows, BE))
    msub = sub_tiles(cfg, fp8, self_group, adt, P, E)
    if msub > 1:
        kw.update(M_SUB=msub)
    kw.update(weight_descriptors(cfg, dict(wd_desc=wd_t), BN, BK))
    _moe_down_kernel[(row_program_count(E, P, cfg.block_m * msub) if dn_rows else n_slots, triton.cdiv(D, BN),
                      dn_split)](
        act, act.stride(-2), order, bounds, experts if slots is None else slots,
        wd_t, wd_t.stride(0), wd_t.stride(1), wd_t.stride(2),
        y, y.stride(-2),
        D, I, E,
        WDT=WDT, BM=cfg.block_m, BN=BN, BK=BK, SWAP=cfg.swap, **(dict(sg_args, KT=KT) if sg_args else {}), **kw,
        **LAUNCH,
    )
    return MoEPartials(y, weights, ids, gate, SHARED, GATED)


def combine(parts: MoEPartials, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """4. the rank-ordered combine of :func:`moe_partials`' pair outputs into fp32 [B, D] (``out`` if given;
    MOE_COMBINE_CONFIGS); pairs whose expert id is -1 (another rank's, under tensor parallel) add 0."""
    y = parts.y
    B, D = parts.rows, y.shape[-1]
    out = float_out(out, (B, D), y.device)
    cfg = MOE_COMBINE_CONFIGS(D)
    ROWS, BD = cfg.rows, cfg.block_d
    split = dict(SPLIT=y.shape[0], sy_s=y.stride(0)) if y.dim() == 3 else {}
    w, ids, gate = parts.weights, parts.ids, parts.gate
    _moe_combine_kernel[(triton.cdiv(B, ROWS), triton.cdiv(D, BD))](
        y, y.stride(-2), w, w.stride(0), gate, gate.stride(0), ids, ids.stride(0), parts.shared, out, out.stride(0),
        B, D, KTOP=parts.top_k, KT=parts.ranks, GATED=parts.gated, ROWS=ROWS, BD=BD, **split, **LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------- reference


def moe_experts_ref(h, ids, weights, w_gate, w_up, w_down, *, shared_expert=None, shared_gate=None, out=None,
                    act_dtype=None):
    """Plain-torch :func:`moe_experts` (same rounding points, rank-ordered sum); FP8 weights are
    dequantized (``as_float``: fp8 * scale in fp32) and the activations rounded to A as there."""
    wdt = activation_dtype("moe_experts", h, w_gate, act_dtype)
    w_gate, w_up, w_down = (as_float(w, torch.float32) for w in (w_gate, w_up, w_down))
    if shared_expert is not None:
        B = ids.shape[0]
        ids = torch.cat([ids.long(), torch.full((B, 1), shared_expert, dtype=torch.long, device=ids.device)], 1)
        sw = (torch.sigmoid(shared_gate.float()) if shared_gate is not None
              else torch.ones(B, dtype=torch.float32, device=h.device))
        weights = torch.cat([weights.float(), sw[:, None]], 1)
    B, k = ids.shape
    x = h.float().to(wdt).float()
    res = torch.zeros((B, w_gate.shape[2]), dtype=torch.float32, device=h.device)
    idx = ids.long()
    for j in range(k):
        ok = idx[:, j] >= 0   # -1: a skipped pair (an expert another rank holds) adds 0
        e = idx[:, j].clamp(min=0)
        g = torch.einsum("bd,bid->bi", x, w_gate[e].float())
        u = torch.einsum("bd,bid->bi", x, w_up[e].float())
        a = (F.silu(g) * u).to(wdt).float()
        yj = torch.einsum("bi,bdi->bd", a, w_down[e].float())
        res = res + torch.where(ok[:, None], weights[:, j].float()[:, None] * yj, 0.0)
    if out is not None:
        out.copy_(res)
        return out
    return res


# ----------------------------------------------------------------------------- self-check

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}
TOL_FP8 = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}
"""FP8 weights, keyed on the activation dtype."""


@register_check
def _check(device) -> List[CheckResult]:
    g = torch.Generator().manual_seed(0)
    results = []
    B, E, k, D, I = 6, 10, 3, 48, 40
    h = torch.randn(B, D, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(B)]).to(device, torch.int32)
    ids[1] = ids[0].flip(0)  # rows sharing experts (in another rank order)
    wts = torch.rand(B, k, generator=g).to(device)
    for dt in (torch.float32, torch.bfloat16):
        wg = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(device, dt)
        wu = (torch.randn(E, I, D, generator=g) / D ** 0.5).to(device, dt)
        wd = (torch.randn(E, D, I, generator=g) / I ** 0.5).to(device, dt)
        o = moe_experts(h, ids, wts, wg, wu, wd)
        ref = moe_experts_ref(h, ids, wts, wg, wu, wd)
        err = ((o - ref).abs().max() / ref.abs().max()).item()
        # rows 0 and 1 share their experts; row 5 sits last
        inv = all(torch.equal(moe_experts(h[i:i + 1], ids[i:i + 1], wts[i:i + 1], wg, wu, wd)[0], o[i])
                  for i in (0, 1, 5))
        ms = timer(lambda: moe_experts(h, ids, wts, wg, wu, wd), warmup=0 if INTERPRET else 3,
                   iters=1 if INTERPRET else 10)
        results.append(CheckResult(f"moe_experts {str(dt).split('.')[-1]}", f"B={B} E={E} k={k} D={D} I={I}",
                                   err, TOL[dt], inv, ms, note="max_err relative to max |ref|"))
    # FP8 weights (W8A16, 128x128 blocks; D, I not multiples of 128), fp32 activations
    wg, wu, wd = (quantize(torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device)
                  for shape in ((E, I, D), (E, I, D), (E, D, I)))
    o = moe_experts(h, ids, wts, wg, wu, wd)
    ref = moe_experts_ref(h, ids, wts, wg, wu, wd)
    err = ((o - ref).abs().max() / ref.abs().max()).item()
    inv = all(torch.equal(moe_experts(h[i:i + 1], ids[i:i + 1], wts[i:i + 1], wg, wu, wd)[0], o[i]) for i in (0, 1, 5))
    ms = timer(lambda: moe_experts(h, ids, wts, wg, wu, wd), warmup=0 if INTERPRET else 3, iters=1 if INTERPRET else 10)
    results.append(CheckResult("moe_experts fp8 x float32", f"B={B} E={E} k={k} D={D} I={I}", err, TOL_FP8[torch.float32],
                               inv, ms, note="max_err relative to max |ref|; FP8 weights, 128x128 blocks"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(moe_experts, reference=moe_experts_ref, variants=(GPU, INTERP, HOST_LIST))
