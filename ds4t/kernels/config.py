"""Launch constants: one idiom for every kernel that has them.

A kernel module declares a frozen dataclass of its launch constants and one :class:`ConfigTable`:
GPU entries measured on a GPU and keyed on the weight shapes (or the op's shape key), a rule for
GPU keys not in the table, and the interpreter's rule (few, big programs: the interpreter pays per
program and per op). The key never holds the batch size: a row's bits must not depend on it.
Next to each table, the ``source`` names the ``bench/results`` file whose sweep chose its entries.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Dict, Generic, Hashable, TypeVar

from ds4t.backend import INTERPRET

C = TypeVar("C")


def launch_kwargs(cfg) -> dict:
    """``num_warps`` / ``num_stages`` of a config as Triton launch keywords (None: Triton's default)."""
    return {k: v for k in ("num_warps", "num_stages") if (v := getattr(cfg, k, None)) is not None}


@dataclasses.dataclass
class ConfigTable(Generic[C]):
    """``table(*key) -> C``: the measured GPU entry for ``key``, else ``gpu_rule(*key)``; in the
    interpreter always ``interp_rule(*key)``."""
    kernel: str
    gpu: Dict[Hashable, C]
    gpu_rule: Callable[..., C]
    interp_rule: Callable[..., C]
    source: str   # the bench/results file (or the reason) behind the GPU entries

    def __call__(self, *key) -> C:
        if INTERPRET:
            return self.interp_rule(*key)
        key_ = key[0] if len(key) == 1 else key
        cfg = self.gpu.get(key_)
        return cfg if cfg is not None else self.gpu_rule(*key)

    @contextlib.contextmanager
    def forced(self, rule: Callable[..., C]):
        """Inside the block every key gets ``rule(*key)``, on either backend (tests run the GPU's
        tiles in the interpreter this way)."""
        saved = self.gpu, self.gpu_rule, self.interp_rule
        self.gpu, self.gpu_rule, self.interp_rule = {}, rule, rule
        try:
            yield self
        finally:
            self.gpu, self.gpu_rule, self.interp_rule = saved
