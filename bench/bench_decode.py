"""Decode benchmark for one model on this device: exactness on the GPU, then step time vs N.

For a preset (default: the Qwen3-Next 80B-A3B-shaped 4-layer model, random bf16 weights):
  1. the exactness harness (native vs ordered, bitwise) on random session mixes, with its
     negative control;
  2. decode step time vs N in {1,2,4,8,16,32} for the native path and the ordered fallback
     (CUDA events around eval_batch, warm-up, medians), aggregate tok/s;
  3. the bytes floor of each step (weights read once per batch, expected unique routed experts,
     every session's state read + written) over the copy bandwidth measured in the same run.

Writes $OUT/<name>.md and .csv, prints a short table last.
Usage: python bench/bench_decode.py --model qwen3-next-80b-4l [--ns 1,2,4,8,16,32] [--ctx 256]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402
from ds4t.exactness.harness import plant, random_scenario, run_scenario  # noqa: E402


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
    params = model.parameters()
    rc = getattr(model, "router_cfg", None)
    E = rc.num_experts if rc else 0
    dense = routed = 0.0
    for name, t in params.items():
        b = t.numel() * t.element_size()
        if name == "embed" and "lm_head" in params:  # untied: only the n rows looked up
            dense += n * t.shape[1] * t.element_size()
        elif E and t.dim() == 3 and t.shape[0] in (E, E + 1):
            per_expert = b / t.shape[0]
            touched = E * (1 - (1 - rc.top_k / E) ** n) + (t.shape[0] - E)
            routed += per_expert * touched
        else:
            dense += b
    state = 0
    for name, spec in model.pool.specs.items():
        per = torch.Size(spec.concrete(1)).numel() * spec.dtype.itemsize
        state += n * per * ((ctx + 1) if spec.has_ctx else 2)
    return {"dense": dense, "routed": routed, "state": state, "total": dense + routed + state}


def time_steps(model, n: int, mode: str, ctx: int, iters: int, warmup: int = 3) -> float:
    rng = random.Random(n)
    sessions = [model.new_session(max_ctx=ctx + warmup + iters + 8) for _ in range(n)]
    for s in sessions:
        s.prefill([rng.randrange(model.vocab_size) for _ in range(ctx)], chunk=1024)
    toks = [rng.randrange(model.vocab_size) for _ in range(n)]
    items = lambda: [ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)]  # noqa: E731
    for _ in range(warmup):
        ds4t.eval_batch(items(), mode=mode)
    ts = []
    for _ in range(iters):
        torch.cuda.synchronize()
        s0, e0 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s0.record()
        res = ds4t.eval_batch(items(), mode=mode)
        e0.record()
        e0.synchronize()
        ts.append(s0.elapsed_time(e0))
        assert all(p == ("native" if mode == "native" else "ordered") for p in res.paths)
    for s in sessions:
        s.close()
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-next-80b-4l")
    ap.add_argument("--ns", default="1,2,4,8,16,32")
    ap.add_argument("--ctx", type=int, default=256, help="tokens in each session before timing")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-rounds", type=int, default=2)
    ap.add_argument("--exact-sessions", type=int, default=16)
    ap.add_argument("--exact-steps", type=int, default=12)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--tag", default=None)
    ap.add_argument("--paths", default=None,
                    help="comma list of native paths to time (models with a native_path option, e.g. full,ds4)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    tag = args.tag or args.model
    dev = torch.device("cuda")
    lines = []
    log = lambda s="": (print(s, flush=True), lines.append(s))  # noqa: E731
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout.strip()
    log(f"# ds4t decode benchmark: {args.model}")
    log(f"commit {commit}{' (+ uncommitted changes)' if dirty else ''}; {torch.cuda.get_device_name()}; "
        f"torch {torch.__version__}; triton {__import__('triton').__version__}")
    log(f"command: python bench/bench_decode.py {' '.join(sys.argv[1:])}")
    bw = copy_bandwidth(dev)
    log(f"measured copy bandwidth: {bw / 1e12:.2f} TB/s (read + write)")
    t0 = time.time()
    model = ds4t.load(args.model, device="cuda")
    torch.cuda.synchronize()
    log(f"loaded in {time.time() - t0:.0f} s: {model.family}, {model.dtype}, weights {model.weight_bytes() / 1e9:.2f} GB")

    # 1. exactness on the GPU
    log("\n## Exactness (native vs ordered, torch.equal on logits and every state tensor)\n")
    log("| round | sessions | steps | rows | states | mismatches | paths |")
    log("|---|---|---|---|---|---|---|")
    rng = random.Random(1)
    all_ok = True
    paths = args.paths.split(",") if args.paths else [None]
    for path in paths:
        if path is not None:
            model.native_path = path
        for r in range(args.exact_rounds):
            sc = random_scenario(rng, model.vocab_size, args.exact_sessions, args.exact_steps, max_prompt=200,
                                 max_ctx=200 + args.exact_steps + 8)
            rep = run_scenario(model, sc, mode="native")
            all_ok &= rep.ok
            label = f"{r}" if path is None else f"{r} ({path})"
            log(f"| {label} | {rep.sessions} | {rep.steps} | {rep.rows} | {rep.states} | {rep.mismatches} | {rep.paths} |")
    caught = {}
    for kind in ("ulp", "batch-dependent"):
        sc = random_scenario(random.Random(7), model.vocab_size, 4, 2, max_prompt=16, max_ctx=40)
        with plant(kind):
            caught[kind] = run_scenario(model, sc, mode="native").mismatches
    log(f"\nnegative control: planted 1-ulp deviation -> {caught['ulp']} mismatches; "
        f"batch-dependent linear -> {caught['batch-dependent']} mismatches")
    exact = all_ok and all(v > 0 for v in caught.values())
    log(f"exactness on GPU: {'PASS' if exact else 'FAIL'}")

    # 2./3. timing vs N with the bytes floor
    ns = [int(x) for x in args.ns.split(",")]
    rows = []
    for n in ns:
        fb = step_floor_bytes(model, n, args.ctx)
        floor_ms = fb["total"] / bw * 1e3
        ordd = time_steps(model, n, "ordered", args.ctx, max(3, args.iters // 2))
        for path in paths:
            if path is not None:
                model.native_path = path
            nat = time_steps(model, n, "native", args.ctx, args.iters)
            rows.append(dict(n=n, path=path or "native", native_ms=nat, ordered_ms=ordd, floor_ms=floor_ms,
                             floor_mb=fb["total"] / 1e6, native_tok_s=n / nat * 1e3, ordered_tok_s=n / ordd * 1e3,
                             speedup=ordd / nat, floor_frac=floor_ms / nat))
            print(json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, f"{tag}.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    log(f"\n## Decode step time vs N (context {args.ctx} tokens per session, median of {args.iters})\n")
    log("| N | path | native ms | ordered ms | native tok/s | ordered tok/s | speed-up | bytes floor MB | floor ms | native / floor |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['n']} | {r['path']} | {r['native_ms']:.2f} | {r['ordered_ms']:.2f} | {r['native_tok_s']:.0f} | "
            f"{r['ordered_tok_s']:.0f} | {r['speedup']:.2f}x | {r['floor_mb']:.0f} | {r['floor_ms']:.3f} | "
            f"{r['native_ms'] / r['floor_ms']:.1f}x |")
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
