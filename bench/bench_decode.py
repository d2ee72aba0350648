"""The decode benchmark: every family on this GPU, ds4t native / ordered next to its peers.

For each preset (default: the three 4-layer presets at real layer dimensions, random bf16
weights), in one run:
  1. exactness on the GPU: the harness (native vs ordered, torch.equal on logits and every
     state tensor) on random session mixes, with its negative controls; CUDA-graph replay vs
     eager steps, bitwise;
  2. the non-invariant twin (bench/twin.py): the same model step with every op swapped for a fast
     plain-torch implementation (cuBLAS, SDPA, grouped_mm MoE, ...) through the kernel registry's
     overrides, replayed as CUDA graphs (ds4t.batch.graphs.capture_overrides). Checked: each twin
     op against the ds4t kernel inside a real step (per-op error), the twin's logits against
     ds4t's (bf16-close), and whether the twin is batch invariant (row 0 alone vs in a batch);
  3. for each context in --ctx and each N: the decode step time of the native path (CUDA graphs;
     eager too), the ordered fallback and the twin (op sets "all" and "priced": see twin.SETS),
     CUDA events around eval_batch, warm-up, medians. Sessions are filled fast: one prefilled with
     ctx random tokens, its state copied into the others (slots 0..N-1, in batch order). A
     (ctx, N) the memory plan (ds4t.serve.planner) says does not fit is skipped, with the reason;
  4. the bytes floor of each step (weights read once per batch, expected unique routed experts,
     every session's KV / latent cache at that context read and one entry written, recurrent
     and conv states read and written) over the copy bandwidth measured in the same run;
  5. HF transformers on the same config and the same weights (bench/hf_peer.py), after ds4t's
     model is freed: eager batched decode with its dynamic cache, and the static-cache compiled
     step that generate(cache_implementation="static") runs (torch.compile reduce-overhead, CUDA
     graphs) within a time budget (--hf-static-budget, --hf-static-ns); logits vs ds4t's, row-0
     batch invariance of both.

Writes $OUT/decode.md, decode.csv and decode.png, updating them after each family; prints the
short table (model, ctx, N, native, twin, HF static, HF eager, floor, ratios) last.
Usage: python bench/bench_decode.py [--models qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l]
       [--ns 1,16,64] [--ctx 256,8192] [--paths deepseek-v3-4l=full,ds4] [--no-hf] [--no-twin]
       [--hf-static-ns 1,16,64] [--hf-static-budget 360] [--ordered-ns 1,16] [--eager-ns 1]
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import math
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402
from bench import hf_peer, model_spec, twin  # noqa: E402
from ds4t.batch import graphs  # noqa: E402
from ds4t.exactness.harness import plant, random_scenario, run_scenario  # noqa: E402


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10; a small copy off the GPU)."""
    device = torch.device(device)
    n = 1 << (30 if device.type == "cuda" else 24)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    ms = hf_peer.median_ms(lambda: b.copy_(a), 10, 3, device)
    del a, b
    return 2 * n / (ms / 1e3)


def step_floor_bytes(model, n: int, ctx: int) -> dict:
    """Bytes one native decode step of n sessions at position ~ctx must move (read + write).

    Weights once per batch (the embedding: only the n rows looked up; stacked routed experts: the
    expected number of distinct experts n tokens touch under uniform top-k routing, plus the
    shared expert when it is stacked as expert E), and every session's state: the visible KV /
    latent cache read and one entry written, recurrent and conv states read and written.
    """
    # a plain decode step never reads the MTP head (parameters "mtp.*", state under mtp_state_prefix)
    params = {k: v for k, v in model.parameters().items() if not k.startswith("mtp.")}
    mtp_state = getattr(model, "mtp_state_prefix", None) or "\0"
    rc = getattr(model, "router_cfg", None)
    E = rc.num_experts if rc else 0
    dense = routed = 0.0
    for name, t in params.items():
        b = t.numel() * t.element_size()
        if name == "embed" and any(k.split(".")[0] == "lm_head" for k in params):  # untied: only the n rows looked up
            dense += n * t.shape[1] * t.element_size()
        elif E and t.dim() == 3 and t.shape[0] in (E, E + 1):
            per_expert = b / t.shape[0]
            touched = E * (1 - (1 - rc.top_k / E) ** n) + (t.shape[0] - E)
            routed += per_expert * touched
        else:
            dense += b
    state = 0
    for name, spec in model.pool.specs.items():
        if name.startswith(mtp_state):
            continue
        per = torch.Size(spec.concrete(1)).numel() * spec.dtype.itemsize
        state += n * per * ((ctx + 1) if spec.has_ctx else 2)
    return {"dense": dense, "routed": routed, "state": state, "total": dense + routed + state}


def _sessions(model, n: int, ctx: int, extra: int, seed: int):
    rng = random.Random(seed)
    sessions = [model.new_session(max_ctx=ctx + extra) for _ in range(n)]
    for s in sessions:
        s.prefill([rng.randrange(model.vocab_size) for _ in range(ctx)], chunk=1024)
    return sessions, [rng.randrange(model.vocab_size) for _ in range(n)]


DEVICE = torch.device("cuda")
"""Where the benchmark runs (--device; cpu only for a smoke run of the script with tiny presets)."""


def _median_ms(fn, iters: int, warmup: int) -> float:
    """Median ms of fn after warm-up: CUDA events on the GPU (wall clock for a CPU smoke run)."""
    return hf_peer.median_ms(fn, iters, warmup, DEVICE)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def kernel_increments(events, steps: int):
    """Per-launch figures of ``steps`` consecutive decode steps from their GPU kernel events (dicts with
    ``name``, ``ts`` and ``dur`` in us, as torch.profiler's chrome trace writes them, every step launching
    the same kernels in the same order). A kernel's *increment* runs from the end of the kernels before it
    (the latest end so far in its step) to its own end, 0 when it ends earlier: under programmatic dependent
    launch a kernel starts while its predecessor drains and waits, so its own duration overstates it.

    Returns ``(rows, span, sequence)``: rows ``[(kernel, increment us, calls, duration us)]`` per step
    summed by kernel name, largest increment first; span the median us from a step's first kernel's start
    to its last kernel's end; sequence ``[(kernel, increment us, duration us)]`` one step in launch order,
    each the median over the steps. ``([], 0.0, [])`` when there are fewer events than steps."""
    events = sorted(events, key=lambda e: e["ts"])
    per = len(events) // steps if steps else 0
    if not per:   # no GPU kernels (a CPU smoke run)
        return [], 0.0, []
    agg, spans = {}, []
    incs = [[0.0] * steps for _ in range(per)]
    durs = [[0.0] * steps for _ in range(per)]
    for k in range(steps):
        step = events[k * per:(k + 1) * per]
        prev_end = step[0]["ts"]
        for i, e in enumerate(step):
            end = e["ts"] + e["dur"]
            inc = max(end, prev_end) - prev_end
            a = agg.setdefault(e["name"], [0.0, 0, 0.0])
            a[0] += inc
            a[1] += 1
            a[2] += e["dur"]
            incs[i][k], durs[i][k] = inc, e["dur"]
            prev_end = max(end, prev_end)
        spans.append(prev_end - step[0]["ts"])
    rows = sorted(((k, v[0] / steps, v[1] / steps, v[2] / steps) for k, v in agg.items()), key=lambda r: -r[1])
    sequence = [(events[i]["name"], statistics.median(incs[i]), statistics.median(durs[i])) for i in range(per)]
    return rows, statistics.median(spans), sequence


def profile_step(model, n: int, ctx: int, steps: int = 5):
    """Where a graph-replayed native step's GPU time goes (torch.profiler; CUPTI reports the kernels
    inside a graph): :func:`kernel_increments` of ``steps`` steps of ``n`` sessions at ``ctx`` tokens. The
    step time minus the span is host work before the graph starts (metadata copy, launch) and after it."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    from bench.bench_fp8 import synthetic_sessions   # bench_fp8 imports this module

    sessions, toks = synthetic_sessions(model, n, ctx, steps + 16, seed=n + 1000)
    items = lambda: [ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)]  # noqa: E731
    try:
        for _ in range(3):   # compile and capture outside the profile
            ds4t.eval_batch(items(), mode="native")
        _sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ds4t.eval_batch(items(), mode="native")
                _sync()
    finally:
        for s in sessions:
            s.close()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    return kernel_increments(events, steps)


def log_profile(model, label: str, n: int, ctx: int, step_ms: float, log) -> None:
    """:func:`profile_step` of ``n`` sessions at ``ctx`` tokens, logged as markdown: the kernels by increment,
    then one step in launch order (``step_ms``: the timed step, for the host share; nan if not timed)."""
    prof, span_us, sequence = profile_step(model, n, ctx)
    log(f"\n### {label}: where a graph-replayed native step's GPU time goes, N={n}, {ctx} tokens "
        f"(torch.profiler)\n")
    log(f"GPU span {span_us / 1e3:.3f} ms per step (first kernel's start to last kernel's end); step "
        f"{step_ms:.3f} ms; {sum(r[2] for r in prof):.0f} kernels per step. Increment: from the previous "
        "kernel's end to this one's (under programmatic dependent launch a kernel's own duration "
        "includes its wait)\n")
    log("| kernel | increment us per step | calls per step | duration us per step |")
    log("|---|---|---|---|")
    for k, inc, calls, dur in prof[:20]:
        log(f"| `{k[:90]}` | {inc:.1f} | {calls:.0f} | {dur:.1f} |")
    if sequence:   # the same step in launch order: where each layer's time goes
        log(f"\nOne step in launch order ({len(sequence)} kernels; medians over the profiled steps)\n")
        log("| # | kernel | increment us | duration us |")
        log("|---|---|---|---|")
        for i, (k, inc, dur) in enumerate(sequence):
            log(f"| {i} | `{k[:70]}` | {inc:.2f} | {dur:.2f} |")


def graph_exactness(model, n: int = 6, steps: int = 6) -> bool:
    """The same greedy decode with CUDA graphs and eagerly: logits and final states bitwise equal."""
    runs = []
    for use in (False, True):
        model.cuda_graphs = use
        sessions, toks = _sessions(model, n, 33, steps + 8, seed=99)
        logits = []
        for k in range(steps):
            group = sessions if k % 2 == 0 else sessions[: max(1, n // 2)]
            res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(group, toks)], mode="native")
            toks[: len(group)] = [int(x) for x in res.logits.argmax(-1).tolist()]
            logits.append(res.logits)
        runs.append((logits, [s.state_dict() for s in sessions]))
        for s in sessions:
            s.close()
    model.cuda_graphs = True
    (la, sa), (lb, sb) = runs
    return all(torch.equal(x, y) for x, y in zip(la, lb)) and all(
        torch.equal(a[k], b[k]) for a, b in zip(sa, sb) for k in a)


def exactness(model, args, log, paths) -> bool:
    log("| check | sessions | steps | rows | states | mismatches | paths |")
    log("|---|---|---|---|---|---|---|")
    rng = random.Random(1)
    ok = True
    for path in paths:
        if path is not None:
            model.native_path = path
        for r in range(args.exact_rounds):
            sc = random_scenario(rng, model.vocab_size, args.exact_sessions, args.exact_steps, max_prompt=200,
                                 max_ctx=200 + args.exact_steps + 8)
            rep = run_scenario(model, sc, mode="native")
            ok &= rep.ok
            label = f"harness {r}" + (f" ({path})" if path else "")
            log(f"| {label} | {rep.sessions} | {rep.steps} | {rep.rows} | {rep.states} | {rep.mismatches} | {rep.paths} |")
        g = graph_exactness(model)
        ok &= g
        log(f"| graph replay == eager{f' ({path})' if path else ''} | 6 | 6 | - | - | {0 if g else 'DIFFER'} | native |")
    caught = {}
    for kind in ("ulp", "batch-dependent"):
        sc = random_scenario(random.Random(7), model.vocab_size, 4, 2, max_prompt=16, max_ctx=40)
        with plant(kind):
            caught[kind] = run_scenario(model, sc, mode="native").mismatches
    log(f"\nnegative controls: planted 1-ulp deviation -> {caught['ulp']} mismatches; "
        f"batch-dependent linear -> {caught['batch-dependent']} mismatches")
    ok = ok and all(v > 0 for v in caught.values())
    log(f"exactness on GPU: {'PASS' if ok else 'FAIL'}")
    return ok


# ----------------------------------------------------------------------------------------------
# sessions at a context, timed steps
# ----------------------------------------------------------------------------------------------
def ints(text: str):
    return [int(x) for x in str(text).split(",") if x.strip()]


def fill_sessions(model, n: int, ctx: int, extra: int, seed: int):
    """n sessions at position ctx (room for ``extra`` more tokens) and n next tokens. The first is
    prefilled with ctx random tokens in big chunks; its state is copied into the others (a step's
    cost does not depend on the values, and prefilling n x ctx tokens would take minutes). With no
    other session open they hold slots 0..n-1 in order (the twin then reads slot views, no gathers)."""
    gc.collect()   # closed-but-unreferenced sessions give their slots back
    rng = random.Random(seed)
    # All n slots in one allocation, as the memory plan counts them (as `ds4t serve` reserves them):
    # grown one session at a time the pool doubles, and each doubling holds the old and the new tensors.
    model.pool.reserve(n, ctx + extra)
    sessions = [model.new_session(max_ctx=ctx + extra) for _ in range(n)]
    prompt = [rng.randrange(model.vocab_size) for _ in range(ctx)]
    sessions[0].prefill(prompt, chunk=2048)
    state = sessions[0].state_dict()
    for s in sessions[1:]:
        s.load_state_dict(state, ctx, prompt)
    return sessions, [rng.randrange(model.vocab_size) for _ in range(n)]


def exact_at_context(model, sessions, toks, ctx: int, path) -> bool:
    """One decode step of these sessions (all at position ``ctx``) ordered, then the same step native
    from the same states: logits and every session's state bitwise equal. The sessions are put back at
    ``ctx`` afterwards. (The harness runs short prompts; this checks the long-context kernels' splits.)"""
    if path is not None:
        model.native_path = path
    # Copies in host memory: three per session at 32k context are ~10 GB the device may not have spare.
    saved = [(s.state_dict("cpu"), list(s.tokens)) for s in sessions]

    def run(mode):
        for s, (st, tk) in zip(sessions, saved):
            s.load_state_dict(st, ctx, tk)
        res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode=mode)
        return res.logits.clone(), [s.state_dict("cpu") for s in sessions], res.paths

    lo, so, _ = run("ordered")
    ln, sn, paths = run("native")
    for s, (st, tk) in zip(sessions, saved):
        s.load_state_dict(st, ctx, tk)
    same_states = all(a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(so, sn))
    return torch.equal(lo, ln) and same_states and set(paths) == {"native"}


def rewind(sessions, pos: int) -> None:
    """Put the sessions back at position ``pos`` (the KV entries past it are overwritten by the next
    steps; recurrent states keep their values, which a step's cost does not depend on)."""
    for s in sessions:
        s.pos = pos
        del s.tokens[pos:]


def slots_are_rows(sessions) -> bool:
    """The sessions hold slots 0..N-1 in batch order and every op sees the whole batch, so the twin
    may read slot views instead of gathering (twin.applied(slots_are_rows=True)). Not on DeepSeek's
    "ds4" path: it runs MLA per session (one row, slot r), where row 0 is not slot 0."""
    model = sessions[0].model if sessions else None
    if getattr(model, "native_path", None) == "ds4":
        return False
    return [s.slot for s in sessions] == list(range(len(sessions)))


def _selection(twin_set: str) -> str:
    """A --twin-sets entry: a set name (twin.SETS) or ops joined by "+" -> what twin.applied takes."""
    return twin_set.replace("+", ",")


@contextlib.contextmanager
def twin_steps(twin_set: str, rows: bool):
    """The twin ops applied and captured in CUDA graphs (explicit opt-in: they are graph-safe)."""
    with twin.applied(_selection(twin_set), slots_are_rows=rows) as rep, graphs.capture_overrides():
        yield rep


def time_step(model, sessions, toks, ctx: int, mode: str, iters: int, warmup: int = 3, cuda_graphs: bool = True,
              twin_set=None) -> float:
    """Median ms of one eval_batch step of these sessions from position ctx (rewound first):
    mode "native" or "ordered"; ``twin_set``: the native step on the twin ops of that set."""
    rewind(sessions, ctx)
    model.cuda_graphs = cuda_graphs
    want = "native" if mode == "native" else "ordered"
    items = [ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)]

    def step():
        res = ds4t.eval_batch(items, mode=mode)
        assert all(p == want for p in res.paths)

    cm = twin_steps(twin_set, slots_are_rows(sessions)) if twin_set else contextlib.nullcontext()
    try:
        with cm:
            return _median_ms(step, iters, warmup)
    finally:
        model.cuda_graphs = True


# ----------------------------------------------------------------------------------------------
# the twin's checks
# ----------------------------------------------------------------------------------------------
def twin_checks(model, sets, n: int, log) -> dict:
    """At a short context, eagerly: every twin op against the ds4t kernel inside one step of n
    sessions (twin.shadowed), then per twin set the step's logits against ds4t's and the twin's row
    0 alone against the same row among n (batch invariance)."""
    gc.collect()
    rng = random.Random(5)
    sessions = [model.new_session(96) for _ in range(n)]
    for s in sessions:
        s.prefill([rng.randrange(model.vocab_size) for _ in range(rng.randint(20, 64))])
    toks = [rng.randrange(model.vocab_size) for _ in range(n)]
    saved = [(s.state_dict(), s.pos) for s in sessions]
    rows = slots_are_rows(sessions)

    def step(k=n):
        out = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions[:k], toks[:k])], mode="native").logits
        for s, (st, pos) in zip(sessions, saved):
            s.load_state_dict(st, pos)
        return out

    res = {}
    try:
        with graphs.suspended():
            native = step()
            with twin.shadowed("all") as diffs:
                step()
            for name in sets:
                with twin.applied(_selection(name), slots_are_rows=rows) as rep:
                    tw, tw1 = step(), step(1)
                res[name] = dict(rel=((tw - native).abs().max() / native.abs().max()).item(),
                                 top1=(tw.argmax(-1) == native.argmax(-1)).float().mean().item(),
                                 row0_invariant=bool(torch.equal(tw1[0], tw[0])), report=rep.describe())
    finally:
        for s in sessions:
            s.close()
    log(f"\n## Non-invariant twin (bench/twin.py): checks at ~20-64 tokens of context, {n} sessions, eager\n")
    log("Each twin op against the ds4t kernel on the same inputs inside one native step (max |twin - ds4t| / "
        "max |ds4t| over its outputs and in-place writes; router ids that differ):\n")
    log("| op | calls | max rel err | ids differing |")
    log("|---|---|---|---|")
    for op, d in sorted(diffs.items()):
        log(f"| {op} | {d.calls} | {d.max_rel:.1e} | {d.int_mismatches} |")
    tol = 5e-2 if model.dtype != torch.float32 else 1e-4
    off = [op for op, d in sorted(diffs.items()) if d.max_rel > tol]
    log(f"\nevery twin op within {tol:g} of the kernel: {'yes' if not off else 'NO: ' + ', '.join(off)}"
        + ("" if not twin.ATTN_CHOICE else f"; decode attention ran {sorted(set(twin.ATTN_CHOICE.values()))}"))
    for name, r in res.items():
        log(f"\ntwin set `{name}`: {r['report']}.")
        log(f"logits vs ds4t native: max rel err {r['rel']:.2e} ({'bf16-close' if r['rel'] < 0.1 else 'NOT close'}), "
            f"top-1 agreement {100 * r['top1']:.0f}%; row 0 alone == row 0 among {n}: "
            f"{'yes' if r['row0_invariant'] else 'NO (not batch invariant)'}")
    return res


# ----------------------------------------------------------------------------------------------
# one model
# ----------------------------------------------------------------------------------------------
def _fmt(v, spec=".2f", none="-"):
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _ratio(num, den):
    return num / den if num and den and not math.isnan(num) and not math.isnan(den) else None


def _best_twin(r: dict, sets):
    vals = [(r.get(f"twin_{s}_ms"), s) for s in sets if r.get(f"twin_{s}_ms")]
    return min(vals) if vals else (None, None)


def bench_model(name, args, bw, log, rows, hf_budget):
    from ds4t.serve import planner

    ns, ctxs = sorted(ints(args.ns)), sorted(ints(args.ctx))
    ordered_ns = set(ints(args.ordered_ns or args.ns))
    eager_ns = set(ints(args.eager_ns or args.ns))
    sets = [s for s in args.twin_sets.split(",") if s] if args.twin else []
    warmup = 3
    extra = warmup + args.iters + 8
    paths = [None]
    for spec in args.paths:
        m, _, p = spec.partition("=")
        if m == name:
            paths = p.split(",")
    log(f"\n# {name}\n")
    t0 = time.time()
    preset, quant = model_spec.split(name)
    model = model_spec.load(name, DEVICE)
    _sync()
    log(f"loaded in {time.time() - t0:.0f} s: {model.family}, {model.dtype}, weights {model.weight_bytes() / 1e9:.2f} GB")
    if getattr(model, "native_window", None) is not None and model.native_window < max(ctxs) + extra:
        log(f"native_window raised from {model.native_window} to {max(ctxs) + extra} (the longest context timed)")
        model.native_window = max(ctxs) + extra
    t0 = time.time()
    log("\n## Exactness (native vs ordered; graph replay vs eager)\n")
    exact = exactness(model, args, log, paths)
    ref_prompt = list(range(1, 33))
    ref_logits = model.new_session(64).prefill(ref_prompt)
    if sets:
        twin_checks(model, sets, min(8, max(ns)), log)
    log(f"\n(exactness and twin checks: {time.time() - t0:.0f} s)")
    mine = []
    runner = sessions = S = T = None
    for ctx in ctxs:
        t0 = time.time()
        plan = planner.plan(model, slots=max(ns), max_ctx=ctx + extra, step_rows=max(ns))
        room = max(ns) if plan.fits else (plan.max_slots() or 0)
        fit = [n for n in ns if n <= room]
        for n in ns:
            if n not in fit:
                log(f"\nskipped ctx {ctx} N={n}: the memory plan does not fit ({room} session(s) of {ctx + extra} "
                    f"tokens fit):\n```\n{plan.format()}\n```")
                mine.append(dict(model=name, ctx=ctx, n=n, path=paths[0] or "native", skipped="memory plan"))
        if not fit:
            continue
        if paths[0] is not None:
            model.native_path = paths[0]
        runner = sessions = S = T = None   # the last context's sessions give their slots back first
        sessions, toks = fill_sessions(model, max(fit), ctx, extra, seed=ctx)
        log(f"\nctx {ctx}: {max(fit)} sessions filled in {time.time() - t0:.1f} s (one prefilled, its state copied); "
            f"slots 0..N-1 in batch order: {'yes' if slots_are_rows(sessions) else 'no (the twin gathers slots)'}")
        ok_ctx = exact_at_context(model, sessions[:min(4, max(fit))], toks, ctx, paths[0])
        log(f"ctx {ctx}: one step of {min(4, max(fit))} sessions, native == ordered (logits and state, bitwise): "
            f"{'yes' if ok_ctx else '**NO**'}")
        exact = exact and ok_ctx
        runner = None
        for n in fit:
            S, T = sessions[:n], toks[:n]
            fb = step_floor_bytes(model, n, ctx)
            f1 = step_floor_bytes(model, 1, ctx)["total"]
            ordd = (time_step(model, S, T, ctx, "ordered", max(3, args.iters // 2))
                    if n in ordered_ns else float("nan"))
            twin_ms, notes = {}, []
            for s in sets:
                if paths[0] is not None:
                    model.native_path = paths[0]
                runner = runner or graphs.graphs_for(model)
                fails = runner.stats.failures if runner else 0
                try:
                    twin_ms[s] = time_step(model, S, T, ctx, "native", args.iters, twin_set=s)
                except Exception as e:  # noqa: BLE001  (a twin op that cannot run here: say so, go on)
                    twin_ms[s] = None
                    notes.append(f"twin {s} failed: {type(e).__name__}: {str(e)[:200]}")
                if runner and runner.stats.failures > fails:
                    notes.append(f"twin {s}: CUDA graph capture failed, timed eagerly")
            for path in paths:
                if path is not None:
                    model.native_path = path
                nat = time_step(model, S, T, ctx, "native", args.iters)
                eager = (time_step(model, S, T, ctx, "native", max(3, args.iters // 2), cuda_graphs=False)
                         if n in eager_ns else float("nan"))
                floor_ms = fb["total"] / bw * 1e3
                r = dict(model=name, ctx=ctx, n=n, path=path or "native", native_ms=nat, eager_ms=eager,
                         ordered_ms=ordd, floor_ms=floor_ms, floor_mb=fb["total"] / 1e6,
                         floor_state_mb=fb["state"] / 1e6, native_tok_s=n / nat * 1e3,
                         speedup=_ratio(ordd, nat), floor_speedup=n * f1 / fb["total"], floor_frac=floor_ms / nat,
                         exact=exact, notes="; ".join(notes))
                for s in sets:
                    r[f"twin_{s}_ms"] = twin_ms.get(s)
                mine.append(r)
                print(json.dumps(r), flush=True)
        for s in sessions:
            s.close()
        sessions = S = T = None
        gc.collect()
        log(f"(ctx {ctx}: ds4t timings took {time.time() - t0:.0f} s)")
    if twin.ATTN_CHOICE:
        ran = {}
        for (qs, ks, _, _), v in twin.ATTN_CHOICE.items():
            ran.setdefault(v, []).append(f"N={qs[0]} L={ks[1]}")
        log(f"\ntwin decode attention (twin.ATTENTION_IMPL={twin.ATTENTION_IMPL}) ran: "
            + "; ".join(f"{k} ({', '.join(v)})" for k, v in ran.items()))
        twin.ATTN_CHOICE.clear()
    if args.profile:
        if paths[0] is not None:
            model.native_path = paths[0]
        for n in ns:
            step = next((r["native_ms"] for r in mine if r["n"] == n and r["ctx"] == ctxs[0] and "native_ms" in r),
                        float("nan"))
            log_profile(model, name, n, ctxs[0], step, log)
    # the captured graphs (held by the runner) and the state pool go with the model, before HF loads
    runner = sessions = S = T = plan = s = None  # noqa: F841  (s: the last session a loop closed)
    del model
    gc.collect()
    _empty_cache()
    if DEVICE.type == "cuda":   # what still holds the ds4t model shows here (DeepSeek's HF twin then OOMs)
        log(f"\nGPU memory allocated before the HF part: {torch.cuda.memory_allocated() / 2**30:.1f} GiB")
    if args.hf and quant:
        log(f"\nHF skipped: its twin would hold {preset}'s unquantized weights, not the {quant} ones timed here")
    hf = _hf_part(name, args, ctxs, ns, ref_prompt, ref_logits, log, hf_budget) if args.hf and not quant else {}
    for r in mine:
        h = hf.get((r["ctx"], r["n"]))
        r["hf_eager_ms"] = h.eager_ms if h else None
        r["hf_static_ms"] = h.static_ms if h else None
        r["hf_notes"] = "; ".join(f"{k}: {v}" for k, v in (("eager", h.eager_note), ("static", h.static_note))
                                  if v) if h else ""
        peers = [(v, k) for v, k in ((r["hf_static_ms"], "HF static"), (r["hf_eager_ms"], "HF eager")) if v]
        r["strongest_peer"] = min(peers)[1] if peers else None
        r["vs_peer"] = _ratio(min(peers)[0], r.get("native_ms")) if peers else None
        r["twin_ms"], r["twin_set"] = _best_twin(r, sets)
        r["vs_twin"] = _ratio(r["twin_ms"], r.get("native_ms"))
    rows += mine
    _model_tables(name, mine, sets, args, log)


def _hf_part(name, args, ctxs, ns, ref_prompt, ref_logits, log, hf_budget) -> dict:
    """HF eager and static rows of this model, {(ctx, n): HFRow}; the static share of the budget."""
    from ds4t.hf import hf_twin

    hf_budget["models"] -= 1   # models after this one
    budget = hf_peer.StaticBudget(hf_budget["left"] / (hf_budget["models"] + 1), deadline=hf_budget["deadline"],
                                  reserve=RESERVE_S * hf_budget["models"])
    out = {}
    hf = None
    t0 = time.time()
    try:
        hf = hf_twin(name, device=DEVICE)
        _sync()
        with torch.no_grad():
            lg = hf(input_ids=torch.tensor([ref_prompt], device=DEVICE)).logits[0, -1].float()
        ref = ref_logits.to(DEVICE)
        rel = ((lg - ref).abs().max() / ref.abs().max()).item()
        log(f"\n## HF transformers {__import__('transformers').__version__} peer\n")
        log(f"twin loaded in {time.time() - t0:.0f} s (same config, same weights); fla: {_fla_version()}; its prompt "
            f"logits vs ds4t's: max rel error {rel:.2e} (bf16: close, not equal); MoE experts of the eager forward: "
            f"{hf_peer.experts_implementation(hf)}. Static-cache budget for this model: {budget.seconds:.0f} s.")
        from transformers import CompileConfig

        cfg = CompileConfig(dynamic=True) if args.hf_static_dynamic else None
        if DEVICE.type != "cuda":   # a CPU smoke run: generate compiles only on accelerators; trace, don't codegen
            cfg = CompileConfig(backend="eager", mode=None)
            cfg._compile_all_devices = True
        static_ns = ints(args.hf_static_ns or args.ns)
        for r in hf_peer.bench_hf(hf, ctxs, ns, static_ns, max(3, args.iters // 2), 2, budget, log, cfg):
            out[(r.ctx, r.n)] = r
        for ctx in ctxs:
            rs = [r for (c, _), r in out.items() if c == ctx]
            log(f"HF row 0 of a batch of N equals the same row at N=1, ctx {ctx}: eager "
                + ", ".join(f"N={r.n}: {_yn(r.eager_row0_equal)}" for r in rs) + "; static "
                + ", ".join(f"N={r.n}: {_yn(r.static_row0_equal)}" for r in rs))
    except Exception:  # noqa: BLE001
        log(f"\nHF transformers failed:\n```\n{traceback.format_exc()[-2000:]}```")
    finally:
        hf_budget["left"] -= budget.used
        if hf is not None:
            hf_peer.reset_compiled(hf)
        del hf
        gc.collect()
        _empty_cache()
    log(f"(HF part: {time.time() - t0:.0f} s, {budget.used:.0f} s of it in static-cache generate/compile)")
    return out


def _yn(v):
    return "-" if v is None else ("yes" if v else "no")


def _model_tables(name, mine, sets, args, log):
    for ctx in sorted({r["ctx"] for r in mine}):
        rs = [r for r in mine if r["ctx"] == ctx and "native_ms" in r]
        if not rs:
            continue
        log(f"\n## {name}: decode step vs N, context {ctx} tokens per session (median of {args.iters})\n")
        tw_cols = "".join(f" twin ms ({s}) |" for s in sets)
        log(f"| N | path | native ms (graphs) | native ms (eager) | ordered ms |{tw_cols} HF eager ms | HF static ms | "
            "native tok/s | native / strongest peer | native / twin | speed-up vs ordered (floor allows) | "
            "floor ms | floor / native |")
        log("|---" * (13 + len(sets)) + "|")
        for r in rs:
            tw = "".join(f" {_fmt(r.get(f'twin_{s}_ms'))} |" for s in sets)
            vs_peer = f"{r['vs_peer']:.2f}x ({r['strongest_peer']})" if r.get("vs_peer") else "-"
            vs_twin = f"{r['vs_twin']:.2f}x" if r.get("vs_twin") else "-"
            sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
            log(f"| {r['n']} | {r['path']} | {r['native_ms']:.2f} | {_fmt(r['eager_ms'])} | {_fmt(r['ordered_ms'])} |{tw} "
                f"{_fmt(r.get('hf_eager_ms'))} | {_fmt(r.get('hf_static_ms'))} | {r['native_tok_s']:.0f} | {vs_peer} | "
                f"{vs_twin} | {sp} ({r['floor_speedup']:.2f}x) | {r['floor_ms']:.3f} | {100 * r['floor_frac']:.0f}% |")
        for r in rs:
            if r.get("notes"):
                log(f"- N={r['n']}: {r['notes']}")
        notes = sorted({r.get("hf_notes") for r in rs if r.get("hf_notes")})
        for nt in notes[:3]:
            log(f"- HF: {nt}")


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "native_ms" in r]
    if not rows:
        return
    models = list(dict.fromkeys(r["model"] for r in rows))
    ctxs = sorted({r["ctx"] for r in rows})
    fig, axes = plt.subplots(len(ctxs), len(models), figsize=(5 * len(models), 4 * len(ctxs)), squeeze=False)
    for i, ctx in enumerate(ctxs):
        for ax, m in zip(axes[i], models):
            rs = [r for r in rows if r["model"] == m and r["ctx"] == ctx]
            if not rs:
                ax.set_visible(False)
                continue
            first = [r for r in rs if r["path"] == rs[0]["path"]]
            x = [r["n"] for r in first]

            def line(key, fmt, label, rs_=first):
                pts = [(r["n"], r["n"] / r[key] * 1e3) for r in rs_ if r.get(key) and not math.isnan(r[key])]
                if pts:
                    ax.plot(*zip(*pts), fmt, label=label)

            for p in dict.fromkeys(r["path"] for r in rs):
                line("native_ms", "o-", f"ds4t native ({p})", [r for r in rs if r["path"] == p])
            line("ordered_ms", "s--", "ds4t ordered")
            line("twin_ms", "d-", "non-invariant twin (best set)")
            line("hf_static_ms", "^-", "HF static + compile")
            line("hf_eager_ms", "v:", "HF eager")
            ax.plot(x, [r["n"] / r["floor_ms"] * 1e3 for r in first], ":", color="grey", label="bytes floor")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("sessions N")
            ax.set_ylabel("aggregate tok/s")
            ax.set_title(f"{m}, ctx {ctx}")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fla_version():
    try:
        import fla

        return getattr(fla, "__version__", "installed")
    except ImportError:
        return "not installed"


RESERVE_S = 150.0
"""Seconds kept, under --deadline, for each model still to run (its ds4t part and HF eager)."""

CSV_FIELDS = ["model", "ctx", "n", "path", "native_ms", "eager_ms", "ordered_ms", "twin_ms", "twin_set",
              "hf_static_ms", "hf_eager_ms", "strongest_peer", "vs_peer", "vs_twin", "floor_ms", "floor_mb",
              "floor_state_mb", "floor_frac", "native_tok_s", "speedup", "floor_speedup", "exact", "skipped", "notes",
              "hf_notes"]


def summary(rows, log):
    """The short table, last in the output."""
    log("\n## Summary\n")
    log("ratios: peer ms / ds4t native ms (> 1: ds4t is faster); strongest peer = the faster of HF static and HF "
        "eager; twin = the faster twin set (see the per-model tables)\n")
    log("| model | ctx | N | ds4t native ms | twin ms | HF static ms | HF eager ms | floor ms | native / strongest peer "
        "| native / twin |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        model = r["model"] if r.get("path", "native") == "native" else f"{r['model']} ({r['path']})"
        if "native_ms" not in r:
            log(f"| {model} | {r['ctx']} | {r['n']} | skipped ({r.get('skipped')}) | | | | | | |")
            continue
        tw = f"{r['twin_ms']:.2f} ({r['twin_set']})" if r.get("twin_ms") else "-"
        vp = f"{r['vs_peer']:.2f}x" if r.get("vs_peer") else "-"
        vt = f"{r['vs_twin']:.2f}x" if r.get("vs_twin") else "-"
        log(f"| {model} | {r['ctx']} | {r['n']} | {r['native_ms']:.2f} | {tw} | {_fmt(r.get('hf_static_ms'))} | "
            f"{_fmt(r.get('hf_eager_ms'))} | {r['floor_ms']:.3f} | {vp} | {vt} |")


_OVERRIDES = contextlib.ExitStack()   # --configs: held for the whole run

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", "--model", default="qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l",
                    help="presets or paths; PRESET:fp8 quantizes at load (no HF peer then)")
    ap.add_argument("--ns", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", default="256", help="contexts (tokens per session before timing), e.g. 256,8192,32768")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-rounds", type=int, default=1)
    ap.add_argument("--exact-sessions", type=int, default=16)
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--paths", action="append", default=[],
                    help="MODEL=p1,p2: native paths to time for a model with a native_path option")
    ap.add_argument("--eager-ns", default=None, help="N values to time without CUDA graphs too (default: --ns)")
    ap.add_argument("--ordered-ns", default=None, help="N values to time the ordered fallback at (default: --ns)")
    ap.add_argument("--no-twin", dest="twin", action="store_false", help="skip the non-invariant twin")
    ap.add_argument("--twin-sets", default="all,priced",
                    help="twin op sets to time: all (every op plain torch), priced (only the GEMM / attention / "
                         "MoE ops whose algorithm invariance constrains), or op1+op2 lists separated by commas")
    ap.add_argument("--twin-attention", default="auto", choices=("auto", "sdpa"),
                    help="the twin's GQA decode attention: auto (FlashAttention varlen where it runs, else SDPA) "
                         "or sdpa (F.scaled_dot_product_attention with a length mask)")
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--hf-static-ns", default=None, help="N values for the HF static-cache compiled peer (default: --ns)")
    ap.add_argument("--hf-static-budget", type=float, default=360.0,
                    help="seconds all models together may spend in HF static-cache generate (compilation); "
                         "runs that would not fit are skipped and labelled")
    ap.add_argument("--hf-static-dynamic", action="store_true",
                    help="compile the HF static step with dynamic shapes (one compile for every N and context "
                         "instead of one per shape; generate's default is dynamic=None)")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds from the start by which the run should end: HF static runs that would end later "
                         f"than {RESERVE_S:.0f} s per model still to run are skipped, and a model that would start "
                         "after it is skipped (the summary is still printed)")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel GPU time of a graph-replayed native step at each --ns (first --ctx)")
    ap.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    ap.add_argument("--configs", default=None,
                    help="JSON file of GPU config-table entries to use instead (ds4t.kernels.config.overridden)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script (tiny presets)")
    ap.add_argument("--wide-norms", action="store_true",
                    help="A/B only: every norm writes fp32, as before DecoderModel.norm_dtype (a bf16 model's norms "
                         "write bf16 where every reader rounds to it)")
    ap.add_argument("--wide-stores", action="store_true",
                    help="A/B only: every store blocks.narrow_store narrows (swiglu's silu(g)*u, MLA's W_UV "
                         "output, Qwen3-Next's attention and Gated DeltaNet outputs) in fp32 instead (a bf16 "
                         "model stores them in bf16, which their linear rounds to)")
    args = ap.parse_args()
    if args.deadline is not None and args.deadline <= RESERVE_S:
        # every model would be skipped before it starts, leaving an empty table
        ap.error(f"--deadline {args.deadline:g}: must exceed the {RESERVE_S:.0f} s kept for each model")
    if args.wide_norms:
        from ds4t.models.decoder import DecoderModel
        DecoderModel.norm_dtype = lambda self, i, site: torch.float32
    if args.wide_stores:
        from ds4t.models import blocks
        blocks.linear_input_dtype = lambda x, w: torch.float32
    global DEVICE
    DEVICE = torch.device(args.device)
    twin.ATTENTION_IMPL = args.twin_attention
    for s in args.twin_sets.split(","):   # fail now on an unknown set or op, not after an hour
        twin.resolve(_selection(s))
    os.makedirs(args.out, exist_ok=True)
    lines = []
    t_start = time.time()

    def log(s=""):
        print(s, flush=True)
        lines.append(s)
        with open(os.path.join(args.out, "decode.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    log("# ds4t decode benchmark")
    if args.configs:
        from ds4t.kernels.config import overridden
        for table, key, cfg in _OVERRIDES.enter_context(overridden(args.configs)):
            log(f"config override: {table.kernel} {key!r} -> {cfg}")
    where = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "CPU (smoke run)"
    log(f"commit {commit}; {where}; torch {torch.__version__}; "
        f"triton {__import__('triton').__version__}")
    log(f"command: python bench/bench_decode.py {' '.join(sys.argv[1:])}")
    bw = copy_bandwidth(DEVICE)
    log(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    models = args.models.split(",")
    deadline = t_start + args.deadline if args.deadline else None
    hf_budget = {"left": args.hf_static_budget, "models": len(models), "deadline": deadline}
    for name in models:
        if deadline is not None and time.time() > deadline - RESERVE_S:
            log(f"\n# {name}: skipped, {deadline - time.time():.0f} s left before --deadline")
            hf_budget["models"] -= 1
            continue
        t0 = time.time()
        bench_model(name, args, bw, log, rows, hf_budget)
        log(f"\n({name}: {time.time() - t0:.0f} s; run so far {time.time() - t_start:.0f} s)")
        with open(os.path.join(args.out, "decode.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=CSV_FIELDS + sorted({k for r in rows for k in r} - set(CSV_FIELDS)),
                               restval="")
            w.writeheader()
            w.writerows(rows)
        plot(rows, os.path.join(args.out, "decode.png"))
    log(f"\n(total {time.time() - t_start:.0f} s)")
    summary(rows, log)


if __name__ == "__main__":
    main()
