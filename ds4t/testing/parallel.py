"""Jobs for :class:`ds4t.parallel.workers.RankPool` (the tensor-parallel tests and checks): each runs on
every rank of the pool, SPMD, and returns something picklable (CPU tensors, dicts).

    with RankPool(2) as pool:
        ranks = pool.run(tp_logits, "tiny-qwen", [1, 2, 3], 4)   # [rank 0's logits, rank 1's]
"""
from __future__ import annotations

import random
from typing import Dict, Sequence

import torch

import ds4t
from ds4t.parallel.workers import CACHE


def tp_model(path_or_preset: str, **options):
    """``ds4t.load(path_or_preset, tp=<world size>, **options)``, loaded once per rank and kept."""
    import torch.distributed as dist

    key = (path_or_preset, tuple(sorted(options.items())))
    if key not in CACHE:
        CACHE[key] = ds4t.load(path_or_preset, tp=dist.get_world_size(), **options)
    return CACHE[key]


def reference_logits(model, prompt: Sequence[int], steps: int) -> torch.Tensor:
    """fp32 [len(prompt) + steps, vocab]: the prompt's logits (every position), then ``steps`` decode
    steps run natively beside a second session. The same calls on any model (tp or not). The decode
    tokens are fixed (teacher-forced), not argmax: two sum orders that pick different argmaxes at a
    near-tie would otherwise compare the logits of different continuations."""
    a, b = model.new_session(len(prompt) + steps + 8), model.new_session(len(prompt) + steps + 8)
    try:
        rows = [a.prefill(list(prompt), all_logits=True)]
        b.prefill([5, 6])
        for j in range(steps):
            ta, tb = prompt[j % len(prompt)], prompt[(j + 1) % len(prompt)]
            res = ds4t.eval_batch([ds4t.DecodeItem(a, ta), ds4t.DecodeItem(b, tb)], mode="native")
            rows.append(res.logits[:1])
        return torch.cat(rows).cpu()
    finally:
        a.close()
        b.close()


def tp_logits(path_or_preset: str, prompt: Sequence[int], steps: int, **options) -> torch.Tensor:
    return reference_logits(tp_model(path_or_preset, **options), prompt, steps)


def tp_native_exact(preset: str, sessions: int = 3, steps: int = 3, seed: int = 0, mode: str = "native",
                    **options) -> Dict[str, object]:
    """:func:`ds4t.testing.assert_native_exact` (with its negative controls) on this rank's shard."""
    from ds4t.testing import assert_native_exact

    rep = assert_native_exact(tp_model(preset, **options), mode=mode, sessions=sessions, steps=steps, seed=seed)
    return {"rows": rep.rows, "states": rep.states, "paths": dict(rep.paths), "native_batches": rep.native_batches}


def tp_chunk_invariant(preset: str, prompt: Sequence[int], chunks=(1, 5, 64), **options) -> bool:
    from ds4t.testing import assert_prefill_chunk_invariant

    assert_prefill_chunk_invariant(tp_model(preset, **options), list(prompt), chunks=chunks)
    return True


def tp_planted_reduction(preset: str, kind: str, seed: int = 1, **options) -> Dict[str, int]:
    """Run a small native scenario with a planted reduction (:mod:`ds4t.parallel.controls`); the harness's
    mismatches and how many native calls held 2+ rows."""
    from ds4t.exactness.harness import random_scenario, run_scenario
    from ds4t.parallel.controls import plant

    model = tp_model(preset, **options)
    sc = random_scenario(random.Random(seed), model.vocab_size, 3, 2, max_prompt=6, max_ctx=24)
    with plant(kind):
        rep = run_scenario(model, sc, mode="native")
    return {"mismatches": rep.mismatches, "native_batches": rep.native_batches}


def tp_state_shapes(preset: str, **options) -> Dict[str, tuple]:
    """Per-slot shape of every state tensor of this rank's shard."""
    m = tp_model(preset, **options)
    return {k: tuple(v.shape) for k, v in m.pool.specs.items()}


def tp_reduce_rows(rows: int, dim: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """The reduction itself on random partials (different per rank): the sum of all ``rows`` rows at
    once and of each row alone, to compare bitwise (batch invariance of the collective)."""
    import torch.distributed as dist

    from ds4t.parallel.comm import Collectives

    comm = Collectives(None, dist.get_world_size())
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    p = torch.randn(rows, dim, generator=g) * torch.logspace(-3, 3, dim)   # magnitudes that round
    whole = comm.sum(p)
    alone = torch.cat([comm.sum(p[i:i + 1]) for i in range(rows)])
    return {"whole": whole, "alone": alone, "partial": p}


def tp_parameters(preset: str, **options) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in tp_model(preset, **options).parameters().items()}
