"""Shared helpers for kernel tests. NaN poisoning and the row batch-invariance property live in
:mod:`ds4t.testing` (shipped, for researchers' own tests too) and are re-exported here."""
from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from ds4t.kernels.moe import _program_tile
from ds4t.testing import assert_rows_invariant, poisoned  # noqa: F401


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


class Launches:
    """Counts launches of a Triton kernel (``kernel[grid](...)``) and keeps each one's keyword arguments:
    monkeypatch a module's kernel with it to see what a launch passed."""

    def __init__(self, kernel):
        self.kernel, self.n, self.kwargs = kernel, 0, []

    def __getitem__(self, grid):
        self.n += 1
        launch = self.kernel[grid]

        def call(*args, **kwargs):
            self.kwargs.append(kwargs)
            return launch(*args, **kwargs)
        return call


def poison_empty(patch, keep=None) -> list:
    """``torch.empty`` replaced, through ``patch`` (a pytest MonkeyPatch), by NaN-filled float and zeroed
    integer buffers: a kernel that leaves part of a launcher's buffer unwritten then shows, where a freed
    buffer's old values (the caching allocator hands the same memory back) could stand in for the missing
    ones. Returns a list that collects the float buffers whose shape ``keep`` (a predicate on the shape
    tuple) accepts, e.g. a launcher's scratch partials, to see which parts a kernel wrote."""
    empty, kept = torch.empty, []

    def nan_empty(*a, dtype=None, **kw):
        t = empty(*a, dtype=dtype, **kw)
        t.fill_(float("nan") if t.is_floating_point() else 0)
        if keep is not None and t.is_floating_point() and keep(tuple(t.shape)):
            kept.append(t)
        return t

    patch.setattr(torch, "empty", nan_empty)
    return kept


@triton.jit
def half_row_tiles(bounds_ptr, E, BE: tl.constexpr, BM: tl.constexpr):
    """A broken :func:`ds4t.kernels.moe._program_tile` for negative controls (swapped in where the
    interpreter looks the helper up): every row tile runs its first BM / 2 pairs only."""
    e, start, end = _program_tile(bounds_ptr, E, BE, BM)
    return e, start, tl.minimum(end, start + BM // 2)
