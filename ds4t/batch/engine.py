"""eval_batch: one decode step (or prefill chunk) for several sessions, native or ordered.

Native: every item's tokens are rows of ONE model.forward call (weights read once).
Ordered: each item alone, in the given order (a 1-item forward per session).
The kernels are batch-invariant, so both give the same bits; the exactness harness checks it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ds4t.batch.errors import BatchError, NotNativeError
from ds4t.batch.graphs import graphs_for
from ds4t.batch.session import Session, as_token_list
from ds4t.step import StepBatch

MODES = ("auto", "native", "ordered")


@dataclasses.dataclass
class DecodeItem:
    """One session's work in a batch: a decode token (int), or a chunk of prompt tokens (list)."""

    session: Session
    token: Union[int, Sequence[int], torch.Tensor]


@dataclasses.dataclass
class BatchResult:
    logits: torch.Tensor          # float32 [count, vocab], row i for item i (last token of a chunk)
    paths: List[str]              # per item: "native" or "ordered" — what actually ran
    reasons: List[Optional[str]]  # per item: why native was not taken (None when it was)
    elapsed_s: float = 0.0


def run_step(model, segments: Sequence[Tuple[int, List[int], int]], all_logits: bool = False) -> torch.Tensor:
    """One model.forward over (slot, tokens, start position) segments, sessions aside: a whole decode
    batch on a GPU replays its captured CUDA graph (ds4t.batch.graphs). A model with a ``step_hook``
    (tensor parallel serving: ds4t.parallel.mirror) hears of the step first."""
    hook = getattr(model, "step_hook", None)
    if hook is not None:
        hook(segments, all_logits)
    runner = graphs_for(model) if not all_logits and all(len(t) == 1 for _, t, _ in segments) else None
    if runner is not None:
        return runner.step(segments)
    return model.forward(StepBatch.build(segments, model.device, all_logits=all_logits))


def run_segments(model, work: Sequence[Tuple[Session, List[int]]], all_logits: bool = False) -> torch.Tensor:
    """:func:`run_step` over (session, tokens) pairs; advances each session."""
    logits = run_step(model, [(s.slot, toks, s.pos) for s, toks in work], all_logits)
    for s, toks in work:
        s.pos += len(toks)
        s.tokens.extend(toks)
    return logits


def _validate(items: Sequence[DecodeItem]):
    if not isinstance(items, (list, tuple)) or not items:
        raise BatchError("eval_batch: empty batch")
    model, seen, work = None, {}, []
    vocab = 0
    for i, it in enumerate(items):
        try:
            if not isinstance(it, DecodeItem):
                raise BatchError(f"item {i}: expected DecodeItem, got {type(it).__name__}")
            s = it.session
            if not isinstance(s, Session):
                raise BatchError(f"item {i}: session is {type(s).__name__}, not a ds4t Session")
            if model is None:
                model = s.model
                vocab = model.vocab_size
            elif s.model is not model:
                raise BatchError(f"item {i}: session belongs to model {s.model.name!r}, item 0's to {model.name!r}")
            if id(s) in seen:
                raise BatchError(f"item {i}: session already in the batch as item {seen[id(s)]}")
            seen[id(s)] = i
            # The host work before a decode step's graph launches is step latency (an N = 16 step's validation
            # was ~40 % of it on the CPU): a Python int token and a usable session pass without building the
            # messages; anything else goes through as_token_list / _check_usable, which raise them.
            t = it.token
            toks = [t] if type(t) is int and 0 <= t < vocab else as_token_list(t, vocab, f"item {i}")
            if not toks:
                raise BatchError(f"item {i}: no tokens")
            if s.pos + len(toks) > s.max_ctx or s.closed:
                s._check_usable(f"item {i}", len(toks))
        except BatchError as e:
            raise BatchError(str(e), item=i) from None
        work.append((s, toks))
    return model, work


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise BatchError(f"mode must be one of {MODES}, got {mode!r}")


def path_reasons(model, rows: Sequence[Tuple[int, int]], mode: str) -> List[Optional[str]]:
    """For (position, token count) of each item under ``mode``: None where the item runs natively, else
    why it runs ordered. mode "native" with an item the model cannot take raises NotNativeError naming it."""
    if mode == "ordered":
        return ["ordered mode requested"] * len(rows)
    reasons = list(model.row_reasons(rows))
    if mode == "native":
        bad = [(i, r) for i, r in enumerate(reasons) if r is not None]
        if bad:
            i, r = bad[0]
            raise NotNativeError(f"item {i}: native path not available: {r}", item=i)
    return reasons


def eval_batch(items: Sequence[DecodeItem], mode: str = "auto") -> BatchResult:
    """Run one step for every item. mode: "auto" (native where the model allows, ordered for the
    rest, in the same call), "native" (all rows in one batched call, or an error naming the
    reason), "ordered" (each item alone, in order).

    Invalid input raises BatchError naming the item and changes no session.
    """
    check_mode(mode)
    model, work = _validate(items)
    t0 = time.perf_counter()
    n = len(work)
    reasons = path_reasons(model, [(s.pos, len(toks)) for s, toks in work], mode)
    native = [i for i in range(n) if reasons[i] is None]
    if len(native) == n:   # the whole batch in one call: its logits are already in item order
        out = run_segments(model, work)
        return BatchResult(out, ["native"] * n, reasons, time.perf_counter() - t0)
    logits: List[Optional[torch.Tensor]] = [None] * n
    if native:
        out = run_segments(model, [work[i] for i in native])
        for j, i in enumerate(native):
            logits[i] = out[j]
    for i in range(n):
        if reasons[i] is not None:
            logits[i] = run_segments(model, [work[i]])[0]
    paths = ["native" if r is None else "ordered" for r in reasons]
    return BatchResult(torch.stack(logits), paths, reasons, time.perf_counter() - t0)
