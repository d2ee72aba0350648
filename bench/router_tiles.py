#!/usr/bin/env python
"""Tiles of the small latency-bound linears of a decode step, each against the table's config, bits and time:
the fp32 MoE routers (GLM-4.5's 5120 x 160, DeepSeek-V3's 7168 x 256) and, with ``--heads``, MLA's absorbed
per-head weights (``linear_heads``, bf16: DeepSeek-V3's W_UK [128, 512, 128] and W_UV [128, 128, 512]).

An fp32 weight's product is IEEE fp32 (``backend.mma``), which Triton lowers to FMA chains: each output sums its
split's K columns in order whatever the tile, so every tile that keeps the split's columns (``k_per_split``) keeps
the bits. bf16 tiles keep them on Hopper too (``bench/mma_shapes.py``; checked here again). This script times each
such tile (rows of N, K columns a step, warps, stages) -- the weights rotated past L2 (routers) or in 4 copies
(per-head weights) in a CUDA graph (``bench_kernels.time_calls``), median us a call -- checks each output against
the table's bit for bit, and writes the best same-bits tile of each shape (summed over the row counts) in the
``ds4t.kernels.config.overridden`` format, which ``bench/step_ab.py --variant`` takes: a tile goes into the table
only once a whole step says so (the per-head tiles were 13-17 % faster alone and moved no step).

    python bench/router_tiles.py [--heads] [--budget-s 100] [--out DIR]
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
from bench.bench_kernels import time_calls  # noqa: E402
from ds4t.kernels import config as C  # noqa: E402
from ds4t.kernels import linear as L  # noqa: E402

SHAPES = (("deepseek-v3 router", 7168, 256), ("glm-4.5 router", 5120, 160))
HEADS = (("deepseek-v3 W_UK", 128, 512, 128), ("deepseek-v3 W_UV", 128, 128, 512))   # (name, G, N, K)
GRID = dict(block_n=(16, 32, 64), block_k=(16, 32, 64), num_warps=(1, 2, 4), num_stages=(2, 4, 6))
HEADS_GRID = dict(block_n=(16, 32, 64, 128), block_k=(64, 128), num_warps=(2, 4, 8), num_stages=(2, 3, 4))


def cases(heads: bool) -> list:
    """(name, K, N, weight dtype, weights(g), x(B, g), call(x, w), grid) of each shape swept."""
    if not heads:
        return [(name, K, N, torch.float32,
                 lambda g, K=K, N=N: [torch.randn(N, K, device="cuda", generator=g) / K ** 0.5 for _ in range(16)],
                 lambda B, g, K=K: torch.randn(B, K, device="cuda", generator=g),
                 lambda x, w: L.linear_parts(x, w).part, GRID) for name, K, N in SHAPES]
    return [(name, K, N, torch.bfloat16,
             lambda g, G=G, K=K, N=N: [torch.randn(G, N, K, device="cuda", generator=g).bfloat16() for _ in range(4)],
             lambda B, g, G=G, K=K: torch.randn(B, G, K, device="cuda", generator=g).bfloat16(),
             L.linear_heads, HEADS_GRID) for name, G, N, K in HEADS]


def same_split_tiles(base: "L.LinearConfig", K: int, grid: dict = GRID) -> list:
    """The fields of every ``grid`` tile that keeps ``base``'s columns a split (so its bits), ``{}`` (the
    table's own config) first."""
    kps = base.k_per_split(K)
    out = [{}]
    for vals in itertools.product(*grid.values()):
        f = dict(zip(grid, vals))
        if dataclasses.replace(base, **f).k_per_split(K) == kps and f != {k: getattr(base, k) for k in f}:
            out.append(f)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", action="store_true", help="MLA's per-head weights instead of the routers")
    ap.add_argument("--budget-s", type=float, default=100.0)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0, totals = time.time(), {}
    print(f"# {'per-head weight' if args.heads else 'fp32 router'} tiles on {torch.cuda.get_device_name()}")
    for name, K, N, wdt, weights, make_x, call, grid in cases(args.heads):
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = weights(g)
        base = L.LINEAR_CONFIGS(K, N, wdt)
        key = [K, N, str(wdt)]
        print(f"\n## {name}, K={K} N={N}: table {base} ({ws[0].numel() * ws[0].element_size() / 1e6:.1f} MB)")
        cands = same_split_tiles(base, K, grid)
        for B in (int(b) for b in args.rows.split(",")):
            x = make_x(B, g)
            ref = call(x, ws[0]).clone()
            rows = []
            for f in cands:
                if time.time() - t0 > args.budget_s:
                    print("  (budget spent)")
                    break
                with C.overridden({"linear": [{"key": key, "fields": f}]}):
                    same = torch.equal(call(x, ws[0]), ref)
                    us = time_calls([lambda w=w: call(x, w) for w in ws])[0] * 1e3
                rows.append((us, f, same))
                if same:
                    k = (K, N, str(wdt), json.dumps(f, sort_keys=True))
                    us_sum, n = totals.get(k, (0.0, 0))
                    totals[k] = (us_sum + us, n + 1)
            rows.sort(key=lambda r: r[0])
            table = next((r[0] for r in rows if not r[1]), float("nan"))
            print(f"B={B}: table {table:.2f} us; other bits in {sum(not r[2] for r in rows)} of {len(rows)} tiles")
            for us, f, same in rows[:8]:
                print(f"  {us:7.2f} us  {'same bits' if same else 'OTHER BITS'}  {f or 'table'}")
    # a tile ranks on its sum over every row count, so only tiles timed -- with the table's bits -- at all of them
    n_rows = len(args.rows.split(","))
    best = {}
    for (K, N, wdt, f), (us, n) in sorted(totals.items(), key=lambda kv: kv[1][0]):
        if n == n_rows:
            best.setdefault((K, N, wdt), f)
    spec = {"linear": [{"key": [K, N, wdt], "fields": json.loads(f)} for (K, N, wdt), f in best.items()
                       if f != "{}"]}
    with open(os.path.join(args.out, "best_tiles.json"), "w") as fh:
        json.dump(spec, fh)
    print("\nbest same-bits tiles (summed over the rows):", json.dumps(spec))


if __name__ == "__main__":
    main()
