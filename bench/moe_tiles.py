"""Sweep the GPU launch constants of the grouped MoE kernels (ds4t.kernels.moe.MOE_CONFIGS) at the
three families' expert shapes, for decode batches of 1 and 16 rows. Prints, per kernel config, the
step time of ``moe_experts`` and the fraction of the copy bandwidth its weight bytes allow.

    python bench/moe_tiles.py [--out DIR] [--fp8 [--warps 2,4,8] [--stages 2,3,4] [--routes f32]
                              [--swaps 0,1] [--splits 1,2,4] [--scale-blocks 1,2] [--tiles-n 32,64]
                              [--tiles-k 64,128]]
                              [--shapes qwen3-next] [--ns 1,16] [--kernels gate_up]

``--fp8``: block-scaled FP8 experts (128x128 blocks, bf16 activations), configs keyed
(kernel, "fp8"), K tiles that divide the scale block, every fp8 route (ds4t.backend.FP8_ROUTES);
``--swaps`` the operand order (``MoEConfig.swap``), ``--splits`` the K splits (``MoEConfig.split``). The best
summed config per kernel is written as ``best_configs.json``, the ``--configs`` format of bench_fp8 /
bench_decode (``ds4t.kernels.config.overridden``), so one device call can sweep and then time the winner
in a full model.

``--rows R``: the row-tile entries (key + ("rows",)) for a prefill chunk of R rows instead: pairs per
tile (``--block-m``), N / K tiles, warps and stages (the same flags as ``--fp8``, their own defaults), weight
formats (``--formats``), with the decode entries unchanged; each config's rows 0 and
R-1 must equal those rows launched alone (the decode tiles), bitwise. TFLOP/s counted from the pairs.

Timing: a launch whose experts fit in the L2 is timed in turn with routings to other experts until the
weights read exceed 4x the L2 (:func:`rotations`; a decode step reads every layer's experts from DRAM), the
first routing being the one checked; the "MB" printed is a call's average.

Each config is also checked: the output equals the current default's within the bf16 tolerance,
and row 0 computed alone equals row 0 in the batch, bitwise; ``same-bits`` says whether the whole output is
the default's bit for bit (a config that keeps them could replace the default without changing any result).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.bench_decode import copy_bandwidth  # noqa: E402
from ds4t.kernels import moe as M  # noqa: E402

# (name, E routed, top-k, D, I): the 4-layer presets' expert shapes (+1 fused shared expert)
SHAPES = [("qwen3-next", 512, 10, 2048, 512), ("glm-4.5", 160, 8, 5120, 1536), ("deepseek-v3", 256, 8, 7168, 2048)]
TILES_N = (16, 32, 64, 128)
TILES_K = (64, 128, 256)
STAGES = (3, 4)


def _quantize_experts(w, quantize, chunk: int = 32):
    """Block-FP8 (128 x 128) of stacked experts [E, N, K], ``chunk`` experts at a time."""
    from ds4t.kernels.weights import FP8Weight
    parts = [quantize(w[i:i + chunk].float(), (128, 128)) for i in range(0, w.shape[0], chunk)]
    return FP8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scale for p in parts]), parts[0].block_k)


def _warm(fn, seconds: float = 0.3) -> None:
    """Run fn back to back for ``seconds`` first: timed straight after the host built a shape's weights
    (an idle GPU), the default config's line read ~10 % slower than the same config timed later in the
    same sweep (bench/results/2026-12-02-h200-few-rows.md)."""
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        torch.cuda.synchronize()


def _time(fn, iters=20):
    """Median ms per call of ``fn``, or of each callable of a list ``fn`` (one call each in turn, e.g. the same
    launch over other experts' weights), four rounds of them replayed in a CUDA graph."""
    fns = fn if isinstance(fn, (list, tuple)) else [fn]
    for _ in range(3):
        for f in fns:
            f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(4):
            for f in fns:
                f()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / (4 * len(fns)))
    return statistics.median(ts)


def rotations(used_bytes: float, l2_bytes: float, most: int = 16) -> int:
    """How many routings (other experts each) a timing must rotate through so that the weights it reads
    exceed 4x the L2 cache: a decode step reads its experts from DRAM (every layer has its own), while one
    launch replayed alone over 36 MB of experts (Qwen3-Next at one row) is served from a 50-60 MB L2 --
    the few-row sweeps of bench/results/2026-12-06-h100-n1-anatomy.md found configs 20 % faster that way
    that moved no whole step. At least 1, at most ``most``."""
    return max(1, min(most, -(-int(4 * l2_bytes) // max(1, int(used_bytes)))))


def sweep_rows(args) -> None:
    """The ("rows",) entries at args.rows rows, both formats; prints the best per kernel and format."""
    from ds4t.kernels.weights import quantize
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {args.rows} rows", flush=True)
    default = dict(M.MOE_CONFIGS.gpu)
    g = torch.Generator(device=dev).manual_seed(0)
    rows, R = [], args.rows
    ints = lambda text: [int(x) for x in text.split(",")]   # noqa: E731
    grid = list(itertools.product(ints(args.block_m), ints(args.tiles_n), ints(args.tiles_k), ints(args.warps),
                                  ints(args.stages), ints(args.row_programs)))
    shapes = [s_ for s_ in SHAPES if s_[0] in args.shapes.split(",")]
    for fp8 in [f == "fp8" for f in args.formats.split(",")]:
        fmt = ("fp8",) if fp8 else ()
        for name, E, k, D, I in shapes:
            Et = E + 1
            ws = [(torch.randn(Et, *sh, device=dev, generator=g) * 0.02).bfloat16() for sh in ((I, D), (I, D), (D, I))]
            if fp8:
                ws = [quantize(w_.float(), (128, 128)) for w_ in ws]
            h = torch.randn(R, D, device=dev, generator=g)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(R)]).int()
            w = torch.rand(R, k, device=dev, generator=g)
            adt = torch.bfloat16 if fp8 else None
            run = lambda n=R: M.moe_experts(h[:n], ids[:n], w[:n], *ws, shared_expert=E, act_dtype=adt)  # noqa: E731
            flops = 2 * 3 * I * D * R * (k + 1)
            nbytes = Et * 3 * I * D * (1 + 4 / 128 if fp8 else 2)
            M.MOE_CONFIGS.gpu.clear()
            M.MOE_CONFIGS.gpu.update(default)
            alone = [run(1)[0], M.moe_experts(h[R - 1:], ids[R - 1:], w[R - 1:], *ws, shared_expert=E, act_dtype=adt)[0]]
            _warm(run)
            base_ms = _time(run, 5)
            print(f"{name} {'fp8' if fp8 else 'bf16'}: default {base_ms:.3f} ms = {flops / base_ms / 1e9:.0f} TFLOP/s, "
                  f"{nbytes / (base_ms / 1e3) / bw * 100:.0f}% of copy BW for every expert's bytes", flush=True)
            for kernel in ("gate_up", "down"):
                best = None
                for bm, tn, tk, wp, stg, rp in grid:
                    M.MOE_CONFIGS.gpu.clear()
                    M.MOE_CONFIGS.gpu.update(default)
                    M.MOE_CONFIGS.gpu[(kernel, *fmt, "rows")] = M.MoEConfig(
                        tile_n=tn, tile_k=tk, num_warps=wp, num_stages=stg, block_m=bm, min_rows=2,
                        fp8_route="f32" if fp8 else "direct", row_programs=bool(rp))
                    try:
                        out = run()
                        inv = bool(torch.equal(out[0], alone[0]) and torch.equal(out[R - 1], alone[1]))
                        ms = _time(run, 5)
                    except Exception as e:  # noqa: BLE001 (shared memory: report, go on)
                        print(f"   {kernel} {bm}/{tn}/{tk}/w{wp}/s{stg}/rp{rp}: {type(e).__name__}", flush=True)
                        continue
                    rows.append(dict(shape=name, fp8=fp8, kernel=kernel, block_m=bm, tile_n=tn, tile_k=tk, warps=wp,
                                     stages=stg, row_programs=rp, ms=ms, inv=inv))
                    if inv and (best is None or ms < best[0]):
                        best = (ms, bm, tn, tk, wp, stg, rp)
                    if not inv:
                        print(f"   {kernel} {bm}/{tn}/{tk}/w{wp}/s{stg}/rp{rp}: ROWS DIFFER from the decode tiles",
                              flush=True)
                if best:
                    print(f"   {kernel:8s} best block_m={best[1]} tile_n={best[2]} tile_k={best[3]} warps={best[4]} "
                          f"stages={best[5]} row_programs={best[6]}: whole call {best[0]:.3f} ms = "
                          f"{nbytes / (best[0] / 1e3) / bw * 100:.0f}% of copy BW", flush=True)
            del ws
            torch.cuda.empty_cache()
    M.MOE_CONFIGS.gpu.clear()
    M.MOE_CONFIGS.gpu.update(default)
    with open(os.path.join(args.out, "moe_rows.json"), "w") as f:
        json.dump(rows, f)
    print(f"\nsummed over shapes (ms), best 4 per kernel and format; {sum(not r['inv'] for r in rows)} configs "
          f"changed a row's bits:")
    for fp8 in (False, True):
        for kernel in ("gate_up", "down"):
            tot = {}
            for r in rows:
                if r["kernel"] == kernel and r["fp8"] == fp8 and r["inv"]:
                    tot.setdefault((r["block_m"], r["tile_n"], r["tile_k"], r["warps"], r["stages"],
                                    r["row_programs"]), []).append(r["ms"])
            full = {k_: sum(v) for k_, v in tot.items() if len(v) == len(shapes)}
            for key, ms in sorted(full.items(), key=lambda t: t[1])[:4]:
                print(f"  {'fp8 ' if fp8 else 'bf16'} {kernel:8s} block_m={key[0]} tile_n={key[1]} tile_k={key[2]} "
                      f"warps={key[3]} stages={key[4]} row_programs={key[5]}: {ms:.3f}")


_GRID_DEFAULTS = {"fp8": dict(tiles_n="16,32,64", tiles_k="64,128", warps="4", stages="3"),
                  "rows": dict(tiles_n="64,128", tiles_k="64,128", warps="4,8", stages="3", row_programs="1")}
"""The tile grid a sweep tries where the command line names none: decode (--fp8) or row tiles (--rows)."""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--rows", type=int, default=0, help="sweep the row-tile entries at this many rows")
    ap.add_argument("--formats", default="bf16,fp8", help="--rows: weight formats (bf16, fp8)")
    ap.add_argument("--block-m", default="32,64", help="--rows: pairs per tile to try")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SHAPES), help="expert shapes to sweep (names)")
    ap.add_argument("--ns", default="1,16", help="decode batches")
    # the tile grid of --fp8 and --rows (defaults per mode: _GRID_DEFAULTS)
    ap.add_argument("--warps", default=None, help="warps per program to try")
    ap.add_argument("--tiles-n", default=None, help="N tiles to try")
    ap.add_argument("--stages", default=None, help="pipeline stages to try")
    ap.add_argument("--routes", default="f32,tf32", help="--fp8: fp8 routes to try (ds4t.backend.FP8_ROUTES)")
    ap.add_argument("--tiles-k", default=None, help="K tiles to try")
    ap.add_argument("--row-programs", default=None, help="--rows: MoEConfig.row_programs to try (0, 1)")
    ap.add_argument("--kernels", default="gate_up,down", help="the grouped kernels to sweep (decode)")
    ap.add_argument("--splits", default="1", help="--fp8: K splits to try (MoEConfig.split)")
    ap.add_argument("--swaps", default="0", help="--fp8: operand orders to try (1: MoEConfig.swap, w @ h^T)")
    ap.add_argument("--scale-blocks", default="1",
                    help="--fp8: scale blocks a K step to try (MoEConfig.scale_blocks; the same bits)")
    ap.add_argument("--tma", default="0",
                    help="--fp8: weight tiles through tensor descriptors to try (0, 1: MoEConfig.tma; the same bits)")
    args = ap.parse_args()
    for field, value in _GRID_DEFAULTS["rows" if args.rows else "fp8"].items():
        if getattr(args, field) is None:
            setattr(args, field, value)
    if args.rows:
        return sweep_rows(args)
    fp8 = args.fp8
    from ds4t.kernels.weights import quantize
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 60 << 20)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; L2 {l2 / 2**20:.0f} MiB", flush=True)
    # few-rows entries (key + ("few", K)) would replace the swept decode entry at small N, row entries (key +
    # ("rows",)) at N >= their min_rows: out while sweeping
    few = {k_: M.MOE_CONFIGS.gpu.pop(k_) for k_ in list(M.MOE_CONFIGS.gpu)
           if isinstance(k_, tuple) and ("few" in k_ or "rows" in k_)}
    M.MOE_CONFIGS.clear_caches()
    default = dict(M.MOE_CONFIGS.gpu)
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for name, E, k, D, I in [s_ for s_ in SHAPES if s_[0] in args.shapes.split(",")]:
        Et = E + 1
        wg = (torch.randn(Et, I, D, device=dev, generator=g) * 0.02).bfloat16()
        wu = (torch.randn(Et, I, D, device=dev, generator=g) * 0.02).bfloat16()
        wd = (torch.randn(Et, D, I, device=dev, generator=g) * 0.02).bfloat16()
        if fp8:   # a few experts at a time: DeepSeek-V3's 257 in fp32 at once outgrow an 80 GB card
            wg, wu, wd = (_quantize_experts(w_, quantize) for w_ in (wg, wu, wd))
        for n in [int(v) for v in args.ns.split(",")]:
            h = torch.randn(n, D, device=dev, generator=g)
            ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(n)]).int()
            w = torch.rand(n, k, device=dev, generator=g)
            used = len(set(ids.flatten().tolist())) + 1
            per_expert = 3 * I * D * (1 + 4 / 128 if fp8 else 2)
            nbytes = used * per_expert
            adt = torch.bfloat16 if fp8 else None
            run = lambda ids=ids: M.moe_experts(h, ids, w, wg, wu, wd, shared_expert=E, act_dtype=adt)  # noqa: E731
            # timed over routings to other experts (the first is the one checked) until past the L2
            more = [torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(n)]).int()
                    for _ in range(rotations(nbytes, l2) - 1)]
            runs = [run] + [lambda ids=ids_: run(ids) for ids_ in more]
            nbytes = statistics.mean([nbytes] + [(len(set(i.flatten().tolist())) + 1) * per_expert for i in more])
            M.MOE_CONFIGS.gpu.update(default)
            ref = run()
            _warm(lambda: [f() for f in runs])
            base_ms = _time(runs)
            print(f"{name} N={n}: {used} experts, {nbytes / 1e6:.0f} MB a call ({len(runs)} routings in turn), "
                  f"default {base_ms * 1e3:.1f} us "
                  f"({nbytes / (base_ms / 1e3) / bw * 100:.0f}% of copy BW)", flush=True)
            for kernel in args.kernels.split(","):
                best = None
                key_ = (kernel, "fp8") if fp8 else kernel
                ints = lambda v: [int(x) for x in v.split(",")]   # noqa: E731
                splits = ints(args.splits)
                grid = (itertools.product(ints(args.tiles_n), ints(args.tiles_k), ints(args.stages),
                                          args.routes.split(","), ints(args.warps), ints(args.swaps), splits,
                                          ints(args.scale_blocks), ints(args.tma))
                        if fp8 else itertools.product(TILES_N, TILES_K, STAGES, ("direct",), (4,), (0,), (1,), (1,),
                                                      (0,)))
                for tn, tk, st, via, wp, sw, sp, sb, tm in grid:
                    M.MOE_CONFIGS.gpu.update(default)
                    M.MOE_CONFIGS.gpu[key_] = M.MoEConfig(tile_n=tn, tile_k=tk, num_warps=wp, num_stages=st,
                                                          fp8_route=via, swap=bool(sw), split=sp, scale_blocks=sb,
                                                          tma=bool(tm))
                    try:
                        out = run()
                        ok = bool(((out - ref).abs().max() / ref.abs().max()).item() < 2e-2)
                        bits = bool(torch.equal(out, ref))   # the default's bits: a config free to swap in
                        inv = bool(torch.equal(M.moe_experts(h[:1], ids[:1], w[:1], wg, wu, wd, shared_expert=E, act_dtype=adt)[0],
                                               out[0]))
                        ms = _time(runs)
                    except Exception as e:  # a config that does not compile (shared memory)
                        rows.append(dict(shape=name, n=n, kernel=kernel, tile_n=tn, tile_k=tk, stages=st,
                                         warps=wp, via=via, swap=sw, split=sp, sb=sb, tma=tm,
                                         status=f"{type(e).__name__}"))
                        continue
                    r = dict(shape=name, n=n, kernel=kernel, tile_n=tn, tile_k=tk, stages=st, warps=wp, via=via,
                             swap=sw, split=sp, sb=sb, tma=tm, us=ms * 1e3,
                             ok=ok, inv=inv, bits=bits, status="ok", default_us=base_ms * 1e3)
                    rows.append(r)
                    print(f"     {kernel} tile_n={tn} tile_k={tk} warps={wp} stages={st} route={via} swap={sw} split={sp} sb={sb} tma={tm}: "
                          f"{ms * 1e3:.1f} us"
                          f" ok={ok} inv={inv} same-bits={bits}", flush=True)
                    if ok and inv and (best is None or ms < best[0]):
                        best = (ms, tn, tk, st, via, wp, sw, sp, sb, tm)
                # The default again, after the sweep: the first timing of a cell (straight after the host built
                # its weights) read 10-30 % slower than the same config later in the cell on an H100 even after
                # _warm (bench/results/2026-12-06-h100-block-dots.md): compare configs with this one.
                M.MOE_CONFIGS.gpu.update(default)
                again = _time(runs)
                print(f"     {kernel} default re-timed after the sweep: {again * 1e3:.1f} us "
                      f"(first {base_ms * 1e3:.1f} us)", flush=True)
                for r in rows:
                    if r.get("shape") == name and r.get("n") == n and r.get("kernel") == kernel and "us" in r:
                        r["default_again_us"] = again * 1e3
                if best:
                    print(f"   {kernel:8s} best tile_n={best[1]} tile_k={best[2]} warps={best[5]} stages={best[3]} "
                          f"route={best[4]} swap={best[6]} split={best[7]} sb={best[8]} tma={best[9]}: "
                          f"{best[0] * 1e3:.1f} us ({nbytes / (best[0] / 1e3) / bw * 100:.0f}% of copy BW over "
                          f"both kernels' bytes)", flush=True)
            with open(os.path.join(args.out, "moe_tiles.json"), "w") as f:
                json.dump(rows, f)
        del wg, wu, wd
        torch.cuda.empty_cache()
    M.MOE_CONFIGS.gpu.update(default)
    M.MOE_CONFIGS.gpu.update(few)
    M.MOE_CONFIGS.clear_caches()
    # the best config per kernel by the summed time over every shape and N (one table for all)
    print("\nsummed over shapes and N (us), best 6 per kernel:")
    best = []
    for kernel in args.kernels.split(","):
        tot = {}
        for r in rows:
            if r["kernel"] == kernel and r["status"] == "ok" and r["ok"] and r["inv"]:
                key = (r["tile_n"], r["tile_k"], r["stages"], r["via"], r["warps"], r["swap"], r.get("split", 1),
                       r.get("sb", 1), r.get("tma", 0))
                tot.setdefault(key, []).append(r["us"])
        cells = len({(r["shape"], r["n"]) for r in rows})
        full = {k_: sum(v) for k_, v in tot.items() if len(v) == cells}
        ranked = sorted(full.items(), key=lambda t: t[1])
        for key, us in ranked[:6]:
            print(f"  {kernel:8s} tile_n={key[0]:3d} tile_k={key[1]:3d} stages={key[2]} route={key[3]} warps={key[4]} "
                  f"swap={key[5]} split={key[6]} sb={key[7]} tma={key[8]}: {us:8.1f}")
        if ranked:
            k_ = ranked[0][0]
            best.append({"key": [kernel, "fp8"] if fp8 else [kernel],
                         "fields": dict(tile_n=k_[0], tile_k=k_[1], num_stages=k_[2], fp8_route=k_[3], num_warps=k_[4],
                                        swap=bool(k_[5]), split=k_[6], scale_blocks=k_[7], tma=bool(k_[8]))})
    # the winners as config overrides: python bench/bench_fp8.py --configs $OUT/best_configs.json ...
    with open(os.path.join(args.out, "best_configs.json"), "w") as f:
        json.dump({"moe": best}, f, indent=1)


if __name__ == "__main__":
    main()
