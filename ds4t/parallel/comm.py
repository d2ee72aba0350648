"""Batch-invariant collectives.

An all-reduce leaves the order of its additions to the library: NCCL picks ring or tree, protocol and
chunking from the message size, and the message size is rows x hidden, so a row's bits could change
with the number of rows in the step. ds4t never lets the library add. Every rank's fp32 partial sum
is all-gathered (a copy: no arithmetic, so its algorithm cannot change a bit) and each rank adds the K
partials itself, elementwise, in rank order: ``((p_0 + p_1) + p_2) + ... + p_{K-1}``. Each element's
result depends only on that element's K partials: not on the batch, not on the row's place in it,
and not on the rank doing the sum (every rank gets the same bits, so all ranks continue from the same
hidden state without a broadcast). Cost: K x the bytes of an all-reduce's output, which at decode
sizes (rows x hidden x 4 bytes: 16 KB per row at hidden 4096) is latency-bound either way.

The same sums in fewer bytes (:func:`scattered_sum`): an all-to-all (a copy) hands rank j every rank's
j-th slice of the columns, rank j adds its slice's K partials in rank order, and an all-gather (a copy) lays
the summed slices side by side. Each element is still ``((p_0 + p_1) + ...) + p_{K-1}``, computed by one rank
instead of all: the same bits, 2 x the output's bytes moved instead of K x, in two collectives instead of one.
Since the two give the same bits, the choice may follow the message size without touching batch invariance:
:attr:`Collectives.scatter_from` (bytes of the gathered message; None: never) -- :func:`default_scatter_from`.

The vocabulary-parallel LM head needs no sum at all: each rank's logits for its vocabulary rows are
all-gathered and laid side by side.

:func:`override_reduction` swaps the reduction for a block (the negative control,
:mod:`ds4t.parallel.controls`, and benchmarks); :class:`CollectiveTimer` measures the time spent in
collectives with CUDA events (wall clock on the CPU).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

Reduction = Callable[["Collectives", torch.Tensor], torch.Tensor]
_override: List[Reduction] = []


def _all_gather_flat(out: torch.Tensor, x: torch.Tensor, group) -> None:
    # torch >= 2.12 calls it all_gather_single; 2.11 (the GPU machines) all_gather_into_tensor
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def default_scatter_from(backend: str, size: int) -> Optional[int]:
    """From how many bytes of a gathered message (K x rows x columns x 4) :meth:`Collectives.sum` takes
    :func:`scattered_sum`. gloo (the CPU) from 4 ranks: always, so the CPU tests run the two-phase path at
    4 and 8 ranks (it is the same bits). nccl: never, until ``bench/bench_tp.py`` times it on 4-8 GPUs (its
    ``scatter`` rows): at N = 64 it would move 3.7 MB into a rank instead of 14.7 MB a reduction at DeepSeek-V3's
    7168 columns and tp = 8, in two launches instead of one (latency at small N)."""
    return 0 if backend == "gloo" and size >= 4 else None


class Collectives:
    """The collectives of one tensor-parallel group (``group``: a torch.distributed group, None for
    the world; ``size`` ranks; ``backend`` the group's, which picks :attr:`scatter_from`)."""

    def __init__(self, group, size: int, backend: str = "gloo"):
        self.group, self.size = group, size
        self.timer: Optional["CollectiveTimer"] = None
        self.scatter_from: Optional[int] = default_scatter_from(backend, size)
        """Bytes of the gathered message from which :meth:`sum` takes :func:`scattered_sum` (None: never).
        Either gives the same bits; CUDA graphs captured before a change replay the old choice."""

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[K, *x.shape]: every rank's ``x`` (same shape and dtype on all ranks), index = rank."""
        x = x.contiguous()
        out = torch.empty((self.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather_flat(out, x, self.group)
        return out.view((self.size,) + tuple(x.shape))

    def sum(self, partial: torch.Tensor) -> torch.Tensor:
        """fp32 [R, D] partial sums of this rank -> their sum over the ranks, fp32 [R, D], the same bits on
        every rank and for every R (module docstring)."""
        t = self.timer.start() if self.timer is not None else None
        if _override:
            fn = _override[-1]
        elif self.scatter_from is not None and self.size * partial.numel() * 4 >= self.scatter_from:
            fn = scattered_sum
        else:
            fn = fixed_order_sum
        out = fn(self, partial)
        if t is not None:
            self.timer.stop(t)
        return out

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R, C] per rank -> [R, K*C]: rank r's columns at [r C, (r+1) C) (no arithmetic)."""
        t = self.timer.start() if self.timer is not None else None
        parts = self.all_gather(x)                              # [K, R, C]
        out = parts.permute(1, 0, 2).reshape(x.shape[0], -1)
        if t is not None:
            self.timer.stop(t)
        return out


def fixed_order_sum(comm: Collectives, partial: torch.Tensor) -> torch.Tensor:
    """The batch-invariant reduction: all-gather, then p_0 + p_1 + ... + p_{K-1} elementwise in rank order."""
    return rank_order_sum(comm.all_gather(partial.float()))


def rank_order_sum(parts: torch.Tensor) -> torch.Tensor:
    """[K, ...] -> parts[0] + parts[1] + ... + parts[K-1], elementwise, in that order (a new tensor)."""
    out = parts[0].clone() if parts.shape[0] == 1 else torch.add(parts[0], parts[1])
    for k in range(2, parts.shape[0]):
        out.add_(parts[k])
    return out


def scattered_sum(comm: Collectives, partial: torch.Tensor) -> torch.Tensor:
    """:func:`fixed_order_sum`'s bits in 2 x the output's bytes (module docstring): all-to-all of column
    slices (rank j receives slice j of every rank's partial), the rank-order sum of its slice, all-gather of
    the sums. fp32 [R, D] -> fp32 [R, D]; columns are padded with zeros to a multiple of K (each padded
    element sums zeros and is cut off)."""
    K = comm.size
    p = partial.float()
    R, D = p.shape
    C = -(-D // K)
    if C * K != D:
        p = torch.nn.functional.pad(p, (0, C * K - D))
    send = p.view(R, K, C).permute(1, 0, 2).contiguous()          # [K, R, C]: slice j for rank j
    recv = torch.empty_like(send)                                  # [K, R, C]: this rank's slice of every rank
    dist.all_to_all_single(recv, send, group=comm.group)
    mine = rank_order_sum(recv)                                   # [R, C]
    return comm.all_gather(mine).permute(1, 0, 2).reshape(R, C * K)[:, :D].contiguous()


def library_all_reduce(comm: Collectives, partial: torch.Tensor) -> torch.Tensor:
    """``dist.all_reduce``: the library chooses the order (NOT batch-invariant in general; for timing
    comparisons only, through :func:`override_reduction`)."""
    out = partial.float().contiguous().clone()
    dist.all_reduce(out, group=comm.group)
    return out


@contextlib.contextmanager
def override_reduction(fn: Reduction):
    """Use ``fn(comm, partial)`` for every partial-sum reduction in this process inside the block. CUDA
    graphs are suspended meanwhile: a step captured before would replay the reduction it was captured with."""
    from ds4t.batch.graphs import suspended

    _override.append(fn)
    try:
        with suspended():
            yield
    finally:
        _override.remove(fn)


class CollectiveTimer:
    """Accumulates the time spent in collectives: CUDA events on a GPU (read after a synchronize),
    the wall clock on the CPU. ``ms()`` totals, ``reset()`` starts over."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.spans: list = []
        self.calls = 0

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, t0) -> None:
        self.calls += 1
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.spans.append((t0, e))
        else:
            self.spans.append((time.perf_counter() - t0) * 1e3)

    def ms(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans)
        return sum(self.spans)

    def reset(self) -> None:
        self.spans.clear()
        self.calls = 0
