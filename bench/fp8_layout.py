#!/usr/bin/env python
"""FP8 rows under the layout barrier (``DS4T_FP8_BARRIER``): the same bits across tiles, and what decode pays.

    PYTHONUNBUFFERED=1 python bench/fp8_layout.py [--shapes 7168x18432,18432x7168,16384x7168,2048x12352]
        [--rows 1024] [--tiles 128x128x64w8s3,64x128x64w4s3] [--out DIR]

FP8 weights have had no row tiles: a converted fp8 tile's operand layout follows its 8-bit load (kWidth 4 on
mma.sync, 2 on wgmma), so an FP8 row's bits changed with the tile. ``DS4T_FP8_BARRIER=1`` gives the converted tile
the 16-bit layout (``ds4t.backend.FP8_LAYOUT_BARRIER``). The parent runs one child process per setting, off and on
(the backend reads the switch at import and a compiled kernel keeps the value it saw); each child, for each FP8
weight shape (128 x 128 scale blocks, x in bf16 as the models hand it over, the decode config of the table):

* bits: a ``--rows``-row launch on each row tile (``BMxBNxBKwWARPSsSTAGES``) against the same rows on the decode
  config's tiles (whose rows are each row alone's: the batch-invariance tests) -- equal or not. With the switch
  off they are expected to differ (the control: the comparison sees a tile's K order);
* time: the decode config at B = 1 and 16 (us, % of copy bandwidth over the fp8 values + scales), and the
  ``--rows``-row launch on the decode tiles and on each row tile (TFLOP/s, % of the bf16 matmul peak);
* the grouped MoE over FP8 experts (GLM-4.5's and Qwen3-Next's shapes, random top-k routing, ``--rows`` rows):
  the table's rows entries against wgmma-sized pair tiles (``--moe-rows``), the combined output bit for bit and
  the call timed.

The tables of the two children come last, side by side. Needs a CUDA GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, ROOT)
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
from bench.report import Report  # noqa: E402

SHAPES = "7168x18432,18432x7168,16384x7168,2048x12352"
TILES = "128x128x64w8s3,64x128x64w4s3"
MOE_SHAPES = {"glm-4.5": (160, 8, 5120, 1536), "qwen3-next": (512, 10, 2048, 512)}
"""Routed experts E, top-k, D, I of the grouped MoE's FP8 launches (plus one shared expert of the same size)."""
MOE_ROWS = "64x64x64w4s3,32x64x64w4s3"
"""Candidate FP8 rows entries of the grouped kernels: pairs x weight rows x K a step, warps, stages (one config for
gate/up and down), in place of the table's ("rows",) entries (the decode tiles, 16 or 2 x 16 pairs). Compiled for
sm_90 (Triton 3.6): 64 x 64 on 4 warps fits (gate/up 255 registers, 48 bytes of stack; down 247, none); 64 x 128
spills in the gate/up loop on 4 or 8 warps (its f32 route holds a block's dot and the running sum for gate and up)."""


def moe_rows(args, gen, dev) -> list:
    """The grouped MoE over FP8 experts at ``--rows`` rows (random routing): the table's rows entries against
    each candidate of ``--moe-rows`` -- the combined output bit for bit, and the call timed."""
    from bench.bench_kernels import time_calls
    from bench.linear_rows import parse_tile
    from ds4t.kernels import moe as M
    from ds4t.kernels.config import overridden
    from ds4t.kernels.weights import quantize

    out = []
    for name in args.moe_shapes.split(","):
        E, k, D, I = MOE_SHAPES[name]
        wg, wu, wd = (quantize(torch.randn(E + 1, n, kk, generator=gen, device=dev) / kk ** 0.5)
                      for n, kk in ((I, D), (I, D), (D, I)))
        h = torch.randn(args.rows, D, generator=gen, device=dev).to(torch.bfloat16)
        scores = torch.rand(args.rows, E, generator=gen, device=dev)
        ids = scores.topk(k, dim=-1).indices.to(torch.int32)
        wts = torch.rand(args.rows, k, generator=gen, device=dev)
        y = torch.empty(args.rows, D, device=dev)

        def call(out_=None):
            return M.moe_experts(h, ids, wts, wg, wu, wd, shared_expert=E, act_dtype=torch.bfloat16, out=out_)

        base = call().clone()
        ms, _ = time_calls([lambda: call(y)])
        out.append(dict(shape=f"MoE {name}", what=f"{args.rows} rows, table", us=ms * 1e3, bits="base", of="-"))
        for spec in (t for t in args.moe_rows.split(",") if t):
            t = parse_tile(spec)
            fields = dict(tile_n=t.block_n, tile_k=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
                          block_m=t.block_m, m_sub=1, m_sub_pairs=0, swap=False)
            with overridden({"moe": [{"key": [kernel, "fp8", "rows"], "fields": fields}
                                     for kernel in ("gate_up", "down")]}):
                got = call().clone()
                ms, _ = time_calls([lambda: call(y)])
            out.append(dict(shape=f"MoE {name}", what=f"{args.rows} rows, {spec}", us=ms * 1e3,
                            bits="=" if torch.equal(got.view(torch.int32), base.view(torch.int32)) else "DIFFER",
                            of="-"))
    return out


def child(args) -> list:
    """One row a (shape, what): {shape, what, us, bits, of} under this process's barrier setting."""
    from bench.bench_decode import copy_bandwidth
    from bench.bench_kernels import time_calls
    from bench.bench_prefill import matmul_peak
    from bench.linear_rows import parse_tile, same_bits, tile_str
    from ds4t.kernels import linear as L
    from ds4t.kernels.weights import quantize

    dev = torch.device("cuda")
    bw, peak = copy_bandwidth(dev), matmul_peak(dev)
    tiles = [parse_tile(s) for s in args.tiles.split(",") if s]
    gen = torch.Generator(device=dev).manual_seed(0)
    out = []
    for shape in args.shapes.split(","):
        K, N = (int(v) for v in shape.split("x"))
        w = quantize(torch.randn(N, K, generator=gen, device=dev) / K ** 0.5)
        nbytes = w.data.numel() + w.scale.numel() * 4
        cfg = L.linear_config(K, N, L.FP8_DTYPE, torch.bfloat16, w.block_k)
        for B in (1, 16):
            x = torch.randn(B, K, generator=gen, device=dev).to(torch.bfloat16)
            y = torch.empty(B, N, device=dev)
            ms, _ = time_calls([lambda x=x, y=y: L._launch(x, w, None, y, cfg, torch.bfloat16, ())])
            out.append(dict(shape=shape, what=f"decode B = {B}", us=ms * 1e3, bits="-",
                            of=f"{100 * nbytes / (ms * 1e-3) / bw:.0f} % of copy BW"))
        x = torch.randn(args.rows, K, generator=gen, device=dev).to(torch.bfloat16)
        y = torch.empty(args.rows, N, device=dev)
        flop = 2.0 * args.rows * K * N
        base = L._launch(x, w, None, torch.empty(args.rows, N, device=dev), cfg, torch.bfloat16, ()).clone()
        for label, row_tiles in [("decode tiles", ())] + [(tile_str(t), (t,)) for t in tiles]:
            got = L._launch(x, w, None, torch.empty(args.rows, N, device=dev), cfg, torch.bfloat16, row_tiles)
            ms, _ = time_calls([lambda rt=row_tiles: L._launch(x, w, None, y, cfg, torch.bfloat16, rt)])
            out.append(dict(shape=shape, what=f"{args.rows} rows, {label}", us=ms * 1e3,
                            bits="base" if not row_tiles else ("=" if same_bits(got, base) else "DIFFER"),
                            of=f"{100 * flop / (ms * 1e-3) / peak:.0f} % of the bf16 peak"))
    return out + moe_rows(args, gen, dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=SHAPES, help="FP8 weights KxN,...")
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--tiles", default=TILES, help="row tiles BMxBNxBKwWARPSsSTAGES,...")
    ap.add_argument("--moe-shapes", default=",".join(MOE_SHAPES), help="grouped MoE shapes: " + ",".join(MOE_SHAPES))
    ap.add_argument("--moe-rows", default=MOE_ROWS, help="FP8 MoE rows entries BMxBNxBKwWARPSsSTAGES,...")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_layout: needs a CUDA GPU")
    if args.child:
        print(json.dumps(child(args)))
        return 0
    log = Report()
    runs = {}
    for barrier in ("0", "1"):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--shapes", args.shapes, "--rows", str(args.rows),
               "--tiles", args.tiles, "--moe-shapes", args.moe_shapes, "--moe-rows", args.moe_rows]
        p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, DS4T_FP8_BARRIER=barrier))
        if p.returncode != 0:
            log(f"barrier {barrier}: the child failed\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
            return 1
        runs[barrier] = json.loads(p.stdout.strip().splitlines()[-1])
    log(f"# FP8 rows with and without the layout barrier, {torch.cuda.get_device_name()}")
    log("")
    log("| shape | launch | off: us | off: bits | on: us | on: bits | on / off | on: of |")
    log("|---|---|---|---|---|---|---|---|")
    for off, on in zip(runs["0"], runs["1"]):
        log(f"| {off['shape']} | {off['what']} | {off['us']:.1f} | {off['bits']} | {on['us']:.1f} | {on['bits']} | "
            f"{on['us'] / off['us']:.3f} | {on['of']} |")
    held = all(r["bits"] in ("base", "-", "=") for r in runs["1"])
    caught = any(r["bits"] == "DIFFER" for r in runs["0"])
    log("")
    log(f"row tiles keep the decode tiles' bits with the barrier: {held}; without it some differ (control): {caught}")
    if args.out:
        log.write(args.out, "fp8_layout.md")
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
