"""KV split schedules of the split-KV decode attention kernels (GQA and absorbed MLA).

A decode attention row of ``length`` cached positions is cut into splits of consecutive positions;
one program folds a split with the online softmax and a merge combines the splits in ascending
order. The split size fixes the reduction order, so it must never depend on the batch: here it is a
function of the row's *own* length only,

    split_of(length) = the smallest power-of-two multiple ``min_split * 2**k`` (k <= steps) with
                       ``split * target_splits >= length``, else ``max_split``,

so a row has at most ``target_splits`` splits up to ``max_split * target_splits`` positions. A short
row gets short splits (enough programs for one row to fill the GPU at N = 1) and a long row long ones
(few fp32 partials per row at large batches). Because a prefill row at position p and the decode row
at the same position have the same length, they get the same splits: chunked prefill stays bitwise
equal to token-by-token decode. A fixed split size is the schedule with ``min_split == max_split``.

Also here, shared by both kernels: the merge's one step (:func:`merge_step`), and the launch hint of a
prefill step's rows -- runs of consecutive rows of one slot (:class:`SameSlotRuns`) -- with the device
test that tells a kernel whether a row sits in a run long enough for one program to fold all of its
splits (:func:`in_long_run`).
"""
from __future__ import annotations

import dataclasses
from typing import Union

import torch
import triton
import triton.language as tl


@dataclasses.dataclass(frozen=True)
class SplitSchedule:
    """Split sizes as a function of a row's length (see the module docstring).

    ``min_split`` >= 1 and ``max_split = min_split * 2**k``; ``target_splits`` >= 1 (irrelevant when
    min_split == max_split)."""
    min_split: int
    max_split: int
    target_splits: int = 1

    def __post_init__(self):
        if self.min_split < 1 or self.target_splits < 1 or self.max_split < self.min_split:
            raise ValueError(f"split_size: splits and target_splits must be >= 1 and max_split >= min_split, "
                             f"got {self}")
        r = self.max_split // self.min_split
        if self.max_split % self.min_split or r & (r - 1):
            raise ValueError(f"max_split must be min_split times a power of two, got {self}")

    @classmethod
    def fixed(cls, split: int) -> "SplitSchedule":
        """Every row cut into splits of ``split`` positions."""
        return cls(int(split), int(split), 1)

    @property
    def steps(self) -> int:
        """Doublings from min_split to max_split."""
        return (self.max_split // self.min_split).bit_length() - 1

    def split_of(self, length: int) -> int:
        """The split size of a row of ``length`` positions (host mirror of :func:`split_of`)."""
        sp = self.min_split
        for _ in range(self.steps):
            if sp * self.target_splits < length:
                sp *= 2
        return sp

    def max_splits(self, capacity: int) -> int:
        """The most splits any row of length 1..capacity has: the split grid axis."""
        most, sp = 1, self.min_split
        while True:
            last = capacity if sp == self.max_split else min(capacity, sp * self.target_splits)
            most = max(most, triton.cdiv(last, sp))
            if sp == self.max_split or last == capacity:
                return most
            sp *= 2

    def kernel_args(self) -> dict:
        """The constexpr arguments :func:`split_of` takes in a kernel."""
        return dict(MIN_SPLIT=self.min_split, SPLIT_STEPS=self.steps, TARGET_SPLITS=self.target_splits)


def as_schedule(split: Union[None, int, SplitSchedule], default: SplitSchedule) -> SplitSchedule:
    """``split_size`` as the attention ops take it: None (the default schedule), an int (a fixed
    split size) or a :class:`SplitSchedule`."""
    if split is None:
        return default
    if isinstance(split, SplitSchedule):
        return split
    return SplitSchedule.fixed(int(split))


@triton.jit
def split_of(length, MIN_SPLIT: tl.constexpr, SPLIT_STEPS: tl.constexpr, TARGET_SPLITS: tl.constexpr):
    """:meth:`SplitSchedule.split_of` in a kernel; ``length`` is an int32 scalar or tensor."""
    sp = length * 0 + MIN_SPLIT
    for _ in tl.static_range(SPLIT_STEPS):
        sp = tl.where(sp * TARGET_SPLITS < length, sp * 2, sp)
    return sp


def describe(s: SplitSchedule) -> str:
    """A short label for tables: ``split 2048`` or ``split 64..2048 (<= 32 per row)``."""
    if s.min_split == s.max_split:
        return f"split {s.min_split}"
    return f"split {s.min_split}..{s.max_split} (<= {s.target_splits} per row)"


@dataclasses.dataclass(frozen=True)
class SameSlotRuns:
    """A launch hint: the rows of a step come in runs of consecutive rows of one slot (prefill chunks,
    speculative verify chunks) beside one-row decode rows. Never changes a bit; it lets a kernel share
    K / V tiles among a run's rows and, for a run of many rows, fold all splits of a row in one program.

    ``table``: int64 [M, >= 2] on the kernels' device, one line a run of more than one row, its first row
    and its number of rows in columns 0 and 1 (``StepBatch.multi_segments``); ``shortest`` / ``longest``:
    rows of its shortest / longest run (host ints, so a launch can choose its kernels without reading
    the device)."""
    table: torch.Tensor
    shortest: int
    longest: int

    def __post_init__(self):
        if (self.table.dim() != 2 or self.table.shape[1] < 2 or self.table.dtype != torch.int64
                or self.table.stride(1) != 1):
            raise ValueError(f"SameSlotRuns: table must be int64 [M, >= 2] with unit column stride, got "
                             f"{self.table.dtype} {tuple(self.table.shape)} strides {self.table.stride()}")
        if not 2 <= self.shortest <= self.longest:
            raise ValueError(f"SameSlotRuns: runs have 2 <= shortest <= longest rows, got {self.shortest}, "
                             f"{self.longest}")

    def check_device(self, device: torch.device, op: str) -> "SameSlotRuns":
        """self, when its table is on ``device`` (the kernels read it there); ValueError naming ``op``
        otherwise."""
        if self.table.device != device:
            raise ValueError(f"{op}: same_slot_runs' table is on {self.table.device}, the rows on {device}")
        return self


def table_args(runs: "SameSlotRuns | None", dummy: torch.Tensor) -> tuple:
    """(pointer, line stride, lines) of the runs table a launch's kernels read (:func:`in_long_run`), or
    ``(dummy, 0, 0)`` when they read none (``runs`` None): constant ints, so a launch without a table is
    not respecialised from step to step, and any tensor of the launch serves as the unread pointer."""
    if runs is None:
        return dummy, 0, 0
    return runs.table, runs.table.stride(0), runs.table.shape[0]


@triton.jit
def merge_step(m_run, l_run, acc, m_s, l_s, o_s):
    """Fold one split's (max m_s [R], sum l_s [R], unnormalised output o_s [R, C]) into its rows' running
    (m, l, acc), in ascending split order from (-inf, 0, 0). Every merge of splits -- a merge kernel, or a
    program that folds a row's splits itself -- uses this one expression, so both give the same bits. The
    fused multiply-adds are written out: left to the compiler, ``x * a + y * c`` may contract either
    product, and that choice could differ between two kernels that inline this step."""
    m_new = tl.maximum(m_run, m_s)
    a = tl.exp2(m_run - m_new)
    c = tl.exp2(m_s - m_new)
    acc = tl.fma(acc, a[:, None], o_s * c[:, None])
    l_run = tl.fma(l_run, a, l_s * c)
    return m_new, l_run, acc


@triton.jit
def in_long_run(runs_ptr, stride_run, M, row, FUSE_ROWS: tl.constexpr):
    """Whether batch row ``row`` (an int64 scalar) lies in a run of at least FUSE_ROWS rows of the
    ``runs_ptr`` table (M lines of (first row, rows, ...), line stride ``stride_run``; :class:`SameSlotRuns`)."""
    hit = row < 0   # False, as a scalar of the right type
    for i in range(M):
        first = tl.load(runs_ptr + i * stride_run)
        n = tl.load(runs_ptr + i * stride_run + 1)
        hit = hit | ((first <= row) & (row < first + n) & (n >= FUSE_ROWS))
    return hit
