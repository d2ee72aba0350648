"""Same-process A/B of the nibble pack (``ds4t.kernels.qlinear.nibble_pack``: quant bytes one nibble bit trick
takes at once, 2 or 4) for the 4-bit GGUF linears, and of Q4_K's launch tiles, on one GPU.

    python bench/nibble_pack_ab.py                      # Q4_0 / Q4_1 / Q4_K at their configs, pack 2 vs 4
    python bench/nibble_pack_ab.py --q4k-tiles          # also Q4_K's former 4-warp wgmma entry and 2-warp tiles

Each launch constant is forced by replacing ``nibble_pack`` in the launchers' modules for the call, so both
variants compile in one process; CUDA graphs over two weight copies (nothing from L2), medians of ``--rounds``.
The pack changes no value, so the outputs of the two packs must be bitwise equal (checked); other tiles are
checked against ``linear_ref`` instead. A short table is printed last. What
bench/results/2026-12-05-h200-q4-nibbles.md measured (with scratch copies of qlinear.py; this script is the same
measurement on the committed code). ``--device cpu`` runs tiny shapes through the interpreter (a smoke test of
the script: the interpreter ignores the pack).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from ds4t.kernels import qlinear as Q  # noqa: E402
from ds4t.kernels import qmoe  # noqa: E402
from ds4t.kernels.linear import linear_ref  # noqa: E402
from ds4t.kernels.quant_blocks import quantize  # noqa: E402

SHAPES = [(7168, 36864), (2048, 151936)]


@contextlib.contextmanager
def forced_pack(pack):
    """Every launch in the block takes nibble pack ``pack`` (None: the launcher's own choice)."""
    if pack is None:
        yield
        return
    saved = Q.nibble_pack, qmoe.nibble_pack
    Q.nibble_pack = qmoe.nibble_pack = lambda num_warps, rows: pack
    try:
        yield
    finally:
        Q.nibble_pack, qmoe.nibble_pack = saved


def timer(dev):
    """ms per call of the callables ``fns``: bench_kernels' CUDA-graph timer on the GPU, wall time on the CPU."""
    if dev != "cpu":
        from bench.bench_kernels import time_calls

        return lambda fns: time_calls(fns)[0]

    def cpu(fns):
        t = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - t) * 1e3 / len(fns)
    return cpu


def copy_bandwidth(dev) -> float:
    if dev == "cpu":
        return float("nan")
    from bench.bench_kernels import copy_bandwidth as measured

    return measured()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q4_K")
    ap.add_argument("--bs", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--q4k-tiles", action="store_true",
                    help="also Q4_K at its former table tile (64 rows, 4 warps, 1 stage) and 2-warp tiles")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev, bf = args.device, torch.bfloat16
    shapes = SHAPES if dev != "cpu" else [(256, 96)]
    bs = [int(b) for b in args.bs.split(",")]
    run, bw = timer(dev), copy_bandwidth(dev)
    name = torch.cuda.get_device_name() if dev != "cpu" else "cpu (interpreter)"
    print(f"{name}; copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for K, N in shapes:
        for qt in args.types.split(","):
            ws = [quantize(torch.randn(N, K, device=dev, generator=g, dtype=bf) * K ** -0.5, qt, act_dtype=bf)
                  for _ in range(2)]
            xs = {B: torch.randn(B, K, device=dev, generator=g, dtype=bf) for B in bs}
            cfg = Q.qlinear_config(K, N, qt, bf)
            variants = [(f"pack {p}", cfg, p) for p in (2, 4)]
            if qt == "Q4_K" and args.q4k_tiles:
                old = Q.QLinearConfig(block_n=64, split=2 if K >= 4096 else 1, num_warps=4, num_stages=1, fold=True)
                variants += [("4-warp wgmma tile (before)", old, None)]
                variants += [(f"2w BN{bn} s{sp} st{st} pack {p}",
                              Q.QLinearConfig(block_n=bn, split=sp, num_warps=2, num_stages=st, fold=True), p)
                             for bn in (32, 64) for sp in (1, 2) for st in (3, 4) for p in (2, 4)]
            ref = linear_ref(xs[bs[-1]], ws[0])
            outs = {}
            for label, c, pack in variants:
                ms = {}
                for B in bs:
                    o = torch.empty(B, N, device=dev)

                    def call(w, o=o, x=xs[B], c=c, pack=pack):
                        with forced_pack(pack):
                            Q.launch(x, w, None, o, bf, c)
                    with forced_pack(pack):   # compile and capture under the forced pack
                        ms[B] = statistics.median([run([lambda w=w: call(w) for w in ws])
                                                   for _ in range(args.rounds)])
                with forced_pack(pack):
                    y = Q.launch(xs[bs[-1]], ws[0], None, torch.empty(bs[-1], N, device=dev), bf, c)
                outs[label] = y
                err = ((y - ref).abs().max() / ref.abs().max()).item()
                rows.append(dict(shape=f"{K} x {N}", type=qt, variant=label, ms=ms, err=err,
                                 pct={B: 100 * ws[0].nbytes / (ms[B] * 1e-3) / bw for B in bs}))
                r = rows[-1]
                print(f"  {r['shape']} {qt} {label}: " + ", ".join(f"B={B} {ms[B]:.4f} ms ({r['pct'][B]:.0f} %)"
                                                             for B in bs) + f", err {err:.1e}", flush=True)
            same = torch.equal(outs["pack 2"], outs["pack 4"])
            print(f"  {K} x {N} {qt}: pack 2 and pack 4 bitwise equal: {same}", flush=True)
            if not same:
                print("FAIL: the nibble pack changed bits", flush=True)
                return 1
            del ws
    print("\n| K x N | type | variant | " + " | ".join(f"B = {B} ms (%)" for B in bs) + " | sum ms | err |")
    print("|---|---|---|" + "---|" * len(bs) + "---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['type']} | {r['variant']} | "
              + " | ".join(f"{r['ms'][B]:.4f} ({r['pct'][B]:.0f} %)" for B in bs)
              + f" | {sum(r['ms'].values()):.4f} | {r['err']:.1e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
