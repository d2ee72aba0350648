"""A resident session: one slot of the model's state pool, its position and token history."""
from __future__ import annotations

import numbers
import weakref
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import torch

from ds4t.batch.errors import BatchError


def is_int(t) -> bool:
    """A Python or numpy integer, not a bool (bools are ints to Python but never token ids or counts)."""
    # ``type(t) is int`` first: the ABC check costs ~1 us a call, which a decode step pays per token
    return type(t) is int or (isinstance(t, numbers.Integral) and not isinstance(t, (bool, np.bool_)))


def as_token_list(tokens: Union[int, Sequence[int], torch.Tensor, np.ndarray], vocab: int, what: str) -> List[int]:
    """Validate token ids against the vocabulary; returns them as a list of Python ints.

    Accepted: an int (Python or numpy integer scalar), a list/tuple of them, or a 1-D integer
    torch tensor / numpy array. Bools and floats are rejected.
    """
    if type(tokens) is int:   # a decode token: the common case, kept cheap (host time is step latency at N = 1)
        if not 0 <= tokens < vocab:
            raise BatchError(f"{what}: token {tokens} outside the vocabulary [0, {vocab})")
        return [tokens]
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() > 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise BatchError(f"{what}: token ids must be a 1-D integer tensor, got {tuple(tokens.shape)} {tokens.dtype}")
        tokens = tokens.reshape(-1).tolist()
    elif isinstance(tokens, np.ndarray):
        if tokens.ndim > 1 or tokens.dtype.kind not in "iu":
            raise BatchError(f"{what}: token ids must be a 1-D integer array, got {tokens.shape} {tokens.dtype}")
        tokens = tokens.reshape(-1).tolist()
    elif is_int(tokens):
        tokens = [tokens]
    elif isinstance(tokens, (list, tuple)):
        tokens = list(tokens)
    else:
        raise BatchError(f"{what}: token {tokens!r} is not an int or a list of ints")
    for t in tokens:
        if not is_int(t):
            raise BatchError(f"{what}: token {t!r} is not an int")
        if not 0 <= t < vocab:
            raise BatchError(f"{what}: token {t} outside the vocabulary [0, {vocab})")
    return [int(t) for t in tokens]


class Session:
    """One conversation's resident state in a model's slot pool.

    ``pos``: tokens consumed. ``tokens``: their ids (used for prefix reuse when serving).
    """

    def __init__(self, model, max_ctx: int = 4096):
        if not isinstance(max_ctx, int) or max_ctx < 1:
            raise BatchError(f"max_ctx must be a positive int, got {max_ctx!r}")
        if max_ctx > model.max_position:
            raise BatchError(f"max_ctx {max_ctx} exceeds the model's max_position_embeddings {model.max_position}")
        self.model = model
        self.max_ctx = max_ctx
        self.slot = model.pool.alloc(max_ctx)
        self.pos = 0
        self.tokens: List[int] = []
        self._finalizer = weakref.finalize(self, model.pool.free, self.slot)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        """Give the slot back to the pool; the session can no longer be used."""
        self._finalizer()

    def prefill(self, token_ids, all_logits: bool = False, chunk: int = 256) -> torch.Tensor:
        """Consume ``token_ids`` (list of ints or 1-D tensor); float32 logits of the last position
        [vocab], or of every position [T, vocab] with all_logits. Runs in chunks of ``chunk`` tokens."""
        from ds4t.batch.engine import run_segments

        ids = as_token_list(token_ids, self.model.vocab_size, "prefill")
        self._check_usable("prefill", len(ids))
        if not ids:
            raise BatchError("prefill: no tokens")
        outs = []
        for start in range(0, len(ids), chunk):
            piece = ids[start:start + chunk]
            logits = run_segments(self.model, [(self, piece)], all_logits=all_logits)
            outs.append(logits)
        return torch.cat(outs) if all_logits else outs[-1][0]

    def _check_usable(self, what: str, n: int) -> None:
        if self.closed:
            raise BatchError(f"{what}: session is closed")
        if self.pos + n > self.max_ctx:
            raise BatchError(f"{what}: session at position {self.pos} cannot take {n} more token(s): "
                             f"max_ctx is {self.max_ctx}")

    def state_dict(self, device=None) -> Dict[str, torch.Tensor]:
        """Copies of everything the next step depends on: KV caches up to pos, conv and
        recurrent states; on ``device`` if given (e.g. "cpu": straight to host memory, no device copy)."""
        if self.closed:
            raise BatchError("state_dict: session is closed")
        return self.model.pool.state(self.slot, self.pos, device)

    def load_state_dict(self, state: Dict[str, torch.Tensor], pos: int, tokens: Optional[List[int]] = None) -> None:
        """Restore a state taken with :meth:`state_dict` at position ``pos``."""
        self._check_usable("load_state_dict", 0)
        if not 0 <= pos <= self.max_ctx:
            raise BatchError(f"load_state_dict: pos {pos} outside [0, {self.max_ctx}]")
        self.model.pool.load(self.slot, state, pos)
        self.pos = pos
        self.tokens = list(tokens) if tokens is not None else self.tokens[:pos]

    def __repr__(self) -> str:
        return (f"Session(model={self.model.name!r}, slot={self.slot}, pos={self.pos}, max_ctx={self.max_ctx}, "
                f"closed={self.closed})")
