"""Shared helpers for kernel tests. NaN poisoning and the row batch-invariance property live in
:mod:`ds4t.testing` (shipped, for researchers' own tests too) and are re-exported here."""
from __future__ import annotations

import contextlib

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
