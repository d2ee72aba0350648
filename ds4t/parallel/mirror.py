"""Tensor-parallel serving: rank 0 leads, the other ranks replay its step list.

The server (HTTP, slot pool, decode worker) runs on rank 0 only. Every operation that changes a rank's
shard of the sessions' state goes to the other ranks first, over a gloo group (CPU objects, whatever the
compute backend), and they apply it to their shard in the same order: slot allocation, reservation,
resets, every forward step (its (slot, tokens, position) segments; the followers' forward joins the
same collectives), and the model calls of a speculative step (``ds4t.batch.speculative`` reports each to
``model.spec_hook``: the verify forward with its segment flags, the MTP head's calls with their input
hiddens, which are the same on every rank, and the rollbacks). Slots are freed by the garbage collector
on any thread, so a free is held back and sent with the next operation, from the thread that runs the
steps.

Restoring a saved state (``--kv-cache-dir``) is not mirrored (rank 0's state dict is its shard only):
:class:`Leader` refuses any load but a reset to the fresh state.
"""
from __future__ import annotations

import threading
from typing import List

import torch
import torch.distributed as dist

from ds4t.parallel.group import ParallelError


def _bcast(obj, group):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Leader:
    """Installed on rank 0's model: sends its pool operations and steps to the followers (``group``: a
    gloo group of all ranks)."""

    def __init__(self, model, group):
        self.model, self.group = model, group
        self._frees: List[int] = []
        self._lock = threading.Lock()
        pool = model.pool
        self._alloc, self._free, self._reserve, self._load = pool.alloc, pool.free, pool.reserve, pool.load
        pool.alloc, pool.free, pool.reserve, pool.load = self.alloc, self.free, self.reserve, self.load
        model.step_hook = self.step
        model.spec_hook = self.spec

    def _send(self, *cmd) -> None:
        with self._lock:
            frees, self._frees = self._frees, []
        _bcast((frees, cmd), self.group)
        for slot in frees:
            self._free(slot)

    def alloc(self, max_ctx: int) -> int:
        self._send("alloc", max_ctx)
        return self._alloc(max_ctx)

    def free(self, slot: int) -> None:
        with self._lock:
            self._frees.append(slot)

    def reserve(self, slots: int, ctx: int) -> None:
        self._send("reserve", slots, ctx)
        self._reserve(slots, ctx)

    def load(self, slot: int, state, pos: int) -> None:
        if pos != 0 or any(bool(t.any()) for t in state.values()):
            raise ParallelError("restoring a saved session state is not supported under tensor parallel "
                                "(each rank holds its shard): serve without --kv-cache-dir")
        self._send("reset", slot)
        self._load(slot, state, pos)

    def step(self, segments, all_logits: bool) -> None:
        self._send("step", [(int(s), list(t), int(p)) for s, t, p in segments], bool(all_logits))

    def spec(self, op: str, *args) -> None:
        """A model call of a speculative step: ("forward", segment specs), ("mtp_forward", specs, hidden)
        or ("rollback", slot, consumed)."""
        if op == "mtp_forward":
            args = (args[0], args[1].detach().cpu())
        self._send("spec", op, args)

    def stop(self) -> None:
        """Release the followers (they return from :func:`follow`)."""
        self._send("stop")


def _spec_call(model, op: str, args) -> None:
    """A follower's side of :meth:`Leader.spec`: the same model call on this rank's shard."""
    from ds4t.step import StepBatch

    if op == "forward":
        model.forward(StepBatch.build(args[0], model.device))
    elif op == "mtp_forward":
        model.mtp_forward(StepBatch.build(args[0], model.device), args[1].to(model.device))
    elif op == "rollback":
        model.rollback(*args)
    else:
        raise ParallelError(f"follower: unknown speculative call {op!r} from rank 0")


def follow(model, group) -> int:
    """A follower rank: apply rank 0's operations to this rank's shard until it stops. Returns 0.
    SIGINT / SIGTERM are ignored here: a supervisor signalling the whole process group must not take a
    follower away while rank 0 drains its requests (rank 0's "stop", or its exit, ends the loop)."""
    import signal

    from ds4t.batch.engine import run_step

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)

    pool = model.pool
    while True:
        frees, cmd = _bcast(None, group)
        for slot in frees:
            pool.free(slot)
        op = cmd[0]
        if op == "stop":
            return 0
        if op == "alloc":
            pool.alloc(cmd[1])
        elif op == "reserve":
            pool.reserve(cmd[1], cmd[2])
        elif op == "reset":
            for t in pool.tensors.values():
                t[cmd[1]].zero_()
        elif op == "step":
            with torch.no_grad():
                run_step(model, cmd[1], cmd[2])
        elif op == "spec":
            with torch.no_grad():
                _spec_call(model, cmd[1], cmd[2])
        else:
            raise ParallelError(f"follower: unknown operation {op!r} from rank 0")
