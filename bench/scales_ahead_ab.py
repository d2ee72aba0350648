"""A/B of ``MoEConfig.scales_ahead`` (the FP8 down kernel loading each step's scales a step early) against the
GPU table's down entry, the same process, alternating rounds: the grouped MoE call at the three families'
expert shapes (FP8, bf16 activations), N = 1 / 2 / 16, routings rotated so the experts read exceed 4x the L2
(bench/moe_tiles.py ``rotations``), each call a CUDA graph; outputs compared bitwise against the table's.

    python3 bench/scales_ahead_ab.py [--rounds 5] [--out DIR]

Why (bench/results/2026-12-07-h100-fp8-moe-stalls.md): Nsight's stall sampling put 23-26 % of the one-row down
kernel's warp samples on the store that relays each step's scale vector to the accumulator's layout, waiting
on that step's own scale load.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.moe_tiles import rotations  # noqa: E402
from bench.report import Report  # noqa: E402
from ds4t.kernels import moe as M  # noqa: E402
from ds4t.kernels.weights import quantize  # noqa: E402

SHAPES = [("qwen3-next", 512, 512, 2048, 10), ("glm-4.5", 160, 1536, 5120, 8), ("deepseek-v3", 64, 2048, 7168, 8)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--ns", default="1,2,16")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    log = Report()
    log(f"{torch.cuda.get_device_name()}; torch {torch.__version__}")
    log("| shape | N | MB a call | table us | scales ahead us | change | bits |")
    log("|---|---|---|---|---|---|---|")
    ok = True
    table = M.MOE_CONFIGS.gpu_entries()
    rule = M.MOE_CONFIGS.gpu_rule
    for name, E, I, D, k in SHAPES:
        ws = [quantize(torch.randn(E, n, kk, device=dev, generator=g, dtype=torch.bfloat16) * kk ** -0.5)
              .with_act_dtype(torch.bfloat16) for n, kk in ((I, D), (I, D), (D, I))]
        per_expert = sum(w.nbytes for w in ws) / E
        for N in [int(v) for v in args.ns.split(",")]:
            touched = min(E, N * k)
            R = rotations(per_expert * touched, l2)
            h = torch.randn(N, D, device=dev, generator=g).to(torch.bfloat16)
            idss = [torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(N)]).to(torch.int32)
                    for _ in range(R)]
            wts = torch.rand(N, k, device=dev, generator=g)

            def cfg_for(ahead):
                def f(*key):
                    c = table(*key) or rule(*key)
                    return dataclasses.replace(c, scales_ahead=True) if ahead and key[0] == "down" else c
                return f

            graphs, outs = {}, {}
            for ahead in (False, True):
                with M.MOE_CONFIGS.forced(cfg_for(ahead)):
                    calls = [lambda ids=ids: M.moe_experts(h, ids, wts, *ws) for ids in idss]
                    outs[ahead] = [c() for c in calls]
                    torch.cuda.synchronize()
                    gr = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gr):
                        for c in calls:
                            c()
                    graphs[ahead] = gr
            same = all(torch.equal(a, b) for a, b in zip(outs[False], outs[True]))
            ok &= same
            times = {False: [], True: []}
            for r in range(args.rounds):
                for ahead in ((False, True) if r % 2 == 0 else (True, False)):
                    gr = graphs[ahead]
                    gr.replay()
                    torch.cuda.synchronize()
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record()
                    for _ in range(args.iters):
                        gr.replay()
                    e.record()
                    torch.cuda.synchronize()
                    times[ahead].append(s.elapsed_time(e) * 1e3 / args.iters / R)
            a, b = statistics.median(times[False]), statistics.median(times[True])
            log(f"| {name} (E {E}, I {I}, D {D}, top-{k}) | {N} | {per_expert * touched / 1e6:.0f} | {a:.1f} | "
                f"{b:.1f} | {100 * (b - a) / a:+.1f} % | {'=' if same else 'DIFFER'} |")
        del ws
        torch.cuda.empty_cache()
    log(f"\nbits as the table's in every cell: {ok}")
    os.makedirs(args.out, exist_ok=True)
    log.write(args.out, "scales_ahead_ab.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
