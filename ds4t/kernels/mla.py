"""Absorbed MLA decode (DeepSeek-V2/V3 multi-head latent attention) over a slotted latent cache.

State model: a per-layer pool ``cache`` [S, L, R + Dr] (S slots, capacity L tokens,
R = kv_lora_rank, Dr = qk_rope_head_dim; float32 / bfloat16 / float16). Per token it holds
``[c_kv (after kv_a_layernorm) || k_pe (after RoPE)]``. Batch row b reads slot ``slots[b]`` and
attends to positions ``t < lengths[b]`` (the current token already written with
:func:`write_latent`). Prefill is the same call with T rows of one slot and lengths
start+1 .. start+T.

Absorption (the caller's side): with W_UK [H, nope, R] and W_UV [H, v, R] taken from kv_b_proj,
``q_nope . (W_UK c) = (q_nope W_UK) . c``, so the caller passes ``q_latent = q_nope @ W_UK``
[B, H, R]; the kernel returns the latent ``o = sum_t p_t c_t`` [B, H, R] and the caller applies
W_UV and o_proj. All H heads share one cache row: MQA.

Numerics, per row b and head h::

    s_t = scale * (q_latent . c_t + q_pe . k_pe_t)        t < lengths[b]
    o   = sum_t softmax(s)_t * c_t                        (fp32 result)

* q_latent / q_pe are rounded to the cache dtype (as a bf16 model's activations are) and the
  products accumulate in fp32 (:func:`ds4t.backend.mma`; fp32 caches use IEEE fp32, never TF32).
* Softmax statistics are fp32, in the log2 domain (``exp2`` with ``scale * log2(e)``).
* The probabilities are rounded to the cache dtype before the P.V product (tensor cores on the
  GPU, as FlashMLA / FlashAttention do); the normaliser sums those rounded probabilities.
  The reference keeps exact probabilities; the tolerance table covers the difference.

Split-KV: the positions of a row are cut into splits whose size comes from the row's own length
through a split schedule (:mod:`ds4t.kernels.splits`; default :func:`default_split_schedule`,
from R, Dr and the cache dtype only). Kernel 1 runs one program per (head block, split, row); a
split past the row's length exits at once. A row with one split writes its output directly (a
row of length 0 gets zeros); otherwise each split writes (unnormalised acc, max, sumexp) and
kernel 2 merges the splits in ascending order with log-sum-exp (:func:`ds4t.kernels.splits.merge_step`,
online). The grid comes from shapes (B, H, L) only; nothing is read back to the host. The fp32 partials
take B * NS * H * (R + 2) * 4 bytes of scratch (NS: the most splits a row of length <= L has; never read
or written past a row's length). A prefill chunk's rows (the launch hint ``same_slot_runs``, a
:class:`~ds4t.kernels.splits.SameSlotRuns` table of the step's runs) may instead be folded whole by their
split-0 programs -- every split in order, each merged at once with the same step -- when their run is
long (``MLAConfig.fuse_rows``): their partials are never written and kernel 2 skips them. Same bits.

Batch invariance: every program reads one row's q, slot and length (and the runs table, a hint that
changes no bit) and writes only that row;
tile sizes, the split schedule and the reduction order depend on (H, R, Dr, dtype, interpreter or
GPU), never on B; a row's split size depends on its own length only (so a prefill row at position
p splits as the decode row at p does). So a row's bits never depend on the other rows of the launch.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Union

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, cast, grid_dependency, mma, timer
from ds4t.kernels import norm, rope
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op, rows_invariant
from ds4t.kernels.splits import (SameSlotRuns, SplitSchedule, as_schedule, in_long_run, merge_step, split_of,
                                 table_args)
from ds4t.kernels.tensors import float_out

_LOG2E = 1.4426950408889634
_MAX_GRID_Y = 65535  # CUDA limit on grid axis 1 (rows); larger batches are launched in chunks


# --------------------------------------------------------------------------------------------
# configuration (shapes only)
# --------------------------------------------------------------------------------------------

def _mla_schedule(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> SplitSchedule:
    """Tokens per KV split as a function of a row's length: up to the power of two nearest below
    2 MiB of cache per split, in [64, 1024] (DeepSeek-V3, R=512, Dr=64: 1024 for bf16/fp16, 512 for
    fp32), down to an eighth of that for short rows, at most 16 splits per row below 16 long splits.

    Depends only on the latent width and the cache dtype (never on the batch). Long splits write
    fewer fp32 partials ([H, R] per split and row, 256 KiB at H=128); short rows get shorter splits
    so that a lone row has programs for the GPU. Measured on the H200 (DeepSeek-V3's 128 heads,
    bench/results/2026-11-30-h200-attention-splits.md): a lone row of 4k positions 26 us (one split
    size of 1024: 61 us), 8k 40 us (63), 32k the same; B = 8 at 32k 5 % faster, B >= 8 at 8k 10-20 %
    slower (more partials), the best of 6 schedules summed over the cells.
    """
    elt = torch.empty((), dtype=dtype).element_size()
    per_token = (kv_lora_rank + rope_dim) * elt
    n = max(1, (2 << 20) // max(1, per_token))
    longest = int(min(1024, max(64, 1 << (n.bit_length() - 1))))
    return SplitSchedule(max(16, longest // 8), longest, 16)


MLA_SPLIT_SCHEDULES: ConfigTable[SplitSchedule] = ConfigTable(
    "mla_splits", gpu={}, gpu_rule=_mla_schedule, interp_rule=_mla_schedule,
    source="bench/results/2026-11-30-h200-attention-splits.md (bench/bench_attention.py --schedules)")
"""Keyed on (kv_lora_rank, rope_dim, cache dtype): the KV split schedule of :func:`mla_decode`, a table
like the launch constants (``config.overridden``); never keyed on the batch."""


def default_split_schedule(kv_lora_rank: int, rope_dim: int, dtype: torch.dtype) -> SplitSchedule:
    """The split schedule for this latent width, rope dim and cache dtype (:data:`MLA_SPLIT_SCHEDULES`)."""
    return MLA_SPLIT_SCHEDULES(kv_lora_rank, rope_dim, dtype)


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """Launch constants of mla_decode: heads per split program, tokens per tile, heads per merge
    program, warps and stages of the split kernel, warps of the merge kernel; ``fuse_rows``: a row of a
    run of at least this many rows (a prefill chunk; ``same_slot_runs``) has its splits folded and merged
    by one program, no partials (None: never). Same bits either way."""
    block_h: int
    block_n: int
    merge_heads: int
    num_warps: int
    num_stages: int = 2
    merge_warps: int = 4
    merge_stages: int = 4   # merge: loads of this many splits in flight (1: one split at a time)
    fuse_rows: Optional[int] = None
    few_rows: int = 0       # launches of at most this many rows run the split kernel with few_stages / few_heads
    few_stages: Optional[int] = None   # pipeline stages (None: num_stages); stages never change a bit
    few_heads: Optional[int] = None    # heads a split program (None: block_h): only a head block that gives
                                       # block_h's bits (a few-row launch must equal the same rows in a larger
                                       # one: tests/kernels/test_mla.py::test_few_row_tiles_change_no_bit)

    def split_tile(self, rows: int) -> tuple:
        """(heads a program, pipeline stages) of the split kernel in a launch of ``rows`` rows."""
        if rows <= self.few_rows:
            return (self.few_heads or self.block_h,
                    self.num_stages if self.few_stages is None else self.few_stages)
        return self.block_h, self.num_stages


def _gpu_config(H: int, R: int, Dr: int, split: int) -> MLAConfig:
    # 32 heads x 64 tokens per tile, 4 warps: the best of 84 configs in the H200 sweep at R = 512
    # (bench/results/2026-11-30-h200-attention.md), 2x the 64-head / 8-warp tile, whose fp32
    # accumulator [64, 512] does not fit the registers. Each cache tile is read once per 32 heads
    # (DeepSeek-V3: 4 head blocks; the repeats mostly hit L2). tl.dot needs M >= 16.
    # fuse_rows 512 from 64 heads: a folding program holds a second fp32 [32, 512] accumulator (the running
    # merge beside the split's) and its sm_90 build spills more (552 bytes of stack against the split kernel's
    # 184; bench/compile_check.py's SASS report), yet skipping the partials wins: DeepSeek-V3's 1024-row
    # chunk at 0 / 3072 / 31744 -17 / -11 / -2 %, whole DeepSeek-V3-4l prompts 4k -7.6 %, 32k -2.0 %
    # (bench/results/2026-12-05-h200-prefill-runs.md; same bits). Timed at 128 heads (4 head blocks a row);
    # below 64 heads (tensor-parallel ranks of 8) a chunk's fused programs would be a row's 1 head block
    # alone: untimed, so off there.
    # few_rows / few_stages (stages keep every bit, so a launch may choose them by its rows) stay off: a third
    # stage takes a one-row launch 4-10 % faster alone (H100, 4k / 8k / 32k: 23.3 / 35.7 / 77.6 -> 22.4 / 32.2 /
    # 74.6 us; H200 4-14 %) and two rows 9-15 % slower, but DeepSeek-V3-4l's N = 1 step moved -0.7 % at 4k and
    # +0.4 % at 32k (one process, 3 rounds; bench/results/2026-12-07-h100-one-row-attention.md) -- presumably
    # because a program then holds nearly all of a SM's shared memory (189 KB at two stages), so under PDL the
    # next kernel's programs cannot start beside it. few_heads 16 at one row (twice the programs, the same bits)
    # on an H200: the kernel alone 4-17 % faster at 4k / 8k and 1 % slower at 32k, the DeepSeek-V3-4l (FP8) N = 1
    # step -2.3 % at 4k and +0.8 % at 32k (bench/results/2026-12-07-h200-fp8-table-80b-n1.md) -- an entry cannot
    # see the context length, so it stays off too. bench/one_row_programs.py kernels --only mla re-times both.
    return MLAConfig(block_h=max(16, min(32, triton.next_power_of_2(H))),
                     block_n=max(16, min(64, triton.next_power_of_2(split))),
                     merge_heads=max(1, min(triton.next_power_of_2(H), 4096 // triton.next_power_of_2(R))),
                     num_warps=4, num_stages=2, fuse_rows=512 if H >= 64 else None)


def _interp_config(H: int, R: int, Dr: int, split: int) -> MLAConfig:
    # Few, big programs: every head in one block, long tiles -- as far as the interpreter's dot allows (it
    # materialises [heads, R, tokens]: at most 2^20 elements, so DeepSeek-V3's R = 512 takes 16 heads x 128
    # tokens); a prefill chunk's rows fold their own splits (fewer programs and no merge launch for them;
    # the CPU tests run the fused path everywhere).
    block_n = max(16, min(128, triton.next_power_of_2(split)))
    budget = (1 << 20) // (triton.next_power_of_2(R) * block_n)
    block_h = max(16, min(triton.next_power_of_2(H), triton.next_power_of_2(max(1, budget + 1)) // 2))
    return MLAConfig(block_h=block_h, block_n=block_n, merge_heads=triton.next_power_of_2(H), num_warps=4,
                     fuse_rows=16)


MLA_CONFIGS: ConfigTable[MLAConfig] = ConfigTable(
    "mla_decode", gpu={}, gpu_rule=_gpu_config, interp_rule=_interp_config,
    source="bench/results/2026-11-30-h200-attention.md (bench/bench_attention.py --sweep); fuse_rows: "
           "bench/results/2026-12-05-h200-prefill-runs.md (bench/prefill_attention.py --only mla, bench/prefill_ab.py)")
"""Keyed on (heads, latent rank R, rope dim Dr, the schedule's smallest split): never on the batch."""


@dataclasses.dataclass(frozen=True)
class WriteLatentConfig:
    """Launch constants of write_latent (one program per row): warps."""
    num_warps: int


WRITE_LATENT_CONFIGS: ConfigTable[WriteLatentConfig] = ConfigTable(
    "write_latent", gpu={},
    gpu_rule=lambda R: WriteLatentConfig(num_warps=max(1, min(4, triton.next_power_of_2(R) // 128))),
    interp_rule=lambda R: WriteLatentConfig(num_warps=4),
    source="rule: one warp per 128 latent columns, 1 to 4; not swept")
"""Keyed on the latent rank R."""


# --------------------------------------------------------------------------------------------
# kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _write_latent_kernel(
    ckv_ptr, s_ckv,
    kpe_ptr, s_kpe,
    cache_ptr, s_cs, s_cl,
    slots_ptr, pos_ptr,
    R: tl.constexpr, DR: tl.constexpr, RP: tl.constexpr, DRP: tl.constexpr,
):
    grid_dependency()
    b = tl.program_id(0)
    b64 = b.to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b).to(tl.int64)
    dst = cache_ptr + slot * s_cs + pos * s_cl
    dt = cache_ptr.dtype.element_ty
    rr = tl.arange(0, RP)
    x = tl.load(ckv_ptr + b64 * s_ckv + rr, mask=rr < R, other=0.0).to(tl.float32)
    tl.store(dst + rr, cast(x, dt), mask=rr < R)
    rp = tl.arange(0, DRP)
    y = tl.load(kpe_ptr + b64 * s_kpe + rp, mask=rp < DR, other=0.0).to(tl.float32)
    tl.store(dst + R + rp, cast(y, dt), mask=rp < DR)


@triton.jit
def _mla_fold(q, qpe, base, s_cl, lo, hi, qk_scale, R: tl.constexpr, DR: tl.constexpr, RP: tl.constexpr,
              DRP: tl.constexpr, BH: tl.constexpr, BLOCK_N: tl.constexpr):
    """Positions lo .. hi of one row's cache (``base``: its slot's first entry) folded with the online
    softmax for the BH heads of q [BH, RP] / qpe [BH, DRP] (in the cache dtype): (max [BH], sum [BH],
    unnormalised output [BH, RP]) -- one split, the same operations wherever a split is folded."""
    dt = base.dtype.element_ty
    rr = tl.arange(0, RP)
    rm = rr < R
    rp = tl.arange(0, DRP)
    pm = rp < DR
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, RP], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        nm = pos < hi
        rows = base + pos[:, None] * s_cl
        # One load of the tile serves every head of the block, for both products.
        c = tl.load(rows + rr[None, :], mask=nm[:, None] & rm[None, :], other=0.0)
        kpe = tl.load(rows + R + rp[None, :], mask=nm[:, None] & pm[None, :], other=0.0)
        sc = mma(q, tl.trans(c), tl.zeros([BH, BLOCK_N], tl.float32))
        sc = mma(qpe, tl.trans(kpe), sc)
        sc = tl.where(nm[None, :], sc * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = cast(tl.exp2(sc - m_new[:, None]), dt)
        l_i = l_i * alpha + tl.sum(p.to(tl.float32), 1)
        acc = mma(p, c, acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _mla_split_kernel(
    q_ptr, s_qb, s_qh,
    qpe_ptr, s_pb, s_ph,
    cache_ptr, s_cs, s_cl,
    slots_ptr, lengths_ptr,
    out_ptr, s_ob, s_oh,
    po_ptr, pm_ptr, pl_ptr,
    qk_scale, H, L, NS,
    runs_ptr, stride_run, M, row0,
    R: tl.constexpr, DR: tl.constexpr, RP: tl.constexpr, DRP: tl.constexpr,
    BH: tl.constexpr, BLOCK_N: tl.constexpr, NHB: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr,
    FUSE_ROWS: tl.constexpr = 0,
):
    # Program (head block, split) x row. FUSE_ROWS > 0: a row of more than one split in a run of at
    # least FUSE_ROWS rows (batch row row0 + b of the runs table) is done by its split-0 programs alone --
    # every split in ascending order, each merged into the row's running result with the merge kernel's
    # own step (splits.merge_step), so no partials go through memory and the merge skips the row.
    grid_dependency()
    pid = tl.program_id(0)
    b = tl.program_id(1)
    hb = pid % NHB
    s = pid // NHB
    length = tl.load(lengths_ptr + b)
    length = tl.maximum(tl.minimum(length, L), 0)
    split = split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS)
    fused = False
    if FUSE_ROWS > 0:
        fused = (length > split) & in_long_run(runs_ptr, stride_run, M, row0 + b.to(tl.int64), FUSE_ROWS)
    lo = s * split
    if fused and s > 0:   # the split-0 program does this row's every split
        return
    if lo < length:
        dt = cache_ptr.dtype.element_ty
        b64 = b.to(tl.int64)
        slot = tl.load(slots_ptr + b).to(tl.int64)
        heads = hb * BH + tl.arange(0, BH)
        hm = heads < H
        rr = tl.arange(0, RP)
        rm = rr < R
        rp = tl.arange(0, DRP)
        pm = rp < DR

        # A query already in the cache dtype is used as loaded: no conversion, and the compiler may
        # keep it in shared memory as the MMA operand (wgmma tiles) instead of registers.
        q = tl.load(q_ptr + b64 * s_qb + heads[:, None] * s_qh + rr[None, :],
                    mask=hm[:, None] & rm[None, :], other=0.0)
        if q.dtype != dt:
            q = cast(q.to(tl.float32), dt)
        qpe = tl.load(qpe_ptr + b64 * s_pb + heads[:, None] * s_ph + rp[None, :],
                      mask=hm[:, None] & pm[None, :], other=0.0)
        if qpe.dtype != dt:
            qpe = cast(qpe.to(tl.float32), dt)

        base = cache_ptr + slot * s_cs
        om = hm[:, None] & rm[None, :]
        if fused:
            m_run = tl.full([BH], float("-inf"), tl.float32)
            l_run = tl.zeros([BH], tl.float32)
            acc_run = tl.zeros([BH, RP], tl.float32)
            for sp in range(0, tl.cdiv(length, split)):
                m_i, l_i, acc = _mla_fold(q, qpe, base, s_cl, sp * split, tl.minimum(sp * split + split, length),
                                          qk_scale, R, DR, RP, DRP, BH, BLOCK_N)
                m_run, l_run, acc_run = merge_step(m_run, l_run, acc_run, m_i, l_i, acc)
            tl.store(out_ptr + b64 * s_ob + heads[:, None] * s_oh + rr[None, :], acc_run / l_run[:, None], mask=om)
        else:
            m_i, l_i, acc = _mla_fold(q, qpe, base, s_cl, lo, tl.minimum(lo + split, length), qk_scale,
                                      R, DR, RP, DRP, BH, BLOCK_N)
            if length <= split:
                # The row has one split: normalise and write the output; the merge skips the row.
                o = acc / l_i[:, None]
                tl.store(out_ptr + b64 * s_ob + heads[:, None] * s_oh + rr[None, :], o, mask=om)
            else:
                prow = (b64 * NS + s) * H + heads
                tl.store(po_ptr + prow[:, None] * R + rr[None, :], acc, mask=om)
                tl.store(pm_ptr + prow, m_i, mask=hm)
                tl.store(pl_ptr + prow, l_i, mask=hm)
    elif s == 0:
        # An empty row (length 0) gets zeros.
        heads = hb * BH + tl.arange(0, BH)
        rr = tl.arange(0, RP)
        om = (heads < H)[:, None] & (rr < R)[None, :]
        tl.store(out_ptr + b.to(tl.int64) * s_ob + heads[:, None] * s_oh + rr[None, :],
                 tl.zeros([BH, RP], tl.float32), mask=om)


@triton.jit
def _mla_merge_kernel(
    out_ptr, s_ob, s_oh,
    po_ptr, pm_ptr, pl_ptr,
    lengths_ptr, H, L, NS,
    runs_ptr, stride_run, M, row0,
    R: tl.constexpr, RP: tl.constexpr, MH: tl.constexpr,
    MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr,
    MERGE_STAGES: tl.constexpr, FUSE_ROWS: tl.constexpr = 0,
):
    # The splits of a row in ascending order, with the one merge step (splits.merge_step) a fused row's
    # program uses too. FUSE_ROWS > 0: rows the split kernel fused are already stored.
    grid_dependency()
    hb = tl.program_id(0)
    b = tl.program_id(1)
    length = tl.load(lengths_ptr + b)
    length = tl.maximum(tl.minimum(length, L), 0)
    n = tl.cdiv(length, split_of(length, MIN_SPLIT, SPLIT_STEPS, TARGET_SPLITS))
    if n > 1:
        if FUSE_ROWS > 0:
            if in_long_run(runs_ptr, stride_run, M, row0 + b.to(tl.int64), FUSE_ROWS):
                return
        b64 = b.to(tl.int64)
        heads = hb * MH + tl.arange(0, MH)
        hm = heads < H
        rr = tl.arange(0, RP)
        om = hm[:, None] & (rr < R)[None, :]
        row0_p = b64 * NS * H + heads
        m_run = tl.full([MH], float("-inf"), tl.float32)
        l_run = tl.zeros([MH], tl.float32)
        acc = tl.zeros([MH, RP], tl.float32)
        # The loads do not depend on the running max: MERGE_STAGES splits' loads are in flight at once.
        for s in tl.range(0, n, num_stages=MERGE_STAGES):
            prow = row0_p + s * H
            m_s = tl.load(pm_ptr + prow, mask=hm, other=0.0)
            l_s = tl.load(pl_ptr + prow, mask=hm, other=1.0)
            a = tl.load(po_ptr + prow[:, None] * R + rr[None, :], mask=om, other=0.0)
            m_run, l_run, acc = merge_step(m_run, l_run, acc, m_s, l_s, a)
        tl.store(out_ptr + b64 * s_ob + heads[:, None] * s_oh + rr[None, :], acc / l_run[:, None], mask=om)


# --------------------------------------------------------------------------------------------
# launchers
# --------------------------------------------------------------------------------------------

def _last_contig(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_latent_row(op: str, c_kv, k_pe, cache, slots, positions):
    """(B, R, Dr) of a latent cache write's arguments (c_kv [B, R], k_pe [B, Dr], cache [S, L, R + Dr] with a
    contiguous last dim, slots / positions [B]); ValueError naming ``op`` otherwise."""
    B, R = c_kv.shape
    Dr = k_pe.shape[-1]
    if k_pe.shape != (B, Dr) or cache.dim() != 3 or cache.shape[-1] != R + Dr:
        raise ValueError(f"{op}: shapes c_kv {tuple(c_kv.shape)}, k_pe {tuple(k_pe.shape)}, "
                         f"cache {tuple(cache.shape)} do not fit [B,R], [B,Dr], [S,L,R+Dr]")
    if slots.shape != (B,) or positions.shape != (B,):
        raise ValueError(f"{op}: slots and positions must be [B]")
    if cache.stride(-1) != 1:
        raise ValueError(f"{op}: cache must have a contiguous last dim")
    return B, R, Dr


def write_latent(c_kv: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                 slots: torch.Tensor, positions: torch.Tensor) -> None:
    """cache[slots[b], positions[b]] = [c_kv[b] || k_pe[b]], rounded to the cache dtype (RNE).

    c_kv [B, R], k_pe [B, Dr] (fp32, or any float dtype); cache [S, L, R + Dr] fp32/bf16/fp16
    with a contiguous last dim; slots, positions [B] int32. Rows must name distinct (slot,
    position) pairs. In place, no host sync.
    """
    B, R, Dr = _check_latent_row("write_latent", c_kv, k_pe, cache, slots, positions)
    if B == 0:
        return
    c_kv = _last_contig(c_kv)
    k_pe = _last_contig(k_pe)
    _write_latent_kernel[(B,)](
        c_kv, c_kv.stride(0), k_pe, k_pe.stride(0),
        cache, cache.stride(0), cache.stride(1),
        slots, positions,
        R=R, DR=Dr, RP=triton.next_power_of_2(R), DRP=triton.next_power_of_2(max(Dr, 1)),
        num_warps=WRITE_LATENT_CONFIGS(R).num_warps, **LAUNCH,
    )


def write_latent_ref(c_kv, k_pe, cache, slots, positions) -> None:
    """Plain-torch :func:`write_latent`."""
    row = torch.cat([c_kv.float(), k_pe.float()], dim=-1).to(cache.dtype)
    cache[slots.long(), positions.long()] = row


@triton.jit
def _norm_rope_latent_kernel(
    q_ptr, sq_b, sq_h, sq_d,
    kv_ptr, skv_b,
    kpe_ptr, skpe_b,
    w_ptr, eps,
    pos_ptr, freq_ptr, scale,
    slots_ptr, cache_ptr, s_cs, s_cl, S, L,
    out_ptr, so_b, so_h, so_d,
    H: tl.constexpr, R: tl.constexpr, DR: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    """Program (row b, j): q_pe heads j*BLOCK_H.. rotated into out, or (the row's last program) the
    cache entry [rms_norm(kv) * w || rope(k_pe)] rounded to the cache dtype. The rotation is
    :func:`ds4t.kernels.rope.rotate`; the norm the norm kernel's arithmetic on one [1, BLOCK_R] row,
    its sum of squares in this kernel's order (see :func:`norm_rope_write_latent`)."""
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    HALF: tl.constexpr = DR // 2
    c, s = rope.angles(pos_ptr, b, freq_ptr, scale, HALF, BLOCK_HALF)
    d1, d2 = rope.pair_columns(HALF, INTERLEAVED, BLOCK_HALF)
    im = (tl.arange(0, BLOCK_HALF) < HALF)[None, :]
    if j * BLOCK_H < H:
        h = j * BLOCK_H + tl.arange(0, BLOCK_H)
        m = (h < H)[:, None] & im
        o1, o2 = rope.rotate(q_ptr + b * sq_b + h[:, None] * sq_h, sq_d, m, d1, d2, c, s)
        ob = out_ptr + b * so_b + h[:, None] * so_h
        tl.store(ob + d1[None, :] * so_d, o1, mask=m)
        tl.store(ob + d2[None, :] * so_d, o2, mask=m)
    else:
        slot = tl.load(slots_ptr + b).to(tl.int64)
        pos = tl.load(pos_ptr + b).to(tl.int64)
        ok = (slot >= 0) & (slot < S) & (pos >= 0) & (pos < L)   # never write outside the pool
        rr = tl.arange(0, BLOCK_R)[None, :]
        rm = rr < R
        v = tl.load(kv_ptr + b * skv_b + rr, mask=rm, other=0.0).to(tl.float32)
        sq = norm.add_square(tl.zeros((1, BLOCK_R), dtype=tl.float32), v)
        y = (v * norm.rstd_of(sq, R, eps)) * tl.load(w_ptr + rr, mask=rm, other=0.0).to(tl.float32)
        dst = cache_ptr + slot * s_cs + pos * s_cl
        dt = cache_ptr.dtype.element_ty
        # (a scalar bool & a tensor mask is a bad mask in the interpreter: limits instead)
        tl.store(dst + rr, cast(y, dt), mask=rr < tl.where(ok, R, 0))
        km = im & (tl.arange(0, BLOCK_HALF) < tl.where(ok, HALF, 0))[None, :]
        k1, k2 = rope.rotate((kpe_ptr + b * skpe_b + tl.arange(0, 1))[:, None], 1, km, d1, d2, c, s)
        tl.store(dst + R + d1[None, :], cast(k1, dt), mask=km)
        tl.store(dst + R + d2[None, :], cast(k2, dt), mask=km)


def norm_rope_write_latent(c_kv: torch.Tensor, kv_norm: torch.Tensor, eps: float, q_pe: torch.Tensor,
                           k_pe: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           cache: torch.Tensor, slots: torch.Tensor, *, interleaved: bool = False,
                           scale: float = 1.0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """MLA's per-token prologue in one launch: ``cache[slots[b], positions[b]] = [rms_norm(c_kv[b]) ·
    kv_norm || rope(k_pe[b])]`` (rounded to the cache dtype) and the returned ``rope(q_pe)``.

    c_kv [B, R] (the latent before kv_a_layernorm) and k_pe [B, Dr] (any float, unit column stride:
    views of the down-projection), kv_norm [R], q_pe [B, H, Dr] (any strides), positions / slots [B]
    int32, inv_freq [Dr / 2] fp32 (every rope dim rotates), cache [S, L, R + Dr] with a contiguous last
    dim; ``interleaved`` / ``scale`` as :func:`ds4t.kernels.rope.rope`. Returns fp32 [B, H, Dr] (``out`` if
    given, with a unit last stride). The same values as :func:`ds4t.kernels.norm.rms_norm`, :func:`ds4t.kernels.rope.rope` and
    :func:`write_latent` in turn in one launch instead of five (two
    copies assembled rope's input), bitwise on the GPU too (the norm's sum of squares is
    :func:`ds4t.kernels.norm.rstd_of`'s fixed tree in both). Rows past the pool (a slot
    or position out of range) write nothing. Batch invariant: one row per program."""
    B, R, Dr = _check_latent_row("norm_rope_write_latent", c_kv, k_pe, cache, slots, positions)
    if q_pe.dim() != 3 or q_pe.shape[0] != B or q_pe.shape[2] != Dr:
        raise ValueError(f"norm_rope_write_latent: q_pe {tuple(q_pe.shape)} does not fit [B={B}, H, Dr={Dr}]")
    if kv_norm.shape != (R,) or inv_freq.shape != (Dr // 2,) or Dr % 2:
        raise ValueError(f"norm_rope_write_latent: kv_norm must be [{R}] and inv_freq [{Dr // 2}] (Dr={Dr} even), "
                         f"got {tuple(kv_norm.shape)} and {tuple(inv_freq.shape)}")
    H = q_pe.shape[1]
    out = float_out(out, (B, H, Dr), q_pe.device)
    if B == 0:
        return out
    c_kv, k_pe = _last_contig(c_kv), _last_contig(k_pe)
    cfg = rope.ROPE_CONFIGS(H, Dr, Dr)
    _norm_rope_latent_kernel[(B, triton.cdiv(H, cfg.block_h) + 1)](
        q_pe, *q_pe.stride(), c_kv, c_kv.stride(0), k_pe, k_pe.stride(0), kv_norm.contiguous(), float(eps),
        positions, inv_freq, float(scale), slots, cache, cache.stride(0), cache.stride(1), cache.shape[0],
        cache.shape[1], out, *out.stride(),
        H=H, R=R, DR=Dr, INTERLEAVED=bool(interleaved), BLOCK_H=cfg.block_h, BLOCK_R=triton.next_power_of_2(R),
        BLOCK_HALF=cfg.block_half, num_warps=norm.NORM_CONFIGS(R).num_warps, **LAUNCH,
    )
    return out


def norm_rope_write_latent_ref(c_kv, kv_norm, eps, q_pe, k_pe, positions, inv_freq, cache, slots, *,
                               interleaved=False, scale=1.0, out=None):
    """Plain-torch :func:`norm_rope_write_latent`: the three references in turn."""
    k = rope.rope_ref(k_pe[:, None], positions, inv_freq, interleaved=interleaved, scale=scale)[:, 0]
    write_latent_ref(norm.rms_norm_ref(c_kv, kv_norm, eps), k, cache, slots, positions)
    return rope.rope_ref(q_pe, positions, inv_freq, interleaved=interleaved, scale=scale, out=out)


def _check_decode_args(q_latent, q_pe, cache, slots, lengths, kv_lora_rank):
    if q_latent.dim() != 3 or q_pe.dim() != 3 or cache.dim() != 3:
        raise ValueError("mla_decode: q_latent [B,H,R], q_pe [B,H,Dr], cache [S,L,R+Dr] expected")
    B, H, R = q_latent.shape
    if R != kv_lora_rank:
        raise ValueError(f"mla_decode: q_latent last dim {R} != kv_lora_rank {kv_lora_rank}")
    Dr = cache.shape[-1] - R
    if Dr < 0 or q_pe.shape != (B, H, Dr):
        raise ValueError(f"mla_decode: q_pe {tuple(q_pe.shape)} / cache {tuple(cache.shape)} do not "
                         f"fit q_latent {tuple(q_latent.shape)}")
    if slots.shape != (B,) or lengths.shape != (B,):
        raise ValueError("mla_decode: slots and lengths must be [B]")
    if slots.dtype.is_floating_point or lengths.dtype.is_floating_point:
        raise TypeError("mla_decode: slots and lengths must be integer (int32) tensors")
    return B, H, R, Dr


def mla_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
               slots: torch.Tensor, lengths: torch.Tensor, scale: float, *,
               kv_lora_rank: int, split_size: Optional[int] = None,
               out: Optional[torch.Tensor] = None,
               same_slot_runs: Union[SameSlotRuns, int, None] = None) -> torch.Tensor:
    """Absorbed MLA attention over the latent cache; returns the latent output fp32 [B, H, R].

    q_latent [B, H, R] (q_nope @ W_UK) and q_pe [B, H, Dr] (after RoPE), any float dtype, rounded to
    the cache dtype (RNE) in the kernel (passing them in the cache dtype gives the same bits from half
    the bytes); cache [S, L, R + Dr] fp32/bf16/fp16, last dim contiguous; slots, lengths [B] int32
    (1 <= lengths[b] <= L; lengths are clamped to [0, L],
    a row of length 0 gets zeros). ``scale`` multiplies q.k (include YaRN mscale). ``split_size``:
    tokens per KV split, an int (every row) or a :class:`~ds4t.kernels.splits.SplitSchedule`
    (default :func:`default_split_schedule`); results depend on it, never on B. ``out``: optional
    fp32 [B, H, R] destination (may be strided, last dim contiguous).

    ``same_slot_runs``: a launch hint that never changes a bit, :class:`~ds4t.kernels.splits.SameSlotRuns` of
    the step (prefill chunks): a row of more than one split in a run of at least ``MLAConfig.fuse_rows`` rows
    is done by one program a head block, its splits folded in ascending order and merged as the merge kernel
    merges them (its fp32 partials, 256 KiB a split and row at H = 128, are never written or read), while
    decode rows and short runs keep a program a split. Other values (an int, None): no run is fused.
    """
    B, H, R, Dr = _check_decode_args(q_latent, q_pe, cache, slots, lengths, kv_lora_rank)
    S, L, _ = cache.shape
    if cache.stride(-1) != 1:
        raise ValueError("mla_decode: cache must have a contiguous last dim")
    sched = as_schedule(split_size, default_split_schedule(R, Dr, cache.dtype))
    if out is None:
        out = torch.empty((B, H, R), dtype=torch.float32, device=q_latent.device)
    elif out.shape != (B, H, R) or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError("mla_decode: out must be fp32 [B, H, R] with a contiguous last dim")
    if B == 0 or H == 0:
        return out
    q_latent = _last_contig(q_latent)
    q_pe = _last_contig(q_pe)

    NS = sched.max_splits(L)
    cfg = MLA_CONFIGS(H, R, Dr, sched.min_split)
    runs = same_slot_runs.check_device(slots.device, "mla_decode") if isinstance(same_slot_runs, SameSlotRuns) \
        else None
    fuse = NS > 1 and runs is not None and cfg.fuse_rows is not None and runs.longest >= cfg.fuse_rows
    table = table_args(runs if fuse else None, slots)
    BH, stages = cfg.split_tile(B)
    BLOCK_N, MH, warps = cfg.block_n, cfg.merge_heads, cfg.num_warps
    RP = triton.next_power_of_2(R)
    DRP = max(16, triton.next_power_of_2(max(Dr, 1)))
    NHB = triton.cdiv(H, BH)
    dev = q_latent.device
    if NS > 1:
        po = torch.empty((B, NS, H, R), dtype=torch.float32, device=dev)
        pm = torch.empty((B, NS, H), dtype=torch.float32, device=dev)
        pl = torch.empty((B, NS, H), dtype=torch.float32, device=dev)
    else:  # every row fits one split: partials are never touched
        po = pm = pl = torch.empty((1,), dtype=torch.float32, device=dev)
    qk_scale = float(scale) * _LOG2E

    for b0 in range(0, B, _MAX_GRID_Y):
        b1 = min(B, b0 + _MAX_GRID_Y)
        nb = b1 - b0
        if NS > 1:
            po_c, pm_c, pl_c = po[b0:b1], pm[b0:b1], pl[b0:b1]
        else:
            po_c, pm_c, pl_c = po, pm, pl
        o_c = out[b0:b1]
        _mla_split_kernel[(NHB * NS, nb)](
            q_latent[b0:b1], q_latent.stride(0), q_latent.stride(1),
            q_pe[b0:b1], q_pe.stride(0), q_pe.stride(1),
            cache, cache.stride(0), cache.stride(1),
            slots[b0:b1], lengths[b0:b1],
            o_c, out.stride(0), out.stride(1),
            po_c, pm_c, pl_c,
            qk_scale, H, L, NS, *table, b0,
            R=R, DR=Dr, RP=RP, DRP=DRP, BH=BH, BLOCK_N=BLOCK_N, NHB=NHB, **sched.kernel_args(),
            FUSE_ROWS=cfg.fuse_rows if fuse else 0, num_warps=warps, num_stages=stages, **LAUNCH,
        )
        if NS > 1:
            _mla_merge_kernel[(triton.cdiv(H, MH), nb)](
                o_c, out.stride(0), out.stride(1),
                po_c, pm_c, pl_c,
                lengths[b0:b1], H, L, NS, *table, b0,
                R=R, RP=RP, MH=MH, **sched.kernel_args(), MERGE_STAGES=cfg.merge_stages,
                FUSE_ROWS=cfg.fuse_rows if fuse else 0, num_warps=cfg.merge_warps, **LAUNCH,
            )
    return out


def mla_decode_ref(q_latent, q_pe, cache, slots, lengths, scale, *, kv_lora_rank,
                   split_size=None, out=None) -> torch.Tensor:
    """Plain-torch :func:`mla_decode` (float64 inside, exact softmax; ``split_size`` is ignored).

    Like the kernel, q is rounded to the cache dtype first; unlike it, probabilities are not.
    """
    B, H, R, Dr = _check_decode_args(q_latent, q_pe, cache, slots, lengths, kv_lora_rank)
    L = cache.shape[1]
    kv = cache[slots.long()]                                           # [B, L, R+Dr]
    n = lengths.long().clamp(0, L)
    valid = torch.arange(L, device=cache.device)[None, :] < n[:, None]  # [B, L]
    kv = torch.where(valid[:, :, None], kv.double(), torch.zeros((), dtype=torch.float64,
                                                                   device=cache.device))
    q = q_latent.to(cache.dtype).double()
    qp = q_pe.to(cache.dtype).double()
    s = torch.einsum("bhr,blr->bhl", q, kv[..., :R]) + torch.einsum("bhd,bld->bhl", qp, kv[..., R:])
    s = (s * scale).masked_fill(~valid[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # an empty row -> zeros
    o = torch.einsum("bhl,blr->bhr", p, kv[..., :R]).float()
    if out is not None:
        out.copy_(o)
        return out
    return o


# --------------------------------------------------------------------------------------------
# self-check
# --------------------------------------------------------------------------------------------

# (atol, rtol) against mla_decode_ref, per cache dtype (the kernel rounds probabilities).
TOLERANCE = {
    torch.float32: (2e-5, 2e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (3e-3, 3e-3),
}


@register_check
def _check(device) -> List[CheckResult]:
    res = []
    g = torch.Generator().manual_seed(1234)
    H, R, Dr, S, L, B, split = 4, 16, 8, 4, 40, 5, 16
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(S, L, R + Dr, generator=g).to(dtype).to(device)
        q = torch.randn(B, H, R, generator=g).to(device)
        qp = torch.randn(B, H, Dr, generator=g).to(device)
        slots = torch.tensor([2, 0, 3, 1, 2], dtype=torch.int32, device=device)
        lengths = torch.tensor([1, 40, 17, 33, 16], dtype=torch.int32, device=device)
        scale = 1.0 / math.sqrt(24)

        def run(idx):
            return mla_decode(q[idx], qp[idx], cache, slots[idx], lengths[idx], scale,
                              kv_lora_rank=R, split_size=split)

        idx = torch.arange(B, device=device)
        got = run(idx)
        ref = mla_decode_ref(q, qp, cache, slots, lengths, scale, kv_lora_rank=R)
        atol, rtol = TOLERANCE[dtype]
        err = ((got - ref).abs() - rtol * ref.abs()).max().item()
        res.append(CheckResult(
            kernel=f"mla_decode {str(dtype).replace('torch.', '')}",
            shapes=f"B={B} H={H} R={R} Dr={Dr} L={L} split={split}",
            max_err=max(err, 0.0), tol=atol,
            batch_invariant=rows_invariant(run, idx),
            ms=timer(lambda: run(idx), warmup=1, iters=3),
            note="max(|err| - rtol*|ref|)",
        ))
    return res


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(write_latent, reference=write_latent_ref)
register_op(norm_rope_write_latent, reference=norm_rope_write_latent_ref)
register_op(mla_decode, reference=mla_decode_ref)
