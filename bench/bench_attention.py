#!/usr/bin/env python
"""Long-context decode attention on the GPU: GQA (ds4t.kernels.attention) and absorbed MLA
(ds4t.kernels.mla) at 8k-32k tokens of context, correctness, invariance and bandwidth in one call.

    PYTHONUNBUFFERED=1 python bench/bench_attention.py [--sweep] [--out $OUT/attn]

Shapes (the three families' decode attention):
  * GQA 16 q / 2 kv heads, d 256 (Qwen3-Next's gated attention), bf16 cache
  * GQA 96 q / 8 kv heads, d 128 (GLM-4.5), bf16 cache
  * MLA 128 heads, latent 512 + rope 64 (DeepSeek-V3), bf16 cache
at L in {8192, 32768} tokens of context and B in {8, 16, 64} rows (every row at length L).

Bytes = the cache a step must read (K + V, or the latent rows), plus nothing else; % is of the
device-to-device copy bandwidth (read + write) measured in the same run. Timing: CUDA graphs of
back-to-back calls over rotating cache copies (> 4x L2), median of replays (bench_kernels.time_calls).

``--sweep``: every candidate launch config (and split size) per shape, compiled in parallel processes
first, timed at the sweep cases; the best per shape is checked (reference error, a row alone == the
same row in the batch) and printed as the table entry ``ds4t/kernels/{attention,mla}.py`` should hold.
Without ``--sweep`` the kernels run with their current tables. SDPA (torch, bf16, enable_gqa) runs
next to GQA as the non-invariant peer. A short table is printed last; everything goes to --out.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import math
import os
import sys
import time

import torch
import triton

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_kernels import copy_bandwidth, time_calls  # noqa: E402
from ds4t.kernels import attention as A  # noqa: E402
from ds4t.kernels import mla as M  # noqa: E402
from ds4t.kernels.splits import SplitSchedule, describe  # noqa: E402

L2_BYTES = 60e6
GQA_SHAPES = [(16, 2, 256), (96, 8, 128)]
MLA_SHAPE = (128, 512, 64)
LENGTHS = [8192, 32768]
BATCHES = [8, 16, 64]
SWEEP_CASES = [(32768, 8), (8192, 64), (8192, 8)]   # (L, B) the sweep ranks configs on (sum of times)

LOG = []


def log(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


# ----------------------------------------------------------------------------- candidates

def gqa_candidates(d):
    out = []
    for split in (256, 512, 1024, 2048):
        for bn in (32, 64, 128):
            if bn * d * 2 > 64 * 1024 or bn > split:   # a K tile above 64 KiB never fits 2 stages
                continue
            for warps, stages in ((4, 2), (4, 3), (8, 2), (8, 3)):
                out.append((split, A.AttentionConfig(block_n=bn, num_warps=warps, num_stages=stages, merge_warps=4)))
    return out


def mla_tile(spec: str) -> "M.MLAConfig":
    """An MLA tile written ``"64x32x8x2"``: heads, tokens, warps, stages a program (merge over 8 heads)."""
    bh, bn, w, st = (int(v) for v in spec.split("x"))
    return M.MLAConfig(block_h=bh, block_n=bn, merge_heads=8, num_warps=w, num_stages=st)


def mla_candidates(spec=None):
    """Every (split, MLAConfig) of the grid, or the tiles of ``spec`` (``"64x32x8x2,32x64x4x2"``,
    :func:`mla_tile`) with the default split schedule."""
    if spec:
        sched = default_split("mla", MLA_SHAPE)
        return [(sched, mla_tile(c)) for c in spec.split(",")]
    out = []
    for split in (512, 1024, 2048):
        for bh, bn, warps, stages in itertools.product((16, 32, 64), (32, 64, 128), (4, 8), (1, 2, 3)):
            if bh * bn > 4096 or (bh == 64 and warps == 4) or (bh * bn == 4096 and stages == 3):
                continue
            out.append((split, M.MLAConfig(block_h=bh, block_n=bn, merge_heads=8, num_warps=warps, num_stages=stages)))
    return out


# ----------------------------------------------------------------------------- problems

def gqa_problem(hq, hkv, d, L, B, gen, rotate=True):
    kv_bytes = B * L * hkv * d * 2 * 2
    n_rot = max(1, math.ceil(4 * L2_BYTES / kv_bytes)) if rotate else 1
    S = B * n_rot
    kc = torch.randn(S, L, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(S, L, hkv, d, device="cuda", generator=gen).bfloat16()
    q = torch.randn(B, hq, d, device="cuda", generator=gen)
    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B)).cuda()
    slot_sets = [(r * B + perm).to(torch.int32) for r in range(n_rot)]
    return dict(q=q, kc=kc, vc=vc, lengths=lengths, slot_sets=slot_sets, bytes=kv_bytes, scale=d ** -0.5)


def mla_problem(H, R, Dr, L, B, gen, rotate=True):
    nbytes = B * L * (R + Dr) * 2
    n_rot = max(1, math.ceil(4 * L2_BYTES / nbytes)) if rotate else 1
    S = B * n_rot
    cache = (torch.randn(S, L, R + Dr, device="cuda", generator=gen) * 0.5).bfloat16()
    # q_latent in the cache dtype, as DeepSeek's model passes it (linear_heads stores it rounded); q_pe fp32
    ql = (torch.randn(B, H, R, device="cuda", generator=gen) * 0.05).bfloat16()
    qp = torch.randn(B, H, Dr, device="cuda", generator=gen) * 0.05
    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B)).cuda()
    slot_sets = [(r * B + perm).to(torch.int32) for r in range(n_rot)]
    return dict(ql=ql, qp=qp, cache=cache, lengths=lengths, slot_sets=slot_sets, bytes=nbytes,
                scale=(128 + 64) ** -0.5, R=R)


def run_gqa(p, slots, split, cfg, out=None, rows=None):
    q, lengths = p["q"], p["lengths"]
    if rows is not None:
        q, slots, lengths = q[rows], slots[rows], lengths[rows]
        out = None
    ctx = A.ATTENTION_CONFIGS.forced(lambda *k: cfg) if cfg is not None else contextlib.nullcontext()
    with ctx:
        return A.decode_attention(q, p["kc"], p["vc"], slots, lengths, p["scale"], split_size=split, out=out)


def run_mla(p, slots, split, cfg, out=None, rows=None):
    ql, qp, lengths = p["ql"], p["qp"], p["lengths"]
    if rows is not None:
        ql, qp, slots, lengths = ql[rows], qp[rows], slots[rows], lengths[rows]
        out = None
    ctx = M.MLA_CONFIGS.forced(lambda *k: cfg) if cfg is not None else contextlib.nullcontext()
    with ctx:
        return M.mla_decode(ql, qp, p["cache"], slots, lengths, p["scale"], kv_lora_rank=p["R"],
                            split_size=split, out=out)


# ----------------------------------------------------------------------------- precompile

def _compile_worker(jobs):
    """Run each (kind, shape, L, split, cfg) once on a 1-row problem: fills Triton's disk cache with the
    same specialisations the timed runs use (L and the strides are the same; B is only the grid)."""
    import torch as _t
    gen = _t.Generator(device="cuda").manual_seed(0)
    errs = []
    probs = {}
    for kind, shape, L, split, fields in jobs:
        try:
            key = (kind, shape, L)
            if key not in probs:
                probs.clear()
                _t.cuda.empty_cache()
                probs[key] = (gqa_problem(*shape, L, 1, gen, rotate=False) if kind == "gqa"
                              else mla_problem(*shape, L, 1, gen, rotate=False))
            p = probs[key]
            if kind == "gqa":
                run_gqa(p, p["slot_sets"][0], split, A.AttentionConfig(**fields))
            else:
                run_mla(p, p["slot_sets"][0], split, M.MLAConfig(**fields))
            _t.cuda.synchronize()
            errs.append(None)
        except Exception as e:
            errs.append(f"{type(e).__name__}: {str(e)[:160]}")
    return errs


def precompile(jobs, workers):
    import concurrent.futures as cf
    import multiprocessing as mp
    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    bad = {}
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        for chunk, errs in zip(chunks, ex.map(_compile_worker, chunks)):
            for j, e in zip(chunk, errs):
                if e:
                    bad[(j[0], j[1], j[3], tuple(sorted(j[4].items())))] = e
    log(f"precompiled {len(jobs)} (config, L) pairs in {time.time() - t0:.0f} s, {len(bad)} failed")
    return bad


# ----------------------------------------------------------------------------- measure

def time_case(kind, p, split, cfg):
    run = run_gqa if kind == "gqa" else run_mla
    out = torch.empty_like(run(p, p["slot_sets"][0], split, cfg))
    fns = [lambda s=s: run(p, s, split, cfg, out=out) for s in p["slot_sets"]]
    ms, _ = time_calls(fns)
    return ms


def check_case(kind, p, split, cfg):
    """(max relative error vs the fp32/fp64 reference on 3 rows, rows alone == rows in the batch)."""
    run = run_gqa if kind == "gqa" else run_mla
    slots = p["slot_sets"][0]
    B = slots.shape[0]
    y = run(p, slots, split, cfg)
    idx = sorted({0, B // 2, B - 1})
    inv = all(torch.equal(run(p, slots, split, cfg, rows=torch.tensor([i], device="cuda"))[0], y[i]) for i in idx)
    err = 0.0
    for i in idx:
        r = torch.tensor([i], device="cuda")
        if kind == "gqa":
            ref = A.decode_attention_ref(p["q"][r], p["kc"], p["vc"], slots[r], p["lengths"][r], p["scale"])
        else:
            ref = M.mla_decode_ref(p["ql"][r], p["qp"][r], p["cache"], slots[r], p["lengths"][r], p["scale"],
                                   kv_lora_rank=p["R"])
        err = max(err, ((y[i] - ref[0].to(y.dtype)).abs().max() / ref.abs().max().clamp_min(1e-30)).item())
    return err, inv


def sdpa_ms(p):
    import torch.nn.functional as F
    qt = p["q"].bfloat16().unsqueeze(2)
    ks = [p["kc"][s.long()].transpose(1, 2).contiguous() for s in p["slot_sets"][:2]]
    vs = [p["vc"][s.long()].transpose(1, 2).contiguous() for s in p["slot_sets"][:2]]
    ms, _ = time_calls([lambda k=k, v=v: F.scaled_dot_product_attention(qt, k, v, scale=p["scale"], enable_gqa=True)
                        for k, v in zip(ks, vs)])
    del ks, vs
    return ms


def default_split(kind, shape):
    if kind == "gqa":
        return A.default_split_schedule(shape[2], shape[2], torch.bfloat16)
    return M.default_split_schedule(shape[1], shape[2], torch.bfloat16)


def parse_schedules(text):
    """``64-2048/32,2048,64-2048/16:1`` -> [(SplitSchedule(64, 2048, 32), None), (SplitSchedule.fixed(2048),
    None), (SplitSchedule(64, 2048, 16), 1)]: a schedule and the merge's ``merge_stages`` (``:S``; none: the
    table's)."""
    out = []
    for item in filter(None, text.split(",")):
        item, _, stages = item.partition(":")
        stages = int(stages) if stages else None
        if "-" in item:
            rng, t = item.split("/")
            lo, hi = rng.split("-")
            out.append((SplitSchedule(int(lo), int(hi), int(t)), stages))
        else:
            out.append((SplitSchedule.fixed(int(item)), stages))
    return out


def table_config(kind, shape, sched, stages):
    """The table config of ``sched`` with ``merge_stages`` replaced (None: the table's own config)."""
    if not stages:
        return None
    if kind == "gqa":
        d = max(16, triton.next_power_of_2(shape[2]))   # decode_attention's BLOCK_D / BLOCK_DV
        return dataclasses.replace(A.ATTENTION_CONFIGS(sched.min_split, d, d), merge_stages=stages)
    return dataclasses.replace(M.MLA_CONFIGS(*shape, sched.min_split), merge_stages=stages)


def schedule_table(kind, shape, schedules, cells, gen, bw):
    """Each split schedule (table launch config) timed at each (L, B) cell, every row at length L:
    ms and % of copy bandwidth, plus the error / row-invariance check; returns table rows."""
    rows = []
    for L, B in cells:
        try:
            p = gqa_problem(*shape, L, B, gen) if kind == "gqa" else mla_problem(*shape, L, B, gen)
        except torch.OutOfMemoryError:
            log(f"  {kind} {shape} L={L} B={B}: does not fit")
            continue
        for sched, stages in schedules:
            cfg = table_config(kind, shape, sched, stages)
            label = describe(sched) + (f" merge stages {stages}" if stages else "")
            ms = time_case(kind, p, sched, cfg)
            err, inv = check_case(kind, p, sched, cfg)
            tbs = p["bytes"] / (ms * 1e-3) / 1e12
            rows.append((kind, shape, L, B, label, ms, tbs, 100 * tbs * 1e12 / bw, f"{err:.1e}",
                         "yes" if inv else "**NO**"))
            log(f"  {kind} {shape} L={L} B={B} {label}: {ms:.4f} ms {tbs:.2f} TB/s "
                f"{rows[-1][7]:.0f}% err {err:.1e} inv {inv}")
        del p
        torch.cuda.empty_cache()
    return rows


def sweep(kind, shape, gen, bw, budget_end, mla_spec=None):
    cands = gqa_candidates(shape[2]) if kind == "gqa" else mla_candidates(mla_spec)
    results = []
    probs = {c: (gqa_problem(*shape, *c, gen) if kind == "gqa" else mla_problem(*shape, *c, gen)) for c in SWEEP_CASES}
    for split, cfg in cands:
        if time.time() > budget_end:
            log(f"  sweep budget spent after {len(results)} of {len(cands)} configs")
            break
        try:
            ms = [time_case(kind, probs[c], split, cfg) for c in SWEEP_CASES]
        except Exception as e:
            log(f"  {kind} {shape} split {split} {cfg}: {type(e).__name__}: {str(e)[:120]}")
            continue
        results.append((sum(ms), split, cfg, ms))
    results.sort(key=lambda r: r[0])
    log(f"\n### sweep {kind} {shape}: best 5 of {len(results)} (ms at " + ", ".join(f"L={L} B={B}" for L, B in SWEEP_CASES) + ")")
    def show(tot, split, cfg, ms):
        tbs = [probs[c]["bytes"] / (m * 1e-3) / 1e12 for c, m in zip(SWEEP_CASES, ms)]
        log(f"  split {split} {cfg}: " + ", ".join(f"{m:.4f} ms ({t:.2f} TB/s, {100 * t * 1e12 / bw:.0f}%)"
                                               for m, t in zip(ms, tbs)))
    for r in results[:5]:
        show(*r)
    log("  best per split size:")
    for split in sorted({r[1] for r in results}):
        show(*next(r for r in results if r[1] == split))
    del probs
    torch.cuda.empty_cache()
    return results[0][1:3] if results else None


def mla_copy_ceiling(heads: int, r: int, dr: int, peak: float, bw: float) -> tuple:
    """(FLOP a cached byte, the most of copy bandwidth ``bw`` the latent cache can stream at) of absorbed
    MLA decode with ``heads`` query heads, latent rank ``r`` and rope dim ``dr`` (bf16 cache, 2 bytes an
    element): each cached row costs 2 * heads * (r + dr) FLOP for the scores and 2 * heads * r for the
    output, so with many heads the MMAs at ``peak`` FLOP/s, not the bytes, set the step's time."""
    per_byte = heads * (2 * r + dr) / (r + dr)
    return per_byte, min(1.0, peak / (per_byte * bw))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--sweep-budget-s", type=float, default=240.0)
    ap.add_argument("--sweep-cells", default=None,
                    help="LxB cells the sweep ranks configs on (sum of times), e.g. 4096x1,32768x1,8192x64 "
                         "(default: " + ",".join(f"{L}x{B}" for L, B in SWEEP_CASES) + ")")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    ap.add_argument("--batches", default=",".join(map(str, BATCHES)))
    ap.add_argument("--only", default="gqa,mla")
    ap.add_argument("--sweep-only", default=None, help="comma-separated shape kinds to sweep (default: --only)")
    ap.add_argument("--schedules", default=None,
                    help="split schedules to compare instead of the length x batch table, per kind: "
                         "'gqa=64-2048/32,2048;mla=256-1024/16,1024' (min-max/target or a fixed size; "
                         ":S after one: the merge's merge_stages S)")
    ap.add_argument("--cells", default="4096x1,8192x1,32768x1,8192x8,32768x8,8192x64",
                    help="LxB cells of --schedules")
    ap.add_argument("--mla-configs", default=None,
                    help="sweep only these MLA tiles, heads x tokens x warps x stages (e.g. 64x32x8x2,32x64x4x2), "
                         "with the default split schedule")
    ap.add_argument("--mla-heads", default=str(MLA_SHAPE[0]),
                    help="MLA query heads a GPU holds, e.g. 128,64,16 (DeepSeek-V3 on 1, 2 and 8 tensor-parallel "
                         "ranks): 128 heads spend 242 FLOP a cached byte (compute-bound), 16 heads 30 (bytes-bound)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    if args.sweep_cells:
        SWEEP_CASES[:] = [tuple(int(v) for v in c.split("x")) for c in args.sweep_cells.split(",")]
    os.makedirs(args.out, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    kinds = args.only.split(",")
    bw = copy_bandwidth()[0]
    log(f"# ds4t long-context decode attention on {torch.cuda.get_device_name()}")
    log(f"commit {args.commit or '?'}; torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s")
    log("command: " + " ".join(sys.argv))
    mla_shapes = [(int(h), *MLA_SHAPE[1:]) for h in args.mla_heads.split(",")]
    if "mla" in kinds:
        # absorbed MLA multiplies every cached latent row by each head's query twice (scores over R + Dr,
        # output over R): with many heads the MMAs, not the bytes, bound a step
        from bench.bench_prefill import matmul_peak
        peak = matmul_peak(torch.device("cuda"))
        for h, r, dr in mla_shapes:
            per_byte, ceiling = mla_copy_ceiling(h, r, dr, peak, bw)
            log(f"mla {h} heads: {per_byte:.0f} FLOP a cached byte; at the measured bf16 peak ({peak / 1e12:.0f} "
                f"TFLOP/s) the cache streams at most {100 * ceiling:.0f} % of copy bandwidth")
    shapes = ([("gqa", s) for s in GQA_SHAPES] if "gqa" in kinds else []) + ([("mla", s) for s in mla_shapes]
                                                                           if "mla" in kinds else [])
    gen = torch.Generator(device="cuda").manual_seed(7)

    chosen = {}
    if args.sweep:
        jobs = []
        swept = [(k, sh) for k, sh in shapes if k in (args.sweep_only or args.only).split(",")]
        for kind, shape in swept:
            cands = gqa_candidates(shape[2]) if kind == "gqa" else mla_candidates(args.mla_configs)
            Ls = sorted({L for L, _ in SWEEP_CASES} | set(lengths))
            jobs += [(kind, shape, L, split, dataclasses.asdict(cfg)) for split, cfg in cands for L in Ls]
        precompile(jobs, args.workers)
        end = time.time() + args.sweep_budget_s
        for i, (kind, shape) in enumerate(swept):
            share = (end - time.time()) / (len(swept) - i)
            chosen[(kind, shape)] = sweep(kind, shape, gen, bw, time.time() + share, args.mla_configs)

    rows = []
    if args.schedules:
        per_kind = dict(part.split("=") for part in args.schedules.split(";"))
        cells = [tuple(int(v) for v in c.split("x")) for c in args.cells.split(",")]
        for kind, shape in shapes:
            if kind in per_kind:
                rows += schedule_table(kind, shape, parse_schedules(per_kind[kind]), cells, gen, bw)
        shapes = []
    for kind, shape in shapes:
        configs = [("table", default_split(kind, shape), None)]
        if chosen.get((kind, shape)):
            configs.append(("swept", *chosen[(kind, shape)]))
        for L in lengths:
            for B in batches:
                try:
                    p = gqa_problem(*shape, L, B, gen) if kind == "gqa" else mla_problem(*shape, L, B, gen)
                except torch.OutOfMemoryError:
                    log(f"  {kind} {shape} L={L} B={B}: does not fit")
                    continue
                for label, split, cfg in configs:
                    ms = time_case(kind, p, split, cfg)
                    err, inv = check_case(kind, p, split, cfg)
                    tbs = p["bytes"] / (ms * 1e-3) / 1e12
                    if kind == "mla":   # compute next to bytes: 2 H (R + Dr + R) FLOP a row and cached position
                        tf = 2 * shape[0] * (2 * shape[1] + shape[2]) * L * B / (ms * 1e-3) / 1e12
                        log(f"  mla {shape} L={L} B={B} {label}: {tf:.0f} TFLOP/s of MMA work")
                    rows.append((kind, shape, L, B, f"ds4t {label} ({describe(split) if isinstance(split, SplitSchedule) else f'split {split}'})", ms, tbs, 100 * tbs * 1e12 / bw,
                                 f"{err:.1e}", "yes" if inv else "**NO**"))
                if kind == "gqa":
                    ms = sdpa_ms(p)
                    tbs = p["bytes"] / (ms * 1e-3) / 1e12
                    rows.append((kind, shape, L, B, "torch SDPA (bf16, not invariant)", ms, tbs,
                                 100 * tbs * 1e12 / bw, "-", "-"))
                del p
                torch.cuda.empty_cache()
                for r in rows[-len(configs) - (kind == "gqa"):]:
                    log(f"  {r[0]} {r[1]} L={r[2]} B={r[3]} {r[4]}: {r[5]:.4f} ms {r[6]:.2f} TB/s {r[7]:.0f}% "
                        f"err {r[8]} inv {r[9]}")
    for (kind, shape), best in chosen.items():
        if best:
            log(f"\nbest {kind} {shape}: split {best[0]}, {best[1]}")
    log("\n| kernel | shape | L | B | impl | ms | TB/s | % of copy | max rel err | row invariant |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]:.4f} | {r[6]:.2f} | {r[7]:.0f} | {r[8]} | {r[9]} |")
    with open(os.path.join(args.out, "attention.md"), "w") as f:
        f.write("\n".join(LOG) + "\n")


if __name__ == "__main__":
    main()
