"""Speculative decoding against plain decoding, bitwise: tokens, every token's logits, state.

:func:`run_speculative` decodes random sessions twice. Plain: each session alone, one token per
step, choosing each token with :func:`ds4t.sampling.sample` (greedy or seeded sampling). Speculative:
the same sessions in :func:`ds4t.batch.speculative.spec_step` calls -- drafts from the MTP head or
replayed from the plain run with planted errors (so every acceptance length occurs), k = 0 rows
among them, sessions joining through a prompt chunk inside a verify call, sessions without drafts.
Every emitted token, the full fp32 logits it was chosen from, the final position and every state
tensor of the model (the MTP head's own cache aside: plain decoding never fills it) must be equal.
:func:`plant` holds the negative controls.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Dict, List, Optional

import torch

from ds4t import sampling
from ds4t.batch import speculative as spec
from ds4t.batch.engine import DecodeItem, eval_batch

CONTROLS = ("accept-one-more", "skip-rollback")


@dataclasses.dataclass
class SpecReport:
    sessions: int = 0
    calls: int = 0            # spec_step calls
    emitted: int = 0          # tokens emitted by the speculative run
    drafted: int = 0
    accepted: int = 0
    mismatches: int = 0
    first_mismatch: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.mismatches == 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def miss(self, what: str) -> None:
        self.mismatches += 1
        self.first_mismatch = self.first_mismatch or what


@dataclasses.dataclass
class _Plan:
    prompt: List[int]
    temperature: float
    seed: int
    join: int
    mtp: bool           # drafts from the MTP head (else replayed from the plain run)


def _plain(model, p: _Plan, n: int, max_ctx: int):
    """Plain decoding of one session alone: (tokens, logits [n, V], state, pos)."""
    s = model.new_session(max_ctx)
    try:
        lg = s.prefill(p.prompt)
        toks, rows = [], []
        while True:
            t = int(sampling.sample(lg[None], temperature=p.temperature, seed=p.seed, position=s.pos).item())
            toks.append(t)
            rows.append(lg)
            if len(toks) == n:
                break
            lg = eval_batch([DecodeItem(s, t)], mode="ordered").logits[0]
        return toks, torch.stack(rows), s.state_dict(), s.pos
    finally:
        s.close()


def run_speculative(model, k: int = 3, sessions: int = 4, new_tokens: int = 10, seed: int = 0,
                    replay_accept: float = 0.6, max_ctx: int = 128) -> SpecReport:
    """One random mix (module docstring); the report counts every comparison that differed."""
    rng = random.Random(seed)
    V = model.vocab_size
    has_mtp = getattr(model, "mtp", None) is not None
    plans = [_Plan([rng.randrange(V) for _ in range(rng.randint(1, 9))], rng.choice([0.0, 0.0, 0.8]),
                   rng.randrange(1 << 30), 0 if i < 2 else rng.randint(1, 3), has_mtp and rng.random() < 0.5)
             for i in range(sessions)]
    ref = [_plain(model, p, new_tokens, max_ctx) for p in plans]
    rep = SpecReport(sessions=sessions)
    ss = [model.new_session(max_ctx) for _ in plans]
    out: Dict[int, List[int]] = {}
    rows: Dict[int, List[torch.Tensor]] = {}
    try:
        first = [i for i, p in enumerate(plans) if p.join == 0]
        lg = spec.prefill([DecodeItem(ss[i], plans[i].prompt) for i in first])
        for i, row in zip(first, lg):
            out[i], rows[i] = [_choose(plans[i], row, ss[i].pos)], [row]
        step = 0
        while len(out) < len(plans) or any(len(out[i]) < new_tokens for i in out):
            step += 1
            items, who = [], []
            for i in sorted(out):
                if len(out[i]) >= new_tokens:
                    continue
                p, kk = plans[i], k if rng.random() < 0.8 else 0
                drafts = None
                if kk and not p.mtp:
                    future = ref[i][0][len(out[i]):len(out[i]) + kk]
                    drafts = [t if rng.random() < replay_accept else (t + 1 + rng.randrange(V - 1)) % V for t in future]
                    drafts += [rng.randrange(V) for _ in range(kk - len(drafts))]
                items.append(spec.SpecItem(ss[i], out[i][-1], k=kk, drafts=drafts, temperature=p.temperature,
                                           seed=p.seed, max_tokens=new_tokens - len(out[i])))
                who.append(i)
            joining = [i for i, p in enumerate(plans) if p.join == step and i not in out]
            extra = [DecodeItem(ss[i], plans[i].prompt) for i in joining]
            if not items:   # nothing to verify yet: the joiners prefill on their own
                lg = spec.prefill(extra)
            else:
                res, lg = spec.spec_step(items, extra=extra)
                rep.calls += 1
                for i, r in zip(who, res):
                    out[i] += r.tokens
                    rows[i] += list(r.logits)
                    rep.emitted += len(r.tokens)
                    rep.drafted += r.drafted
                    rep.accepted += r.accepted
            for i, row in zip(joining, lg if joining else []):
                out[i], rows[i] = [_choose(plans[i], row, ss[i].pos)], [row]
        for i, (toks, lgs, state, pos) in enumerate(ref):
            if out[i] != toks:
                j = next(j for j, (a, b) in enumerate(zip(out[i], toks)) if a != b)
                rep.miss(f"session {i}: token {j} is {out[i][j]}, plain decoding chose {toks[j]}")
            elif not torch.equal(torch.stack(rows[i]), lgs):
                rep.miss(f"session {i}: logits differ from plain decoding")
            if ss[i].pos != pos:
                rep.miss(f"session {i}: position {ss[i].pos}, plain decoding {pos}")
                continue
            got, skip = ss[i].state_dict(), getattr(model, "mtp_state_prefix", None) or "\0"
            for name, t in state.items():
                if not name.startswith(skip) and not torch.equal(got[name], t):
                    rep.miss(f"session {i}: state {name!r} differs from plain decoding")
    finally:
        for s in ss:
            s.close()
    return rep


def _choose(p: _Plan, row: torch.Tensor, pos: int) -> int:
    return int(sampling.sample(row[None], temperature=p.temperature, seed=p.seed, position=pos).item())


@contextlib.contextmanager
def plant(kind: str, model=None):
    """A deviation the comparison must catch. ``accept-one-more``: one draft more than matched is
    kept (an off-by-one in acceptance). ``skip-rollback``: the model's rollback does nothing, so its
    recurrent state stays where the whole verify chunk left it (models with recurrent state only:
    :func:`has_recurrent_rollback`)."""
    if kind == "accept-one-more":
        original = spec._accepted
        spec._accepted = lambda chosen, drafts: min(original(chosen, drafts) + 1, len(drafts))
        try:
            yield
        finally:
            spec._accepted = original
    elif kind == "skip-rollback":
        cls = type(model)
        original = cls.rollback
        cls.rollback = lambda self, slot, consumed: None
        try:
            yield
        finally:
            cls.rollback = original
    else:
        raise ValueError(f"unknown control {kind!r}; controls: {CONTROLS}")


def has_recurrent_rollback(model) -> bool:
    """Whether the model restores state on rollback (the skip-rollback control applies)."""
    from ds4t.models.base import Model

    return type(model).rollback is not Model.rollback
