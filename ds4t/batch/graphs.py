"""CUDA graphs of pure decode steps: captured once per batch size, then replayed.

A decode step launches hundreds of small kernels; on a GPU their launch cost, not the bytes
they move, sets the step time at small N. The step has no host synchronisation (routing,
lengths and slots stay on the device), so it can be captured. For each key a model gives
(:meth:`ds4t.models.base.Model.graph_key`: the row count, plus any option that changes which
kernels run) the first step runs eagerly on a static metadata buffer and is then captured
reading that buffer; later steps copy their metadata into it and replay. Replay runs the same
kernels on the same addresses, so its bits equal the eager step's (tests/batch/test_cuda_graphs.py).
The host -> device copy of the metadata is the graph's first node, reading a pinned host buffer the
step fills: at N = 1 the host work before the GPU starts is part of a step's latency, and a pinned
staging tensor plus a copy call per step cost 0.7-2.7 % of an N = 1 step on the H200
(bench/results/2026-12-02-h200-n1-launches.md). An event
recorded right after that node tells the host when the buffer may be refilled, so back-to-back
replays of one graph (the ordered path's sessions) never read the next step's metadata.

Only whole decode batches (one token per session) are captured, at their exact size: padding
to a bucket would make padded rows pick MoE experts and read weights no session needs.
A graph reads the weights and state at the addresses it was captured with: copying new values
into them is fine, but replacing a weight tensor by another object needs
``graphs_for(model).clear()`` (growing the state pool is noticed and clears them automatically).
Steps run eagerly while a kernel override (``ds4t.kernels.override``) or a non-default launch
variant is active, unless the caller opts in to capturing overridden ops with
:func:`capture_overrides` (a benchmark's plain-torch twin of the kernels, bench/twin.py): graphs
are then keyed by the active overrides too, so a step never replays another set of functions'
kernels. Everything here is inert on the CPU. ``DS4T_CUDA_GRAPHS=0`` turns graphs off;
``DS4T_CUDA_GRAPH_MAX_ROWS`` (default 64) caps the batch sizes captured.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
import weakref
from collections.abc import Sequence

import torch

from ds4t.kernels.registry import dispatch_modified, override_key
from ds4t.step import StepBatch, to_device

_suspended = 0
_capture_overrides = 0


@contextlib.contextmanager
def suspended():
    """Run every step eagerly inside this block (e.g. while a test patches a kernel: a graph
    captured before would replay the unpatched kernels)."""
    global _suspended
    _suspended += 1
    try:
        yield
    finally:
        _suspended -= 1


@contextlib.contextmanager
def capture_overrides():
    """Explicit opt-in: inside this block, steps are captured and replayed as CUDA graphs even while
    kernel overrides (``ds4t.kernels.override``) are active. Off by default, because an override may
    synchronise with the host or make shapes depend on data, which a graph cannot hold; the caller
    vouches that every active overriding function is graph-safe (no ``.item()``, no host sync, no
    data-dependent shapes). Each graph is keyed by :func:`ds4t.kernels.registry.override_key` as
    well, so graphs captured with one set of functions never replay for another (or for the ds4t
    kernels). Non-default launch variants and ``recording()`` still turn graphs off."""
    global _capture_overrides
    _capture_overrides += 1
    try:
        yield
    finally:
        _capture_overrides -= 1


def enabled_for(model) -> bool:
    """Graphs apply: a CUDA model, not suspended or turned off, and no kernel override (outside
    :func:`capture_overrides`) or non-default launch variant active (a graph replays the kernels it
    was captured with)."""
    return (model.device.type == "cuda" and not _suspended and getattr(model, "cuda_graphs", True)
            and os.environ.get("DS4T_CUDA_GRAPHS", "1") != "0"
            and not dispatch_modified(overrides=not _capture_overrides))


def graph_key(model, rows: int):
    """The key a decode step of ``rows`` sessions is captured under: the model's
    :meth:`~ds4t.models.base.Model.graph_key`, plus the active overrides when there are any (only
    possible inside :func:`capture_overrides`); None when the step cannot be captured."""
    key = model.graph_key(rows)
    if key is None or not _capture_overrides:   # outside capture_overrides an override turns graphs off
        return key
    ok = override_key()
    return (key, ok) if ok else key


def max_rows() -> int:
    return int(os.environ.get("DS4T_CUDA_GRAPH_MAX_ROWS", "64"))


@dataclasses.dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    host: torch.Tensor      # pinned host input: the step's metadata (StepBatch.host_meta layout)
    meta: torch.Tensor      # its device copy, the graph's first node; held here because the graph
                            # does not keep it alive (freed, its memory would go to other tensors)
    logits: torch.Tensor    # static device output
    copied: torch.cuda.Event  # an event node right after the copy: ``host`` is free once it fired

    host_np: object = None  # ``host`` as a numpy array (shared memory): the step's metadata is written into it

    def replay(self, segments) -> torch.Tensor:
        self.copied.synchronize()   # an earlier replay still queued would read ``host`` when it runs
        if self.host_np is None:
            self.host_np = self.host.numpy()
        StepBatch.decode_meta(segments, out=self.host_np)
        self.graph.replay()
        return self.logits.clone()


@dataclasses.dataclass
class GraphStats:
    captures: int = 0
    replays: int = 0
    eager: int = 0      # steps run eagerly (first step of a key, uncapturable keys)
    failures: int = 0   # keys whose capture failed (run eagerly from then on)


class StepGraphs:
    """The captured decode steps of one model (see the module docstring)."""

    def __init__(self, model):
        self._model = weakref.ref(model)   # the registry below must not keep a model alive
        self.graphs: dict[tuple, _Captured] = {}
        self.failed: set = set()
        self.stats = GraphStats()
        self._pool = None
        self._generation = model.pool.generation

    @property
    def model(self):
        return self._model()

    def clear(self) -> None:
        """Drop every graph (the state pool moved, or weights changed)."""
        self.graphs.clear()
        self.failed.clear()
        self._pool = None
        self._generation = self.model.pool.generation

    def step(self, segments: Sequence[tuple[int, Sequence[int], int]]) -> torch.Tensor:
        """One decode step (every segment one token): logits fp32 [len(segments), vocab]."""
        model = self.model
        if model.pool.generation != self._generation:
            self.clear()
        n = len(segments)
        key = graph_key(model, n)
        cap = self.graphs.get(key) if key is not None else None
        if cap is not None:   # the common case first: nothing built on the host but the metadata words
            self.stats.replays += 1
            return cap.replay(segments)
        meta, n, o, segs, _ = StepBatch.host_meta(segments)
        if key is None or key in self.failed or n > max_rows():
            self.stats.eager += 1
            return model.forward(StepBatch.from_meta(to_device(meta, model.device), n, o, segs))
        # First step of this key: run it for real on the static buffer (compiling every kernel
        # it needs), then record the same launches, the copy from the pinned host buffer first.
        host = meta.pin_memory()
        static = to_device(host, model.device)
        copied = torch.cuda.Event(external=True)   # external: recorded inside the graph, it is a node
        copied.record()
        logits = model.forward(StepBatch.from_meta(static, n, o, segs))
        self.stats.eager += 1
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                static.copy_(host, non_blocking=True)
                copied.record()
                out = model.forward(StepBatch.from_meta(static, n, o, segs))
        except Exception as e:  # a host sync or an uncapturable op: stay eager for this key
            self.failed.add(key)
            self.stats.failures += 1
            warnings.warn(f"ds4t: CUDA graph capture failed for {key} ({type(e).__name__}: {e}); running it eagerly")
            return logits
        self.graphs[key] = _Captured(graph, host, static, out, copied)
        self.stats.captures += 1
        return logits


def memory_estimate(model, max_batch: int) -> int:
    """Bytes the captured steps of batches of 1..max_batch sessions hold on to beyond one step's
    workspace: each graph keeps its static logits (fp32 [n, vocab]); intermediates share one pool. A model
    on 'meta' (a plan for a GPU that is not here) counts them as that GPU would, unless graphs are off."""
    planned = model.device.type == "meta" and getattr(model, "cuda_graphs", True) \
        and os.environ.get("DS4T_CUDA_GRAPHS", "1") != "0"
    if not (planned or enabled_for(model)):
        return 0
    top = min(max_batch, max_rows())
    return 4 * model.vocab_size * top * (top + 1) // 2


_runners: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def graphs_for(model) -> StepGraphs | None:
    """The model's StepGraphs when graphs apply (CUDA device, not disabled), else None."""
    if not enabled_for(model):
        return None
    g = _runners.get(model)
    if g is None:
        g = _runners[model] = StepGraphs(model)
    return g
