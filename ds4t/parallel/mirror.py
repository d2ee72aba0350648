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

Session states (``--kv-cache-dir``, ``Session.state_dict``) are every rank's: under a :class:`Leader` a slot's
state is gathered to rank 0 as one dict whose names carry the rank (``tp0.<name>``, ``tp1.<name>``, ...; host
memory), so one file holds the whole state, and loading one scatters each rank its part and fails on rank 0
when any rank refuses its part (the slot is then reset on every rank by the caller, as on one rank). State
that every rank holds alike (``StateSpec.replicated``: MLA's latent cache) travels and is kept once, as rank 0's.
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
        self.size = dist.get_world_size(group)
        pool = model.pool
        self._alloc, self._free, self._reserve = pool.alloc, pool.free, pool.reserve
        self._state, self._load = pool.state, pool.load
        pool.alloc, pool.free, pool.reserve = self.alloc, self.free, self.reserve
        pool.state, pool.load = self.state, self.load
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

    def state(self, slot: int, pos: int, device=None) -> dict:
        """The slot's state on every rank, gathered: ``tp{r}.<name>`` for rank r's shard, in host memory
        (``device`` is ignored: the shards of other ranks arrive on the host anyway)."""
        self._send("state", slot, pos)
        parts = [None] * self.size
        dist.gather_object(self._state(slot, pos, "cpu"), parts, dst=0, group=self.group)
        return {f"tp{r}.{k}": v for r, part in enumerate(parts) for k, v in part.items()}

    def load(self, slot: int, state, pos: int) -> None:
        """Load a state of :meth:`state`'s form: each rank its part. A fresh (all-zero) state at 0 is a reset
        (nothing travels). ValueError when the state is not every rank's, or a rank refused its part."""
        parts = split_ranks(state, self.size, _replicated(self.model.pool))
        if pos == 0 and not any(bool(t.any()) for t in state.values()):
            self._send("reset", slot)
            self._load(slot, parts[0], pos)
            return
        self._send("load", slot, pos)
        mine = [None]
        dist.scatter_object_list(mine, parts, src=0, group=self.group)
        errors = [None] * self.size
        dist.gather_object(_try_load(self._load, slot, mine[0], pos), errors, dst=0, group=self.group)
        bad = [(r, e) for r, e in enumerate(errors) if e]
        if bad:
            raise ValueError(f"rank {bad[0][0]} refused its part of the state: {bad[0][1]}")

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


def _replicated(pool) -> frozenset:
    return frozenset(name for name, spec in pool.specs.items() if spec.replicated)


def _unique(pool, slot: int, pos: int) -> dict:
    """A follower's part of a gathered state: its slot's state less what rank 0 sends for every rank."""
    skip = _replicated(pool)
    return {k: v for k, v in pool.state(slot, pos, "cpu").items() if k not in skip}


def split_ranks(state: dict, size: int, replicated=frozenset()) -> list:
    """A gathered state (``tp{r}.<name>``) -> [rank 0's dict, ..., rank size-1's], each rank given rank 0's
    copy of the ``replicated`` names; ValueError naming what is missing or foreign (a state saved on another
    number of ranks, or on one)."""
    parts = [{} for _ in range(size)]
    for key, t in state.items():
        head, dot, name = key.partition(".")
        r = int(head[2:]) if head.startswith("tp") and head[2:].isdigit() and dot else -1
        if not 0 <= r < size:
            raise ValueError(f"state entry {key!r} is not one of {size} ranks' (tp<rank>.<name>): a state saved "
                             f"with another --tp does not fit")
        parts[r][name] = t
    for name in replicated:
        if name in parts[0]:
            for p in parts[1:]:
                p.setdefault(name, parts[0][name])
    empty = [r for r, p in enumerate(parts) if not p]
    if empty:
        raise ValueError(f"the state holds nothing for rank(s) {empty} of {size}")
    return parts


def _try_load(load, slot: int, part: dict, pos: int):
    """``load(slot, part, pos)``; None, or the error's text (the pool checks every shape before it writes,
    so a refused part leaves the slot as it was)."""
    try:
        load(slot, part, pos)
    except ValueError as e:
        return str(e)
    return None


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
        elif op == "state":
            dist.gather_object(_unique(pool, cmd[1], cmd[2]), None, dst=0, group=group)
        elif op == "load":
            mine = [None]
            dist.scatter_object_list(mine, None, src=0, group=group)
            dist.gather_object(_try_load(pool.load, cmd[1], mine[0], cmd[2]), None, dst=0, group=group)
        elif op == "step":
            with torch.no_grad():
                run_step(model, cmd[1], cmd[2])
        elif op == "spec":
            with torch.no_grad():
                _spec_call(model, cmd[1], cmd[2])
        else:
            raise ParallelError(f"follower: unknown operation {op!r} from rank 0")
