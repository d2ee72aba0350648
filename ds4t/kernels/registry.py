"""Self-checks that ``ds4t check`` runs: every kernel against its reference on this device."""
from __future__ import annotations

import dataclasses
from typing import Callable, List

import torch


@dataclasses.dataclass
class CheckResult:
    kernel: str          # e.g. "linear bf16"
    shapes: str          # e.g. "B=5 K=96 N=200"
    max_err: float       # max |kernel - reference| (relative where stated in ``note``)
    tol: float           # the tolerance max_err was held to
    batch_invariant: bool  # row i alone == row i among the batch, bitwise
    ms: float            # median kernel time in milliseconds on this device
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.max_err <= self.tol and self.batch_invariant


_CHECKS: List[Callable[[torch.device], List[CheckResult]]] = []


def register_check(fn: Callable[[torch.device], List[CheckResult]]):
    """Register ``fn(device) -> [CheckResult]``; used as a decorator in each kernel module."""
    _CHECKS.append(fn)
    return fn


def all_checks() -> List[Callable[[torch.device], List[CheckResult]]]:
    # Importing the kernel modules registers their checks.
    import importlib
    import pkgutil

    import ds4t.kernels as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name not in ("registry",):
            importlib.import_module(f"ds4t.kernels.{info.name}")
    return list(_CHECKS)


def rows_invariant(run: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> bool:
    """True when ``run`` on all rows of x gives, for each row, the bits it gives on that row alone.

    ``run`` maps a batch [B, ...] to outputs [B, ...]; rows are compared with torch.equal.
    """
    full = run(x)
    for i in range(x.shape[0]):
        alone = run(x[i : i + 1].contiguous())
        if not torch.equal(alone[0], full[i]):
            return False
    return True
