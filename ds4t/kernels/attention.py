"""Paged-by-slot KV cache writes and batch-invariant split-KV decode attention (GQA / MQA).

State model: per layer, pools ``k_cache`` [S, L, Hkv, D] and ``v_cache`` [S, L, Hkv, Dv]
(S session slots, capacity L tokens; fp32, bf16 or fp16). Batch row b reads slot ``slots[b]``
and attends to cache positions ``0 .. lengths[b]-1`` (the current token already written with
:func:`write_kv`). Prefill is the same call: T rows with the same slot and lengths
``start+1 .. start+T`` give causal attention, so chunked prefill and mixed prefill + decode
batches need nothing else.

Algorithm (two kernels, no host synchronisation, grid from shapes only):

1. ``_attn_split_kernel``, grid ``(B, Hkv, NS)``. One program = one row, one kv head, one split
   of consecutive positions. A row's split size comes from its own length through the split
   schedule (:mod:`ds4t.kernels.splits`: short rows short splits, long rows long ones); NS is the
   most splits any row of length <= L can have. All G = Hq/Hkv query heads of the kv head are
   processed together (rows of a [BLOCK_H, D] tile, BLOCK_H = max(16, next_pow2(G)), padding rows
   masked), so each K/V tile is read once per group. Splits at or past the row's length exit at
   once. Inside a split, tiles of BLOCK_N positions are folded with the usual online softmax (fixed
   order: ascending positions). Each split stores its un-normalised output, running max and
   running sum (fp32); a row with one split writes its output directly.
   With ``same_slot_runs`` (prefill chunks) ``_attn_runs_kernel`` takes its place: grid
   ``(B / RUN, Hkv, NS)``, RUN consecutive rows a program sharing each K / V tile of their slot and
   one MMA of their RUN x G (row, query head) pairs packed densely (:func:`run_tile` rows, a power of
   two), every row folding exactly the tiles and operations it folds in the
   split kernel (same bits; rows of another slot in the same program run as their own group). A program
   whose rows are one slot of a long run (``run_fuse_rows``; each run's length from the step's runs table,
   :class:`~ds4t.kernels.splits.SameSlotRuns`) folds all their splits itself, merging each with the merge
   kernel's step as it ends: no partials for those rows, and the merge kernel skips them. Row
   sums of the probabilities are MMAs against ones in both kernels (:func:`_row_sum`): tl.sum's
   reduction tree follows the tile's layout, which differs between the two tile heights.
2. ``_attn_merge_kernel``, grid ``(B, Hkv, Dv / 64)``: merges a row's splits in ascending split
   order with log-sum-exp rescaling and divides by the sum (elementwise in the value columns).

Batch invariance (the rules: docs/kernel-conventions.md): the split schedule and BLOCK_N depend
only on head dims, cache dtype and the backend, never on B; a row's split size depends on its own
length only; a row's programs see only that row's q, slot and length; merge order is fixed. So a
row's bits never depend on the other rows, on B or on its position in the batch. A prefill row at
position p has the length of the decode row at p, so both get the same splits.

Numerics: fp32 statistics; scores are computed as ``(q * scale * log2 e) . k`` and
exponentials as ``exp2``. For bf16/fp16 caches the products use tensor-core dots without
rounding q or p to 16 bits: q (and the probabilities p) are split as ``hi + lo`` with
``hi = x.to(cache dtype)``, ``lo = (x - hi).to(cache dtype)`` and both halves are multiplied
with the (exact) 16-bit K / V tile, accumulating in fp32. This keeps ~16 extra mantissa bits,
i.e. effectively fp32 math (relative error ~1e-5 rather than bf16's 4e-3), for twice the
tensor-core work, which decode (memory bound) does not notice and a long prompt's prefill does;
``products="cache"`` (a model's ``attention_products`` load option) rounds q and p once to the cache
dtype instead, one MMA each, as FlashAttention does. With fp16 caches q·scale·log2e
must lie within the fp16 range (|x| < 65504), as in any fp16 model. fp32 caches use IEEE fp32
dots (no TF32), see :func:`ds4t.backend.mma`.

Workspace: each call allocates the partials, B · NS · Hq · (Dv + 2) fp32 values
(from the torch allocator; fine inside CUDA graphs).

Positions ``>= lengths[b]`` are never loaded (masked loads), so garbage / NaN in unused cache
positions cannot leak into outputs. ``lengths[b]`` is clamped to L in the kernel; a row with
length 0 returns zeros.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Union

import torch
import triton
import triton.language as tl

from ds4t.backend import INTERPRET, LAUNCH, cast, grid_dependency, mma, sigmoid, timer, tl_dtype
from ds4t.kernels import norm, rope
from ds4t.kernels.config import ConfigTable, launch_kwargs
from ds4t.kernels.registry import GPU, INTERP, CheckResult, register_check, register_op, variant
from ds4t.kernels.splits import (SameSlotRuns, SplitSchedule, as_schedule, in_long_run, merge_step, split_of,
                                 table_args)
from ds4t.kernels.interp import attention_rows

_LOG2E = 1.4426950408889634

# ----------------------------------------------------------------------------- configuration


def _gqa_schedule(head_dim: int, head_dim_v: int, dtype: torch.dtype) -> SplitSchedule:
    """Splits of 64 .. 2048 positions, at most 16 per row below 32k positions.

    Measured on the H200 (bench/results/2026-11-30-h200-attention-splits.md, 6 schedules x 6 cells
    per head shape): one split size of 2048 for every row gave a lone row of 4k positions 2 splits
    per kv head (4 programs on 132 SMs: 78 us for Qwen3-Next's 8 MB); this schedule takes 19 us there,
    28 us at 8k (was 78), the same at 32k, and 74-99 % of copy bandwidth at 8k-32k with B >= 8 (the
    fixed 2048: 40-104 %). Shorter splits (<= 32 per row, or 32-position splits) lose at B >= 8.
    """
    return SplitSchedule(64, 2048, 16)


SPLIT_SCHEDULES: ConfigTable[SplitSchedule] = ConfigTable(
    "attention_splits",
    # d 256 (Qwen3-Next: 2 kv heads, so a lone row has 2 programs a split): splits stop growing at 1024,
    # i.e. 32 splits at 32k. H200, bench/results/2026-12-04-h200-gdn-attention-merge.md: a lone row of 32k
    # 84.0 -> 47.6 us, B = 8 / 64 at 32k +10 % / +5 %, rows up to 16k unchanged; the 4-layer model's
    # N = 1 step at 32k 0.584 -> 0.505 ms, N = 64 +1.2 %. d 128 (GLM-4.5: 8 kv heads, 128 programs a
    # lone row already) keeps 2048: 1024 gave 32k -3 % at N = 1 and +4-5 % at B >= 8. Not measured past
    # 32k, where d-256 rows now have 2x the splits they had (64 at 64k).
    gpu={(256, 256, torch.bfloat16): SplitSchedule(64, 1024, 16)},
    gpu_rule=_gqa_schedule, interp_rule=_gqa_schedule,
    source="bench/results/2026-11-30-h200-attention-splits.md, bench/results/2026-12-04-h200-gdn-attention-merge.md "
           "(bench/bench_attention.py --schedules; bench/step_ab.py)")
"""Keyed on (head_dim, head_dim_v, cache dtype): the KV split schedule of :func:`decode_attention` -- a
table like the launch constants, so a benchmark or a researcher overrides it the same way
(``config.overridden({"attention_splits": [{"key": [256, 256, "torch.bfloat16"], "fields": {...}}]})``).
Never keyed on the batch; a row's split follows its own length only."""


def default_split_schedule(head_dim: int, head_dim_v: int, dtype: torch.dtype) -> SplitSchedule:
    """The split schedule (:mod:`ds4t.kernels.splits`) for these head dims and cache dtype
    (:data:`SPLIT_SCHEDULES`). Depends on nothing else (never on the batch size; a row's split only on
    its own length)."""
    return SPLIT_SCHEDULES(head_dim, head_dim_v, dtype)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Launch constants of the split and merge kernels (None: Triton's default). Warps and stages
    never change numerics; ``block_n`` (positions per inner tile, dividing every split) is a function
    of the schedule's smallest split and the head dims only."""
    block_n: int
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    merge_warps: Optional[int] = None
    run_rows: int = 1               # rows per program of a launch told its rows come in same-slot runs
                                    # (their G query heads each: a tile of run_tile(run_rows, G) rows)
    run_warps: Optional[int] = None
    run_stages: Optional[int] = None  # stages of the same-slot-runs kernel (None: num_stages)
    merge_stages: int = 4           # merge: loads of this many splits in flight (1: one split at a time)
    run_fuse_rows: Optional[int] = None  # a one-slot program of a same-slot run of this many rows does all
                                         # its splits and merges them (None: never)
    run_peel: bool = False          # fused runs: split 0 before the split loop (same bits, fewer spills;
                                    # off on the GPU until timed)
    run_interior: bool = False      # runs kernel: the tiles inside all of a group's ranges without masks
                                    # (same bits; on the GPU for d 256 only, where it was faster)
    dv_parts: int = 1               # split kernel: value columns in this many parts, a program each, for
    dv_rows: int = 0                # launches of at most dv_rows rows (same bits: dv_parts_of())


def _gpu_config(split: int, block_d: int, block_dv: int) -> AttentionConfig:
    """~16 KiB of K (or V) per tile, 4 warps, 3 stages: the best of 40-48 configs per shape in the
    H200 sweep (bench/results/2026-11-30-h200-attention.md, ``bench/bench_attention.py --sweep``);
    D = Dv = 256: BLOCK_N 32; D = Dv = 128: BLOCK_N 64. Same-slot runs (prefill chunks; the rows' query
    heads packed densely, :func:`run_tile`), a 1024-row chunk at 0 / 3072 / 31744 in
    ``bench/prefill_attention.py`` (bench/results/2026-12-04-h200-prefill-attention.md): d 128 (GLM-4.5's
    96 / 8 heads) 5 rows a program (60 of a 64-row tile), 4 warps, 2 stages -- 1.05 / 2.13 / 10.07 ms against
    1.48 / 3.31 / 17.0 for 4 rows and 3 stages (8 warps, 10 rows or 1 stage slower); d 256 (Qwen3-Next's 16 / 2)
    4 rows (a 32-row tile), 4 warps, 3 stages -- 0.49 / 1.12 / 7.09 ms against 0.46 / 1.81 / 13.67 for a program
    a row (8 rows, 2 warps or other stages slower). Fused runs (``run_fuse_rows``: a one-slot program folds and
    merges all its splits; bench/results/2026-12-04-h200-fused-runs.md, CUDA-graph timing, same bits): d 128 from
    1024-row runs -- whole prompts (bench/prefill_ab.py) GLM-4.5-4l 4k -10.5 %, 32k -3.0 %; 512-row chunks gain
    early (0.23 -> 0.14 ms at 0) and lose late (4.83 -> 5.64 ms at 31744), so 512 stays unfused; d 256 from 512
    -- 1024-row chunks -17 / -11 / -4 % at 0 / 3072 / 31744, 512-row -5 % / -3 % at 0 / 31744, 256-row +12 % /
    +83 % (too few programs); whole Qwen3-Next-4l prompts 4k -1.5 %, 32k -3.2 %. Interior tiles without masks
    (``run_interior``; bench/results/2026-12-05-h200-prefill-runs.md, same bits): d 256 -- a 1024-row chunk
    +9 / -8 / -14 % at 0 / 3072 / 31744, whole Qwen3-Next-4l prompts 4k -0.7 %, 32k -4.2 %; d 128 loses
    (GLM-4.5's chunk at 0 / 31744 +11 / +17 %: its unmasked tile keeps the masked one's registers and adds
    code), so off."""
    wide = block_d + block_dv >= 512
    return AttentionConfig(block_n=min(split, 32 if wide else 64), num_warps=4, num_stages=3, merge_warps=4,
                           run_rows=4 if wide else 5, run_warps=4, run_stages=3 if wide else 2,
                           run_fuse_rows=512 if wide else 1024, run_interior=wide)


def run_tile(run_rows: int, group: int) -> int:
    """Tile rows of a same-slot-runs program: its ``run_rows`` rows' ``group`` query heads each, packed
    densely, padded to a power of two >= 16 (tl.dot's least M)."""
    return max(16, triton.next_power_of_2(run_rows * group))


def _interp_config(split: int, block_d: int, block_dv: int) -> AttentionConfig:
    """Up to 64 positions per tile: few loop iterations at the small splits tests use, while splits
    > 64 still run the multi-tile online softmax the GPU runs. Runs of 4 rows, as on the GPU; one-slot runs
    fused from 16 rows (the interpreter pays per program: fewer, longer ones are cheaper), interior tiles
    unmasked (fewer ops), fused programs' split 0 peeled off their loop (the GPU table's path-to-be runs
    through every CPU test)."""
    return AttentionConfig(block_n=min(split, 64), run_rows=4, run_fuse_rows=16, run_interior=True, run_peel=True)


ATTENTION_CONFIGS: ConfigTable[AttentionConfig] = ConfigTable(
    "decode_attention", gpu={}, gpu_rule=_gpu_config, interp_rule=_interp_config,
    source="bench/results/2026-11-30-h200-attention.md (bench/bench_attention.py --sweep); same-slot runs: "
           "bench/results/2026-12-04-h200-prefill-attention.md (bench/prefill_attention.py); fused runs: "
           "bench/results/2026-12-04-h200-fused-runs.md (bench/prefill_attention.py, bench/prefill_ab.py); interior "
           "tiles: bench/results/2026-12-05-h200-prefill-runs.md")
"""Keyed on (the schedule's smallest split, BLOCK_D, BLOCK_DV)."""


@dataclasses.dataclass(frozen=True)
class NormRopeConfig:
    """Launch constants of the q / k norm + RoPE + cache-write prologue (:func:`_norm_rope_kv_kernel`): heads a
    program for launches of at least ``min_rows`` rows (fewer rows keep one head a program at the norm's warps,
    so a decode step keeps its programs) and the warps of such a program. No field changes a bit: each head's
    sum of squares is :func:`ds4t.kernels.norm.rstd_of`'s fixed tree whatever the tile."""
    heads: int
    min_rows: int
    num_warps: int


def _norm_rope_config(D: int) -> NormRopeConfig:
    # A program a (row, head) made GLM-4.5's 1024-row prefill chunk 106k one-warp programs of 128 columns:
    # 0.19 ms a layer where its ~80 MB take ~30 us at copy bandwidth (an H100 profile,
    # bench/results/2026-12-06-h100-prefill-norms-down.md). Tiles of ~2048 elements over 4 warps instead.
    return NormRopeConfig(heads=max(1, 2048 // triton.next_power_of_2(D)), min_rows=64, num_warps=4)


NORM_ROPE_CONFIGS: ConfigTable[NormRopeConfig] = ConfigTable(
    "norm_rope", gpu={}, gpu_rule=_norm_rope_config, interp_rule=_norm_rope_config,
    source="bench/results/2026-12-06-h100-prefill-norms-down.md (bench/prefill_ab.py, bench/step_ab.py)")
"""Keyed on the head dim D. The interpreter runs the prologue's own twin (variant ``"interp"``); its rule
matters where tests force the GPU kernel there."""

PRODUCTS = ("split", "cache")
"""How :func:`decode_attention` multiplies with a 16-bit cache: hi + lo halves (fp32-accurate) or once in the
cache dtype."""


def checked_products(value, what: str = "products") -> str:
    """``value`` if it names one of :data:`PRODUCTS`, else ValueError "{what} must be one of ..."."""
    if value not in PRODUCTS:
        raise ValueError(f"{what} must be one of {PRODUCTS}, got {value!r}")
    return value

def dv_parts_of(cfg: AttentionConfig, B: int, BLOCK_DV: int) -> int:
    """Programs a (row, kv head, split) of a B-row split-kernel launch takes, each over BLOCK_DV / parts of
    the value columns: ``cfg.dv_parts`` for launches of at most ``cfg.dv_rows`` rows, else 1. Each part
    computes the same scores, softmax and row sums and accumulates its own columns -- every column the same
    operations as in one program -- so the bits do not depend on it; a one-row launch gets the programs it
    lacks (a few kv heads x splits). Fewer parts where a part would hold < 16 columns (a dot's minimum).
    ValueError for a count that is not a power of two."""
    if cfg.dv_parts < 1 or cfg.dv_parts & (cfg.dv_parts - 1):
        raise ValueError(f"decode_attention: dv_parts must be a power of two, got {cfg.dv_parts}")
    parts = cfg.dv_parts if B <= cfg.dv_rows else 1
    while parts > 1 and BLOCK_DV // parts < 16:
        parts //= 2
    return parts


_MERGE_DV = 64
"""Value columns per merge program: the merge is elementwise in them (no bit depends on it); 64 gives
a row 2 (d 128) or 4 (d 256) programs per kv head."""


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _write_kv_kernel(
    k_ptr, sk_b, sk_h, sk_d,
    v_ptr, sv_b, sv_h, sv_d,
    kc_ptr, skc_s, skc_l, skc_h, skc_d,
    vc_ptr, svc_s, svc_l, svc_h, svc_d,
    slots_ptr, pos_ptr,
    S, L,
    HKV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    ok = (slot >= 0) & (slot < S) & (pos >= 0) & (pos < L)   # never write outside the pool
    h = tl.arange(0, BLOCK_H)
    # (a scalar bool & a tensor mask gives a bad mask in the triton 3.9 interpreter)
    hm = h < tl.where(ok, HKV, 0)
    d = tl.arange(0, BLOCK_D)
    m = hm[:, None] & (d < D)[None, :]
    kx = tl.load(k_ptr + b * sk_b + h[:, None] * sk_h + d[None, :] * sk_d, mask=m, other=0.0)
    tl.store(kc_ptr + slot * skc_s + pos * skc_l + h[:, None] * skc_h + d[None, :] * skc_d,
             cast(kx, kc_ptr.dtype.element_ty), mask=m)
    dv = tl.arange(0, BLOCK_DV)
    mv = hm[:, None] & (dv < DV)[None, :]
    vx = tl.load(v_ptr + b * sv_b + h[:, None] * sv_h + dv[None, :] * sv_d, mask=mv, other=0.0)
    tl.store(vc_ptr + slot * svc_s + pos * svc_l + h[:, None] * svc_h + dv[None, :] * svc_d,
             cast(vx, vc_ptr.dtype.element_ty), mask=mv)


@triton.jit
def _norm_rope_head(x_row, sd, hm, w_ptr, c, s, eps,
                    D: tl.constexpr, HALF: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr):
    """Heads of :func:`_norm_rope_kv_kernel`: x_row [HEADS, 1] pointers to each head's first element, hm
    [HEADS, 1] the heads that exist; (rotated first half, rotated second half, pass-through part), fp32
    [HEADS, BLOCK_HALF] x 2 and [HEADS, BLOCK_P]. The sum of squares: a [HEADS, BLOCK_D] tile loaded at unit
    stride (``sd``: the caller's stride argument, which Triton specialises to 1, so the load vectorises), each
    head's row summed by :func:`ds4t.kernels.norm.rstd_of`'s fixed tree (the same bits for any HEADS)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    if D == BLOCK_D:
        v = tl.load(x_row + d * sd, mask=hm, other=0.0).to(tl.float32)
    else:
        v = tl.load(x_row + d * sd, mask=hm & (d < D), other=0.0).to(tl.float32)
    rstd = norm.rstd_of(norm.add_square(tl.zeros(v.shape, dtype=tl.float32), v), D, eps)
    i = tl.arange(0, BLOCK_HALF)[None, :]
    im = i < HALF
    w1 = tl.load(w_ptr + i, mask=im, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + i + HALF, mask=im, other=0.0).to(tl.float32)
    pd = 2 * HALF + tl.arange(0, BLOCK_P)[None, :]
    pm = pd < D
    wp = tl.load(w_ptr + pd, mask=pm, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        w1 = 1.0 + w1
        w2 = 1.0 + w2
        wp = 1.0 + wp
    x1 = (tl.load(x_row + i * sd, mask=hm & im, other=0.0).to(tl.float32) * rstd) * w1
    x2 = (tl.load(x_row + (i + HALF) * sd, mask=hm & im, other=0.0).to(tl.float32) * rstd) * w2
    xp = (tl.load(x_row + pd * sd, mask=hm & pm, other=0.0).to(tl.float32) * rstd) * wp
    return x1 * c - x2 * s, x2 * c + x1 * s, xp


@triton.jit
def _norm_rope_kv_kernel(
    x_ptr, sx_b, sx_h, sx_d, k_ptr, sk_b, sk_h, sk_d, v_ptr, sv_b, sv_h, sv_d,
    qn_ptr, kn_ptr, freq_ptr, pos_ptr, slots_ptr,
    kc_ptr, skc_s, skc_l, skc_h, skc_d, vc_ptr, svc_s, svc_l, svc_h, svc_d,
    out_ptr, so_b, so_h, so_d,
    S, L, eps,
    H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HALF: tl.constexpr,
    ZERO_CENTERED: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_DV: tl.constexpr, HEADS: tl.constexpr = 1,
):
    """Program (row b, head block j): q heads j HEADS .. j HEADS + HEADS - 1 normed and rotated into out
    (j < cdiv(H, HEADS)), or that block of k heads normed, rotated and stored into the cache with their v heads.
    Each step is the separate kernels' arithmetic (:func:`_norm_rope_head`; the rope's angles and rotation, the
    cache dtype's rounding) in one launch for four or five; the sum of squares' order is this kernel's own (see
    :func:`norm_rope_write_kv`), the same for every HEADS."""
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    QB: tl.constexpr = (H + HEADS - 1) // HEADS
    i = tl.arange(0, BLOCK_HALF)[None, :]
    im = i < HALF
    pd = 2 * HALF + tl.arange(0, BLOCK_P)[None, :]
    pm = (pd < D) & (D > 2 * HALF)
    pos = tl.load(pos_ptr + b)
    f = tl.load(freq_ptr + i, mask=im, other=0.0).to(tl.float32)
    c, s = rope.cos_sin(pos.to(tl.float32) * f)
    if j < QB:
        hq = (j * HEADS + tl.arange(0, HEADS))[:, None]
        hm = hq < H
        o1, o2, xp = _norm_rope_head(x_ptr + b * sx_b + hq * sx_h, sx_d, hm, qn_ptr, c, s, eps,
                                     D, HALF, ZERO_CENTERED, BLOCK_D, BLOCK_HALF, BLOCK_P)
        o_row = out_ptr + b * so_b + hq * so_h
        tl.store(o_row + i * so_d, o1, mask=hm & im)
        tl.store(o_row + (i + HALF) * so_d, o2, mask=hm & im)
        tl.store(o_row + pd * so_d, xp, mask=hm & pm)
    else:
        jk = ((j - QB) * HEADS + tl.arange(0, HEADS))[:, None]
        hm = jk < KV
        o1, o2, xp = _norm_rope_head(k_ptr + b * sk_b + jk * sk_h, sk_d, hm, kn_ptr, c, s, eps,
                                     D, HALF, ZERO_CENTERED, BLOCK_D, BLOCK_HALF, BLOCK_P)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        p64 = pos.to(tl.int64)
        ok = (slot >= 0) & (slot < S) & (p64 >= 0) & (p64 < L)   # never write outside the pool
        lim = tl.where(ok, D, 0)   # (a scalar bool & a tensor mask is a bad mask in the interpreter)
        kc_row = kc_ptr + slot * skc_s + p64 * skc_l + jk * skc_h
        kdt = kc_ptr.dtype.element_ty
        tl.store(kc_row + i * skc_d, cast(o1, kdt), mask=hm & im & (i < lim))
        tl.store(kc_row + (i + HALF) * skc_d, cast(o2, kdt), mask=hm & im & (i + HALF < lim))
        tl.store(kc_row + pd * skc_d, cast(xp, kdt), mask=hm & pm & (pd < lim))
        dv = tl.arange(0, BLOCK_DV)[None, :]
        vm = hm & (dv < tl.where(ok, DV, 0))
        vx = tl.load(v_ptr + b * sv_b + jk * sv_h + dv * sv_d, mask=vm, other=0.0)
        tl.store(vc_ptr + slot * svc_s + p64 * svc_l + jk * svc_h + dv * svc_d, cast(vx, vc_ptr.dtype.element_ty),
                 mask=vm)


@triton.jit
def _row_sum(p_hi, p_lo, SPLIT: tl.constexpr = True):
    """Each row's sum of p [M, N] (fp32 p passed twice, a 16-bit tile's hi / lo halves, or with SPLIT off
    the one 16-bit tile), as MMAs against ones: the MMA's K order is a row's own whatever the tile's M
    and layout, where tl.sum's shuffle tree follows the layout (a 16-row and a 64-row tile of the same row
    summed its probabilities differently on the H200). All 16 columns hold the same sum; max picks it
    exactly."""
    ones = tl.full([p_hi.shape[1], 16], 1.0, p_hi.dtype)
    s = mma(p_hi, ones, tl.zeros([p_hi.shape[0], 16], tl.float32))
    if SPLIT and p_hi.dtype != tl.float32:
        s = mma(p_lo, ones, s)
    return tl.max(s, axis=1)


@triton.jit
def _q_halves(ptrs, mask, qk_scale, kc_ptr, SPLIT: tl.constexpr = True):
    """A q tile loaded, upcast and pre-scaled (so that softmax uses exp2), as the operands of
    :func:`_scores`: fp32 q twice for an fp32 cache, else its hi / lo halves in the cache dtype (SPLIT
    off: q rounded once to the cache dtype, passed twice)."""
    q = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * qk_scale
    if kc_ptr.dtype.element_ty == tl.float32:
        q_hi = q
        q_lo = q
    elif SPLIT:
        q_hi = cast(q, kc_ptr.dtype.element_ty)
        q_lo = cast(q - q_hi.to(tl.float32), kc_ptr.dtype.element_ty)
    else:
        q_hi = cast(q, kc_ptr.dtype.element_ty)
        q_lo = q_hi
    return q_hi, q_lo


@triton.jit
def _scores(q_hi, q_lo, ktt, SPLIT: tl.constexpr = True):
    """q . k for a tile: fp32 q (q_hi, passed twice) or its 16-bit hi / lo halves (SPLIT off: hi alone)
    against the cache tile ktt [D, BLOCK_N] of that dtype, fp32 [M, BLOCK_N]."""
    sc = mma(q_hi, ktt, tl.zeros([q_hi.shape[0], ktt.shape[1]], tl.float32))
    if SPLIT and q_hi.dtype != tl.float32:
        sc = mma(q_lo, ktt, sc)
    return sc


@triton.jit
def _fold(p, vt, acc, l_i, alpha, SPLIT: tl.constexpr = True):
    """One tile of the online softmax: (l * alpha + rowsum(p), acc * alpha + p . V) with p fp32 [M, BLOCK_N]
    (split into 16-bit hi / lo halves for a 16-bit V tile vt [BLOCK_N, BLOCK_DV]; SPLIT off: p rounded
    once to vt's dtype, and the sum is of the rounded p, as FlashAttention and the MLA kernel do)."""
    acc = acc * alpha[:, None]
    if vt.dtype == tl.float32:
        l_i = l_i * alpha + _row_sum(p, p)
        acc = mma(p, vt, acc)
    elif SPLIT:
        p_hi = cast(p, vt.dtype)
        p_lo = cast(p - p_hi.to(tl.float32), vt.dtype)
        l_i = l_i * alpha + _row_sum(p_hi, p_lo)
        acc = mma(p_hi, vt, acc)
        acc = mma(p_lo, vt, acc)
    else:
        p16 = cast(p, vt.dtype)
        l_i = l_i * alpha + _row_sum(p16, p16, False)
        acc = mma(p16, vt, acc)
    return l_i, acc


@triton.jit
def _store_out(out_ptr, row_off, dv, so_d, mask, res, gate_ptr, g_off, GATED: tl.constexpr):
    """res fp32 [M, BLOCK_DV] into the output rows at row_off [M] (each row's offset in out), rounded to
    out's dtype; GATED: times sigmoid(gate) first, the expression of
    :func:`ds4t.kernels.activation.sigmoid_mul` (gate values at gate_ptr + g_off [M] + dv)."""
    if GATED:
        gt = tl.load(gate_ptr + g_off[:, None] + dv[None, :], mask=mask, other=0.0).to(tl.float32)
        res = res * sigmoid(gt)
    tl.store(out_ptr + row_off[:, None] + dv[None, :] * so_d, cast(res, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _store_rows(out_ptr, row_off, dv, so_d, mask, acc, l_i, gate_ptr, g_off, GATED: tl.constexpr):
    """acc / l for the rows of l > 0, else 0 (a row with no position): the output of one split
    (:func:`_store_out`)."""
    res = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    _store_out(out_ptr, row_off, dv, so_d, mask, res, gate_ptr, g_off, GATED)


@triton.jit
def _attn_split_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    kc_ptr, skc_s, skc_l, skc_h, skc_d,
    vc_ptr, svc_s, svc_l, svc_h, svc_d,
    slots_ptr, lens_ptr,
    o_ptr, m_ptr, l_ptr,            # partials: o [B, NS, HQ, DV], m / l [B, NS, HQ] fp32
    out_ptr, so_b, so_h, so_d,      # the output [B, HQ, DV] (rows with one split)
    gate_ptr, sg_b,                 # GATED: the gate [B, HQ * DV] (row stride sg_b)
    qk_scale, L, NS,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FINAL: tl.constexpr,
    GATED: tl.constexpr, SPLIT_PRODUCTS: tl.constexpr = True, DV_PARTS: tl.constexpr = 1,
):
    # DV_PARTS > 1 (dv_parts_of): grid axis 1 is (kv head, value-column part); a part's BLOCK_DV columns
    # start at part * BLOCK_DV, its scores and softmax those of the whole head.
    # A row with one split (length <= its split size) normalises and writes its output here and the
    # merge skips it. FINAL (NS == 1, from L and the schedule only): every row has one split, no
    # partials exist, and no merge kernel runs.
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) // DV_PARTS
    part = tl.program_id(1) % DV_PARTS
    s = tl.program_id(2)
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), L)
    split = split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS)
    split_start = s * split

    h = tl.arange(0, BLOCK_H)
    hm = h < G
    dv = part * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dvm = dv < DV
    qh = g * G + h
    if split_start >= length:
        if FINAL:  # a row with length 0 returns zeros (gated, as sigmoid_mul would gate them)
            _store_out(out_ptr, b * so_b + qh * so_h, dv, so_d, hm[:, None] & dvm[None, :],
                       tl.zeros([BLOCK_H, BLOCK_DV], tl.float32), gate_ptr, b * sg_b + qh * DV, GATED)
        return
    split_end = tl.minimum(split_start + split, length)
    slot = tl.load(slots_ptr + b).to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    dm = d < D
    n = tl.arange(0, BLOCK_N)

    # q of the G heads that share kv head g
    q_hi, q_lo = _q_halves(q_ptr + b * sq_b + qh[:, None] * sq_h + d[None, :] * sq_d, hm[:, None] & dm[None, :],
                           qk_scale, kc_ptr, SPLIT_PRODUCTS)

    # int64 for the slot / split base; offsets inside a split stay small.
    k_base = kc_ptr + slot * skc_s + g.to(tl.int64) * skc_h + split_start.to(tl.int64) * skc_l
    v_base = vc_ptr + slot * svc_s + g.to(tl.int64) * svc_h + split_start.to(tl.int64) * svc_l
    n_in = split_end - split_start           # valid positions of this split, 1..split

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    for t0 in range(0, n_in, BLOCK_N):      # ascending positions; tiles past the end skipped
        pm = (t0 + n) < n_in
        kt = tl.load(k_base + (t0 + n)[:, None] * skc_l + d[None, :] * skc_d,
                     mask=pm[:, None] & dm[None, :], other=0.0)
        vt = tl.load(v_base + (t0 + n)[:, None] * svc_l + dv[None, :] * svc_d,
                     mask=pm[:, None] & dvm[None, :], other=0.0)
        ktt = tl.trans(kt)
        sc = tl.where(pm[None, :], _scores(q_hi, q_lo, ktt, SPLIT_PRODUCTS), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i, acc = _fold(p, vt, acc, l_i, alpha, SPLIT_PRODUCTS)
        m_i = m_new

    om = hm[:, None] & dvm[None, :]
    # One split (always so under FINAL): the merge of one split is acc / l, bitwise what is stored here.
    if length <= split:
        _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, om, acc, l_i, gate_ptr, b * sg_b + qh * DV, GATED)
    else:
        row = (b * NS + s) * HQ + qh            # [BLOCK_H] index into [B, NS, HQ]
        if part == 0:                           # every part has them; one stores them
            tl.store(m_ptr + row, m_i, mask=hm)
            tl.store(l_ptr + row, l_i, mask=hm)
        tl.store(o_ptr + row[:, None] * DV + dv[None, :], acc, mask=om)


@triton.jit
def _runs_tile(t0, hi, q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start, end, m_i, l_i, acc,
               d, dm, dv, dvm, BLOCK_N: tl.constexpr, SPLIT_PRODUCTS: tl.constexpr, MASKED: tl.constexpr):
    """The tile of positions t0 .. t0 + BLOCK_N - 1 folded into the rows of ``grp`` whose range [start, end)
    holds it; others untouched (tl.where, not arithmetic on -inf). MASKED off: the tile lies inside every
    ``grp`` row's range and below hi, so every mask would be all true and is left out -- the same operations
    on the same values for those rows (rows outside ``grp`` are then updated too; callers drop them)."""
    pos = t0 + tl.arange(0, BLOCK_N)
    if MASKED:
        pm = pos < hi
        kt = tl.load(k_base + pos.to(tl.int64)[:, None] * skc_l + d[None, :] * skc_d,
                     mask=pm[:, None] & dm[None, :], other=0.0)
        vt = tl.load(v_base + pos.to(tl.int64)[:, None] * svc_l + dv[None, :] * svc_d,
                     mask=pm[:, None] & dvm[None, :], other=0.0)
        mine = (pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])
        upd = grp & (t0 >= start) & (t0 < end)     # this tile is one of the row's own
        sc = tl.where(mine, _scores(q_hi, q_lo, tl.trans(kt), SPLIT_PRODUCTS), float("-inf"))
        # rows that skip this tile take max 0 (their results are dropped): no -inf - -inf
        m_new = tl.where(upd, tl.maximum(m_i, tl.max(sc, axis=1)), 0.0)
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(mine & upd[:, None], tl.exp2(sc - m_new[:, None]), 0.0)
        l_new, a_new = _fold(p, vt, acc, l_i, alpha, SPLIT_PRODUCTS)
        m_i = tl.where(upd, m_new, m_i)
        l_i = tl.where(upd, l_new, l_i)
        acc = tl.where(upd[:, None], a_new, acc)
    else:
        kt = tl.load(k_base + pos.to(tl.int64)[:, None] * skc_l + d[None, :] * skc_d, mask=dm[None, :], other=0.0)
        vt = tl.load(v_base + pos.to(tl.int64)[:, None] * svc_l + dv[None, :] * svc_d, mask=dvm[None, :],
                     other=0.0)
        sc = _scores(q_hi, q_lo, tl.trans(kt), SPLIT_PRODUCTS)
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i, acc = _fold(p, vt, acc, l_i, alpha, SPLIT_PRODUCTS)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _runs_group_split(q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start, end,
                      d, dm, dv, dvm, BLOCK_N: tl.constexpr, SPLIT_PRODUCTS: tl.constexpr,
                      INTERIOR: tl.constexpr = False):
    """One split of the rows ``grp`` [M] of one slot (K / V at k_base / v_base): each row folds its own tiles
    of [start, end) [M], ascending, with the split kernel's operations; the union of the rows' ranges is
    walked once (:func:`_runs_tile`). INTERIOR: the tiles inside every row's range (most of a chunk's split:
    the rows share its start and differ in their ends by < the chunk) without masks, the edges with them.
    Returns the rows' running max, sum and un-normalised output (m [M], l [M], acc [M, BLOCK_DV] fp32)."""
    TILE_M: tl.constexpr = q_hi.shape[0]
    lo = tl.min(tl.where(grp, start, 2147483647), axis=0)
    hi = tl.max(tl.where(grp, end, 0), axis=0)
    m_i = tl.full([TILE_M], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_M], tl.float32)
    acc = tl.zeros([TILE_M, dv.shape[0]], tl.float32)
    edge = lo   # the masked tiles from here to hi (without INTERIOR: all of them)
    if INTERIOR:
        # tiles on the BLOCK_N grid from lo (every start is on it: splits are multiples of BLOCK_N)
        a = tl.max(tl.where(grp, start, 0), axis=0)
        edge = tl.maximum(a + ((tl.min(tl.where(grp, end, 2147483647), axis=0) - a) // BLOCK_N) * BLOCK_N, a)
        for t0 in range(lo, a, BLOCK_N):
            m_i, l_i, acc = _runs_tile(t0, hi, q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start,
                                       end, m_i, l_i, acc, d, dm, dv, dvm, BLOCK_N, SPLIT_PRODUCTS, True)
        for t0 in range(a, edge, BLOCK_N):
            m_i, l_i, acc = _runs_tile(t0, hi, q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start,
                                       end, m_i, l_i, acc, d, dm, dv, dvm, BLOCK_N, SPLIT_PRODUCTS, False)
    for t0 in range(edge, hi, BLOCK_N):
        m_i, l_i, acc = _runs_tile(t0, hi, q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start,
                                   end, m_i, l_i, acc, d, dm, dv, dvm, BLOCK_N, SPLIT_PRODUCTS, True)
    return m_i, l_i, acc


@triton.jit
def _run_is_fused(slots_ptr, blk, B, RUN: tl.constexpr, RUN_P2: tl.constexpr, runs_ptr, stride_run, M,
                  FUSE_ROWS: tl.constexpr):
    """Whether batch rows blk * RUN .. + RUN - 1 all exist (< B), name one slot (decode rows are a slot each,
    and a lone last row is never fused) and, with FUSE_ROWS > 0, lie in a run of at least FUSE_ROWS rows of
    the runs table (:func:`ds4t.kernels.splits.in_long_run`; FUSE_ROWS = 0: every run of the launch is long):
    a program whose splits it folds and merges itself (FUSE) -- the runs kernel and the merge kernel both ask."""
    j = tl.arange(0, RUN_P2)
    rows = blk.to(tl.int64) * RUN + j
    ok = (j < RUN) & (rows < B)
    sl = tl.load(slots_ptr + rows, mask=ok, other=0).to(tl.int64)
    one = tl.max(tl.where(ok, sl, -1), axis=0) == tl.min(tl.where(ok, sl, 9223372036854775807), axis=0)
    one = one & ((blk.to(tl.int64) + 1) * RUN <= B)
    if FUSE_ROWS > 0:
        one = one & in_long_run(runs_ptr, stride_run, M, blk.to(tl.int64) * RUN, FUSE_ROWS)
    return one


@triton.jit
def _merge_rows(part, m_run, l_run, acc_run, m_i, l_i, acc):
    """A fused program's merge of one split (m_i, l_i, acc) into its rows' running result, for the rows in
    ``part`` (those of more than one split that reach this split); the other rows keep theirs."""
    m_new, l_new, a_new = merge_step(m_run, l_run, acc_run, m_i, l_i, acc)
    return (tl.where(part, m_new, m_run), tl.where(part, l_new, l_run),
            tl.where(part[:, None], a_new, acc_run))


@triton.jit
def _attn_runs_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    kc_ptr, skc_s, skc_l, skc_h, skc_d,
    vc_ptr, svc_s, svc_l, svc_h, svc_d,
    slots_ptr, lens_ptr,
    o_ptr, m_ptr, l_ptr,
    out_ptr, so_b, so_h, so_d,
    gate_ptr, sg_b,
    qk_scale, L, NS, B,
    HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, FINAL: tl.constexpr,
    RUN: tl.constexpr, GATED: tl.constexpr, TILE_M: tl.constexpr, SPLIT_PRODUCTS: tl.constexpr = True,
    FUSE: tl.constexpr = False, RUN_P2: tl.constexpr = 1, INTERIOR: tl.constexpr = False,
    runs_ptr=None, stride_run=0, M=0, FUSE_ROWS: tl.constexpr = 0, PEEL: tl.constexpr = False,
):
    # _attn_split_kernel for RUN consecutive rows at once, grid (cdiv(B, RUN), Hkv, NS): the rows of
    # one slot (a prefill chunk) share each K / V tile load and one MMA of TILE_M >= RUN * G tile rows,
    # packed densely (tile row i = batch row i // G, query head i % G of kv head g; rows from RUN * G
    # on are padding), so G = 12 heads waste no quarter of the tile as a 16-row head block would. Each row still folds
    # exactly its own tiles, in the same order, with the same operations (_runs_group_split): its split size
    # from its own length, its tiles on the BLOCK_N grid from its split start (split sizes are multiples of
    # BLOCK_N). The MMA gives a row the same bits whatever the other rows of the tile (ds4t.backend.mma; on
    # the H200 for every tile shape, bench/mma_shapes.py), so a row's bits are the split kernel's. Rows of
    # different slots in one program (a decode row beside a chunk) run as separate groups, one slot each.
    # FUSE: a run of one slot is done by its split-0 program alone -- every split in ascending order, each
    # merged into the rows' running result at once by the merge kernel's own step (merge_step), so no
    # partials go through memory and the merge kernel skips these rows (it asks _run_is_fused too). With
    # FUSE_ROWS, only programs in runs of that many rows (a verify chunk beside a long chunk keeps its splits).
    # PEEL: a fused program's split 0 runs before its split loop (the same operations in the same order): the
    # loop then holds no store for the rows of one split (sm_90 at GLM-4.5's tile: 640 -> 456 bytes of spills,
    # 2351 -> 1825 instructions a split outside the tile loop; bench/compile_check.py --sass).
    grid_dependency()
    blk = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    i = tl.arange(0, TILE_M)
    h = i % G
    b = blk.to(tl.int64) * RUN + i // G
    hm = (i < RUN * G) & (b < B)
    qh = g * G + h
    length = tl.minimum(tl.load(lens_ptr + b, mask=hm, other=0).to(tl.int32), L)
    slot = tl.load(slots_ptr + b, mask=hm, other=0).to(tl.int64)
    split = split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS)
    dv = tl.arange(0, BLOCK_DV)
    dvm = dv < DV
    if FINAL:  # rows of length 0 return zeros
        _store_out(out_ptr, b * so_b + qh * so_h, dv, so_d, (hm & (length == 0))[:, None] & dvm[None, :],
                   tl.zeros([TILE_M, BLOCK_DV], tl.float32), gate_ptr, b * sg_b + qh * DV, GATED)
    fused = False
    if FUSE:
        fused = _run_is_fused(slots_ptr, blk, B, RUN, RUN_P2, runs_ptr, stride_run, M, FUSE_ROWS)
    if fused and s > 0:   # the split-0 program does this run's every split
        return
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q_hi, q_lo = _q_halves(q_ptr + b[:, None] * sq_b + qh[:, None] * sq_h + d[None, :] * sq_d,
                           hm[:, None] & dm[None, :], qk_scale, kc_ptr, SPLIT_PRODUCTS)
    one = length <= split
    if fused:
        run_slot = tl.max(tl.where(hm, slot, 0), axis=0)
        k_base = kc_ptr + run_slot * skc_s + g.to(tl.int64) * skc_h
        v_base = vc_ptr + run_slot * svc_s + g.to(tl.int64) * svc_h
        m_run = tl.full([TILE_M], float("-inf"), tl.float32)
        l_run = tl.zeros([TILE_M], tl.float32)
        acc_run = tl.zeros([TILE_M, BLOCK_DV], tl.float32)
        n_splits = tl.max(tl.where(hm, tl.cdiv(length, split), 0), axis=0)
        first = 0
        if PEEL:   # split 0 before the loop, with the one-split rows' store: no store inside the loop
            grp = hm & (0 < length)
            m_i, l_i, acc = _runs_group_split(q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp,
                                              split * 0, tl.minimum(split, length), d, dm, dv, dvm, BLOCK_N,
                                              SPLIT_PRODUCTS, INTERIOR)
            _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, (grp & one)[:, None] & dvm[None, :], acc,
                        l_i, gate_ptr, b * sg_b + qh * DV, GATED)
            part = grp & (length > split)
            m_run, l_run, acc_run = _merge_rows(part, m_run, l_run, acc_run, m_i, l_i, acc)
            first = 1
        for sp in range(first, n_splits):
            start = sp * split
            grp = hm & (start < length)
            m_i, l_i, acc = _runs_group_split(q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start,
                                              tl.minimum(start + split, length), d, dm, dv, dvm, BLOCK_N,
                                              SPLIT_PRODUCTS, INTERIOR)
            if not PEEL:
                if sp == 0:   # rows of one split: no merge, as in the split kernel
                    _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, (grp & one)[:, None] & dvm[None, :],
                                acc, l_i, gate_ptr, b * sg_b + qh * DV, GATED)
            part = grp & (length > split)
            m_run, l_run, acc_run = _merge_rows(part, m_run, l_run, acc_run, m_i, l_i, acc)
        # rows of more than one split, and of none (length 0: zeros, as the merge writes them)
        _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, (hm & (~one | (length == 0)))[:, None] & dvm[None, :],
                    acc_run, l_run, gate_ptr, b * sg_b + qh * DV, GATED)
    else:
        start = s * split
        end = tl.minimum(start + split, length)
        todo = hm & (start < length)
        while tl.max(todo.to(tl.int32), axis=0) > 0:
            lead = tl.min(tl.where(todo, i, TILE_M), axis=0)
            lead_slot = tl.max(tl.where(i == lead, slot, -1), axis=0)
            grp = todo & (slot == lead_slot)
            k_base = kc_ptr + lead_slot * skc_s + g.to(tl.int64) * skc_h
            v_base = vc_ptr + lead_slot * svc_s + g.to(tl.int64) * svc_h
            m_i, l_i, acc = _runs_group_split(q_hi, q_lo, k_base, skc_l, skc_d, v_base, svc_l, svc_d, grp, start,
                                              end, d, dm, dv, dvm, BLOCK_N, SPLIT_PRODUCTS, INTERIOR)
            _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, (grp & one)[:, None] & dvm[None, :], acc, l_i,
                        gate_ptr, b * sg_b + qh * DV, GATED)
            part = grp & (length > split)
            row = (b * NS + s) * HQ + qh
            tl.store(m_ptr + row, m_i, mask=part)
            tl.store(l_ptr + row, l_i, mask=part)
            tl.store(o_ptr + row[:, None] * DV + dv[None, :], acc, mask=part[:, None] & dvm[None, :])
            todo = todo & (slot != lead_slot)


@triton.jit
def _attn_merge_kernel(
    o_ptr, m_ptr, l_ptr,
    lens_ptr, slots_ptr, B,
    out_ptr, so_b, so_h, so_d,
    gate_ptr, sg_b,
    L, NS,
    HQ: tl.constexpr, G: tl.constexpr, DV: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, MERGE_DV: tl.constexpr, GATED: tl.constexpr, MERGE_STAGES: tl.constexpr,
    FUSED_RUN: tl.constexpr = 0, RUN_P2: tl.constexpr = 1, runs_ptr=None, stride_run=0, M=0,
    FUSE_ROWS: tl.constexpr = 0,
):
    # grid (B, Hkv, value-column blocks): the merge is elementwise in the value columns, so the
    # column block changes no bit; it only gives a row more programs. FUSED_RUN: the runs kernel ran with
    # FUSE and runs of this many rows; a row of a one-slot run is already merged and stored.
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), L)
    nvalid = tl.cdiv(length, split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS))
    if nvalid == 1:   # the split kernel wrote this row
        return
    if FUSED_RUN > 0:
        if _run_is_fused(slots_ptr, b // FUSED_RUN, B, FUSED_RUN, RUN_P2, runs_ptr, stride_run, M, FUSE_ROWS):
            return
    h = tl.arange(0, BLOCK_H)
    hm = h < G
    qh = g * G + h
    dv = tl.program_id(2) * MERGE_DV + tl.arange(0, MERGE_DV)
    om = hm[:, None] & (dv < DV)[None, :]

    m_run = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, MERGE_DV], tl.float32)
    # Fixed ascending order. The loads do not depend on the running max: MERGE_STAGES splits' loads are
    # in flight at once (without it every split waited for its own, ~1 us a split at 32-64 splits a row).
    for s in tl.range(0, nvalid, num_stages=MERGE_STAGES):
        row = (b * NS + s) * HQ + qh
        m_s = tl.load(m_ptr + row, mask=hm, other=0.0)
        l_s = tl.load(l_ptr + row, mask=hm, other=0.0)
        o_s = tl.load(o_ptr + row[:, None] * DV + dv[None, :], mask=om, other=0.0)
        m_run, l_run, acc = merge_step(m_run, l_run, acc, m_s, l_s, o_s)
    _store_rows(out_ptr, b * so_b + qh * so_h, dv, so_d, om, acc, l_run, gate_ptr, b * sg_b + qh * DV, GATED)


# ----------------------------------------------------------------------------- launchers


def _check_cache(k_cache, v_cache):
    if k_cache.dim() != 4 or v_cache.dim() != 4:
        raise ValueError(f"caches must be [S, L, Hkv, D], got {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} disagree on [S, L, Hkv]")
    if k_cache.dtype != v_cache.dtype:
        raise TypeError(f"k_cache is {k_cache.dtype}, v_cache is {v_cache.dtype}")
    tl_dtype(k_cache.dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor, positions: torch.Tensor) -> None:
    """Store one token per row: ``k_cache[slots[b], positions[b]] = k[b]`` and the same for v.

    k [B, Hkv, D], v [B, Hkv, Dv] (any float dtype; rounded to nearest even into the cache
    dtype, also in the interpreter), caches [S, L, Hkv, D|Dv], slots / positions [B] int32 or
    int64. Rows whose slot or position is out of range are not written (no host check, no sync).
    Rows must name distinct (slot, position) pairs.
    """
    _check_cache(k_cache, v_cache)
    S, L, HKV, D = k_cache.shape
    DV = v_cache.shape[3]
    B = k.shape[0]
    if k.shape != (B, HKV, D) or v.shape != (B, HKV, DV):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not fit caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if slots.shape != (B,) or positions.shape != (B,):
        raise ValueError(f"slots {tuple(slots.shape)} and positions {tuple(positions.shape)} must be [{B}]")
    if B == 0:
        return
    _write_kv_kernel[(B,)](
        k, *k.stride(), v, *v.stride(),
        k_cache, *k_cache.stride(), v_cache, *v_cache.stride(),
        slots, positions, S, L,
        HKV=HKV, D=D, DV=DV,
        BLOCK_H=triton.next_power_of_2(HKV), BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(DV), **LAUNCH,
    )


def _attn_args(q, k_cache, v_cache, slots, lengths, split_size):
    _check_cache(k_cache, v_cache)
    S, L, HKV, D = k_cache.shape
    DV = v_cache.shape[3]
    if q.dim() != 3 or q.shape[2] != D:
        raise ValueError(f"q must be [B, Hq, {D}], got {tuple(q.shape)}")
    B, HQ, _ = q.shape
    if HQ % HKV != 0:
        raise ValueError(f"Hq={HQ} is not a multiple of Hkv={HKV}")
    if slots.shape != (B,) or lengths.shape != (B,):
        raise ValueError(f"slots {tuple(slots.shape)} and lengths {tuple(lengths.shape)} must be [{B}]")
    sched = as_schedule(split_size, default_split_schedule(D, DV, k_cache.dtype))
    if sched.min_split < 16 or sched.min_split & (sched.min_split - 1):
        raise ValueError(f"split_size: splits must be powers of two >= 16, got {sched}")
    return B, HQ, HKV, D, DV, L, sched


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     slots: torch.Tensor, lengths: torch.Tensor, scale: float, *,
                     split_size: Optional[int] = None, out: Optional[torch.Tensor] = None,
                     gate: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32,
                     same_slot_runs: Union[int, SameSlotRuns, None] = 0, products: str = "split") -> torch.Tensor:
    """softmax(scale · q · Kᵀ) · V per row over cache positions ``< lengths[b]`` of ``slots[b]``.

    q [B, Hq, D] (fp32, or any float, upcast), caches [S, L, Hkv, D] / [S, L, Hkv, Dv] (fp32 /
    bf16 / fp16), slots, lengths [B] int32 (lengths in 1..L). Hq must be a multiple of Hkv: q head
    h uses kv head h // (Hq // Hkv). ``split_size``: how a row's positions are cut into KV splits, a
    :class:`~ds4t.kernels.splits.SplitSchedule` (default :func:`default_split_schedule`) or an int
    (one split size for every row); splits are powers of two >= 16. ``gate`` [B, Hq*Dv]
    (any float dtype, unit column stride): the output is multiplied by sigmoid(gate) as
    :func:`ds4t.kernels.activation.sigmoid_mul` does (gated attention), bitwise the same, by the
    kernel that stores the row (no launch of its own). Returns fp32 [B, Hq, Dv] (written into ``out`` if
    given); with ``out_dtype`` bf16 / fp16 a new tensor of the fp32 result rounded to nearest even (what
    a linear reading the output in that dtype would round it to; with a gate ``out`` is then scratch).
    Batch invariant; no host synchronisation.

    ``same_slot_runs``: a launch hint: 0 / False / None -- one row a slot (decode); rows come in runs of one
    slot (prefill chunks): a :class:`~ds4t.kernels.splits.SameSlotRuns` (the runs' table on the device and
    their shortest / longest lengths), or an int n >= 1 (True: 1), the shortest run of more than one row. Programs
    then take ``AttentionConfig.run_rows`` consecutive rows and share each K / V tile among a run's rows, and
    a program whose rows are all of one run of >= ``run_fuse_rows`` rows folds and merges every split of them
    (no partials, no merge for them): with an int, every run when n >= ``run_fuse_rows`` (else none); with
    the table, each run by its own length (a 1024-row chunk beside a 4-row verify chunk: the chunk's
    programs fold, the verify's keep their splits' parallelism). Every row's bits are the same either way
    (see ``_attn_runs_kernel``); only speed changes.

    ``products`` (16-bit caches; an fp32 cache always multiplies in IEEE fp32): ``"split"`` (default) --
    q and the probabilities as hi + lo halves in the cache dtype, two MMAs each, effectively fp32 products;
    ``"cache"`` -- each rounded once to the cache dtype, one MMA each, the normaliser summing the rounded
    probabilities (FlashAttention's numerics, and :mod:`ds4t.kernels.mla`'s): half the tensor-core work,
    bf16-sized errors. A numerics choice, so a caller's (a model's load option), never a table entry: decode
    and prefill of one model must use the same one for chunked prefill to keep its bits.
    """
    checked_products(products, "decode_attention: products")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"decode_attention: out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    B, HQ, HKV, D, DV, L, sched = _attn_args(q, k_cache, v_cache, slots, lengths, split_size)
    if out is None:
        out = torch.empty((B, HQ, DV), dtype=torch.float32, device=q.device)
    elif out.shape != (B, HQ, DV) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{B}, {HQ}, {DV}]")
    if gate is not None and (gate.shape != (B, HQ * DV) or gate.stride(1) != 1 or not out.is_contiguous()):
        raise ValueError(f"gate must be [{B}, {HQ * DV}] with unit column stride (and out contiguous), "
                         f"got {tuple(gate.shape)}")
    if B == 0:
        return out
    G = HQ // HKV
    NS = sched.max_splits(L)
    BLOCK_H = max(16, triton.next_power_of_2(G))
    BLOCK_D = max(16, triton.next_power_of_2(D))       # dot operands need >= 16
    BLOCK_DV = max(16, triton.next_power_of_2(DV))
    cfg = ATTENTION_CONFIGS(sched.min_split, BLOCK_D, BLOCK_DV)
    BLOCK_N = cfg.block_n
    # an fp32 cache multiplies in IEEE fp32 either way; the interpreter's one-program-per-rows twin multiplies
    # in fp32 ("split"'s numerics), so "cache" with a 16-bit cache runs the GPU's kernels there too
    split_products = products == "split" or k_cache.dtype == torch.float32
    if split_products and variant("decode_attention") == INTERP and attention_rows.launch_decode(
            q, k_cache, v_cache, slots, lengths, out, gate, float(scale) * _LOG2E, sched, BLOCK_N):
        return out if out_dtype == torch.float32 else out.to(out_dtype)
    final = NS == 1
    # Every row has one split (NS from L and the schedule, never from B): no partials, no merge.
    if final:  # the (unused) partial pointers name out
        o_part = m_part = l_part = out
    else:
        o_part = torch.empty((B, NS, HQ, DV), dtype=torch.float32, device=q.device)
        m_part = torch.empty((B, NS, HQ), dtype=torch.float32, device=q.device)
        l_part = torch.empty((B, NS, HQ), dtype=torch.float32, device=q.device)
    # A gate is applied where a row's output is stored, into the returned tensor y in out_dtype.
    gated = gate is not None
    y = out if not gated or out_dtype == torch.float32 else torch.empty((B, HQ, DV), dtype=out_dtype, device=q.device)
    g_args = (gate, gate.stride(0)) if gated else (y, 0)   # any pointer when not gated (never read)
    args = (q, *q.stride(), k_cache, *k_cache.stride(), v_cache, *v_cache.stride(), slots, lengths,
            o_part, m_part, l_part, y, *y.stride(), *g_args, float(scale) * _LOG2E, L, NS)
    consts = dict(HQ=HQ, G=G, D=D, DV=DV, **sched.kernel_args(), BLOCK_N=BLOCK_N, BLOCK_H=BLOCK_H,
                  BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, FINAL=final, GATED=gated, SPLIT_PRODUCTS=split_products)
    runs = bool(same_slot_runs) and cfg.run_rows > 1 and B > 1
    # one-slot programs of long runs fold and merge their splits (a chunk of >= run_fuse_rows rows gives
    # programs enough without the splits'; a short run at a long position -- a speculative verify beside a
    # chunk -- keeps its splits' parallelism); the same bits either way
    if isinstance(same_slot_runs, SameSlotRuns):
        same_slot_runs.check_device(slots.device, "decode_attention")
    fuse, fuse_rows = _fusion(same_slot_runs, cfg.run_fuse_rows, runs and not final)
    run_p2 = triton.next_power_of_2(cfg.run_rows)
    ptr, stride, lines = table_args(same_slot_runs if fuse_rows else None, slots)
    table = dict(runs_ptr=ptr, stride_run=stride, M=lines, FUSE_ROWS=fuse_rows)
    if runs:
        warps = {} if cfg.run_warps is None else {"num_warps": cfg.run_warps}
        run_stages = cfg.num_stages if cfg.run_stages is None else cfg.run_stages
        stages = {} if run_stages is None else {"num_stages": run_stages}
        _attn_runs_kernel[(triton.cdiv(B, cfg.run_rows), HKV, NS)](
            *args, B, **consts, RUN=cfg.run_rows, TILE_M=run_tile(cfg.run_rows, G), FUSE=fuse, RUN_P2=run_p2,
            INTERIOR=cfg.run_interior, PEEL=fuse and cfg.run_peel, **table, **warps, **stages, **LAUNCH)
    else:
        parts = dv_parts_of(cfg, B, BLOCK_DV)
        if parts > 1:
            consts.update(BLOCK_DV=BLOCK_DV // parts, DV_PARTS=parts)
        _attn_split_kernel[(B, HKV * parts, NS)](*args, **consts, **launch_kwargs(cfg), **LAUNCH)
    if not final:
        merge_dv = min(_MERGE_DV, BLOCK_DV)
        _attn_merge_kernel[(B, HKV, triton.cdiv(DV, merge_dv))](
            o_part, m_part, l_part, lengths, slots, B,
            y, *y.stride(), *g_args,
            L, NS,
            HQ=HQ, G=G, DV=DV, **sched.kernel_args(), BLOCK_H=BLOCK_H, MERGE_DV=merge_dv, GATED=gated,
            MERGE_STAGES=cfg.merge_stages, FUSED_RUN=cfg.run_rows if fuse else 0, RUN_P2=run_p2, **table,
            **({} if cfg.merge_warps is None else {"num_warps": cfg.merge_warps}), **LAUNCH,
        )
    return y if gated or out_dtype == torch.float32 else out.to(out_dtype)


def _fusion(hint, threshold: Optional[int], possible: bool):
    """(fuse, FUSE_ROWS) of a launch hint ``same_slot_runs`` (:func:`decode_attention`) against a config's
    ``run_fuse_rows`` threshold: whether any program may fold its rows' splits; 0 when every run of the
    launch is long enough (no table to ask), else the threshold each program's run is held to (the
    kernels then read the hint's table). ``possible``: the launch has split partials and runs programs."""
    if not possible or threshold is None or not hint:
        return False, 0
    if isinstance(hint, SameSlotRuns):
        if hint.longest < threshold:
            return False, 0
        return True, (0 if hint.shortest >= threshold else threshold)
    return int(hint) >= threshold, 0


def norm_rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_norm: torch.Tensor,
                       k_norm: torch.Tensor, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, *,
                       rotary_dim: Optional[int] = None, zero_centered: bool = False,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The gated-attention prologue: per-head RMSNorm of q and k (weights q_norm, k_norm [D];
    x̂·(1 + w) when ``zero_centered``), rotate-half RoPE on their first ``rotary_dim`` dims, then k
    and v stored as :func:`write_kv` stores them. Returns q fp32 [R, H, D].

    q [R, H, D], k [R, KV, D], v [R, KV, Dv] (any float dtype, any strides), positions / slots
    [R] int32 or int64, inv_freq [rotary_dim / 2] fp32, caches [S, L, KV, D|Dv]. Is
    ``rope(rms_norm(q)), write_kv(rope(rms_norm(k)), v)`` (rope scale 1) in one launch: on the GPU
    :func:`_norm_rope_kv_kernel` (a program per row and head), in the interpreter its twin (variant
    ``"interp"``, :mod:`ds4t.kernels.interp.attention_rows`). The result is the separate kernels' bit for
    bit: the norms' sums of squares are :func:`ds4t.kernels.norm.rstd_of`'s fixed tree in every kernel and
    layout. Every row, prefill or decode, of every model with q/k norms goes through it. Batch invariant (a
    row's result never depends on the others).
    """
    _check_cache(k_cache, v_cache)
    S, L, KV, D = k_cache.shape
    DV = v_cache.shape[3]
    R, H, Dq = q.shape
    if Dq != D or k.shape != (R, KV, D) or v.shape != (R, KV, DV):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q_norm.shape != (D,) or k_norm.shape != (D,):
        raise ValueError(f"q_norm and k_norm must be [{D}]")
    if positions.shape != (R,) or slots.shape != (R,):
        raise ValueError(f"positions {tuple(positions.shape)} and slots {tuple(slots.shape)} must be [{R}]")
    if rotary_dim is None:
        rotary_dim = 2 * inv_freq.numel()
    if rotary_dim % 2 or not 2 <= rotary_dim <= D or inv_freq.shape != (rotary_dim // 2,):
        raise ValueError(f"rotary_dim={rotary_dim} must be even, in [2, D={D}], with inv_freq [{rotary_dim // 2}]")
    if out is None:
        out = torch.empty((R, H, D), dtype=torch.float32, device=q.device)
    elif out.shape != (R, H, D) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{R}, {H}, {D}]")
    if R == 0:
        return out
    if variant("norm_rope_write_kv") == INTERP:
        attention_rows.launch_norm_rope_write_kv(q, k, v, q_norm, k_norm, eps, positions, inv_freq, k_cache, v_cache,
                                                 slots, rotary_dim, zero_centered, out)
        return out
    # One launch (_norm_rope_kv_kernel); q and k need a unit last stride for the sum of squares to load as
    # one vector (copied if not, as the norm's reshape copies them).
    q = q if q.stride(2) == 1 else q.contiguous()
    k = k if k.stride(2) == 1 else k.contiguous()
    HALF = rotary_dim // 2
    cfg = NORM_ROPE_CONFIGS(D)
    heads = cfg.heads if R >= cfg.min_rows else 1
    _norm_rope_kv_kernel[(R, triton.cdiv(H, heads) + triton.cdiv(KV, heads))](
        q, *q.stride(), k, *k.stride(), v, *v.stride(),
        q_norm.contiguous(), k_norm.contiguous(), inv_freq.contiguous(), positions, slots,
        k_cache, *k_cache.stride(), v_cache, *v_cache.stride(), out, *out.stride(),
        S, L, float(eps),
        H=H, KV=KV, D=D, DV=DV, HALF=HALF, ZERO_CENTERED=bool(zero_centered),
        BLOCK_D=triton.next_power_of_2(D), BLOCK_HALF=triton.next_power_of_2(HALF),
        BLOCK_P=triton.next_power_of_2(max(D - 2 * HALF, 1)), BLOCK_DV=triton.next_power_of_2(DV), HEADS=heads,
        num_warps=cfg.num_warps if heads > 1 else norm.NORM_CONFIGS(D).num_warps, **LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------- references


def write_kv_ref(k, v, k_cache, v_cache, slots, positions) -> None:
    """Plain-torch :func:`write_kv` (torch's ``.to`` rounds to nearest even)."""
    s = slots.long()
    p = positions.long()
    k_cache[s, p] = k.to(k_cache.dtype)
    v_cache[s, p] = v.to(v_cache.dtype)


def decode_attention_ref(q, k_cache, v_cache, slots, lengths, scale, *, split_size=None, out=None,
                         products="split"):
    """Plain-torch :func:`decode_attention`, one row at a time, fp32 (``split_size`` is ignored). ``products``
    "cache": q pre-scaled (by ``scale`` and log2 e, as the kernel does) rounded to a 16-bit cache's dtype; the
    probabilities stay exact (the tolerance covers the kernel's rounded ones)."""
    checked_products(products, "decode_attention_ref: products")
    if products == "cache" and k_cache.dtype != torch.float32:
        q = (q.float() * (scale * _LOG2E)).to(k_cache.dtype).float() / (scale * _LOG2E)
    B, HQ, D = q.shape
    HKV = k_cache.shape[2]
    G = HQ // HKV
    DV = v_cache.shape[3]
    res = torch.empty((B, HQ, DV), dtype=torch.float32, device=q.device) if out is None else out
    for b in range(B):
        n = int(lengths[b])
        s = int(slots[b])
        k = k_cache[s, :n].float().repeat_interleave(G, dim=1)      # [n, HQ, D]
        v = v_cache[s, :n].float().repeat_interleave(G, dim=1)      # [n, HQ, DV]
        sc = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        p = torch.softmax(sc, dim=-1)
        res[b] = torch.einsum("hn,nhd->hd", p, v)
    return res


# ----------------------------------------------------------------------------- self-check

_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-5, torch.float16: 2e-5}


@register_check
def _check(device) -> List[CheckResult]:
    results = []
    g = torch.Generator(device="cpu").manual_seed(0)
    S, L, HQ, HKV, D, B, SPLIT = 3, 48, 6, 2, 48, 4, 16
    scale = D ** -0.5
    slots = torch.tensor([2, 0, 0, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([48, 1, 37, 17], dtype=torch.int32, device=device)
    for dtype in (torch.float32, torch.bfloat16):
        kc = torch.randn(S, L, HKV, D, generator=g).to(dtype).to(device)
        vc = torch.randn(S, L, HKV, D, generator=g).to(dtype).to(device)
        q = torch.randn(B, HQ, D, generator=g).to(device)

        def run(idx, q=q, kc=kc, vc=vc):
            return decode_attention(q[idx], kc, vc, slots[idx], lengths[idx], scale, split_size=SPLIT)

        idx = torch.arange(B, device=device)
        got = run(idx)
        ref = decode_attention_ref(q, kc, vc, slots, lengths, scale)
        err = (got - ref).abs().max().item()
        perm = torch.tensor([3, 1, 0, 2], device=device)
        inv = torch.equal(run(perm), got[perm])
        inv = inv and all(torch.equal(run(idx[i:i + 1])[0], got[i]) for i in (0, 2))
        ms = timer(lambda: run(idx), warmup=1, iters=1 if INTERPRET else 20)
        results.append(CheckResult(f"decode_attention {str(dtype).replace('torch.', '')}",
                                   f"B={B} Hq={HQ} Hkv={HKV} D={D} L={L} split={SPLIT}", err, _TOL[dtype], inv, ms,
                                   note="row invariance: permuted batch and rows alone"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(write_kv, reference=write_kv_ref)
register_op(decode_attention, reference=decode_attention_ref, variants=(GPU, INTERP))
register_op(norm_rope_write_kv, variants=(GPU, INTERP))
