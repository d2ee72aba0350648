"""What every model family shares: per-session state pools, the step batch, the model interface.

The batch layer (ds4t.batch) talks to models only through :class:`Model`:
``new_slot``/``free_slot``, ``slot_state``/``load_slot_state``, ``forward(StepBatch)``,
``native_rules`` and ``row_reasons``.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

CTX = "ctx"
"""Placeholder in a state shape for the per-slot token capacity (KV caches grow along it)."""


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One per-session state tensor: ``shape`` per slot (may contain CTX), dtype."""

    shape: Tuple
    dtype: torch.dtype

    def concrete(self, ctx: int) -> Tuple[int, ...]:
        return tuple(ctx if d == CTX else d for d in self.shape)

    @property
    def has_ctx(self) -> bool:
        return CTX in self.shape


class StatePool:
    """All sessions' state for one model: for each state name a tensor [slots, *per-slot shape].

    Kernels address a session by its slot index, so a batch of sessions is just a vector of
    slots. The pool grows (slots doubling, token capacity to the largest max_ctx asked) by
    copying into bigger tensors; slot numbers stay valid.
    """

    def __init__(self, specs: Dict[str, StateSpec], device):
        self.specs = specs
        self.device = torch.device(device)
        self.slots = 0
        self.ctx = 0
        self.tensors: Dict[str, torch.Tensor] = {}
        self.generation = 0
        self._free: List[int] = []
        self._used: Dict[int, int] = {}  # slot -> max_ctx

    def _resize(self, slots: int, ctx: int) -> None:
        new = {}
        for name, spec in self.specs.items():
            t = torch.zeros((slots,) + spec.concrete(ctx), dtype=spec.dtype, device=self.device)
            old = self.tensors.get(name)
            if old is not None:
                if spec.has_ctx:
                    axis = spec.shape.index(CTX) + 1
                    t.narrow(0, 0, old.shape[0]).narrow(axis, 0, old.shape[axis]).copy_(old)
                else:
                    t[: old.shape[0]].copy_(old)
            new[name] = t
        self.tensors = new
        self.generation += 1  # tensors moved: anything holding their addresses (CUDA graphs) is stale
        self._free += list(range(self.slots, slots))
        self.slots, self.ctx = slots, ctx

    def bytes_per_slot(self, ctx: int) -> int:
        return sum(torch.Size(s.concrete(ctx)).numel() * s.dtype.itemsize for s in self.specs.values())

    def reserve(self, slots: int, ctx: int) -> None:
        """Pre-allocate room for ``slots`` sessions of ``ctx`` tokens (a server's slot pool)."""
        if slots > self.slots or ctx > self.ctx:
            self._resize(max(slots, self.slots), max(ctx, self.ctx))

    def alloc(self, max_ctx: int) -> int:
        slots = self.slots if self._free else max(1, 2 * self.slots)
        ctx = max(self.ctx, max_ctx)
        if (slots, ctx) != (self.slots, self.ctx):
            self._resize(slots, ctx)
        slot = self._free.pop(0)
        self._used[slot] = max_ctx
        for t in self.tensors.values():
            t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        if self._used.pop(slot, None) is not None:
            self._free.append(slot)
            self._free.sort()

    def state(self, slot: int, pos: int) -> Dict[str, torch.Tensor]:
        """Copies of everything the next step of ``slot`` depends on (caches cut at ``pos``)."""
        out = {}
        for name, spec in self.specs.items():
            t = self.tensors[name][slot]
            if spec.has_ctx:
                t = t.narrow(spec.shape.index(CTX), 0, pos)
            out[name] = t.clone()
        return out

    def load(self, slot: int, state: Dict[str, torch.Tensor], pos: int) -> None:
        missing = set(self.specs) - set(state)
        extra = set(state) - set(self.specs)
        if missing or extra:
            raise ValueError(f"state does not fit this model: missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]}")
        for name, spec in self.specs.items():
            dst = self.tensors[name][slot]
            src = state[name]
            if spec.has_ctx:
                dst = dst.narrow(spec.shape.index(CTX), 0, pos)
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"state {name!r}: got {tuple(src.shape)} {src.dtype}, need {tuple(dst.shape)} {dst.dtype}")
        for name, spec in self.specs.items():
            t = self.tensors[name][slot]
            t.zero_()
            if spec.has_ctx:
                t = t.narrow(spec.shape.index(CTX), 0, pos)
            t.copy_(state[name].to(self.device))


@dataclasses.dataclass
class Segment:
    """Consecutive tokens of one session inside a step batch (1 token for a decode step)."""

    slot: int
    start_row: int
    n: int
    start_pos: int


@dataclasses.dataclass
class StepBatch:
    """The rows of one forward call: one row per token, grouped into per-session segments.

    tokens [R] int64, positions [R] int32 (position of each token), slots [R] int32,
    lengths [R] int32 (= positions + 1: cache entries each row attends to), out_rows [O] int64
    (rows whose logits are returned, in item order).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    out_rows: torch.Tensor
    segments: List[Segment]
    all_single: bool  # every segment is one token (a pure decode batch)
    single_rows: torch.Tensor  # int64 [S]: rows of the one-token segments (decode rows of a mixed batch)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def host_meta(segments: Sequence[Tuple[int, Sequence[int], int]], all_logits: bool = False):
        """The metadata of a step on the host: (meta int64 [3R + O + S], R, O, segments).

        segments: (slot, token ids, start position) per session, in item order. ``meta`` holds
        tokens, positions, slots, out_rows and single_rows back to back, so one host->device
        copy carries all of it (see :meth:`from_meta`).
        """
        toks, pos, slots, out_rows, segs = [], [], [], [], []
        for slot, ids, start in segments:
            r0 = len(toks)
            toks += list(ids)
            pos += range(start, start + len(ids))
            slots += [slot] * len(ids)
            segs.append(Segment(slot, r0, len(ids), start))
            out_rows += list(range(r0, r0 + len(ids))) if all_logits else [r0 + len(ids) - 1]
        singles = [sg.start_row for sg in segs if sg.n == 1]
        meta = torch.tensor(toks + pos + slots + out_rows + singles, dtype=torch.int64)
        return meta, len(toks), len(out_rows), segs

    @classmethod
    def from_meta(cls, meta: torch.Tensor, n: int, o: int, segs: List[Segment]) -> "StepBatch":
        """A batch whose tensors are views of / computed from ``meta`` on the device (no host
        sync, so a CUDA graph can capture it with ``meta`` as its input buffer)."""
        positions = meta[n:2 * n].to(torch.int32)
        return cls(
            tokens=meta[:n],
            positions=positions,
            slots=meta[2 * n:3 * n].to(torch.int32),
            lengths=positions + 1,
            out_rows=meta[3 * n:3 * n + o],
            single_rows=meta[3 * n + o:],
            segments=segs,
            all_single=all(s.n == 1 for s in segs),
        )

    @classmethod
    def build(cls, segments: Sequence[Tuple[int, Sequence[int], int]], device, all_logits: bool = False) -> "StepBatch":
        """segments: (slot, token ids, start position) per session, in item order."""
        meta, n, o, segs = cls.host_meta(segments, all_logits)
        return cls.from_meta(to_device(meta, device), n, o, segs)


def to_device(t: torch.Tensor, device, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Host tensor -> ``device`` (or into ``out``, a device tensor of its shape) without a host
    sync: through pinned memory on a GPU."""
    device = torch.device(device if out is None else out.device)
    if device.type == "cuda":
        t = t.pin_memory()
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)


@dataclasses.dataclass(frozen=True)
class NativeRule:
    """When a model's native path applies, as data the engine and ``ds4t support`` both read."""

    path: str        # e.g. "native"
    condition: str   # human-readable condition, e.g. "visible tokens <= 2051"
    fallback: str    # what happens to rows that fail it


class Model:
    """Interface between the batch layer and a model family.

    Subclasses set: ``family``, ``vocab_size``, ``device``, ``dtype``, ``state_specs()`` and
    implement ``forward``. ``name`` identifies the checkpoint (sessions of different models
    must not share a batch).
    """

    family: str = "?"
    name: str = "?"
    vocab_size: int
    max_position: int
    device: torch.device
    dtype: torch.dtype
    tokenizer = None

    def __init__(self):
        self.pool = StatePool(self.state_specs(), self.device)

    # -- state -------------------------------------------------------------------------------
    def state_specs(self) -> Dict[str, StateSpec]:
        raise NotImplementedError

    def new_session(self, max_ctx: int = 4096):
        from ds4t.batch.session import Session

        return Session(self, max_ctx)

    # -- compute -----------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits fp32 [len(batch.out_rows), vocab] for one step batch; updates the slots' state."""
        raise NotImplementedError

    # -- native-path eligibility (data, see NativeRule) --------------------------------------
    native_rules: Tuple[NativeRule, ...] = (NativeRule("native", "always", "-"),)

    def row_reasons(self, rows: Sequence[Tuple[int, int]]) -> List[Optional[str]]:
        """For (pos, n_tokens) of each item: None when the native path can take it, else why not."""
        return [None] * len(rows)

    def parameters(self) -> Dict[str, torch.Tensor]:
        """Every weight tensor by name (as the model holds it, after load-time fusion)."""
        raise NotImplementedError

    def graph_key(self, rows: int):
        """What a pure decode step of ``rows`` sessions (one token each) depends on besides the
        device-side metadata and state: the key of its CUDA graph, or None when it cannot be
        captured. A family whose step structure depends on an option adds that option."""
        return ("decode", rows)

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters().values())
