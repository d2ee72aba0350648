"""Jobs for :class:`ds4t.parallel.workers.RankPool` (the tensor-parallel tests and checks): each runs on
every rank of the pool, SPMD, and returns something picklable (CPU tensors, dicts).

    with RankPool(2) as pool:
        ranks = pool.run(tp_logits, "tiny-qwen", [1, 2, 3], 4)   # [rank 0's logits, rank 1's]
"""
from __future__ import annotations

import random
from typing import Dict, Optional, Sequence, Tuple

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


def reference_run(model, prompt: Sequence[int], steps: int, perturb: bool = False):
    """(:func:`reference_logits`, the experts the router chose: one int64 [rows, k] tensor per router call,
    each row's ids sorted). ``perturb``: every mixer / FFN output is moved by one relative fp32 ulp
    (``x (1 + 2^-23)``) before its residual add, a change the size of another summation order, on one
    device: how far *that* moves the logits is the noise floor of a TP = K vs TP = 1 comparison.

    In bf16 that floor is not small for MoE models: a sum-order change flips a bf16 rounding now and then,
    which grows through the layers to bf16 noise (~1e-3 relative), and where the router's k-th and
    (k+1)-th scores are that close, the token gets another expert: its hidden state jumps by that
    expert's weighted output and its logits by up to tens of percent of the largest (GLM-4.5's 160
    experts, top 8, weights x 2.5). Count the flips with :func:`route_differences`."""
    import contextlib

    from ds4t.kernels import override, recording
    from ds4t.kernels.norm import add_rms_norm

    def nudged(out, res, *a, **k):
        return add_rms_norm(out * (1 + 2 ** -23), res, *a, **k)

    with (override("add_rms_norm", nudged) if perturb else contextlib.nullcontext()), recording() as log:
        logits = reference_logits(model, prompt, steps)
    # A routing is one linear_router call, or, while its parts run as two calls (a router or linear override),
    # the router call inside it; never both.
    calls = [c for c in log if c.name.startswith("router_")] or [c for c in log if c.name == "linear_router"]
    routes = [torch.sort(c.output[1].long(), dim=1).values.cpu() for c in calls]
    return logits, routes


def route_differences(a, b) -> Tuple[int, int]:
    """(token-layer pairs whose expert set differs, all pairs) between the routes of two :func:`reference_run`s."""
    diff = sum(int((x != y).any(dim=1).sum()) for x, y in zip(a, b))
    return diff, sum(x.shape[0] for x in a)


def tp_logits(path_or_preset: str, prompt: Sequence[int], steps: int, **options) -> torch.Tensor:
    return reference_logits(tp_model(path_or_preset, **options), prompt, steps)


def config_source(cfg: dict, seed: int = 0):
    """The weights of the HF-style config dict ``cfg`` (any family): a preset's deterministic random draw
    (``ds4t.models.registry.preset_source``'s), as a PresetSource (``keys()``, ``get(name)``)."""
    from ds4t.models.loading import PresetSource
    from ds4t.models.registry import _families

    _, parse, expected, init = _families()[cfg["model_type"]]
    return PresetSource(expected(parse(cfg)), init, seed, origin="config " + cfg["model_type"])


def write_checkpoint(cfg: dict, directory, tensors: Optional[Dict[str, torch.Tensor]] = None, seed: int = 0) -> str:
    """An HF checkpoint directory (``config.json`` + ``model.safetensors``) of ``cfg`` (dtype float32 unless it
    names one) holding ``tensors`` (default: :func:`config_source`'s weights); returns its path. For configs
    that are no preset (a preset's structure at other sizes, a ``quantization_config``) that ``ds4t.load``
    and the rank jobs take by path."""
    import json
    import os

    from safetensors.torch import save_file

    if tensors is None:
        src = config_source(cfg, seed)
        tensors = {k: src.get(k) for k in src.keys()}
    os.makedirs(directory, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict({"dtype": "float32"}, **cfg), f)
    return str(directory)


def config_model(cfg: dict, dtype=None, tp=None, seed: int = 0):
    """A model of the HF-style config dict ``cfg`` (any family) with :func:`config_source`'s weights, on the
    CPU; ``tp``: this rank's shard. For configs that are no preset: a preset's structure at other sizes."""
    from ds4t.models.registry import _families

    cls = _families()[cfg["model_type"]][0]
    src = config_source(cfg, seed)
    src.tp = None
    if tp is not None:
        from ds4t.parallel.runtime import TensorParallel

        src.tp = TensorParallel.create(tp, None, torch.device("cpu"))
    src.fp8 = src.quantize = None
    return cls(cfg, src, torch.device("cpu"), dtype or torch.float32, name="config")


def tp_config_logits(cfg: dict, prompt: Sequence[int], steps: int, dtype=None) -> torch.Tensor:
    """:func:`reference_logits` of :func:`config_model` sharded over the pool's ranks."""
    import torch.distributed as dist

    return reference_logits(config_model(cfg, dtype, tp=dist.get_world_size()), prompt, steps)


def tp_native_exact(preset: str, sessions: int = 3, steps: int = 3, seed: int = 0, mode: str = "native",
                    negative_control: bool = True, **options) -> Dict[str, object]:
    """:func:`ds4t.testing.assert_native_exact` (with its negative controls unless told not to: they rerun the
    scenario twice) on this rank's shard."""
    from ds4t.testing import assert_native_exact

    rep = assert_native_exact(tp_model(preset, **options), mode=mode, sessions=sessions, steps=steps, seed=seed,
                              negative_control=negative_control)
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


def tp_reduce_both(rows: int, dim: int, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Both batch-invariant reductions (:func:`ds4t.parallel.comm.fixed_order_sum`, ``scattered_sum``) of the
    same random partials (different per rank, magnitudes that round), and the rank-order sum done in reverse
    (what a wrong order gives: the test's control)."""
    import torch.distributed as dist

    from ds4t.parallel.comm import Collectives, fixed_order_sum, rank_order_sum, scattered_sum

    comm = Collectives(None, dist.get_world_size())
    g = torch.Generator().manual_seed(seed * 1000 + dist.get_rank())
    p = torch.randn(rows, dim, generator=g) * torch.logspace(-3, 3, dim)
    reverse = rank_order_sum(comm.all_gather(p).flip(0))
    return {"gathered": fixed_order_sum(comm, p), "scattered": scattered_sum(comm, p), "reverse": reverse}


def tp_reduction_paths(path_or_preset: str, prompt: Sequence[int], steps: int, **options):
    """:func:`reference_logits` with the model's default reduction choice, then with the two-phase path off
    (``scatter_from = None``); each with the number of reductions that took :func:`ds4t.parallel.comm.scattered_sum`."""
    from unittest import mock

    from ds4t.parallel import comm as comm_mod

    model = tp_model(path_or_preset, **options)
    out = []
    default = model.tp.comm.scatter_from
    for scatter_from in (default, None):
        model.tp.comm.scatter_from, calls = scatter_from, []
        real = comm_mod.scattered_sum

        def counted(comm, partial, real=real, calls=calls):
            calls.append(1)
            return real(comm, partial)

        with mock.patch.object(comm_mod, "scattered_sum", counted):
            logits = reference_logits(model, prompt, steps)
        out.append({"logits": logits, "scattered": len(calls)})
    model.tp.comm.scatter_from = default
    return out


def plain_tensors(w) -> list:
    """A weight's tensors on the CPU, to compare bitwise: a float tensor, an FP8Weight's data and scale, a
    GGUFWeight's repacked bytes."""
    if isinstance(w, torch.Tensor):
        return [w.detach().cpu()]
    return [getattr(w, f).detach().cpu() for f in ("data", "scale") if getattr(w, f, None) is not None]


def tp_expert_reads(path_or_preset: str, **options) -> Dict[str, object]:
    """Load this rank's shard afresh, recording the routed experts its reader asks for: {"asked": {layer
    prefix: [expert indices]}, "experts": {layer i: the rank's w_gate / w_up / w_down tensors}}."""
    import re
    from unittest import mock

    import torch.distributed as dist

    from ds4t.models.blocks import MoEWeights
    from ds4t.models.loading import WeightReader

    asked: Dict[str, set] = {}
    real = WeightReader.stack

    def stack(self, names, **kw):
        for n in names:
            m = re.match(r"(.*)\.experts\.(\d+)\.", n)
            if m:
                asked.setdefault(m.group(1), set()).add(int(m.group(2)))
        return real(self, names, **kw)

    with mock.patch.object(WeightReader, "stack", stack):
        model = ds4t.load(path_or_preset, tp=dist.get_world_size(), **options)
    experts = {i: [plain_tensors(w) for w in (lw.ffn.w_gate, lw.ffn.w_up, lw.ffn.w_down)]
               for i, lw in enumerate(model.layers) if isinstance(lw.ffn, MoEWeights)}
    return {"asked": {k: sorted(v) for k, v in asked.items()}, "experts": experts}


def tp_plan(path_or_preset: str, slots: int, ctx: int, step_rows: int, limit: int, **options) -> Dict[str, object]:
    """This rank's memory plan (:func:`ds4t.serve.planner.plan`) for ``slots`` sessions at ``ctx`` tokens and
    steps of ``step_rows`` rows against ``limit`` bytes, its shard built on 'meta' (shapes only: any size)."""
    import torch.distributed as dist

    from ds4t.serve.planner import plan

    m = ds4t.load(path_or_preset, device="meta", tp=dist.get_world_size(), **options)
    p = plan(m, slots, ctx, step_rows, memory_limit=limit)
    return {"weights": p.weights, "per_slot": p.per_slot, "total": p.total, "fits": p.fits}


def tp_parameters(preset: str, **options) -> Dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in tp_model(preset, **options).parameters().items()}


def mtp_logits(model, prompt: Sequence[int]) -> torch.Tensor:
    """The MTP head's logits fp32 [T - 1, V] over a prompt: the main model's final hidden at every
    position p paired with token p + 1, as one chunk (the catch-up call of a speculative step). The same
    calls on any model (tp or not)."""
    from ds4t.step import SegmentSpec, StepBatch

    s = model.new_session(len(prompt) + 8)
    try:
        toks = list(prompt)
        main = StepBatch.build([SegmentSpec(s.slot, toks, 0, hidden=True)], model.device)
        model.forward(main)
        head = StepBatch.build([SegmentSpec(s.slot, toks[1:], 0, all_logits=True)], model.device)
        return model.mtp_forward(head, main.hidden[:-1]).cpu()
    finally:
        s.close()


def tp_mtp(preset: str, prompt: Sequence[int], k: int = 2, sessions: int = 3, new_tokens: int = 5, seed: int = 0,
           **options) -> Dict[str, object]:
    """Under TP: the MTP head's logits over ``prompt`` (:func:`mtp_logits`) and a speculative-decoding
    run against plain decoding (:func:`ds4t.exactness.speculative.run_speculative`: tokens, logits, state)."""
    from ds4t.exactness.speculative import run_speculative

    model = tp_model(preset, **options)
    rep = run_speculative(model, k=k, sessions=sessions, new_tokens=new_tokens, seed=seed)
    return {"mtp_logits": mtp_logits(model, prompt), "mismatches": rep.mismatches, "drafted": rep.drafted,
            "emitted": rep.emitted, "first": rep.first_mismatch, "has_mtp": model.mtp is not None}
