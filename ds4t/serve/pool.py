"""The slot pool: N resident sessions allocated once at start (at --max-ctx), and the routing rules.

A slot is idle or holds one request. Its session's ``tokens`` is the history its state encodes.
Routing (see :meth:`SlotPool.best_prefix`) continues an idle slot whose history is a proper prefix
of the new prompt (only the rest is prefilled); otherwise a victim slot is reset. Resetting loads
the state a fresh session starts from (taken once at start), so it works for any model family.
Only the decode worker thread touches slots.
"""
from __future__ import annotations

import time
from typing import List, Optional, Sequence, Tuple


class Slot:
    def __init__(self, index: int, session):
        self.index = index
        self.session = session
        self.request = None
        self.last_used = 0.0

    @property
    def idle(self) -> bool:
        return self.request is None

    @property
    def history(self) -> List[int]:
        return self.session.tokens

    def __repr__(self) -> str:
        return f"Slot({self.index}, pos={self.session.pos}, busy={not self.idle})"


class SlotPool:
    def __init__(self, model, n: int, max_ctx: int):
        if n < 1:
            raise ValueError(f"--batched-session must be >= 1, got {n}")
        self.model = model
        self.max_ctx = max_ctx
        model.pool.reserve(n, max_ctx)  # one allocation for all N sessions at full context
        self.slots = [Slot(i, model.new_session(max_ctx)) for i in range(n)]
        self.zero_state = self.slots[0].session.state_dict()  # a fresh session's state at pos 0

    def __len__(self) -> int:
        return len(self.slots)

    def idle_slots(self) -> List[Slot]:
        return [s for s in self.slots if s.idle]

    def busy(self) -> int:
        return sum(not s.idle for s in self.slots)

    def best_prefix(self, prompt: Sequence[int]) -> Tuple[Optional[Slot], int]:
        """The idle slot whose history is the longest proper prefix of ``prompt`` (and its length);
        (None, 0) when none is. A proper prefix leaves at least one prompt token to run, whose
        logits give the first generated token."""
        best, n = None, 0
        for s in self.slots:
            h = s.history
            if s.idle and n < len(h) < len(prompt) and list(prompt[: len(h)]) == h:
                best, n = s, len(h)
        return best, n

    def victim(self, saved=lambda tokens: False, avoid: Optional[Slot] = None) -> Optional[Slot]:
        """The idle slot to give to another conversation: an empty one, else one whose state is
        already saved (``saved(history)``), else the least recently used; ``avoid`` last."""
        idle = self.idle_slots()
        if not idle:
            return None
        return min(idle, key=lambda s: (s is avoid, s.session.pos > 0, not saved(s.history), s.last_used))

    def reset(self, slot: Slot) -> None:
        slot.session.load_state_dict(self.zero_state, 0, [])
        slot.last_used = time.monotonic()

    def assign(self, slot: Slot, request) -> None:
        slot.request = request
        slot.last_used = time.monotonic()

    def close(self) -> None:
        """Give every session back to the model's pool (the server is gone)."""
        for s in self.slots:
            s.session.close()

    def release(self, slot: Slot) -> None:
        slot.request = None
        slot.last_used = time.monotonic()
