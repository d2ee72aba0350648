"""Name the first op whose rows differ between a native step and the same step run ordered.

Twins of N sessions (the same prompts) take one decode step: set A ordered (N one-row forwards),
set B native (one N-row forward). Every op call made through the kernel registry
(:data:`ds4t.kernels.ops`) is recorded with its outputs; call j of the native forward is compared,
row by row and bitwise, with call j of each ordered forward. The first call whose rows differ is
the op to look at; an overridden op is named as such
(``"linear (overridden by mymodule.my_linear)"``). Ops that only write state (KV cache writes)
return nothing and are not compared; a difference they cause shows in the next op that reads it.
"""
from __future__ import annotations

import dataclasses
import random
from typing import List, Optional

import torch

from ds4t.batch.engine import DecodeItem, eval_batch
from ds4t.kernels.registry import OpCall, recording


@dataclasses.dataclass
class CallDiff:
    """One op call of the native forward, compared with the same call of each ordered forward."""
    index: int                 # position in the forward's sequence of op calls
    op: str                    # the op's name
    label: str                 # the op's name, or "name (overridden by module.fn)"
    overridden: bool
    rows_compared: int         # 0: the op returned nothing comparable
    differing_rows: List[int]  # batch rows whose outputs differ from the row alone
    max_abs_diff: float = 0.0

    @property
    def differs(self) -> bool:
        return bool(self.differing_rows)

    def status(self) -> str:
        if not self.rows_compared:
            return "(no output)"
        if not self.differing_rows:
            return "ok"
        shown = ", ".join(map(str, self.differing_rows[:8])) + (" ..." if len(self.differing_rows) > 8 else "")
        return f"DIFFERS: rows {shown} (max |diff| {self.max_abs_diff:.3g})"


@dataclasses.dataclass
class Diagnosis:
    """What :func:`diagnose` found: every op call of the native forward and the first that differs."""
    sessions: int
    calls: List[CallDiff]
    logits_equal: bool         # the step's logits, native vs ordered, bitwise

    @property
    def first(self) -> Optional[CallDiff]:
        return next((c for c in self.calls if c.differs), None)

    def summary(self) -> str:
        f = self.first
        if f is None:
            verdict = "every op's rows agree bitwise"
        else:
            verdict = f"first op whose rows differ: {f.label} (call {f.index}; {f.status()})"
        return f"{len(self.calls)} op calls per forward, {self.sessions} sessions; {verdict}; " \
               f"logits {'equal' if self.logits_equal else 'DIFFER'}"

    def table(self) -> str:
        lines = [f"{c.index:4d}  {c.label:40s} {c.status()}" for c in self.calls]
        return "\n".join(lines + [self.summary()])


def _rows(out, n: int) -> List[torch.Tensor]:
    """The tensors of an op's output as [n, -1] row views (those whose leading size n divides)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.reshape(n, -1) for o in outs
            if isinstance(o, torch.Tensor) and o.dim() >= 1 and o.shape[0] % n == 0 and o.numel()]


def compare_calls(native: List[OpCall], ordered: List[List[OpCall]]) -> List[CallDiff]:
    """Call j of the native forward (N rows) against call j of each ordered forward (row i alone)."""
    n = len(ordered)
    for i, calls in enumerate(ordered):
        if [c.name for c in calls] != [c.name for c in native]:
            raise RuntimeError(
                f"the ordered forward of row {i} made other op calls than the native forward "
                f"({[c.name for c in calls]} vs {[c.name for c in native]}): the two paths launch different "
                "ops, so they cannot be compared call by call")
    diffs = []
    for j, call in enumerate(native):
        nat = _rows(call.output, n)
        bad, worst = [], 0.0
        for i in range(n):
            alone = _rows(ordered[i][j].output, 1)
            for x, a in zip(nat, alone):
                if x.shape[1] != a.shape[1]:
                    continue
                if not torch.equal(x[i], a[0]):
                    bad.append(i)
                    worst = max(worst, (x[i].double() - a[0].double()).abs().nan_to_num(float("inf")).max().item())
                    break
        diffs.append(CallDiff(j, call.name, call.label, call.overridden, n if nat else 0, bad, worst))
    return diffs


def diagnose(model, sessions: int = 8, ctx: int = 64, seed: int = 0) -> Diagnosis:
    """One decode step of ``sessions`` twins, native vs ordered, compared op call by op call.

    Prompts are random (lengths 1..ctx, ``seed``); the sessions are closed afterwards. Returns a
    :class:`Diagnosis`; ``.first`` is the first op call whose rows differ (None when all agree).
    """
    if sessions < 2:
        raise ValueError(f"sessions={sessions}: need at least 2 rows to compare a batch with rows alone")
    rng = random.Random(seed)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(rng.randint(1, ctx))] for _ in range(sessions)]
    toks = [rng.randrange(model.vocab_size) for _ in prompts]
    A = [model.new_session(ctx + 8) for _ in prompts]
    B = [model.new_session(ctx + 8) for _ in prompts]
    try:
        for a, b, p in zip(A, B, prompts):
            a.prefill(p)
            b.prefill(p)
        ordered, rows = [], []
        for a, t in zip(A, toks):
            with recording() as log:   # recording also keeps CUDA graphs from replaying
                rows.append(eval_batch([DecodeItem(a, t)], mode="ordered").logits[0])
            ordered.append(log)
        with recording() as native:
            res = eval_batch([DecodeItem(b, t) for b, t in zip(B, toks)], mode="native")
        calls = compare_calls(native, ordered)
        return Diagnosis(sessions, calls, torch.equal(torch.stack(rows), res.logits))
    finally:
        for s in A + B:
            s.close()
