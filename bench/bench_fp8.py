"""Block-FP8 (W8A16) on the GPU, in one call: exactness, kernel bandwidth, decode steps against the floor.

1. Kernels (``--kernels``): the FP8 linear at weights >= 100 MB and the grouped MoE at Qwen3-Next-80B's expert
   shape, B = 1, 4, 16, next to the same kernels on bf16 weights. Bytes = fp8 values + block scales (the
   weight bytes a step must read); % of the measured device-to-device copy bandwidth. CUDA events, warm-up,
   median of 20.
2. Models (``--models``): each loaded in FP8 (a ``*-fp8`` preset, or any preset with ``:fp8`` to quantize it at
   load, e.g. ``glm-4.5-4l:fp8``); load time and memory; exactness on the GPU (harness native == ordered with
   both negative controls, graph replay == eager); decode step at each N with CUDA graphs, at ``--ctx`` tokens
   of context per session, against the bytes floor (weights once + every session's state). States at
   ``--ctx`` are synthesized (random KV / recurrent / conv values, loaded with ``load_state_dict``): a decode
   step's time does not depend on the values, and prefilling 64 x 4k tokens at full depth would cost minutes.

Full results under ``--out`` (``fp8.md``, ``fp8.jsonl``); the short table is printed last.

    python bench/bench_fp8.py --kernels --models qwen3-next-80b-fp8 --ns 1,16,64 --ctx 4096 --out $OUT
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ds4t  # noqa: E402
from bench.bench_decode import copy_bandwidth, exactness, log_profile, step_floor_bytes  # noqa: E402
from bench import model_spec  # noqa: E402
from bench.report import Report, bandwidth_table  # noqa: E402
from bench.hf_peer import median_ms  # noqa: E402,F401  (bench_gguf and bench_tp import it from here)
from ds4t.kernels import linear as L, moe as M  # noqa: E402
from ds4t.kernels.config import overridden  # noqa: E402

_OVERRIDES = contextlib.ExitStack()   # --configs: held for the whole run
from ds4t.kernels.weights import quantize  # noqa: E402


def kernel_rows(bw: float, log):
    """FP8 vs bf16 linear and MoE at real shapes: ms, GB/s, % of copy bandwidth. Timed as decode runs
    them (bench_kernels.time_calls: CUDA graphs of back-to-back calls, rotating over weight copies /
    expert sets beyond the L2). Activations in bf16, as a bf16 model stores every tensor whose only readers round
    it to bf16 (``Decoder.norm_dtype``, ``blocks.narrow_store``): the norms before the linears and before
    Qwen3-Next's experts (its router is bf16). fp32 activations, which the kernel rounds as it loads them, cost the
    FP8 linear 15-27 points of copy bandwidth on an H200 (bench/results/2026-12-07-h200-fp8-table-80b-n1.md) and
    reach these shapes only in fp32 models or behind an fp32 router (DeepSeek-V3's and GLM-4.5's experts)."""
    from bench.bench_kernels import ROTATE_BYTES, time_calls

    rows = []
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    for K, N in ((7168, 18432), (4096, 28672), (2048, 151936)):
        n_rot = max(2, math.ceil(ROTATE_BYTES / (N * K)))
        ws = [torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * K ** -0.5 for _ in range(n_rot)]
        qs = [quantize(w.float()).with_act_dtype(torch.bfloat16) for w in ws]
        for B in (1, 4, 16):
            x = torch.randn(B, K, device=dev, generator=g, dtype=torch.bfloat16)
            out = torch.empty(B, N, device=dev)
            for fmt, pool, nbytes in (("bf16", ws, ws[0].numel() * 2), ("fp8", qs, qs[0].nbytes)):
                ms, _ = time_calls([lambda w=w: L.linear(x, w, out=out) for w in pool])
                rows.append(dict(kernel="linear", fmt=fmt, shape=f"K={K} N={N}", B=B, mb=nbytes / 1e6, ms=ms,
                                 gbs=nbytes / ms / 1e6, pct=100 * nbytes / ms / 1e-3 / bw))
        del ws, qs
    E, I, D, k = 512, 512, 2048, 10
    wg = torch.randn(E, I, D, device=dev, generator=g, dtype=torch.bfloat16) * D ** -0.5
    wu = torch.randn(E, I, D, device=dev, generator=g, dtype=torch.bfloat16) * D ** -0.5
    wd = torch.randn(E, D, I, device=dev, generator=g, dtype=torch.bfloat16) * I ** -0.5
    qg, qu, qd = (quantize(t.float()).with_act_dtype(torch.bfloat16) for t in (wg, wu, wd))
    for B in (1, 4, 16):
        h = torch.randn(B, D, device=dev, generator=g, dtype=torch.bfloat16)
        # 4 routings, consecutive k-slices of one permutation (disjoint while 4 * B * k <= E): the
        # rotation leaves the L2 at B = 1 and 4
        perm = torch.randperm(E, device=dev, generator=g)
        idss = [torch.stack([perm[(r * B + b) * k % (E - k + 1):][:k] for b in range(B)]).to(torch.int32)
                for r in range(4)]
        wts = torch.softmax(torch.randn(B, k, device=dev, generator=g), -1)
        touched = sum(len(set(ids.flatten().tolist())) for ids in idss) / len(idss)
        for fmt, ws in (("bf16", (wg, wu, wd)), ("fp8", (qg, qu, qd))):
            per_expert = sum((t.nbytes if hasattr(t, "block_k") else t.numel() * 2) for t in ws) / E
            nbytes = per_expert * touched
            ms, _ = time_calls([lambda ids=ids: M.moe_experts(h, ids, wts, *ws) for ids in idss])
            rows.append(dict(kernel="moe_experts", fmt=fmt, shape=f"E={E} I={I} D={D} top{k} ({touched:.0f} experts)",
                             B=B, mb=nbytes / 1e6, ms=ms, gbs=nbytes / ms / 1e6, pct=100 * nbytes / ms / 1e-3 / bw))
    bandwidth_table(log, rows)
    return rows


def synthetic_sessions(model, n: int, ctx: int, extra: int, seed: int):
    """n sessions at position ``ctx`` with random states (see the module docstring), and n next tokens."""
    g = torch.Generator(device=model.device).manual_seed(seed)
    rng = random.Random(seed)
    sessions = []
    for _ in range(n):
        s = model.new_session(max_ctx=ctx + extra)
        state = {}
        for name, t in s.state_dict().items():
            shape = list(t.shape)
            spec = model.pool.specs[name]
            if spec.has_ctx:
                shape[0] = ctx
            state[name] = (0.5 * torch.randn(shape, generator=g, device=model.device)).to(t.dtype)
        s.load_state_dict(state, ctx, [rng.randrange(model.vocab_size) for _ in range(ctx)])
        sessions.append(s)
    return sessions, [rng.randrange(model.vocab_size) for _ in range(n)]


def time_native(model, n: int, ctx: int, iters: int) -> float:
    sessions, toks = synthetic_sessions(model, n, ctx, iters + 16, seed=n)

    def step():
        res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode="native")
        assert all(p == "native" for p in res.paths)

    try:
        return median_ms(step, iters, 3, model.device)
    finally:
        for s in sessions:
            s.close()


def bench_model(spec: str, args, bw: float, log, out_rows, label: str = None):
    """Load ``spec`` ("preset" or "preset:quantize"), check it on the GPU, time its decode steps; rows and
    headings say ``label`` (default: the spec)."""
    label = label or spec
    log(f"\n# {label}\n")
    cuda = torch.device(args.device).type == "cuda"
    free0 = torch.cuda.mem_get_info()[0] if cuda else 0
    t0 = time.time()
    model = model_spec.load(spec, args.device)
    if cuda:
        torch.cuda.synchronize()
    load_s = time.time() - t0
    used = (free0 - torch.cuda.mem_get_info()[0]) / 2**30 if cuda else float("nan")
    log(f"loaded in {load_s:.0f} s: {model!r}")
    log(f"weights + scales {model.weight_bytes() / 1e9:.2f} GB; GPU memory taken by the load {used:.1f} GiB")
    from ds4t.serve.planner import plan

    p = plan(model, max(args.ns), args.ctx + 64, max(args.ns) + 128)
    log("\n```\n" + p.format() + "\n```\n")
    ea = argparse.Namespace(exact_rounds=1, exact_sessions=args.exact_sessions, exact_steps=4)
    log("## Exactness on the GPU\n")
    ok = exactness(model, ea, log, [None]) if cuda else True
    log(f"\n## Decode step at {args.ctx} tokens of context (CUDA graphs, median of {args.iters})\n")
    log("| N | native ms | floor ms | floor / native | tok/s |")
    log("|---|---|---|---|---|")
    for n in args.ns:
        try:
            ms = time_native(model, n, args.ctx, args.iters)
        except ds4t.NotNativeError as e:   # e.g. GLM past its native window: say so, time the rest
            log(f"| {n} | not native at this context: {e} | | | |")
            continue
        floor = step_floor_bytes(model, n, args.ctx)["total"] / bw * 1e3
        row = dict(model=label, n=n, ctx=args.ctx, native_ms=ms, floor_ms=floor, ratio=ms / floor,
                   tok_s=n / ms * 1e3, load_s=load_s, weights_gb=model.weight_bytes() / 1e9, exact=ok)
        out_rows.append(row)
        log(f"| {n} | {ms:.2f} | {floor:.2f} | {100 * floor / ms:.0f}% ({ms / floor:.2f}x) | {row['tok_s']:.0f} |")
    if args.profile and cuda:   # the anatomy of each timed N (e.g. DeepSeek-V3-4l in FP8, which fits an H100)
        for row in [r for r in out_rows if r["model"] == label]:
            log_profile(model, label, row["n"], args.ctx, row["native_ms"], log)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--models", default="", help="comma list: preset or preset:fp8")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-sessions", type=int, default=8)
    ap.add_argument("--profile", action="store_true",
                    help="also print where each timed step's GPU time goes (bench_decode.log_profile)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--configs", default=None,
                    help="JSON file of GPU config-table entries to use instead (ds4t.kernels.config.overridden)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = Report()

    if args.configs:
        for table, key, cfg in _OVERRIDES.enter_context(overridden(args.configs)):
            log(f"config override: {table.kernel} {key!r} -> {cfg}")

    cuda = torch.device(args.device).type == "cuda"
    bw = copy_bandwidth("cuda") if cuda else 20e9
    log(f"# ds4t block-FP8 on {torch.cuda.get_device_name() if cuda else 'cpu (smoke run)'}\ncommit {args.commit}; torch {torch.__version__}; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)\ncommand: python bench/bench_fp8.py {' '.join(sys.argv[1:])}\n")
    krows, mrows, ok = [], [], True
    if args.kernels:
        log("## Kernels\n")
        krows = kernel_rows(bw, log)
        log.write(args.out, "fp8.md")   # so far: a run cut short (a device's time limit) keeps each finished part
    for spec in [m for m in args.models.split(",") if m]:
        ok &= bench_model(spec, args, bw, log, mrows)
        log.write(args.out, "fp8.md")
    with open(os.path.join(args.out, "fp8.jsonl"), "w") as f:
        for r in krows + mrows:
            f.write(json.dumps(r) + "\n")
    log("\n## Summary\n")
    if krows:
        fp8 = [r for r in krows if r["fmt"] == "fp8" and r["mb"] >= 100 and r["B"] <= 16]
        log(f"FP8 kernels, weights >= 100 MB, B <= 16: {min(r['pct'] for r in fp8):.0f}-"
            f"{max(r['pct'] for r in fp8):.0f}% of copy bandwidth (target >= 85%)")
    for r in mrows:
        log(f"{r['model']} N={r['n']} ctx={r['ctx']}: {r['native_ms']:.2f} ms, {r['ratio']:.2f}x the floor")
    log(f"exactness on GPU: {'PASS' if ok else 'FAIL'}")
    log.write(args.out, "fp8.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
