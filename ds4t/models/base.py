"""What every model family shares: per-session state pools and the model interface.

The batch layer (ds4t.batch) talks to models only through :class:`Model`: ``pool``
(:class:`StatePool`), ``forward(StepBatch)``, ``row_reasons``, ``graph_key``, ``vocab_size``,
``max_position``, ``device`` and ``name``. The step metadata (:class:`~ds4t.step.StepBatch`) lives
in the leaf module :mod:`ds4t.step`, so the dependency runs one way: models -> batch -> step.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ds4t.batch.session import Session
from ds4t.step import Segment, StepBatch, to_device  # noqa: F401  (the families import them from here)

COMMON_INIT_ARGS = ("self", "cfg", "source", "device", "dtype", "name", "progress")
"""Constructor arguments every family takes; the rest are its load options (see Model.load_options)."""

CTX = "ctx"
"""Placeholder in a state shape for the per-slot token capacity (KV caches grow along it)."""


@dataclasses.dataclass(frozen=True)
class StateSpec:
    """One per-session state tensor: ``shape`` per slot (may contain CTX), dtype, and ``order``: the
    per-slot dims from outermost to innermost in memory (None: row-major). A kernel that reads the
    state faster in another layout says so here, e.g. the Gated DeltaNet state [Hv, Dk, Dv] with
    order (0, 2, 1), Dk contiguous; the tensors keep the logical shape (strided views)."""

    shape: Tuple
    dtype: torch.dtype
    order: Optional[Tuple[int, ...]] = None
    replicated: bool = False
    """Under tensor parallel every rank holds the same values (MLA's latent cache, shared by all heads):
    a session's saved state keeps one copy (:mod:`ds4t.parallel.mirror`)."""

    def __post_init__(self):
        if self.order is not None and sorted(self.order) != list(range(len(self.shape))):
            raise ValueError(f"StateSpec order {self.order} is not a permutation of the dims of {self.shape}")

    def concrete(self, ctx: int) -> Tuple[int, ...]:
        return tuple(ctx if d == CTX else d for d in self.shape)

    def allocate(self, lead: int, ctx: int, device, zeroed: bool = True) -> torch.Tensor:
        """[lead, *shape] (CTX = ``ctx``), zeros or uninitialised, laid out as ``order`` says below the
        leading dim."""
        shape = self.concrete(ctx)
        make = torch.zeros if zeroed else torch.empty
        if self.order is None:
            return make((lead,) + shape, dtype=self.dtype, device=device)
        stored = make((lead,) + tuple(shape[d] for d in self.order), dtype=self.dtype, device=device)
        return stored.permute(0, *(1 + self.order.index(d) for d in range(len(shape))))

    @property
    def has_ctx(self) -> bool:
        return CTX in self.shape


class StatePool:
    """All sessions' state for one model: for each state name a tensor [slots, *per-slot shape].

    Kernels address a session by its slot index, so a batch of sessions is just a vector of
    slots. The pool grows (slots doubling, token capacity to the largest max_ctx asked) by
    copying into bigger tensors; slot numbers stay valid. A session asking for more context than the
    pool holds re-sizes it to the slots in use plus its own (free slots above the highest in use are
    dropped), so closing a large batch and opening fewer, longer sessions needs only their memory.
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
        """Tensors of ``slots`` slots and ``ctx`` tokens, the slots in use (all below ``slots``) copied over.
        With no slot in use the old tensors go first: nothing to copy, and old and new never coexist."""
        if not self._used:
            self.tensors = {}
        new = {}
        for name, spec in self.specs.items():
            t = spec.allocate(slots, ctx, self.device)
            old = self.tensors.get(name)
            if old is not None:
                keep = min(slots, old.shape[0])
                if spec.has_ctx:
                    axis = spec.shape.index(CTX) + 1
                    t.narrow(0, 0, keep).narrow(axis, 0, old.shape[axis]).copy_(old[:keep])
                else:
                    t[:keep].copy_(old[:keep])
            new[name] = t
        self.tensors = new
        self.generation += 1  # tensors moved: anything holding their addresses (CUDA graphs) is stale
        self._free = sorted({f for f in self._free if f < slots} | set(range(self.slots, slots)))
        self.slots, self.ctx = slots, ctx

    def bytes_per_slot(self, ctx: int) -> int:
        return sum(torch.Size(s.concrete(ctx)).numel() * s.dtype.itemsize for s in self.specs.values())

    def reserve(self, slots: int, ctx: int) -> None:
        """Pre-allocate room for ``slots`` sessions of ``ctx`` tokens (a server's slot pool)."""
        if slots > self.slots or ctx > self.ctx:
            self._resize(max(slots, self.slots), max(ctx, self.ctx))

    def alloc(self, max_ctx: int) -> int:
        ctx = max(self.ctx, max_ctx)
        if ctx > self.ctx:
            # Every slot grows to the new context: keep only the slots up to the highest in use (slot
            # numbers stay valid) and one free slot for this session -- not the free slots a larger
            # batch left behind, which at the new context could be more than the device holds.
            top = max(self._used, default=-1) + 1
            slots = top if any(f < top for f in self._free) else top + 1
        else:
            slots = self.slots if self._free else max(1, 2 * self.slots)
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

    def state(self, slot: int, pos: int, device=None) -> Dict[str, torch.Tensor]:
        """Copies of everything the next step of ``slot`` depends on (caches cut at ``pos``), on ``device``
        (default: the pool's; e.g. "cpu" copies straight to host memory, never holding a device copy)."""
        out = {}
        for name, spec in self.specs.items():
            t = self.tensors[name][slot]
            if spec.has_ctx:
                t = t.narrow(spec.shape.index(CTX), 0, pos)
            out[name] = t.clone() if device is None else t.to(device, copy=True)
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
    text_meta = None   # GGUF checkpoints: chat template, special tokens, EOS ids (ds4t.models.gguf.TextMeta)

    def __init__(self):
        self.pool = StatePool(self.state_specs(), self.device)

    # -- state -------------------------------------------------------------------------------
    def state_specs(self) -> Dict[str, StateSpec]:
        raise NotImplementedError

    def new_session(self, max_ctx: int = 4096) -> Session:
        """A new session on one slot of this model's state pool, able to hold ``max_ctx`` tokens."""
        return Session(self, max_ctx)

    # -- compute -----------------------------------------------------------------------------
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Logits fp32 [len(batch.out_rows), vocab] for one step batch; updates the slots' state."""
        raise NotImplementedError

    def rollback(self, slot: int, consumed: int) -> None:
        """Keep only the first ``consumed`` tokens of the slot's last verify chunk (a step segment run
        with ``keep``; the caller moves the session's position). State addressed by position (KV and
        latent caches) needs nothing: entries past the position are never read and get overwritten.
        Families with recurrent state restore it here (Qwen3-Next)."""

    # -- native-path eligibility (data, see NativeRule) --------------------------------------
    native_rules: Tuple[NativeRule, ...] = (NativeRule(
        "native", "always: every row (decode token or prompt chunk) joins the batched call",
        "- (no fallback needed)"),)

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

    @classmethod
    def load_options(cls) -> Tuple[str, ...]:
        """The family's own keyword options of ``ds4t.load`` (e.g. ``native_path``), read from its
        constructor; the model keeps each as an attribute of that name."""
        return tuple(k for k in inspect.signature(cls.__init__).parameters if k not in COMMON_INIT_ARGS)

    def __repr__(self) -> str:
        cfg = getattr(self, "cfg", None)
        moe = getattr(cfg, "ffn", cfg)  # routed experts sit in the FFN config (DeepSeek, GLM) or the top level
        parts = [f"name={self.name!r}", f"family={self.family!r}", f"dtype={self.dtype}", f"device={self.device}",
                 f"layers={getattr(cfg, 'num_layers', '?')}", f"hidden_size={getattr(cfg, 'hidden_size', '?')}",
                 f"vocab_size={self.vocab_size}"]
        if getattr(moe, "num_experts", 0):
            parts.append(f"experts={moe.num_experts} (top {moe.top_k})")
        parts += [f"{k}={getattr(self, k, '?')!r}" for k in self.load_options()]
        return f"{type(self).__name__}({', '.join(parts)})"

    def weight_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parameters().values())
