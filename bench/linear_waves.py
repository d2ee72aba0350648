#!/usr/bin/env python
"""Where the decode linear's bandwidth goes by launch shape: waves, splits and scale blocks (issue 14 item 5,
issue 15 item 6).

    PYTHONUNBUFFERED=1 python bench/linear_waves.py --waves          # FP8 / Q8_0 at K = 7168 over N and tiles
    PYTHONUNBUFFERED=1 python bench/linear_waves.py --scale-blocks   # FP8 big shapes: splits x scale blocks x stages
    python bench/linear_waves.py --waves --smoke                      # CPU (interpreter), tiny shapes, no timing

Each row: a config of ``ds4t.kernels.linear.linear`` (bf16 activations, as the models hand them over; ``--waves``
also fp32), B = 1 and 16, timed in CUDA graphs (``bench_kernels.time_calls``: medians, two weights in rotation so
each call streams its weight from HBM), as % of the copy bandwidth on the weight's bytes (fp8 + scales, or the
GGUF blocks). Printed beside it: programs, registers and shared memory of the compiled kernel, programs an SM holds
(from those and the 64K registers / 228 KB an SM has), the launch's waves, and whether the output is bitwise the
table-shaped config's (``same-bits``: a config with the table's splits may replace it without changing a result).
A short table (B = 1, B = 16, summed ms) comes last.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_kernels import copy_bandwidth, time_calls  # noqa: E402
from ds4t.kernels import linear as L  # noqa: E402
from ds4t.kernels import qlinear as Q  # noqa: E402
from ds4t.kernels.quant_blocks import quantize as gguf_quantize  # noqa: E402
from ds4t.kernels.weights import quantize as fp8_quantize  # noqa: E402

FP8_BASE = L.LinearConfig(block_n=32, block_k=128, split=2, num_warps=2, num_stages=3, swap=True, fp8_route="f32")
Q8_BASE = Q.QLinearConfig(block_n=32, split=2, group=8, num_warps=2, num_stages=4, pair=True, fold=True)
"""The H200 table's entries for FP8 7168 x 18432 and Q8_0 7168 x 36864."""


def wave_cases():
    """(label, K, N, config, kind, reference label): the table's configs over N at K = 7168 (programs from
    0.6 to 2.9 resident sets), and tile / split variants of the table shapes."""
    r = dataclasses.replace
    out = [("fp8 table-config", 7168, n, FP8_BASE, "fp8") for n in (12288, 18432, 24576, 36864)]
    for lab, c in (("S1", r(FP8_BASE, split=1)), ("S4", r(FP8_BASE, split=4)),
                   ("BN16 w1", r(FP8_BASE, block_n=16, num_warps=1)), ("BN64 w2", r(FP8_BASE, block_n=64)),
                   ("BN64 w4", r(FP8_BASE, block_n=64, num_warps=4)), ("st4", r(FP8_BASE, num_stages=4)),
                   ("BN16 w1 S1", r(FP8_BASE, block_n=16, num_warps=1, split=1))):
        out.append((f"fp8 {lab}", 7168, 18432, c, "fp8"))
    t4 = r(FP8_BASE, split=4)
    out.append(("fp8 table-config", 18432, 7168, t4, "fp8"))
    for lab, c in (("S2", r(t4, split=2)), ("S8", r(t4, split=8)), ("BN16 w1", r(t4, block_n=16, num_warps=1)),
                   ("BN64 w2", r(t4, block_n=64))):
        out.append((f"fp8 {lab}", 18432, 7168, c, "fp8"))
    out += [("q8 table-config", 7168, n, Q8_BASE, "Q8_0") for n in (24576, 36864, 49152)]
    for lab, c in (("unpaired", r(Q8_BASE, pair=False)), ("S1", r(Q8_BASE, split=1)), ("S4", r(Q8_BASE, split=4)),
                   ("BN16 unpaired w1", r(Q8_BASE, block_n=16, pair=False, num_warps=1))):
        out.append((f"q8 {lab}", 7168, 36864, c, "Q8_0"))
    return out


def scale_block_cases():
    """The three FP8 shapes of >= 100 MB at the table's config, then every split 1 / 2 / 4 x scale blocks a step
    1 / 2 / 4 x stages 2 / 3 / 4 whose splits fall on whole steps."""
    r = dataclasses.replace
    out = []
    for K, N, S in ((7168, 18432, 2), (18432, 7168, 4), (16384, 7168, 4)):
        out.append(("fp8 table-config", K, N, r(FP8_BASE, split=S), "fp8"))
        for s in (1, 2, 4):
            for sb in (1, 2, 4):
                for st in ((3,) if sb == 1 else (2, 3, 4)):
                    if (s, sb) == (S, 1) or (K // 128) % (s * sb):
                        continue
                    out.append((f"fp8 S{s} sb{sb} st{st}", K, N, r(FP8_BASE, split=s, scale_blocks=sb, num_stages=st),
                                "fp8"))
    return out


def compiled_info(fn):
    """(registers, shared bytes, warps) of the variant of jit function ``fn`` compiled last (None if unknown)."""
    try:
        k = list(fn.device_caches[torch.cuda.current_device()][0].values())[-1]
        return k.n_regs, k.metadata.shared, k.metadata.num_warps
    except Exception:
        return None, None, None


def resident(regs, shared, warps, sms):
    """Programs the GPU holds at once: registers allocated per warp in 256s out of 64K an SM, shared memory
    (plus 1 KB reserved a program) out of 228 KB, at most 32 programs and 64 warps an SM."""
    if regs is None:
        return None
    per_warp = math.ceil(regs * 32 / 256) * 256
    by_smem = 233472 // (shared + 1024) if shared else 32
    return min(32, 64 // warps, 65536 // (per_warp * warps), by_smem) * sms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--waves", action="store_true")
    ap.add_argument("--scale-blocks", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, shapes / 28 and / 72, no timing")
    args = ap.parse_args()
    smoke = args.smoke
    dev = "cpu" if smoke else "cuda"
    cases = (wave_cases() if args.waves else []) + (scale_block_cases() if args.scale_blocks else [])
    if not cases:
        ap.error("--waves and/or --scale-blocks")
    xdts = (torch.bfloat16, torch.float32) if args.waves else (torch.bfloat16,)
    g = torch.Generator(device=dev).manual_seed(0)
    sms = 132 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
    bw = 1.0 if smoke else copy_bandwidth()[0]
    print(f"{'interpreter' if smoke else torch.cuda.get_device_name()}: copy {bw / 1e12:.3f} TB/s, {sms} SMs",
          flush=True)
    weights, refs, xs_of, rows = {}, {}, {}, []
    for label, K, N, cfg, kind in cases:
        if smoke:
            K, N = K // 28, N // 72
        if (K, N, kind) not in weights:
            w = [torch.randn(N, K, generator=g, device=dev) / K ** 0.5 for _ in range(2)]
            weights[(K, N, kind)] = ([fp8_quantize(v) for v in w] if kind == "fp8" else
                                     [gguf_quantize(v, kind, act_dtype=torch.bfloat16) for v in w])
        ws = weights[(K, N, kind)]
        nbytes = N * K + N * math.ceil(K / 128) * 4 if kind == "fp8" else ws[0].nbytes
        for xdt in xdts if kind == "fp8" else (torch.bfloat16,):
            for B in (1, 16):
                xs = xs_of.setdefault((K, B, xdt), [torch.randn(B, K, generator=g, device=dev).to(xdt)
                                                    for _ in range(2)])
                outs = [torch.empty(B, N, device=dev) for _ in range(2)]
                fns = [lambda i=i: L.linear(xs[i], ws[i], None, out=outs[i], config=cfg, act_dtype=torch.bfloat16)
                       for i in range(2)]
                fns[0]()
                key = (K, N, kind, xdt, B)
                if label.endswith("table-config"):
                    refs.setdefault(key, outs[0].clone())
                same = bool(torch.equal(refs[key], outs[0])) if key in refs else None
                ms = float("nan") if smoke else time_calls(fns)[0]
                regs, shared, warps = compiled_info(L._linear_kernel if kind == "fp8" else Q._qlinear_kernel)
                if kind == "fp8":
                    progs = math.ceil(N / cfg.block_n) * math.ceil(K / cfg.k_per_split(K, 128))
                else:
                    progs = (math.ceil(N / (cfg.block_n * (2 if cfg.pair else 1)))
                             * math.ceil(K / cfg.k_per_split(K, kind)))
                res = resident(regs, shared, warps or cfg.num_warps, sms)
                pct = nbytes / (ms * 1e-3) / bw * 100
                rows.append((label, K, N, str(xdt)[6:], B, ms, pct, same))
                print(f"{label:20s} {K:5d}x{N:<6d} x={str(xdt)[6:]:8s} B={B:2d} {ms:.4f} ms {pct:5.1f}% programs={progs:5d} "
                      f"regs={regs} smem={shared} resident={res} waves={progs / res if res else float('nan'):.2f} "
                      f"same-bits={same}", flush=True)
    print("\n| shape | config | x | B = 1 | B = 16 | B = 1 + 16 ms | same bits as the table's config |")
    print("|---|---|---|---|---|---|---|")
    by = collections.defaultdict(dict)
    for label, K, N, xdt, B, ms, pct, same in rows:
        by[(K, N, label, xdt)][B] = (ms, pct, same)
    for (K, N, label, xdt), d in by.items():
        print(f"| {K} x {N} | {label} | {xdt} | {d[1][1]:.1f} % | {d[16][1]:.1f} % | {d[1][0] + d[16][0]:.4f} | "
              f"{d[1][2]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
