"""Shared helpers for kernel tests: NaN poisoning and the row batch-invariance property."""
from __future__ import annotations

import contextlib
from typing import Callable, Sequence

import torch


def poisoned(shape, dtype=torch.float32, device=None) -> torch.Tensor:
    """A fresh tensor full of NaN: elements a kernel fails to write stay NaN and fail the test.
    ``device=None``: torch's default device (the kernels' device under ``on_kernel_device``)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_rows_invariant(run: Callable[[Sequence[int]], torch.Tensor], batch_rows: Sequence[int], i: int) -> None:
    """Row ``batch_rows[i]`` computed among ``batch_rows`` equals it computed alone, bitwise.

    ``run(rows)`` evaluates the kernel on the given subset of a pool of prepared rows (in that
    order) and returns outputs with one leading entry per row.
    """
    full = run(list(batch_rows))
    alone = run([batch_rows[i]])
    assert torch.equal(full[i], alone[0]), (
        f"row {batch_rows[i]} differs between batch of {len(batch_rows)} and alone: "
        f"max diff {(full[i].float() - alone[0].float()).abs().max().item()}"
    )


@contextlib.contextmanager
def launcher_path(module, rows_path: bool):
    """Run the ops of kernel ``module`` with their interpreter twins (``rows_path`` True, honoured
    only in the interpreter: variant ``"interp"``) or with the GPU's launches (variant ``"gpu"``),
    restoring the previous selection afterwards."""
    from ds4t.backend import INTERPRET
    from ds4t.kernels.registry import GPU, INTERP, ops_with_variants, use_variants

    family = module.__name__.rsplit(".", 1)[-1]
    with_variants = ops_with_variants(family)
    if not with_variants:
        raise ValueError(f"kernel module {module.__name__} has no op with launch variants")
    which = INTERP if rows_path and INTERPRET else GPU
    with use_variants({o.name: which for o in with_variants}):
        yield
