"""Start K ranks from one command: this process becomes rank 0 and spawns ranks 1..K-1 (start method
``spawn``), all joined in one torch.distributed group (nccl with GPUs, gloo on the CPU) on a free
local port. Under torchrun (``WORLD_SIZE`` in the environment) nothing is spawned: the ranks exist.

    code = run_spmd(fn, 2, *args)   # fn(*args) runs on every rank; returns the worst exit code

Ranks other than 0 print nothing (stdout to /dev/null) unless ``DS4T_TP_VERBOSE=1``.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import sys
from typing import Callable

import torch

TIMEOUT = datetime.timedelta(minutes=int(os.environ.get("DS4T_TP_TIMEOUT_MIN", "30")))
"""How long a collective may wait for the other ranks (a rank that died shows as this timeout at worst)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_rank(rank: int, size: int, port: int) -> None:
    """Join the group as ``rank`` of ``size`` (and pick this rank's GPU)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(size),
                      LOCAL_RANK=str(rank))
    if torch.cuda.is_available():
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend(), rank=rank, world_size=size, timeout=TIMEOUT)


def _child(fn, rank: int, size: int, port: int, args) -> None:
    if os.environ.get("DS4T_TP_VERBOSE", "0") == "0":
        sys.stdout = open(os.devnull, "w")
    init_rank(rank, size, port)
    try:
        code = fn(*args)
    finally:
        _finish()
    # Leave without the interpreter's teardown: a C++ thread of the destroyed group could still be joinable
    # when static destructors run and abort the rank ("terminate called without an active exception") after
    # its work was done. multiprocessing's own exit handlers (finalizers: semaphores, queues) still run.
    from multiprocessing import util

    util._exit_function()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))


def _finish() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def run_spmd(fn: Callable[..., int], size: int, *args) -> int:
    """Run ``fn(*args)`` on ``size`` ranks (``fn`` must be importable by name: a module-level function);
    the largest exit code of all ranks (a rank that crashed counts as 1)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return int(fn(*args) or 0)
    if under_torchrun():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group(backend(), timeout=TIMEOUT)
        if dist.get_world_size() != size:
            raise SystemExit(f"--tp {size} but torchrun started {dist.get_world_size()} ranks")
        try:
            return int(fn(*args) or 0)
        finally:
            _finish()
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_child, args=(fn, r, size, port, args), daemon=False) for r in range(1, size)]
    for p in procs:
        p.start()
    code = 1
    try:
        init_rank(0, size, port)
        code = int(fn(*args) or 0)
    finally:
        if backend() == "nccl":    # NCCL's teardown is collective (ncclCommFinalize): all ranks at once
            _finish()
            _join(procs, code)
        else:                      # gloo's is local, and rank 0 hosts the store: a child whose store vanished
            _join(procs, code)     # mid-teardown could abort at exit ("terminate called ..."), so it goes first
            _finish()
    return max([code] + [1 if p.exitcode is None else abs(p.exitcode) for p in procs])


def _join(procs, code: int) -> None:
    for p in procs:
        p.join(timeout=60 if code == 0 else 5)
        if p.is_alive():       # rank 0 failed and left it waiting in a collective
            p.terminate()
            p.join()
