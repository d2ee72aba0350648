"""A persistent pool of K ranks that run jobs: ``pool.run(fn, *args)`` calls ``fn(*args)`` on every rank
(in one torch.distributed group) and returns the K results, index = rank. The CPU tests start one
pair per test module and reuse it (starting a rank costs seconds: imports, the group, the models).

Jobs are module-level functions (sent by name); a job's exception comes back as :class:`RankError`
with the rank's traceback. Models a job loads can be kept in :data:`CACHE` (per process).
"""
from __future__ import annotations

import multiprocessing as mp
import queue
import traceback
from typing import Any, Callable, Dict, List

CACHE: Dict[Any, Any] = {}
"""Per-rank storage that outlives a job (e.g. loaded models, keyed by preset)."""


class RankError(RuntimeError):
    """A job raised on a rank; the message carries its traceback."""


def _worker(rank: int, size: int, port: int, jobs, results) -> None:
    import torch

    from ds4t.parallel.launch import _finish, init_rank

    torch.set_num_threads(1)   # K ranks share the machine's cores
    init_rank(rank, size, port)
    try:
        while True:
            job = jobs.get()
            if job is None:
                break
            fn, args, kwargs = job
            try:
                results.put((rank, True, fn(*args, **kwargs)))
            except BaseException:  # noqa: BLE001 - sent back to the caller
                results.put((rank, False, traceback.format_exc()))
    finally:
        _finish()


class RankPool:
    """K ranks (gloo on the CPU, nccl with GPUs) waiting for jobs; use as a context manager."""

    def __init__(self, size: int = 2, timeout: float = 900.0):
        from ds4t.parallel.launch import free_port

        self.size, self.timeout = size, timeout
        ctx = mp.get_context("spawn")
        port = free_port()
        self.jobs = [ctx.Queue() for _ in range(size)]
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_worker, args=(r, size, port, self.jobs[r], self.results), daemon=True)
                      for r in range(size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, *args, **kwargs) -> List[Any]:
        """``fn(*args, **kwargs)`` on every rank; [result of rank 0, ..., rank K-1]. RankError if any rank
        raised."""
        for q in self.jobs:
            q.put((fn, args, kwargs))
        out: List[Any] = [None] * self.size
        errors = []
        for _ in range(self.size):
            try:
                rank, ok, value = self.results.get(timeout=self.timeout)
            except queue.Empty:
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise RankError(f"{fn.__name__}: no answer within {self.timeout:.0f} s (dead ranks: {dead})") from None
            if ok:
                out[rank] = value
            else:
                errors.append(f"rank {rank}:\n{value}")
        if errors:
            raise RankError(f"{fn.__name__} failed\n" + "\n".join(errors))
        return out

    def close(self) -> None:
        for q, p in zip(self.jobs, self.procs):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join()

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


