"""Routed MoE experts over GGUF blocks: the grouped gate/up and down kernels of :mod:`ds4t.kernels.moe`
with weights read as Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K blocks (what :func:`ds4t.kernels.moe.moe_experts` launches
for :class:`~ds4t.kernels.quant_blocks.GGUFWeight` experts).

Weights (repacked rows, :mod:`ds4t.kernels.quant_blocks`): w_gate / w_up GGUFWeight [E, I, D] of one type
(one loop reads both), w_down GGUFWeight [E, D, I] of any kernel type (llama.cpp's mixes often keep
``ffn_down_exps`` one step above gate/up).
Each product is :func:`ds4t.kernels.qlinear.qdot`: per sub-block ``s * (x . q) - mn * sum(x)`` in fp32,
activations (h, then silu(g)·u) rounded to the activation dtype A first; with bf16 activations a
``QMoEConfig.fold`` entry takes qdot's fold route (the table's choice for every type but Q6_K). Grouping, slot-to-expert
lookup and the rank-ordered combine are moe.py's kernels, unchanged; so is every argument of batch
invariance there (a pair's value depends on its own row, its expert's blocks and launch constants
that come from shapes and types only).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency, tl_dtype
from ds4t.backend import silu as _silu
from ds4t.kernels.config import ConfigTable, differs_only_in, launch_kwargs
from ds4t.kernels.moe import (_program_expert, _program_tile, _store_slot,   # moe.py imports this module only
                              down_finder, row_program_count)                 # inside its launcher
from ds4t.kernels.qlinear import (FOLD_TYPES, _q8_group, folds, kernel_format, nibble_pack, qdot, qdot_pair,
                                  rows_16b_aligned, rows_aligned, x_rows)
from ds4t.kernels.quant_blocks import BLOCKS_32, GGUFWeight


@triton.jit
def _qmoe_gate_up_kernel(
    h_ptr, sh_b, order_ptr, bounds_ptr, experts_ptr,
    wg_ptr, wu_ptr, sw_e, sw_n,
    act_ptr, sa_p,
    I, KTOP, E, D: tl.constexpr,
    FMT: tl.constexpr, G: tl.constexpr, ADT: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, DEVICE_LIST: tl.constexpr, BE: tl.constexpr, INTERLEAVE: tl.constexpr = True,
    FOLD: tl.constexpr = False, slots_ptr=None, ROW_PROGRAMS: tl.constexpr = False,
    AHEAD: tl.constexpr = 0, NP: tl.constexpr = 2,
):
    """Program (slot, N tile): its expert's pairs in BM-row tiles; act[p, n] = silu(g) * u for I columns.
    INTERLEAVE: gate and up step through K together (:func:`ds4t.kernels.qlinear.qdot_pair`), else one
    whole K loop after the other; the same bits either way.
    wg / wu: repacked rows uint8 [E, I, GGUFWeight.row_bytes] (strides sw_e, sw_n bytes, same for both); D is a
    constexpr because the planes of a row start at offsets made from it. ``slots``: as in
    :func:`ds4t.kernels.moe._moe_gate_up_kernel` (each slot's expert, for the down kernel). ROW_PROGRAMS: one
    row tile a program (:func:`ds4t.kernels.moe._program_tile`; no slots)."""
    grid_dependency()
    if ROW_PROGRAMS:
        e, start, end = _program_tile(bounds_ptr, E, BE, BM)
    else:
        e, start, end = _program_expert(experts_ptr, bounds_ptr, E, DEVICE_LIST, BE)
    if slots_ptr is not None:
        _store_slot(slots_ptr, e, start, end, tl.program_id(1) == 0)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < I
    w_off = e.to(tl.int64) * sw_e + tl.minimum(n, I - 1).to(tl.int64) * sw_n
    for m0 in range(start, end, BM):
        q = m0 + tl.arange(0, BM)
        qm = q < end
        p = tl.load(order_ptr + q, mask=qm, other=0).to(tl.int64)
        x_row = x_rows(h_ptr, p // KTOP, qm, sh_b)
        zero = tl.zeros((BN, BM), dtype=tl.float32)
        if INTERLEAVE:
            acc_g, acc_u = qdot_pair(zero, zero, wg_ptr + w_off, wu_ptr + w_off, x_row, 0, D, FMT, ADT, G, D, FOLD,
                                     AHEAD, NP)
        else:
            acc_g = qdot(zero, wg_ptr + w_off, x_row, 0, D, FMT, ADT, G, D, FOLD, AHEAD, NP)
            acc_u = qdot(zero, wu_ptr + w_off, x_row, 0, D, FMT, ADT, G, D, FOLD, AHEAD, NP)
        act = _silu(acc_g) * acc_u                                        # [BN, BM]
        tl.store(act_ptr + p[None, :] * sa_p + n[:, None], act, mask=qm[None, :] & nm[:, None])


@triton.jit
def _qmoe_down_kernel(
    act_ptr, sa_p, order_ptr, bounds_ptr, experts_ptr,
    wd_ptr, sw_e, sw_n,
    y_ptr, sy_p,
    D, E, I: tl.constexpr,
    FMT: tl.constexpr, G: tl.constexpr, ADT: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr, FOLD: tl.constexpr = False,
    DEVICE_LIST: tl.constexpr = False, BE: tl.constexpr = 1, ROW_PROGRAMS: tl.constexpr = False,
    AHEAD: tl.constexpr = 0, NP: tl.constexpr = 2,
):
    """As :func:`_qmoe_gate_up_kernel` over I: y[p, n] = act[p] . w_down[e, n] (w_down uint8 [E, D,
    GGUFWeight.row_bytes]); ``experts`` lists each slot's expert (-1: none), the gate/up kernel's ``slots`` or the
    host-made list; DEVICE_LIST / ROW_PROGRAMS as in :func:`ds4t.kernels.moe._moe_down_kernel`."""
    grid_dependency()
    if ROW_PROGRAMS:
        e, start, end = _program_tile(bounds_ptr, E, BE, BM)
    else:
        e, start, end = _program_expert(experts_ptr, bounds_ptr, E, DEVICE_LIST, BE)
    n = tl.program_id(1) * BN + tl.arange(0, BN)
    nm = n < D
    w_row = wd_ptr + e.to(tl.int64) * sw_e + tl.minimum(n, D - 1).to(tl.int64) * sw_n
    for m0 in range(start, end, BM):
        q = m0 + tl.arange(0, BM)
        qm = q < end
        p = tl.load(order_ptr + q, mask=qm, other=0).to(tl.int64)
        x_row = x_rows(act_ptr, p, qm, sa_p)
        acc = qdot(tl.zeros((BN, BM), dtype=tl.float32), w_row, x_row, 0, I, FMT, ADT, G, I, FOLD, AHEAD, NP)
        tl.store(y_ptr + p[None, :] * sy_p + n[:, None], acc, mask=qm[None, :] & nm[:, None])


@dataclasses.dataclass(frozen=True)
class QMoEConfig:
    """Launch constants of a grouped GGUF kernel: the N tile cap (tile = max(16, min(cap, next_pow2(N)))),
    blocks of 32 (Q8_0, Q4_0, Q4_1) per K step (cap), warps and stages (None: Triton's default)."""
    tile_n: int
    q8_group: int = 4
    num_warps: int = 4
    num_stages: int = 3
    interleave: bool = True   # gate_up: gate and up step through K together (same bits; ~1 % faster on the H200)
    fold: bool = False   # bf16 activations: qlinear's fold route; other dtypes: exact
    prefetch_l2: int = 0         # each K step asks L2 for the quant bytes this many steps ahead (0: never)
    row_programs: bool = False   # one program per row tile (ds4t.kernels.moe.MoEConfig.row_programs)
    min_rows: int = 0            # a ("rows",) entry applies to launches of at least this many rows
    block_m: int = 16            # pairs a row tile holds (a rows entry's may be more: the same bits)
    block_m_rows: int = 0        # block_m applies to launches of at least this many rows, fewer take 16

    def tiles(self, N: int, K: int, qtype: str):
        """(BN, G) for an [N, K] expert weight of ``qtype``: from shapes and type only."""
        g = _q8_group(K, self.q8_group) if qtype in BLOCKS_32 else 1
        return max(16, min(self.tile_n, triton.next_power_of_2(N))), g


ROWS_FIELDS = ("row_programs", "min_rows", "block_m", "block_m_rows", "num_stages")
"""The fields a ("rows",) entry may change (:func:`qmoe_config`): how tiles are assigned to programs, how many pairs
a tile holds, the pipeline depth -- never a pair's dots or their K order (not the warps: 4-warp 32-pair Q8_0 tiles
over the 2-warp decode entry gave other bits on an H100)."""


_QMOE_DECODE = {
    # H200 sweeps, Qwen3-Next's experts (E=512 I=512 D=2048): Q8_0 / Q4_K take the fold route with bf16
    # activations (bench/results/2026-12-02-h200-gguf-fold.md); Q6_K the exact route (2026-11-30-h200-gguf-round3.md)
    ("gate_up", "Q8_0"): QMoEConfig(tile_n=64, q8_group=4, num_warps=2, num_stages=3, fold=True),
    ("down", "Q8_0"): QMoEConfig(tile_n=64, q8_group=4, num_warps=2, num_stages=3, fold=True),
    ("gate_up", "Q4_K"): QMoEConfig(tile_n=64, q8_group=4, num_warps=4, num_stages=1, fold=True),
    ("down", "Q4_K"): QMoEConfig(tile_n=64, q8_group=4, num_warps=4, num_stages=1, fold=True),
    ("gate_up", "Q6_K"): QMoEConfig(tile_n=32, q8_group=4, num_warps=2, num_stages=1),
    ("down", "Q6_K"): QMoEConfig(tile_n=32, q8_group=4, num_warps=2, num_stages=1),
    # Q5_K: untimed; Q4_K's loop plus one 32-byte plane a block, so Q4_K's entries until a sweep says otherwise
    ("gate_up", "Q5_K"): QMoEConfig(tile_n=64, q8_group=4, num_warps=4, num_stages=1, fold=True),
    ("down", "Q5_K"): QMoEConfig(tile_n=64, q8_group=4, num_warps=4, num_stages=1, fold=True),
    # Q4_0 / Q4_1: untimed; Q8_0's blocks of 32 with half the quant bytes, so Q8_0's entries
    **{(kernel, qt): cfg for qt in ("Q4_0", "Q4_1") for kernel, cfg in
       (("gate_up", QMoEConfig(tile_n=64, q8_group=4, num_warps=2, num_stages=3, fold=True)),
        ("down", QMoEConfig(tile_n=64, q8_group=4, num_warps=2, num_stages=3, fold=True)))},
}

ROWS_BLOCK_M = 32
"""Pairs a row tile of the GPU table's ("rows",) entries holds from ROWS_BLOCK_M_ROWS rows (fewer: 16). 1024 tokens
on an H100, the decode entries' warps, the same bits (bench/results/2026-12-06-h100-gguf-row-tiles.md), 16 -> 32
pairs a tile: Qwen3-Next's experts Q8_0 -5 %, Q4_K -18 %, Q6_K -6 %; GLM-4.5's -10 %, -30 %, -10 %. 64 pairs:
GLM-4.5's Q4_K / Q6_K faster still (-47 % / -28 %) but Qwen3-Next's (20 pairs an expert) and every Q8_0 slower; 32 is
the one size that wins everywhere. Not below 128 rows: Qwen3-Next-4l's Q4_K decode step at N = 64 (about one pair an
expert) took 3.795 ms with 32-pair tiles against 3.459 with 16 (+9.7 %)."""
ROWS_BLOCK_M_ROWS = 128

QMOE_CONFIGS: ConfigTable[QMoEConfig] = ConfigTable(
    "qmoe", gpu={**_QMOE_DECODE,
                 # launches of >= 64 rows: the same tiles, one program per row tile (as FP8 in moe.MOE_CONFIGS)
                 **{(*key, "rows"): dataclasses.replace(cfg, row_programs=True, min_rows=64, block_m=ROWS_BLOCK_M,
                                                        block_m_rows=ROWS_BLOCK_M_ROWS)
                    for key, cfg in _QMOE_DECODE.items()}},
    gpu_rule=lambda kernel, qtype, *rows: None if rows else QMoEConfig(tile_n=64, q8_group=4, num_warps=4,
                                                                       num_stages=3, fold=qtype in FOLD_TYPES),
    interp_rule=lambda kernel, qtype, *rows: None if rows else QMoEConfig(tile_n=128, q8_group=8, num_warps=4,
                                                                          num_stages=1, fold=qtype in FOLD_TYPES),
    source="bench/results/2026-12-02-h200-gguf-fold.md, 2026-11-30-h200-gguf-round3.md (python bench/bench_gguf.py "
           "--sweep); Q5_K: Q4_K's entries, Q4_0 / Q4_1: Q8_0's, untimed; the rule: 64-row tiles (moe.py's gate_up tile), 4 Q8_0 blocks a "
           "step, fold for every type but Q6_K; "
           "row programs: bench/results/2026-12-04-h200-moe-row-programs.md; 32-pair row tiles: "
           "bench/results/2026-12-06-h100-gguf-row-tiles.md")
"""Keyed on (kernel "gate_up" | "down", GGUF type), plus (kernel, type, "rows") entries for launches of at
least ``min_rows`` rows, which may differ from the decode entry in :data:`ROWS_FIELDS` alone (:func:`qmoe_config`)."""


def qmoe_config(kernel: str, qtype: str, B: int) -> QMoEConfig:
    """The config of a B-row launch: the ("rows",) entry from its ``min_rows`` on, else the decode entry.
    ValueError if the rows entry changes a field outside :data:`ROWS_FIELDS` (those keep each pair's dots and
    their K order, so the same bits -- checked for the table's entries on the GPU; any other field could change
    them)."""
    cfg = QMOE_CONFIGS(kernel, qtype)
    rows = QMOE_CONFIGS(kernel, qtype, "rows")
    if rows is None or B < rows.min_rows:
        return cfg
    if not differs_only_in(rows, cfg, ROWS_FIELDS):
        raise ValueError(f"qmoe {kernel} {qtype}: a rows entry may change {', '.join(ROWS_FIELDS)} only "
                         f"({rows} vs {cfg})")
    return rows


def check_weights(w_gate, w_up, w_down) -> None:
    """GGUF experts: gate and up of one type and layout (read in one loop), down any kernel type; all one
    act_dtype."""
    if not all(isinstance(w, GGUFWeight) for w in (w_gate, w_up, w_down)):
        raise TypeError("w_gate, w_up, w_down: cannot mix GGUF block weights with other formats")
    if (w_gate.qtype, w_gate.scale_plane) != (w_up.qtype, w_up.scale_plane):
        raise ValueError(f"w_gate and w_up must share one GGUF type and layout, got {w_gate.qtype} and "
                         f"{w_up.qtype} (scale planes: {w_gate.scale_plane}, {w_up.scale_plane})")
    if len({w.act_dtype for w in (w_gate, w_up, w_down)}) != 1:
        raise ValueError("w_gate, w_up, w_down must share one act_dtype")


def interleaves(cfg: QMoEConfig, adt: torch.dtype) -> bool:
    """Whether a gate/up launch steps gate and up through K together (``cfg.interleave``; the same bits either way):
    never with fp32 activations, whose exact-route dots for both weights at once overflow the registers -- compiled
    for sm_90 at Qwen3-Next's experts (D 2048, the table's entries) the interleaved kernel keeps 32 registers and
    6.8-9.6 KB of stack a thread for Q8_0 / Q4_K / Q6_K, one weight after the other 188-255 registers and at most
    120 bytes (tests/test_gpu_compile.py). A GGUF file of quantized matrices loads with fp32 activations unless
    ``dtype`` says otherwise (``GGUFReader.default_dtype``), so that is the default launch."""
    return cfg.interleave and adt != torch.float32


def launch(h, order, bounds, experts, n_slots: int, device_list: bool, w_gate: GGUFWeight, w_up: GGUFWeight,
           w_down: GGUFWeight, act, y, KT: int, adt: torch.dtype, slots=None) -> None:
    """Steps 2 and 3 of :func:`ds4t.kernels.moe.moe_experts` (gate/up into ``act`` [P, I], down into
    ``y`` [P, D], both fp32) for GGUF experts, over pairs already grouped (``order``, ``bounds``).
    ``slots`` (int32 [n_slots], with ``device_list``): where gate/up writes each slot's expert for down."""
    E, I, D = w_gate.shape
    wg, wu, wd = (w.data if w.data.stride(-1) == 1 else w.data.contiguous() for w in (w_gate, w_up, w_down))
    if wg.stride() != wu.stride():
        wg, wu = wg.contiguous(), wu.contiguous()
    BE = triton.next_power_of_2(E)
    ADT = tl_dtype(adt)
    h = rows_aligned(h)
    if not rows_16b_aligned(act):   # down reads its rows as x_rows promises
        raise ValueError("qmoe.launch: act rows must start 16-byte aligned")
    B, P = h.shape[0], h.shape[0] * KT
    gu_cfg, dn_cfg = qmoe_config("gate_up", w_gate.qtype, B), qmoe_config("down", w_down.qtype, B)
    gu_rows, dn_rows = device_list and gu_cfg.row_programs, device_list and dn_cfg.row_programs
    if gu_rows or dn_rows:   # no slot list: row programs find their tiles, slots their experts, from bounds
        slots = None
    cfg = gu_cfg
    BN, G = cfg.tiles(I, D, w_gate.qtype)
    BM = cfg.block_m if B >= cfg.block_m_rows else 16
    _qmoe_gate_up_kernel[(row_program_count(E, P, BM) if gu_rows else n_slots, triton.cdiv(I, BN))](
        h, h.stride(0), order, bounds, experts, wg, wu, wg.stride(0), wg.stride(1), act, act.stride(0),
        I, KT, E, D=D, FMT=kernel_format(w_gate, folds(cfg, adt)), G=G, ADT=ADT, BM=BM, BN=BN,
        DEVICE_LIST=device_list, BE=BE, INTERLEAVE=interleaves(cfg, adt), FOLD=folds(cfg, adt),
        slots_ptr=slots, ROW_PROGRAMS=gu_rows, AHEAD=cfg.prefetch_l2, NP=nibble_pack(cfg.num_warps, BN),
        **launch_kwargs(cfg),
        **LAUNCH)
    cfg = dn_cfg
    BN, G = cfg.tiles(D, I, w_down.qtype)
    BM = cfg.block_m if B >= cfg.block_m_rows else 16
    _qmoe_down_kernel[(row_program_count(E, P, BM) if dn_rows else n_slots, triton.cdiv(D, BN))](
        act, act.stride(0), order, bounds, experts if slots is None else slots, wd, wd.stride(0), wd.stride(1), y,
        y.stride(0), D, E, I=I, FMT=kernel_format(w_down, folds(cfg, adt)), G=G, ADT=ADT, BM=BM, BN=BN,
        FOLD=folds(cfg, adt), AHEAD=cfg.prefetch_l2, NP=nibble_pack(cfg.num_warps, BN),
        **down_finder(gu_rows, dn_rows, BE),
        **launch_kwargs(cfg), **LAUNCH)
