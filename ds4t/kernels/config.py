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
import importlib
import json
import pkgutil
from typing import Callable, Dict, Generic, Hashable, List, Optional, TypeVar

from ds4t.backend import INTERPRET

C = TypeVar("C")


def differs_only_in(entry, base, fields) -> bool:
    """Whether config ``entry`` equals ``base`` but for ``fields``: how a table checks that an entry for some
    launches (a rows or few-rows entry) changes only what cannot change a row's bits."""
    return dataclasses.replace(entry, **{f: getattr(base, f) for f in fields}) == base


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
    caches: List[Callable] = dataclasses.field(default_factory=list)
    """lru-cached lookups built on this table (e.g. ``linear.linear_config``): cleared when it changes."""

    def clear_caches(self) -> None:
        for fn in self.caches:
            fn.cache_clear()

    def __call__(self, *key) -> C:
        if INTERPRET:
            return self.interp_rule(*key)
        return self.gpu_config(*key)

    def gpu_config(self, *key) -> C:
        """The GPU's config for ``key`` on either backend: its measured entry, else ``gpu_rule(*key)`` (a one-part
        key is stored bare)."""
        cfg = self.gpu.get(key[0] if len(key) == 1 else key)
        return cfg if cfg is not None else self.gpu_rule(*key)

    def gpu_entries(self) -> Callable[..., Optional[C]]:
        """The measured GPU entries alone, as a rule for :meth:`forced` (None for a key without one; keys looked up
        as :meth:`__call__` looks them up): the GPU's table on either backend. A copy taken now, so
        ``table.forced(table.gpu_entries())`` works although :meth:`forced` empties ``gpu``."""
        entries = dict(self.gpu)
        return lambda *key: entries.get(key[0] if len(key) == 1 else key)

    @contextlib.contextmanager
    def with_fields(self, fields: dict, where: Callable[..., bool]):
        """Inside the block every GPU key for which ``where(*key)`` holds gets its config (entry or rule) with
        ``fields`` replaced; other keys keep theirs. How a benchmark times one field across a whole table, e.g.
        ``LINEAR_CONFIGS.with_fields({"tma": True}, lambda *key: torch.float8_e4m3fn in key)``. The interpreter
        keeps its own rule (as :func:`overridden`). Unknown fields raise on the first lookup."""
        table = ConfigTable(self.kernel, dict(self.gpu), self.gpu_rule, self.interp_rule, self.source)

        def patched(*key):
            cfg = table.gpu_config(*key)
            return dataclasses.replace(cfg, **fields) if cfg is not None and where(*key) else cfg

        with self._rules(patched, self.interp_rule):
            yield self

    @contextlib.contextmanager
    def forced(self, rule: Callable[..., C]):
        """Inside the block every key gets ``rule(*key)``, on either backend (tests run the GPU's
        tiles in the interpreter this way)."""
        with self._rules(rule, rule):
            yield self

    @contextlib.contextmanager
    def _rules(self, gpu_rule: Callable[..., C], interp_rule: Callable[..., C]):
        """No GPU entries and these two rules inside the block; the table as it was after it (also on error)."""
        saved = self.gpu, self.gpu_rule, self.interp_rule
        self.gpu, self.gpu_rule, self.interp_rule = {}, gpu_rule, interp_rule
        self.clear_caches()
        try:
            yield
        finally:
            self.gpu, self.gpu_rule, self.interp_rule = saved
            self.clear_caches()


def tables() -> Dict[str, ConfigTable]:
    """Every :class:`ConfigTable` of the ``ds4t.kernels`` modules, by its ``kernel`` name."""
    import ds4t.kernels

    out = {}
    for info in pkgutil.iter_modules(ds4t.kernels.__path__):
        if not info.ispkg:
            for v in vars(importlib.import_module(f"ds4t.kernels.{info.name}")).values():
                if isinstance(v, ConfigTable):
                    out[v.kernel] = v
    return out


def _key(key):
    """A JSON key as the tables hold it: a list becomes a tuple (one element: the element itself) and
    "torch.<dtype>" strings become that dtype."""
    import torch

    def one(v):
        if isinstance(v, str) and v.startswith("torch."):
            dt = getattr(torch, v[len("torch."):], None)
            if not isinstance(dt, torch.dtype):
                raise ValueError(f"config override key: {v!r} is not a torch dtype")
            return dt
        return v

    if isinstance(key, list):
        return one(key[0]) if len(key) == 1 else tuple(one(v) for v in key)
    return one(key)


@contextlib.contextmanager
def overridden(spec):
    """GPU entries replaced for the duration of the block, from ``spec`` (a dict, or a path to a JSON file
    holding one): ``{table kernel name: [{"key": [...], "fields": {...}}, ...]}``. Each entry's config is
    the table's current one for ``key`` (entry or rule) with ``fields`` replaced, e.g.
    ``{"moe": [{"key": ["gate_up", "fp8"], "fields": {"split": 2}}]}`` -- how a benchmark times a
    candidate table entry without editing the code (``bench/bench_fp8.py --configs``). A table of tile
    tuples takes ``"tiles": [{fields}, ...]`` instead, each tile the current first one with those fields
    (``"tiles": []``: none), e.g. ``{"linear_rows": [{"key": [7168, 256, "torch.float32"], "tiles": []}]}``. Keys hold
    "torch.bfloat16"-style strings for dtypes. The interpreter reads its own rule, so this changes GPU
    launches only. Unknown tables or fields raise before anything changes."""
    if not isinstance(spec, dict):
        with open(spec) as f:
            spec = json.load(f)
    known = tables()
    plan = []
    for name, entries in spec.items():
        if name not in known:
            raise KeyError(f"no config table {name!r}; tables: {sorted(known)}")
        table = known[name]
        for entry in entries:
            key = _key(entry["key"])
            base = table.gpu_config(*(key if isinstance(key, tuple) else (key,)))
            if base is None:
                raise KeyError(f"config table {name!r} has no entry or rule for key {entry['key']!r}")
            if "tiles" in entry:   # a table of tile tuples (linear_rows): each item the first tile with its fields
                if not isinstance(base, tuple) or (entry["tiles"] and not base):
                    raise ValueError(f"config table {name!r}: 'tiles' needs a table of tile tuples with a tile "
                                     f"for key {entry['key']!r} to replace fields of")
                plan.append((table, key, tuple(dataclasses.replace(base[0], **f) for f in entry["tiles"])))
            else:
                plan.append((table, key, dataclasses.replace(base, **entry.get("fields", {}))))
    saved = [(t, dict(t.gpu)) for t in {id(t): t for t, _, _ in plan}.values()]
    try:
        for table, key, cfg in plan:
            table.gpu[key] = cfg
            table.clear_caches()
        yield plan
    finally:
        for table, gpu in saved:
            table.gpu.clear()
            table.gpu.update(gpu)
            table.clear_caches()
