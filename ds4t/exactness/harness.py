"""Run the same session mix twice — every step ordered, and native — and compare bits.

Each planned session gets twins: A runs every step with mode="ordered", B with the mode under
test. After each step the harness compares, with torch.equal, the full float32 logits of every
row and every tensor of every active session's state_dict(), and checks which path really ran.
Sessions join (prefill, or a prompt chunk inside a mixed batch) and leave at planned steps;
the row order is permuted every step. A negative control (:func:`plant`) shows the harness
catches a 1-ulp deviation and a batch-dependent kernel.
"""
from __future__ import annotations

import contextlib
import dataclasses
import random
from typing import Callable, Dict, List, Optional

import torch

from ds4t.batch.engine import DecodeItem, eval_batch


@dataclasses.dataclass
class Plan:
    prompt: List[int]
    join: int = 0            # step at which the session appears
    leave: int = 10**9       # step at which it is closed
    chunked_join: bool = False  # feed the prompt as a chunk item inside that step's batch


@dataclasses.dataclass
class Scenario:
    plans: List[Plan]
    steps: int
    seed: int = 0
    max_ctx: int = 512


@dataclasses.dataclass
class Report:
    sessions: int = 0
    steps: int = 0
    rows: int = 0
    states: int = 0
    mismatches: int = 0
    paths: Dict[str, int] = dataclasses.field(default_factory=dict)
    first_mismatch: Optional[str] = None
    native_missing: int = 0  # items expected native that ran ordered
    native_batches: int = 0  # steps whose native call held 2+ rows (what a batch-dependent kernel would show in)

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and self.native_missing == 0

    def merge(self, other: "Report") -> None:
        for f in ("sessions", "steps", "rows", "states", "mismatches", "native_missing", "native_batches"):
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for k, v in other.paths.items():
            self.paths[k] = self.paths.get(k, 0) + v
        self.first_mismatch = self.first_mismatch or other.first_mismatch


_PLANTED = {"ulp": False}


@contextlib.contextmanager
def plant(kind: str):
    """Negative control: plant a deviation the harness must catch.

    "ulp": the tested path's logits get one element moved by one ulp.
    "batch-dependent": the models' linear op sums K in two halves whenever a launch has more than
    one row, so a row's bits depend on the batch (what a split-K chosen from the batch size does;
    docs/design.md, "Exactness").
    """
    if kind == "ulp":
        _PLANTED["ulp"] = True
        try:
            yield
        finally:
            _PLANTED["ulp"] = False
    elif kind == "batch-dependent":
        from ds4t.kernels import override
        from ds4t.kernels.linear import linear as original
        from ds4t.kernels.weights import QuantWeight

        def batch_dependent(x, weight, bias=None, *, out=None):
            if x.shape[0] == 1 or x.shape[1] < 2:
                return original(x, weight, bias, out=out)
            h = x.shape[1] // 2
            if isinstance(weight, QuantWeight):  # FP8 scales / GGUF blocks cannot be cut along K: its real values
                weight = weight.dequantize(weight.act_dtype or x.dtype)
            y = original(x[:, :h].contiguous(), weight[:, :h].contiguous(), bias)
            y = y + original(x[:, h:].contiguous(), weight[:, h:].contiguous())
            if out is not None:
                out.copy_(y)
                return out
            return y

        with override("linear", batch_dependent):   # CUDA graphs are bypassed while it holds
            yield
    else:
        raise ValueError(f"unknown planted deviation {kind!r}: use 'ulp' or 'batch-dependent'")


def _greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits).item())


def run_scenario(model, sc: Scenario, mode: str = "native",
                 on_step: Optional[Callable[[int], None]] = None) -> Report:
    """Run ``sc`` with twins (ordered vs ``mode``) and compare; returns the Report.
    ``on_step(step)`` is called after each of the ``sc.steps`` steps (progress bars)."""
    rng = random.Random(sc.seed)
    rep = Report(sessions=len(sc.plans), steps=sc.steps)
    live: Dict[int, tuple] = {}   # plan index -> (session A, session B, next token, pending chunk)
    try:
        for step in range(sc.steps):
            for pi, p in enumerate(sc.plans):
                if p.join == step:
                    a, b = model.new_session(sc.max_ctx), model.new_session(sc.max_ctx)
                    if p.chunked_join:
                        live[pi] = (a, b, None, list(p.prompt))
                    else:
                        la, lb = a.prefill(p.prompt), b.prefill(p.prompt)
                        _compare(rep, f"step {step} prefill plan {pi}", la, lb)
                        live[pi] = (a, b, _greedy(la), None)
                if p.leave == step and pi in live:
                    a, b, _, _ = live.pop(pi)
                    a.close()
                    b.close()
            if not live:
                if on_step is not None:
                    on_step(step)
                continue
            order = list(live)
            rng.shuffle(order)
            items_a, items_b = [], []
            for pi in order:
                a, b, tok, chunk = live[pi]
                work = chunk if chunk is not None else tok
                items_a.append(DecodeItem(a, work))
                items_b.append(DecodeItem(b, work))
            ra = eval_batch(items_a, mode="ordered")
            rb = eval_batch(items_b, mode=mode)
            rep.native_batches += rb.paths.count("native") >= 2
            if _PLANTED["ulp"]:
                i = rng.randrange(rb.logits.shape[0])
                j = rng.randrange(rb.logits.shape[1])
                rb.logits[i, j] = torch.nextafter(rb.logits[i, j], torch.tensor(float("inf"), device=rb.logits.device))
            for k, pi in enumerate(order):
                rep.paths[rb.paths[k]] = rep.paths.get(rb.paths[k], 0) + 1
                if mode == "native" and rb.paths[k] != "native":
                    rep.native_missing += 1
                if rb.reasons[k] is None and rb.paths[k] != "native":
                    rep.native_missing += 1
                a, b, _, _ = live[pi]
                _compare(rep, f"step {step} plan {pi} logits", ra.logits[k], rb.logits[k])
                sa, sb = a.state_dict(), b.state_dict()
                rep.states += 1
                for name in sa:
                    if not torch.equal(sa[name], sb[name]):
                        rep.mismatches += 1
                        rep.first_mismatch = rep.first_mismatch or f"step {step} plan {pi} state {name}"
                # Both twins continue from A's token so one mismatch does not fork the runs.
                live[pi] = (a, b, _greedy(ra.logits[k]), None)
            if on_step is not None:
                on_step(step)
    finally:
        for a, b, _, _ in live.values():
            a.close()
            b.close()
    return rep


def _compare(rep: Report, where: str, la: torch.Tensor, lb: torch.Tensor) -> None:
    rep.rows += 1
    if not torch.equal(la, lb):
        rep.mismatches += 1
        if rep.first_mismatch is None:
            d = (la.float() - lb.float()).abs().max().item()
            rep.first_mismatch = f"{where}: max |diff| {d:.3e}"


def random_scenario(rng: random.Random, vocab: int, sessions: int, steps: int, max_prompt: int = 200,
                    max_ctx: int = 512) -> Scenario:
    """A scenario drawn from ``rng``: staggered joins/leaves, prompt lengths 1..max_prompt,
    some prompts fed as chunks inside mixed batches."""
    plans = []
    for i in range(sessions):
        join = 0 if i < max(1, sessions // 2) else rng.randrange(steps)
        leave = rng.choice([10**9, 10**9, rng.randrange(join + 1, steps + 1)])
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))]
        plans.append(Plan(prompt, join, leave, chunked_join=rng.random() < 0.3))
    return Scenario(plans, steps, seed=rng.randrange(2**31), max_ctx=max_ctx)
