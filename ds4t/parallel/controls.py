"""The negative control of the collectives: reductions whose result depends on the batch, planted to
show that the exactness checks catch them under tensor parallel (a check that cannot fail proves
nothing; docs/design.md, "Negative control").

- ``"size-dependent"``: partials of a message of more than one row travel in bf16, as all-reduces that
  compress large messages do (vLLM's QuickReduce quantizes above a size threshold). One row alone
  (the ordered fallback) is exact; the same row in a batch is not: caught at any tp.
- ``"reverse-order"``: messages of more than one row are summed in reverse rank order, as an
  algorithm switch by message size does (ring vs tree). Two addends commute exactly in IEEE
  arithmetic, so at tp = 2 this changes no bit (:data:`ORDER_NEEDS`): applicable from tp = 3.
"""
from __future__ import annotations

import contextlib

import torch

from ds4t.parallel.comm import Collectives, fixed_order_sum, override_reduction

KINDS = ("size-dependent", "reverse-order")
ORDER_NEEDS = 3
"""Ranks a reduction-order difference needs to change a bit (x + y == y + x exactly)."""


def size_dependent(comm: Collectives, partial: torch.Tensor) -> torch.Tensor:
    if partial.shape[0] > 1:
        partial = partial.to(torch.bfloat16).float()
    return fixed_order_sum(comm, partial)


def reverse_order(comm: Collectives, partial: torch.Tensor) -> torch.Tensor:
    if partial.shape[0] == 1:
        return fixed_order_sum(comm, partial)
    parts = comm.all_gather(partial.float())
    out = parts[-1].clone()
    for k in range(comm.size - 2, -1, -1):
        out.add_(parts[k])
    return out


def applicable(kind: str, size: int) -> bool:
    """Whether planting ``kind`` at tp = ``size`` can change a bit at all."""
    return kind != "reverse-order" or size >= ORDER_NEEDS


@contextlib.contextmanager
def plant(kind: str):
    """Every tensor-parallel reduction of this process uses the planted ``kind`` inside the block (each
    rank must plant the same)."""
    fns = {"size-dependent": size_dependent, "reverse-order": reverse_order}
    if kind not in fns:
        raise ValueError(f"unknown planted reduction {kind!r}: use one of {KINDS}")
    with override_reduction(fns[kind]):
        yield
