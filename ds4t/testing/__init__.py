"""Test helpers for batch-invariant kernels and exact native paths, for ds4t and your own repository.

    from ds4t.testing import poisoned, assert_rows_invariant, assert_native_exact

- :func:`poisoned`: an output buffer full of NaN, so elements a kernel fails to write fail the test.
- :func:`assert_rows_invariant`: row i computed among a batch equals row i computed alone, bitwise.
- :func:`assert_native_exact`: a model's native path against the ordered fallback, bit for bit, plus
  the negative control that shows the check can fail.

The pytest plugin (:mod:`ds4t.testing.plugin`, entry point ``pytest11``) adds the fixtures
``ds4t_device``, ``on_kernel_device`` and ``ds4t_model`` and a hypothesis profile without deadline
(kernels in the Triton interpreter are slow). Hypothesis is needed only by the plugin and by
:mod:`ds4t.exactness.strategies` (the ``test`` extra).
"""
from __future__ import annotations

from typing import Callable, Dict, List, Sequence

import torch

import ds4t  # noqa: F401  (selects the kernel backend before triton is imported)

TINY_PRESETS = ("tiny-qwen", "tiny-deepseek", "tiny-glm", "tiny-llama")   # fp32, CPU-sized: one per model family
HYPOTHESIS_PROFILE = "ds4t"


def poisoned(shape, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """A fresh tensor of ``shape`` and ``dtype`` full of NaN, to pass as a kernel's ``out=``:
    elements the kernel fails to write stay NaN and fail the comparison.
    ``device=None``: torch's default device (the kernels' device under ``on_kernel_device``)."""
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def assert_rows_invariant(run: Callable[[Sequence[int]], torch.Tensor], batch_rows: Sequence[int], i: int) -> None:
    """Row ``batch_rows[i]`` computed among ``batch_rows`` equals it computed alone, bitwise.

    ``run(rows)`` evaluates the kernel on the given subset of a pool of prepared rows (in that
    order) and returns outputs with one leading entry per row (any dtype, shape [len(rows), ...]).
    Drive it with hypothesis (B in 1..33, random order) to cover batch sizes and positions.
    """
    batch_rows = list(batch_rows)
    if not 0 <= i < len(batch_rows):
        raise IndexError(f"assert_rows_invariant: i={i} is outside batch_rows of length {len(batch_rows)}")
    full = run(batch_rows)
    alone = run([batch_rows[i]])
    if full.shape[0] != len(batch_rows) or alone.shape[0] != 1:
        raise ValueError(f"assert_rows_invariant: run(rows) must return one leading entry per row; got "
                         f"{tuple(full.shape)} for {len(batch_rows)} rows and {tuple(alone.shape)} for 1")
    assert torch.equal(full[i], alone[0]), (
        f"row {batch_rows[i]} differs between batch of {len(batch_rows)} and alone: "
        f"max diff {(full[i].float() - alone[0].float()).abs().max().item()}"
    )


def kernel_ops() -> Dict[str, List[str]]:
    """Kernel module name -> the ops it defines: every public launcher ``name`` in ``ds4t/kernels/``
    with a plain-torch reference ``name_ref`` beside it (the naming rule of docs/kernel-conventions.md)."""
    import importlib
    import pkgutil

    import ds4t.kernels as pkg

    out = {}
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"ds4t.kernels.{info.name}")
        ops = sorted(n for n in vars(mod) if not n.startswith("_") and not n.endswith("_ref")
                     and callable(getattr(mod, n)) and callable(getattr(mod, n + "_ref", None)))
        if ops:
            out[info.name] = ops
    return out


def assert_native_exact(model, scenario=None, *, mode: str = "native", negative_control: bool = True,
                        sessions: int = 3, steps: int = 3, seed: int = 0):
    """Run ``scenario`` (default: a small random one) twice -- every step ordered, and in ``mode`` --
    and assert every row's float32 logits and every session's state are bitwise equal and that
    the rows expected native ran natively. With ``negative_control``, then plant a 1-ulp change
    and a batch-dependent linear kernel and assert the same check catches each (a control that
    has nothing to catch -- no native call of 2+ rows -- fails the assertion too: the scenario
    proves nothing about batching). Returns the :class:`ds4t.exactness.harness.Report`.
    """
    import random

    from ds4t.exactness.controls import run_controls
    from ds4t.exactness.harness import random_scenario, run_scenario

    if scenario is None:
        if sessions < 2 or steps < 1:
            raise ValueError(f"assert_native_exact: need sessions >= 2 and steps >= 1 (got {sessions}, {steps})")
        scenario = random_scenario(random.Random(seed), model.vocab_size, sessions, steps, max_prompt=8,
                                   max_ctx=8 + steps + 8)
    rep = run_scenario(model, scenario, mode=mode)
    assert rep.ok, (f"native path of {model.name} is not exact: {rep.mismatches} mismatches "
                    f"(first: {rep.first_mismatch}), {rep.native_missing} rows expected native ran ordered")
    if negative_control:
        for c in run_controls(model, scenario, mode=mode):
            assert c.caught, f"negative control {c.kind!r} {c.verdict} on {model.name}: the check cannot fail here"
    return rep


def assert_prefill_chunk_invariant(model, prompt: Sequence[int], chunks: Sequence[int] = (1, 17, 64),
                                   max_ctx: int = 64) -> None:
    """A prompt's logits (every position, float32) and final state are bitwise the same for every
    prefill chunk size in ``chunks`` as for the whole prompt at once, and equal to feeding it one
    token per step natively in a batch beside another session that decodes. (What exact speculative
    decoding and chunked serving rest on; the check is :func:`ds4t.exactness.chunks.run_chunk_check`.)
    On a GPU, a prompt of at least 128 tokens (and ``max_ctx`` to match) also covers the bigger row tiles
    that long prefill chunks run (``ds4t.kernels.linear.LINEAR_ROW_TILES``)."""
    from ds4t.exactness.chunks import run_chunk_check

    rep = run_chunk_check(model, prompt, chunks, max_ctx=max_ctx)
    assert rep.mismatches == 0, f"{rep.first_mismatch} ({rep.mismatches} mismatches)"
    assert not rep.paths.get("ordered"), f"token by token: rows fell back to ordered: {rep.paths}"


__all__ = ["poisoned", "assert_rows_invariant", "assert_native_exact", "assert_prefill_chunk_invariant", "kernel_ops", "TINY_PRESETS", "HYPOTHESIS_PROFILE"]
