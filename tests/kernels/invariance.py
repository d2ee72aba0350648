"""Shared helpers for kernel tests. NaN poisoning and the row batch-invariance property live in
:mod:`ds4t.testing` (shipped, for researchers' own tests too) and are re-exported here."""
from __future__ import annotations

import contextlib

from ds4t.testing import assert_rows_invariant, poisoned  # noqa: F401


@contextlib.contextmanager
def launcher_path(module, rows_path: bool):
    """Run ``module``'s interpreter-only rows path (``rows_path`` True, honoured only in the
    interpreter) or its GPU launchers, restoring the module's choice afterwards."""
    from ds4t.backend import INTERPRET

    saved = module.ROWS_PATH
    saved_list = getattr(module, "DEVICE_EXPERT_LIST", None)
    module.ROWS_PATH = bool(rows_path) and INTERPRET
    if saved_list is not None:   # the GPU launchers find their experts on the device
        module.DEVICE_EXPERT_LIST = not module.ROWS_PATH
    try:
        yield
    finally:
        module.ROWS_PATH = saved
        if saved_list is not None:
            module.DEVICE_EXPERT_LIST = saved_list
