#!/usr/bin/env python
"""Prefill row tiles of the 16-bit linear: TFLOP/s of candidate tiles at the three families' weight shapes.

A launch of >= 128 rows (a prefill chunk) runs ``linear`` with a :class:`ds4t.kernels.linear.RowTile` in place of
the decode tiles; only the tile shape changes, never the split-K count or the K order, so the rows keep their bits
(``bench/mma_shapes.py``; checked here again for every candidate). This script times the row tiles the table could
hold at each weight shape of GLM-4.5, DeepSeek-V3 and Qwen3-Next (their prefill linears, bf16 weights, x in the
dtype the models hand over), beside

* the same launch without its split-K (``split`` 1: other bits, printed only to show what the decode config's split
  costs a prefill chunk -- partials written and summed),
* cuBLAS on the same operands (``x.bf16() @ w.T``, bf16 out: the non-invariant peer),

and reports TFLOP/s and the fraction of the bf16 matmul peak measured in the same process.

    PYTHONUNBUFFERED=1 python bench/linear_rows.py [--rows 1024] [--families glm,deepseek,qwen] [--out DIR]
        [--tiles 128x256x64w8s3,128x128x64w4s4,...]

A tile is ``BMxBNxBKwWARPSsSTAGES``, then ``f`` for a tile that folds a split-K config's splits into its program
(``RowTile.fold_splits``; timed at split shapes only) and ``t`` for one that loads through tensor descriptors
(``RowTile.tma``; x in bf16 only: an fp32 x takes the pointer loads). The first row of every shape is the table's
own tile ("table").
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
from bench.bench_kernels import time_calls  # noqa: E402
from bench.bench_prefill import matmul_peak  # noqa: E402
from bench.report import Report  # noqa: E402
from ds4t.kernels import linear as L  # noqa: E402

# (name, K, N, x dtype) of each family's prefill linears with bf16 weights, as the models launch them (listed by
# bench/row_tiles_ab.py): x is bf16 where the models store the norm / swiglu / attention output in bf16
# (ds4t.models.decoder.norm_dtype, blocks.narrow_store). DeepSeek-V3's q_a and kv_a run as one fused projection;
# the shared experts run inside the grouped MoE; GLM-4.5's and DeepSeek-V3's routers are fp32 weights.
SHAPES = {
    "glm": [("qkv", 5120, 14336, "bf16"), ("o", 12288, 5120, "bf16"), ("dense gate_up", 5120, 24576, "bf16"),
            ("dense down", 12288, 5120, "bf16")],
    "deepseek": [("q_a + kv_a", 7168, 2112, "bf16"), ("q_b", 1536, 24576, "bf16"), ("o", 16384, 7168, "bf16"),
                 ("dense gate_up", 7168, 36864, "bf16"), ("dense down", 18432, 7168, "bf16")],
    "qwen": [("gdn in_proj", 2048, 12352, "bf16"), ("gdn out / attn o", 4096, 2048, "bf16"),
             ("attn qkv", 2048, 9216, "bf16"), ("router", 2048, 513, "bf16")],
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_TILES = ("128x256x64w8s3,128x256x64w8s4,128x128x64w8s4,128x128x64w8s4f,"
                 "128x256x64w8s4t,128x256x64w8s3t,128x128x64w4s4t,128x128x64w8s4t,256x128x64w8s3t,128x128x64w8s4ft")


def parse_tile(s: str) -> L.RowTile:
    m = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(f?)(t?)", s)
    if not m:
        raise SystemExit(f"linear_rows: tile {s!r} is not BMxBNxBKwWARPSsSTAGES[f][t]")
    bm, bn, bk, w, st = map(int, m.groups()[:5])
    return L.RowTile(min_rows=128, block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                     fold_splits=bool(m.group(6)), tma=bool(m.group(7)))


def tile_str(t: L.RowTile) -> str:
    return (f"{t.block_m}x{t.block_n}x{t.block_k}w{t.num_warps}s{t.num_stages}" + ("f" if t.fold_splits else "")
            + ("t" if t.tma else ""))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def run_shape(name, K, N, xdt, rows, tiles, peak, log, gen):
    w = (torch.randn(N, K, generator=gen, device="cuda") / K ** 0.5).to(torch.bfloat16)
    x = torch.randn(rows, K, generator=gen, device="cuda").to(DTYPES[xdt])
    out = torch.empty(rows, N, device="cuda", dtype=torch.float32)
    flop = 2.0 * rows * K * N
    cfg = L.linear_config(K, N, torch.bfloat16)
    table = L.linear_row_tiles(K, N, torch.bfloat16)
    base = L.linear(x, w).clone()
    res = []

    def timed(label, fn, bits):
        ms, _ = time_calls([fn])
        res.append((label, ms, bits))
        log(f"| {name} | {K} x {N} | {xdt} | {cfg.split} | {label} | {ms * 1e3:.1f} | {flop / ms / 1e9:.0f} "
            f"| {100 * flop / ms / 1e-3 / peak:.0f} % | {bits} |")

    timed("table " + (tile_str(table[-1]) if table else "(decode tiles)"), lambda: L.linear(x, w, out=out), "base")
    for t in tiles:
        if (table and t == table[-1]) or (t.fold_splits and cfg.split == 1) or (t.tma and xdt != "bf16"):
            continue
        with L.LINEAR_ROW_TILES.forced(lambda *k, t=t: (t,)):
            y = L.linear(x, w).clone()
            timed(tile_str(t), lambda: L.linear(x, w, out=out), "=" if same_bits(y, base) else "DIFFER")
    if cfg.split > 1:
        one = dataclasses.replace(cfg, split=1)
        timed("table tile, split 1", lambda: L._launch(x, w, None, out, one, torch.bfloat16, table), "(other sums)")
    xb = x.to(torch.bfloat16)
    timed("cuBLAS bf16", lambda: torch.matmul(xb, w.t()), "-")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--families", default="glm,deepseek,qwen")
    ap.add_argument("--tiles", default=DEFAULT_TILES)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("linear_rows: needs a CUDA GPU")
    log = Report()
    tiles = [parse_tile(s) for s in args.tiles.split(",") if s]
    peak = matmul_peak(torch.device("cuda"))
    log(f"# linear row tiles, {args.rows} rows, {torch.cuda.get_device_name()}, bf16 matmul peak "
        f"{peak / 1e12:.0f} TFLOP/s")
    log("")
    log("| family | linear | K x N | x | split | tile | us | TFLOP/s | of peak | bits |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator(device="cuda").manual_seed(0)
    best = {}
    for fam in args.families.split(","):
        for name, K, N, xdt in SHAPES[fam]:
            res = run_shape(f"{fam} | {name}", K, N, xdt, args.rows, tiles, peak, log, gen)
            same = [r for r in res if r[2] in ("base", "=")]
            b = min(same, key=lambda r: r[1])
            best[(fam, name)] = (res[0][1], b[0], b[1], [r[1] for r in res if r[0] == "cuBLAS bf16"][0])
    log("")
    log("| family | linear | table us | best same-bits tile | us | x table | cuBLAS us |")
    log("|---|---|---|---|---|---|---|")
    for (fam, name), (t0, lab, t1, cb) in best.items():
        log(f"| {fam} | {name} | {t0 * 1e3:.1f} | {lab} | {t1 * 1e3:.1f} | {t1 / t0:.3f} | {cb * 1e3:.1f} |")
    if args.out:
        log.write(args.out, "linear_rows.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
