#!/usr/bin/env python
"""Whole prompts under other 16-bit row tiles of the linear: the table against rule-wide candidates, bits checked.

``bench/linear_rows.py`` times row tiles one weight shape at a time; this script asks whether a whole prompt
agrees. Each model is loaded once and prefilled (4096 tokens, chunks of 1024, one session; ``bench/prefill_ab.py``'s
``models_ab``, which also times one decode step at N = 1 to show decode is untouched) under the table and under
each candidate, which replaces every bf16 weight's row tiles by one tile (``--tile``; a split-K shape of
``--fold-shapes`` by the folded 128 x 128 tile instead). Bits: the last chunk's logits and the session's state
against the table's. The row-tile linear launches the prompt made are listed at the end.

    PYTHONUNBUFFERED=1 python bench/row_tiles_ab.py --models qwen3-next-80b-4l,glm-4.5-4l \\
        --tile 128x256x64w8s4t --tile 128x128x64w4s4t [--fold-shapes 4096x2048] [--out DIR]

Tiles are ``bench/linear_rows.py``'s (``BMxBNxBKwWARPSsSTAGES[f][t]``: ``t`` loads through tensor descriptors);
``--tile table`` keeps the table's tiles and folds only ``--fold-shapes`` (how the folded splits were first timed:
``--tile table --fold-shapes 2048x513,4096x2048 --fold-tile 128x128x64w8s4f`` on Qwen3-Next-80B-4l).
``--device cpu`` with a tiny preset is a smoke run (the interpreter then runs the forced tiles too).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
from bench.linear_rows import parse_tile, tile_str  # noqa: E402
from bench.prefill_ab import models_ab  # noqa: E402
from bench.report import Report  # noqa: E402
from ds4t.kernels import linear as L  # noqa: E402


def rule_of(tile, fold: dict, table: dict):
    """A LINEAR_ROW_TILES rule: ``fold[(K, N)]`` where given, else ``tile`` for every bf16 weight (None: the
    table's own tiles, ``table`` its entries), the table's rule for other dtypes."""
    def rule(K, N, w_dtype, scale_bk=0, act_dtype=None):
        if w_dtype == torch.bfloat16 and (K, N) in fold:
            return (fold[(K, N)],)
        if w_dtype != torch.bfloat16 or tile is None:
            return table.get((K, N, w_dtype)) or L._gpu_row_tiles(K, N, w_dtype, scale_bk, act_dtype)
        return (tile,)
    return rule


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3-next-80b-4l,glm-4.5-4l")
    ap.add_argument("--tile", action="append", default=[],
                    help="a candidate tile for every bf16 weight (repeat); 'table': the table's tiles but for "
                         "--fold-shapes")
    ap.add_argument("--fold-shapes", default="4096x2048", help="KxN,... that take the folded 128 x 128 tile")
    ap.add_argument("--fold-tile", default="128x128x64w8s4ft")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    if not args.tile:
        raise SystemExit("row_tiles_ab: give at least one --tile")
    fold_tile = parse_tile(args.fold_tile)
    fold = {tuple(int(v) for v in s.split("x")): fold_tile for s in args.fold_shapes.split(",") if s}
    variants = [("table", {})]
    table = dict(L.LINEAR_ROW_TILES.gpu)
    for s in args.tile:
        t = None if s == "table" else parse_tile(s)
        name = "table + folds" if t is None else tile_str(t)
        variants.append((name, lambda r=rule_of(t, fold, table): L.LINEAR_ROW_TILES.forced(r)))

    seen = {}
    real = L._launch

    def spy(x, weight, bias, out, cfg, act_dtype=None, row_tiles=(), defer_sum=False):
        if x.shape[0] >= 128 and isinstance(weight, torch.Tensor):
            k = (x.shape[1], weight.shape[0], str(weight.dtype), str(x.dtype), cfg.split)
            seen[k] = seen.get(k, 0) + 1
        return real(x, weight, bias, out, cfg, act_dtype, row_tiles, defer_sum)

    L._launch = spy
    log = Report()
    try:
        ok = models_ab(args.models, [1], variants, args.device, log)
    finally:
        L._launch = real
    log("\nRow-tile linear launches (K, N, weight dtype, x dtype, split): count over all variants and rounds")
    for k, v in sorted(seen.items()):
        log(f"- {k}: {v}")
    log(f"\nbits as the table's in every row: {ok}")
    if args.out:
        log.write(args.out, "row_tiles_ab.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
