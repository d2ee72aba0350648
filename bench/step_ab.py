"""A/B launch-config entries on a whole decode step, in one process.

A config-table entry that wins in a kernel sweep often does not move the step it sits in (a kernel
timed alone replays the same expert weights from L2, or overlaps differently with its neighbours under
programmatic dependent launch), and two processes timing the same step differ by 2-4 %: a gain smaller
than that cannot be read from two ``bench_decode --configs`` runs. This script loads the model once,
gives every session a random state at ``--ctx`` tokens (as ``bench_fp8`` does: a step's cost does not
depend on the values), and then for ``--rounds`` rounds times the native step under each variant in
turn (the order rotates every round; each variant's CUDA graphs are captured afresh, since a graph
replays the kernels it was captured with). The median of the round medians is reported with its
spread, next to the base (no override) and the bytes floor.

Each variant is also run once from the same saved state as the base, natively and (N >= 2) ordered,
each session alone. ``bits``: its logits and every session's state after the step are the base's bit for
bit -- what a few-rows entry (one that applies to launches of at most so many rows) must keep, since the
ordered fallback runs it and a native batch does not. ``native == ordered``: the variant's own native
step equals its ordered one bit for bit -- what any entry must keep, including one that changes a
shape's bits at every N (a new decode entry for a linear).

    python bench/step_ab.py --model glm-4.5-4l:fp8 --ns 1,2,16 --ctx 4096 --rounds 5 --iters 20 \\
        --variant st4='{"moe": [{"key": ["gate_up", "fp8", "few", 5120], "fields": {"num_stages": 4, "max_rows": 2}}]}' \\
        --variant path/to/configs.json

A variant is ``NAME=SPEC`` (or a bare SPEC, named by position), SPEC a JSON file or inline JSON in the
``ds4t.kernels.config.overridden`` format, plus an optional ``"passthrough": [op names]``: those ops are
overridden by their own ds4t function (graphs still captured), so a fused op that watches them runs as its
two calls -- ``{"passthrough": ["router_softmax_topk", "router_sigmoid_grouped"]}`` times ``linear_router``
unfused, ``{"passthrough": ["add_rms_norm"]}`` ``linear_add_rms_norm``, ``{"passthrough": ["moe_experts"]}``
``moe_add_rms_norm``, ``{"passthrough": ["conv1d_update"]}`` ``linear_conv1d_update``. And an optional
``"state_order": {SUFFIX: ORDER}``: the pool's states whose names end with ``.SUFFIX`` are re-laid out in
memory as ``StateSpec.order`` ORDER says (a list, or null for row-major) for the variant, values kept --
``{"state_order": {"recurrent": null}}`` times Qwen3-Next with its Gated DeltaNet state Dv-contiguous (the
kernels' tiles follow the layout). And an optional ``"options": {NAME: VALUE}``: load options the model reads
at every call set for the variant, then restored -- ``{"options": {"attention_products": "cache"}}`` times a
GQA family with its attention products in the cache dtype (other numerics: its bits differ from the base's,
its native step must still equal its ordered one). And an optional ``"fp8_fields": {TABLE: {FIELD: VALUE}}``: the
fields replaced in every config of that table whose key is an FP8 one (entries and rule) --
``{"fp8_fields": {"linear": {"tma": true}, "moe": {"tma": true}}}`` times every FP8 weight tile through a tensor
descriptor. ``--device cpu`` runs the script
on tiny presets (a smoke run: the interpreter ignores GPU config entries, so every variant keeps the base's
bits there).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402
from bench import bench_decode, model_spec  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.bench_fp8 import synthetic_sessions  # noqa: E402
from ds4t.batch.graphs import capture_overrides, graphs_for  # noqa: E402
from ds4t.kernels.config import overridden  # noqa: E402
from ds4t.kernels.registry import op, override  # noqa: E402


def parse_variant(text: str, index: int):
    """``NAME=SPEC`` or ``SPEC`` -> (name, spec dict). SPEC: inline JSON (starts with ``{``) or a JSON file."""
    name, sep, spec = text.partition("=")
    if not sep or name.lstrip().startswith("{"):
        name, spec = f"v{index}", text
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            value = json.loads(spec)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--variant {name}: not valid JSON ({e})") from None
    else:
        if not os.path.isfile(spec):
            raise SystemExit(f"--variant {name}: no such file {spec!r} (give a JSON file or inline JSON)")
        with open(spec) as f:
            value = json.load(f)
    if not isinstance(value, dict):
        raise SystemExit(f"--variant {name}: the spec must be a JSON object {{table: [entries]}}")
    return name.strip(), value


def same_result(a, b) -> bool:
    """Two (logits, [state dict per session]) pairs equal bit for bit (NaNs included: ``torch.equal``
    is False for NaN, so both sides are compared as raw bits)."""
    (la, sa), (lb, sb) = a, b

    def bits(x):
        x = x.contiguous()
        return x.view(torch.uint8) if x.dtype.is_floating_point and x.dim() else x

    def eq(x, y):
        return x.shape == y.shape and x.dtype == y.dtype and torch.equal(bits(x), bits(y))
    return eq(la, lb) and len(sa) == len(sb) and all(
        x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


def _clear_graphs(model) -> None:
    g = graphs_for(model)
    if g is not None:
        g.clear()


@contextlib.contextmanager
def relaid(model, orders: dict):
    """The pool's states named ``*.SUFFIX`` (``orders``: SUFFIX -> StateSpec order, None for row-major)
    copied into tensors of that memory layout for the block, then copied back into the original ones."""
    pool = model.pool
    names = [n for n in pool.specs if any(n.endswith("." + sfx) for sfx in orders)]
    saved = {n: (pool.specs[n], pool.tensors[n]) for n in names}
    for n in names:
        order = orders[n.rsplit(".", 1)[1]]
        spec = dataclasses.replace(pool.specs[n], order=tuple(order) if order is not None else None)
        t = spec.allocate(pool.slots, pool.ctx, pool.device, zeroed=False)
        t.copy_(pool.tensors[n])
        pool.specs[n], pool.tensors[n] = spec, t
    pool.generation += 1   # tensors moved: graphs captured on the old ones are stale
    try:
        yield
    finally:
        for n, (spec, t) in saved.items():
            t.copy_(pool.tensors[n])
            pool.specs[n], pool.tensors[n] = spec, t
        pool.generation += 1


def fp8_fields(table_name: str, fields: dict):
    """The config table ``table_name`` with ``fields`` replaced in every config of an FP8 key (entries and rule):
    a variant's ``"fp8_fields"``."""
    from ds4t.kernels.config import tables

    known = tables()
    if table_name not in known:
        raise SystemExit(f"fp8_fields: no config table {table_name!r}; tables: {sorted(known)}")
    return known[table_name].with_fields(fields, lambda *key: torch.float8_e4m3fn in key or "fp8" in key)


@contextlib.contextmanager
def applied(model, spec):
    """The variant's table entries (and pass-through overrides, state layouts) in force, the model's CUDA
    graphs dropped on entry and on exit (a graph replays the kernels it was captured with, so none may
    outlive the entries it was captured under). ``spec`` may also be a callable returning a context manager
    (a script's own tables, e.g. bench/prefill_tiles.py's forced rules): entered in place of the entries."""
    if callable(spec):
        with spec():
            _clear_graphs(model)
            try:
                yield
            finally:
                _clear_graphs(model)
        return
    table = {k: v for k, v in spec.items() if k not in ("passthrough", "state_order", "options", "fp8_fields")}
    options = spec.get("options") or {}
    bad = [k for k in options if k not in model.load_options()]
    if bad:
        raise SystemExit(f"variant option {bad[0]!r}: {model.family} models take {list(model.load_options())}")
    kept = {k: getattr(model, k) for k in options}
    with overridden(table), contextlib.ExitStack() as stack:
        stack.callback(lambda: [setattr(model, k, v) for k, v in kept.items()])
        for k, v in options.items():
            setattr(model, k, v)
        if spec.get("state_order"):
            stack.enter_context(relaid(model, spec["state_order"]))
        for name, fields in (spec.get("fp8_fields") or {}).items():
            stack.enter_context(fp8_fields(name, fields))
        for name in spec.get("passthrough", []):
            stack.enter_context(override(name, op(name).fn))
        if spec.get("passthrough"):
            stack.enter_context(capture_overrides())
        _clear_graphs(model)
        try:
            yield
        finally:
            _clear_graphs(model)


def one_step(model, sessions, toks, saved, mode: str = "native"):
    """One step (``mode`` "native" or "ordered") from the saved states: (logits, state dicts after it),
    on the host."""
    for s, (st, tk) in zip(sessions, saved):
        s.load_state_dict(st, len(tk), tk)
    res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode=mode)
    assert all(p == mode for p in res.paths), res.paths
    return res.logits.detach().cpu().clone(), [s.state_dict("cpu") for s in sessions]


def run(model, ns, ctx: int, variants, rounds: int, iters: int, bw: float, log):
    """Rows {n, variant, ms (median of round medians), lo, hi, vs_base, bits, floor_ms}."""
    rows = []
    # every timing rewinds to ctx first: room for one call's warm-up and iterations
    sessions, toks = synthetic_sessions(model, max(ns), ctx, iters + 8, seed=7)
    try:
        for n in ns:
            ss, tt = sessions[:n], toks[:n]
            saved = [(s.state_dict("cpu"), list(s.tokens)) for s in ss]
            results, exact = {}, {}
            for name, spec in variants:
                with applied(model, spec):
                    results[name] = one_step(model, ss, tt, saved)
                    exact[name] = same_result(results[name], one_step(model, ss, tt, saved, "ordered")) if n > 1 else None
            for s, (st, tk) in zip(ss, saved):
                s.load_state_dict(st, len(tk), tk)
            times = {name: [] for name, _ in variants}
            for r in range(rounds):
                k = r % len(variants)
                for name, spec in variants[k:] + variants[:k]:
                    with applied(model, spec):
                        times[name].append(bench_decode.time_step(model, ss, tt, ctx, "native", iters))
            floor = bench_decode.step_floor_bytes(model, n, ctx)["total"] / bw * 1e3
            base = statistics.median(times[variants[0][0]])
            for name, _ in variants:
                ms = statistics.median(times[name])
                rows.append(dict(n=n, variant=name, ms=ms, lo=min(times[name]), hi=max(times[name]),
                                 vs_base=ms / base, bits=same_result(results[name], results[variants[0][0]]),
                                 exact=exact[name], floor_ms=floor, rounds=times[name]))
                log(f"N={n} {name}: {ms:.3f} ms ({min(times[name]):.3f}-{max(times[name]):.3f}) "
                    f"x{ms / base:.3f} of base, bits {'same' if rows[-1]['bits'] else 'DIFFER'}, "
                    f"native == ordered {_yes(exact[name])}")
    finally:
        for s in sessions:
            s.close()
    return rows


def _yes(v) -> str:
    return "-" if v is None else "yes" if v else "NO"


def table(rows) -> str:
    out = ["| N | variant | step ms (median of rounds) | rounds min-max | vs base | floor ms | floor / step | "
           "bits as base | native == ordered |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['n']} | {r['variant']} | {r['ms']:.3f} | {r['lo']:.3f}-{r['hi']:.3f} | "
                   f"{r['vs_base']:.3f} | {r['floor_ms']:.3f} | {100 * r['floor_ms'] / r['ms']:.0f} % | "
                   f"{_yes(r['bits'])} | {_yes(r['exact'])} |")
    return "\n".join(out)


def ab_setup(args, tool: str):
    """What an A/B script needs from its parsed arguments (``--variant``, ``--device``, ``--model``, ``--out``):
    (variants with the base first, device, the loaded model, its Report log). SystemExit naming
    ``tool`` for no variant, repeated names or a missing GPU."""
    if not args.variant:
        raise SystemExit(f"{tool}: give at least one --variant to compare with the base")
    variants = [("base", {})] + [parse_variant(v, i + 1) for i, v in enumerate(args.variant)]
    names = [n for n, _ in variants]
    if len(set(names)) != len(names):
        raise SystemExit(f"{tool}: variant names must differ, got {names}")
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"{tool}: no CUDA GPU here (use --device cpu for a smoke run on a tiny preset)")
    os.makedirs(args.out, exist_ok=True)
    log = Report()

    return variants, dev, model_spec.load(args.model, dev), log


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a preset or path, optionally :fp8 (quantize at load)")
    ap.add_argument("--ns", default="1,16")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--variant", action="append", default=[], help="NAME=SPEC (JSON file or inline JSON)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.iters < 1:
        raise SystemExit("step_ab: --rounds and --iters must be at least 1")
    variants, dev, model, log = ab_setup(args, "step_ab")
    bench_decode.DEVICE = dev
    ns = bench_decode.ints(args.ns)
    bw = bench_decode.copy_bandwidth(dev)
    log(f"# step A/B: {args.model}, {args.ctx} tokens of context, commit {args.commit or '?'}")
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.rounds} rounds x {args.iters} steps a variant")
    for n_, spec in variants[1:]:
        log(f"variant {n_}: {json.dumps(spec)}")
    rows = run(model, ns, args.ctx, variants, args.rounds, args.iters, bw, log)
    log("")
    log(table(rows))
    log.write(args.out, "step_ab.md")
    with open(os.path.join(args.out, "step_ab.json"), "w") as f:
        json.dump(dict(model=args.model, ctx=args.ctx, commit=args.commit, variants=dict(variants), rows=rows), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
