"""Speculative decoding on the GPU: exactness, MTP acceptance, and the verify path's speed vs acceptance.

For each preset (default: the three 4-layer presets, random bf16 weights with random MTP heads) and
each N (default 1, 16, 64), in one run:
  1. plain greedy decoding of N sessions (prompts of --prompt tokens, --tokens new tokens each):
     eval_batch native, CUDA graphs and eager; tokens and time recorded;
  2. MTP drafts (k = --k): speculative steps with the model's own head; acceptance measured
     (random weights: drafts are almost never right) and the emitted tokens checked against 1;
  3. replayed drafts: the recorded greedy tokens, each draft kept with probability p and
     otherwise replaced (p dials the acceptance, 0..100 %); tokens/s of the speculative run against
     plain decoding, every run's tokens checked against 1. Labelled "replayed drafts": they show
     what the verify path costs and yields at a given acceptance, not what the random MTP head drafts.

Timing: wall clock around whole runs with torch.cuda.synchronize (the verify steps run eagerly:
their rows are not a pure decode batch; plain decoding is shown with and without CUDA graphs).
Writes $OUT/mtp.md and mtp.jsonl; the short table is printed last.
Usage: python bench/bench_mtp.py [--models qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l] [--ns 1,16,64]
       [--k 3] [--tokens 24] [--prompt 64] [--accept 0,0.5,0.8,1]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402
from ds4t.batch import speculative as spec  # noqa: E402
from ds4t.batch.graphs import suspended  # noqa: E402
from bench.report import Report  # noqa: E402


def sync(model):
    if model.device.type == "cuda":
        torch.cuda.synchronize()


def prompts_for(n: int, length: int, vocab: int, seed: int):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


def plain_run(model, prompts, tokens: int, graphs: bool):
    """Greedy plain decoding; (tokens per session, seconds for the decode steps)."""
    ss = [model.new_session(len(prompts[0]) + tokens + 8) for _ in prompts]
    try:
        lg = ds4t.eval_batch([ds4t.DecodeItem(s, p) for s, p in zip(ss, prompts)]).logits
        out = [[t] for t in lg.argmax(dim=1).tolist()]
        sync(model)
        t0 = time.perf_counter()
        ctx = suspended() if not graphs else _null()
        with ctx:
            for _ in range(tokens - 1):
                lg = ds4t.eval_batch([ds4t.DecodeItem(s, o[-1]) for s, o in zip(ss, out)], mode="native").logits
                for o, t in zip(out, lg.argmax(dim=1).tolist()):
                    o.append(t)
        sync(model)
        return out, time.perf_counter() - t0
    finally:
        for s in ss:
            s.close()


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def spec_run(model, prompts, tokens: int, k: int, drafts_from=None, p_keep: float = 1.0, seed: int = 0):
    """Speculative greedy decoding; drafts from the MTP head (``drafts_from`` None) or replayed from
    ``drafts_from`` (the plain run's tokens), each kept with probability ``p_keep``.
    Returns (tokens per session, seconds, calls, drafted, accepted)."""
    rng = random.Random(seed)
    V = model.vocab_size
    ss = [model.new_session(len(prompts[0]) + tokens + k + 8) for _ in prompts]
    try:
        lg = spec.prefill([ds4t.DecodeItem(s, p) for s, p in zip(ss, prompts)])
        out = [[t] for t in lg.argmax(dim=1).tolist()]
        calls = drafted = accepted = 0
        sync(model)
        t0 = time.perf_counter()
        while any(len(o) < tokens for o in out):
            live = [i for i, o in enumerate(out) if len(o) < tokens]
            items = []
            for i in live:
                d = None
                if drafts_from is not None:
                    fut = drafts_from[i][len(out[i]):len(out[i]) + k]
                    d = [t if rng.random() < p_keep else (t + 1 + rng.randrange(V - 1)) % V for t in fut]
                    d += [0] * (k - len(d))
                items.append(spec.SpecItem(ss[i], out[i][-1], k=k, drafts=d, max_tokens=tokens - len(out[i])))
            res, _ = spec.spec_step(items, mode="native")
            calls += 1
            for i, r in zip(live, res):
                out[i] += r.tokens
                drafted += r.drafted
                accepted += r.accepted
        sync(model)
        return out, time.perf_counter() - t0, calls, drafted, accepted
    finally:
        for s in ss:
            s.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--accept", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.5, 0.8, 1.0])
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log, rows = Report(), []

    dev = ds4t.backend.device_name()
    log(f"# ds4t speculative decoding (MTP) on {dev}")
    log(f"commit {args.commit}; torch {torch.__version__}; k = {args.k}, {args.tokens} tokens per session, "
        f"prompts of {args.prompt} tokens, greedy")
    ok_all = True
    for name in args.models.split(","):
        model = ds4t.load(name)
        log(f"\n## {name}\n\nMTP head: {'yes' if model.mtp is not None else 'no'}\n")
        log("| N | run | acceptance | verify calls | s | tok/s | vs plain (graphs) | tokens == plain |")
        log("|---|---|---|---|---|---|---|---|")
        for n in args.ns:
            prompts = prompts_for(n, args.prompt, model.vocab_size, seed=n)
            plain_run(model, prompts, 4, graphs=True)                    # warm-up: compile, capture
            ref, t_graph = plain_run(model, prompts, args.tokens, graphs=True)
            _, t_eager = plain_run(model, prompts, args.tokens, graphs=False)
            tok = n * (args.tokens - 1)
            log(f"| {n} | plain, CUDA graphs | - | {args.tokens - 1} | {t_graph:.3f} | {tok / t_graph:.0f} | 1.00x | - |")
            log(f"| {n} | plain, eager | - | {args.tokens - 1} | {t_eager:.3f} | {tok / t_eager:.0f} | "
                f"{t_graph / t_eager:.2f}x | - |")
            runs = []
            if model.mtp is not None:
                spec_run(model, prompts, 6, args.k)                       # warm-up
                runs.append(("MTP drafts", None, 1.0))
            runs += [(f"replayed drafts, p = {p:.0%}", ref, p) for p in args.accept]
            for label, src, p in runs:
                out, t, calls, drafted, accepted = spec_run(model, prompts, args.tokens, args.k, src, p, seed=n)
                same = out == ref
                ok_all = ok_all and same
                acc = accepted / drafted if drafted else 0.0
                log(f"| {n} | {label} | {acc:.0%} | {calls} | {t:.3f} | {tok / t:.0f} | {t_graph / t:.2f}x | "
                    f"{'yes' if same else 'NO'} |")
                rows.append(dict(model=name, n=n, run=label, acceptance=acc, calls=calls, seconds=t,
                                 tok_s=tok / t, plain_graph_s=t_graph, plain_eager_s=t_eager, exact=same))
            with open(os.path.join(args.out, "mtp.jsonl"), "w") as f:
                f.write("\n".join(json.dumps(r) for r in rows) + "\n")
        del model
        torch.cuda.empty_cache()
    log(f"\nexact on GPU (every speculative run's tokens == plain greedy): {'PASS' if ok_all else 'FAIL'}")
    log("\n## Summary")
    for r in rows:
        log(f"{r['model']} N={r['n']} {r['run']}: acceptance {r['acceptance']:.0%}, {r['tok_s']:.0f} tok/s, "
            f"{r['plain_graph_s'] / r['seconds']:.2f}x plain (graphs), {'exact' if r['exact'] else 'NOT EXACT'}")
    log.write(args.out, "mtp.md")   # last: the summary is in the file too
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
