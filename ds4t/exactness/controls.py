"""The negative control: plant a deviation, run a scenario, and say whether the harness caught it.

A control only proves something when the run could show its deviation. The 1-ulp change needs one
compared step; the batch-dependent linear kernel changes a row's bits only inside a native call of
two or more rows (alone, and in the ordered twin, it is the real kernel). A run where no such call
happened -- e.g. GLM with ``native_window=1``, where every row falls back to ordered -- reports
that control as not applicable instead of "not caught".
"""
from __future__ import annotations

import dataclasses
from typing import List

import contextlib

from ds4t.exactness.harness import Report, Scenario, plant, run_scenario

KINDS = ("ulp", "batch-dependent")
TP_KINDS = ("size-dependent-reduction",)
"""Under tensor parallel (``model.tp``) also: the partial-sum reduction made batch-dependent
(:mod:`ds4t.parallel.controls`: partials of messages over one row travel in bf16)."""


def kinds_for(model) -> tuple:
    """The controls that apply to ``model``: KINDS, plus TP_KINDS for a tensor-parallel model."""
    return KINDS + (TP_KINDS if getattr(model, "tp", None) is not None else ())


def _plant(kind: str):
    if kind in TP_KINDS:
        from ds4t.parallel.controls import plant as plant_reduction

        return plant_reduction("size-dependent")
    return plant(kind) if kind in KINDS else contextlib.nullcontext()


@dataclasses.dataclass
class ControlResult:
    kind: str          # the planted deviation, one of KINDS
    report: Report     # the harness run with the deviation planted

    @property
    def applicable(self) -> bool:
        """Whether the run could show the deviation at all."""
        if self.kind in ("batch-dependent",) + TP_KINDS:
            return self.report.native_batches > 0
        return bool(self.report.paths)

    @property
    def caught(self) -> bool:
        return self.report.mismatches > 0

    @property
    def ok(self) -> bool:
        """Caught, or not applicable (the run had nothing for it to show in)."""
        return self.caught or not self.applicable

    @property
    def verdict(self) -> str:
        if self.caught:
            return "caught"
        if not self.applicable:
            return "not applicable (no native call of 2+ rows)" if self.kind != "ulp" else \
                "not applicable (no step ran)"
        return "NOT CAUGHT"


def run_controls(model, sc: Scenario, mode: str = "native", kinds=None) -> List[ControlResult]:
    """Run ``sc`` once per planted deviation in ``kinds`` (default: :func:`kinds_for` the model); one
    ControlResult each."""
    out = []
    for kind in kinds if kinds is not None else kinds_for(model):
        if kind not in KINDS + TP_KINDS:
            raise ValueError(f"unknown control {kind!r}: use one of {KINDS + TP_KINDS}")
        with _plant(kind):
            out.append(ControlResult(kind, run_scenario(model, sc, mode=mode)))
    return out
