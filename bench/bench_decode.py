"""The decode benchmark: every family on this GPU, ds4t native / ordered next to HF transformers.

For each preset (default: the three 4-layer presets at real layer dimensions, random bf16
weights), in one run:
  1. exactness on the GPU: the harness (native vs ordered, torch.equal on logits and every
     state tensor) on random session mixes, with its negative controls; CUDA-graph replay vs
     eager steps, bitwise;
  2. decode step time vs N (default 1,2,4,8,16,32) for the native path (CUDA graphs; eager too)
     and the ordered fallback: CUDA events around eval_batch, warm-up, medians; aggregate tok/s;
  3. the bytes floor of each step (weights read once per batch, expected unique routed experts,
     every session's state read + written) over the copy bandwidth measured in the same run;
     the native/ordered speed-up the floor allows (N x floor(1) / floor(N));
  4. HF transformers on the same config and the same weights (ds4t.hf.hf_twin), batched decode
     with its cache, after ds4t's model is freed (the DeepSeek shape does not fit twice): step
     time, tok/s, its logits next to ds4t's (same weights: bf16-close, not equal), and whether
     HF's row 0 in a batch of N equals the same row decoded alone.

Writes $OUT/decode.md, decode.csv and decode.png (tok/s vs N, one line per system and family),
updating them after each family; prints the short table last.
Usage: python bench/bench_decode.py [--models qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l]
       [--ns 1,2,4,8,16,32] [--ctx 256] [--paths deepseek-v3-4l=full,ds4] [--no-hf]
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t
from ds4t.exactness.harness import plant, random_scenario, run_scenario


def copy_bandwidth(device) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    a.random_(0, 255)
    for _ in range(3):
        b.copy_(a)
    ts = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    del a, b
    return 2 * n / statistics.median(ts)


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


def _median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        fn()
        e0.record()
        e0.synchronize()
        ts.append(s0.elapsed_time(e0))
    return statistics.median(ts)


def time_steps(model, n: int, mode: str, ctx: int, iters: int, warmup: int = 3, graphs: bool = True) -> float:
    """Median ms of one eval_batch decode step of n sessions at ~ctx tokens each."""
    model.cuda_graphs = graphs
    sessions, toks = _sessions(model, n, ctx, warmup + iters + 8, seed=n)
    want = "native" if mode == "native" else "ordered"

    def step():
        res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode=mode)
        assert all(p == want for p in res.paths)

    try:
        return _median_ms(step, iters, warmup)
    finally:
        model.cuda_graphs = True
        for s in sessions:
            s.close()


def profile_step(model, n: int, ctx: int, steps: int = 5):
    """Per-kernel GPU time of eager native steps (torch.profiler): [(kernel, us per step, calls per
    step)], most expensive first, and the summed kernel time per step. Compared with the graph
    step time it splits a step into kernel time and launch / idle gaps."""
    from torch.profiler import ProfilerActivity, profile

    model.cuda_graphs = False
    sessions, toks = _sessions(model, n, ctx, steps + 8, seed=n + 1000)
    items = lambda: [ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)]  # noqa: E731
    try:
        ds4t.eval_batch(items(), mode="native")   # compile outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                ds4t.eval_batch(items(), mode="native")
            torch.cuda.synchronize()
    finally:
        model.cuda_graphs = True
        for s in sessions:
            s.close()
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = getattr(ev, "cuda_time_total", 0)
        if dev_us and ev.count:
            rows.append((ev.key, dev_us / steps, ev.count / steps))
    rows.sort(key=lambda r: -r[1])
    return rows, sum(r[1] for r in rows)


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


@torch.no_grad()
def hf_bench(preset: str, ns, ctx: int, iters: int, warmup: int, ref_prompt, ref_logits) -> dict:
    """HF twin: decode step ms per N (batched, its own cache), logits vs ds4t's, batch invariance."""
    from ds4t.hf import hf_twin

    t0 = time.time()
    hf = hf_twin(preset, device="cuda")
    torch.cuda.synchronize()
    out = {"load_s": time.time() - t0, "ms": {}, "row0_equal": {}}
    lg = hf(input_ids=torch.tensor([ref_prompt], device="cuda")).logits[0, -1].float()
    out["rel_err"] = ((lg - ref_logits).abs().max() / ref_logits.abs().max()).item()
    g = torch.Generator().manual_seed(0)
    vocab = hf.config.vocab_size
    prompts = torch.randint(vocab, (max(ns), ctx), generator=g).cuda()
    first_tok = torch.randint(vocab, (max(ns), 1), generator=g).cuda()
    row0 = None
    for n in ns:
        o = hf(input_ids=prompts[:n], use_cache=True)
        pkv = o.past_key_values
        o = hf(input_ids=first_tok[:n], past_key_values=pkv, use_cache=True)
        r0 = o.logits[0, -1].float()
        row0 = r0 if row0 is None else row0
        out["row0_equal"][n] = bool(torch.equal(r0, row0))
        pkv = o.past_key_values
        tok = first_tok[:n]

        def step():
            nonlocal pkv
            pkv = hf(input_ids=tok, past_key_values=pkv, use_cache=True).past_key_values

        out["ms"][n] = _median_ms(step, iters, warmup)
        del pkv, o
        torch.cuda.empty_cache()
    del hf
    return out


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, m in zip(axes[0], models):
        rs = [r for r in rows if r["model"] == m]
        for native_path in dict.fromkeys(r["path"] for r in rs):
            pr = [r for r in rs if r["path"] == native_path]
            ax.plot([r["n"] for r in pr], [r["native_tok_s"] for r in pr], "o-", label=f"ds4t native ({native_path})")
        first = [r for r in rs if r["path"] == rs[0]["path"]]
        ax.plot([r["n"] for r in first], [r["ordered_tok_s"] for r in first], "s--", label="ds4t ordered")
        if any(r.get("hf_tok_s") for r in first):
            ax.plot([r["n"] for r in first], [r["hf_tok_s"] for r in first], "^-", label="HF transformers")
        ax.plot([r["n"] for r in first], [r["n"] / r["floor_ms"] * 1e3 for r in first], ":", color="grey",
                label="bytes floor")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sessions N")
        ax.set_ylabel("aggregate tok/s")
        ax.set_title(m)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def bench_model(name, args, bw, log, rows):
    ns = [int(x) for x in args.ns.split(",")]
    eager_ns = [int(x) for x in (args.eager_ns or args.ns).split(",")]
    paths = [None]
    for spec in args.paths:
        m, _, p = spec.partition("=")
        if m == name:
            paths = p.split(",")
    log(f"\n# {name}\n")
    t0 = time.time()
    model = ds4t.load(name, device="cuda")
    torch.cuda.synchronize()
    log(f"loaded in {time.time() - t0:.0f} s: {model.family}, {model.dtype}, weights {model.weight_bytes() / 1e9:.2f} GB")
    log("\n## Exactness (native vs ordered; graph replay vs eager)\n")
    exact = exactness(model, args, log, paths)
    ref_prompt = list(range(1, 33))
    ref_logits = model.new_session(64).prefill(ref_prompt)
    mine = []
    for n in ns:
        fb = step_floor_bytes(model, n, args.ctx)
        f1 = step_floor_bytes(model, 1, args.ctx)["total"]
        ordd = time_steps(model, n, "ordered", args.ctx, max(3, args.iters // 2))
        for path in paths:
            if path is not None:
                model.native_path = path
            nat = time_steps(model, n, "native", args.ctx, args.iters)
            eager = (time_steps(model, n, "native", args.ctx, max(3, args.iters // 2), graphs=False)
                     if n in eager_ns else float("nan"))
            floor_ms = fb["total"] / bw * 1e3
            mine.append(dict(model=name, n=n, path=path or "native", native_ms=nat, eager_ms=eager, ordered_ms=ordd,
                             floor_ms=floor_ms, floor_mb=fb["total"] / 1e6, native_tok_s=n / nat * 1e3,
                             ordered_tok_s=n / ordd * 1e3, speedup=ordd / nat, floor_speedup=n * f1 / fb["total"],
                             floor_frac=floor_ms / nat, exact=exact))
            print(json.dumps(mine[-1]), flush=True)
    if args.profile:
        if paths[0] is not None:
            model.native_path = paths[0]
        for n in (1, 16):
            prof, total_us = profile_step(model, n, args.ctx)
            step = next((r["native_ms"] for r in mine if r["n"] == n), float("nan"))
            log(f"\n### {name}: profile of an eager native step, N={n} (torch.profiler, GPU time)\n")
            log(f"summed kernel time {total_us / 1e3:.3f} ms per step; graph-replayed step {step:.3f} ms; "
                f"{sum(r[2] for r in prof):.0f} kernels per step\n")
            log("| kernel | us per step | calls per step |")
            log("|---|---|---|")
            for k, us, calls in prof[:15]:
                log(f"| `{k[:90]}` | {us:.1f} | {calls:.0f} |")
    del model
    gc.collect()
    torch.cuda.empty_cache()
    hf = None
    if args.hf:
        try:
            hf = hf_bench(name, ns, args.ctx, max(3, args.iters // 2), 2, ref_prompt, ref_logits.cuda())
            log(f"\nHF transformers {__import__('transformers').__version__} twin loaded in {hf['load_s']:.0f} s "
                f"(same config, same weights); fla: {_fla_version()}; its prompt logits vs ds4t's: max rel "
                f"error {hf['rel_err']:.2e} (bf16: close, not equal)")
            log("HF row 0 of a batch of N equals the same row at N=1: "
                + ", ".join(f"N={n}: {'yes' if v else 'no'}" for n, v in hf["row0_equal"].items()))
        except Exception:
            log(f"\nHF transformers failed:\n```\n{traceback.format_exc()[-2000:]}```")
        torch.cuda.empty_cache()
    for r in mine:
        ms = hf["ms"].get(r["n"]) if hf else None
        r["hf_ms"] = ms
        r["hf_tok_s"] = r["n"] / ms * 1e3 if ms else None
        r["vs_hf"] = r["native_tok_s"] / r["hf_tok_s"] if ms else None
    rows += mine
    log(f"\n## {name}: decode step vs N (context {args.ctx} tokens per session, median of {args.iters})\n")
    log("| N | path | native ms (graphs) | native ms (eager) | ordered ms | HF ms | native tok/s | ordered tok/s | "
        "HF tok/s | native / HF | speed-up vs ordered | floor allows | floor ms | floor / native |")
    log("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in mine:
        hf_ms = f"{r['hf_ms']:.2f}" if r["hf_ms"] else "-"
        hf_t = f"{r['hf_tok_s']:.0f}" if r["hf_tok_s"] else "-"
        vs = f"{r['vs_hf']:.1f}x" if r["vs_hf"] else "-"
        log(f"| {r['n']} | {r['path']} | {r['native_ms']:.2f} | {r['eager_ms']:.2f} | {r['ordered_ms']:.2f} | {hf_ms} | "
            f"{r['native_tok_s']:.0f} | {r['ordered_tok_s']:.0f} | {hf_t} | {vs} | {r['speedup']:.2f}x | "
            f"{r['floor_speedup']:.2f}x | {r['floor_ms']:.3f} | {100 * r['floor_frac']:.0f}% |")


def _fla_version():
    try:
        import fla

        return getattr(fla, "__version__", "installed")
    except ImportError:
        return "not installed"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", "--model", default="qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l")
    ap.add_argument("--ns", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", type=int, default=256, help="tokens in each session before timing")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-rounds", type=int, default=1)
    ap.add_argument("--exact-sessions", type=int, default=16)
    ap.add_argument("--exact-steps", type=int, default=8)
    ap.add_argument("--paths", action="append", default=[],
                    help="MODEL=p1,p2: native paths to time for a model with a native_path option")
    ap.add_argument("--eager-ns", default=None, help="N values to time without CUDA graphs too (default: --ns)")
    ap.add_argument("--no-hf", dest="hf", action="store_false")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU time of a native step at N=1 and 16")
    ap.add_argument("--commit", default=None, help="commit to record (the device copy has no .git)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)
        with open(os.path.join(args.out, "decode.md"), "w") as f:
            f.write("\n".join(lines) + "\n")

    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip() or "unknown"
    log("# ds4t decode benchmark")
    log(f"commit {commit}; {torch.cuda.get_device_name()}; torch {torch.__version__}; "
        f"triton {__import__('triton').__version__}")
    log(f"command: python bench/bench_decode.py {' '.join(sys.argv[1:])}")
    bw = copy_bandwidth(dev)
    log(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    rows = []
    for name in args.models.split(","):
        bench_model(name, args, bw, log, rows)
        with open(os.path.join(args.out, "decode.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        plot(rows, os.path.join(args.out, "decode.png"))
    log("\n## Summary (N = 1 and 16)\n")
    log("| model | path | N | native tok/s | floor / native | native / HF | speed-up vs ordered (floor allows) |")
    log("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["n"] in (1, 16):
            vs = f"{r['vs_hf']:.1f}x" if r["vs_hf"] else "-"
            log(f"| {r['model']} | {r['path']} | {r['n']} | {r['native_tok_s']:.0f} | {100 * r['floor_frac']:.0f}% | "
                f"{vs} | {r['speedup']:.2f}x ({r['floor_speedup']:.2f}x) |")


if __name__ == "__main__":
    main()
