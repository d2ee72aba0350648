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
