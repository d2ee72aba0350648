"""Tensor + expert parallel on the GPUs of one host, in one call (issues 16, 19): exactness, TP = 1 against
TP = K decode steps with the time in collectives apart, and models at full depth.

Launch (NVLink multicast off, one process per GPU):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/bench_tp.py --out $OUT
    # issue 19 (8 GPUs): DeepSeek-V3 (61 layers) and GLM-4.5 (92 layers) at full depth in block-FP8, 4k context;
    # one device call a model (a full-depth load, the checks and the steps fill most of a 10-minute call)
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 bench/bench_tp.py --models deepseek-v3-fp8 \
        --ctx 4096 --ns 1,8,16,32,64 --scatter --budget-s 540 --out $OUT/ds
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 8 bench/bench_tp.py --models glm-4.5-fp8 ...same... --out $OUT/glm

For each preset (default: the 4-layer presets, and ``qwen3-next-80b``: 48 layers in bf16, ~80 GB per GPU at K = 2):
  0. the memory plan of every rank (ds4t.serve.planner: its weights, the largest N sessions at ``--ctx``, the
     step's workspace) against its GPU, before anything is loaded: a preset that cannot fit is skipped;
  1. exactness under TP = K on the GPUs: the harness (native vs ordered, torch.equal on every row's
     logits and every state tensor of this rank's shard) on a random session mix with prompts fed as
     chunks, its negative controls (1-ulp, batch-dependent linear, size-dependent reduction), and CUDA
     graph replay == eager (graphs captured per rank, the collectives inside them); every rank's
     verdict, all must pass; every rank ends with the same logits;
  2. TP = K against TP = 1 (presets that fit one GPU; TP = 1 runs on rank 0 alone): max relative logit error on
     a prompt and teacher-forced steps (another sum order: close, not equal), next to its noise floor (TP = 1
     against TP = 1 with every mixer/FFN output nudged by one fp32 ulp) and the router flips of both: in bf16
     MoE models a near-tie in the router turns sum-order noise into another expert (GLM-4.5: ~0.4);
  3. decode step at N = 1, 16, 64 (``--ns``) sessions at ``--ctx`` tokens of synthetic context: TP = K
     with CUDA graphs, TP = K eager with the time in collectives (CUDA events around each all-gather +
     sum), and TP = 1 with graphs; against the bytes floor per GPU (this rank's weights once, the
     distinct local experts N tokens touch, its state shard) over the measured copy bandwidth. DeepSeek-V3 at
     full depth is set beside the public anchor issue 19 names (:data:`ANCHORS`). ``--scatter``: the same
     steps with the two-phase reduction (ds4t.parallel.comm.scattered_sum) on every reduction, its logits
     checked bitwise against the default path's (the numbers that would set its GPU threshold).

A time budget (``--budget-s``, default 420) skips what is left once spent (rank 0 decides, all follow).
Full results in ``$OUT/tp.md`` and ``$OUT/tp.jsonl``; the short table is printed last.
CPU smoke run of the script (gloo, tiny presets, wall clock; any K the preset's heads allow):
    torchrun --nproc-per-node 2 bench/bench_tp.py --device cpu --models tiny-qwen --ns 1,2 --ctx 8 --iters 2
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import random
import sys
import time
import traceback

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ds4t  # noqa: E402
from bench.bench_decode import copy_bandwidth, graph_exactness, step_floor_bytes  # noqa: E402
from bench.bench_fp8 import median_ms, synthetic_sessions, time_native  # noqa: E402
from ds4t.exactness.controls import kinds_for, run_controls  # noqa: E402
from ds4t.exactness.harness import random_scenario, run_scenario  # noqa: E402
from ds4t.testing.parallel import reference_run, route_differences  # noqa: E402

DEFAULT_MODELS = "qwen3-next-80b-4l,qwen3-next-80b,glm-4.5-4l,deepseek-v3-4l"
ANCHORS = {"deepseek-v3-fp8": ("SGLang, DeepSeek-V3 on 8x H200 (the figures issue 19 quotes)", {1: 30.0, 8: 206.0, 32: 761.0})}
"""Public decode throughputs (tokens/s over all sessions, by batch size) to set beside a preset's rows: cited, not
run here (an SGLang wheel does not fit the machines)."""
PROMPT = [(7 * i + 3) % 256 for i in range(32)]


class Run:
    """This rank's place, the log (rank 0 writes), the budget and the agreement between ranks."""

    def __init__(self, args):
        self.args = args
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.cuda = args.device == "cuda"
        self.t0 = time.time()
        self.lines, self.rows = [], []

    def log(self, s: str = "") -> None:
        if self.rank == 0:
            print(s, flush=True)
            self.lines.append(s)

    def _tensor(self, v: float) -> torch.Tensor:
        return torch.tensor([float(v)], device="cuda" if self.cuda else "cpu")

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (decisions that steer collectives must be the same)."""
        t = self._tensor(flag)
        dist.broadcast(t, src=0)
        return bool(t.item())

    def all_ok(self, ok: bool) -> bool:
        t = self._tensor(ok)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)   # 0/1 flags: any order gives the same answer
        return bool(t.item())

    def time_left(self) -> bool:
        return self.agree(time.time() - self.t0 < self.args.budget_s)

    def sync(self, m=None) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def tp_floor_bytes(model, n: int, ctx: int) -> float:
    """Bytes one native decode step of n sessions must move on this rank: its weights once (the local
    routed experts: the expected number N tokens touch, E_local (1 - (1 - k/E)^N) under uniform top-k
    routing), its share of the looked-up embedding rows, its state shard read and written."""
    rc = getattr(model, "router_cfg", None)
    E, k = (rc.num_experts, rc.top_k) if rc else (0, 0)
    total = 0.0
    for name, t in model.parameters().items():
        b = t.numel() * t.element_size()
        leaf = name.split(".")   # layers.{i}.ffn.w_gate (an FP8 stack: .data / .scale)
        if name == "embed" and "lm_head" in model.parameters():
            total += n / model.tp.size * t.shape[1] * t.element_size()
        elif E and len(leaf) >= 4 and leaf[2] == "ffn" and leaf[3] in ("w_gate", "w_up", "w_down"):
            total += b * (1 - (1 - k / E) ** n)   # each local expert is touched with this probability
        else:
            total += b
    for spec in model.pool.specs.values():
        per = torch.Size(spec.concrete(1)).numel() * spec.dtype.itemsize
        total += n * per * ((ctx + 1) if spec.has_ctx else 2)
    return total


def eager_with_collectives(model, n: int, ctx: int, iters: int, run: Run):
    """(median eager step ms, collective ms per step, collective calls per step) of n sessions."""
    model.cuda_graphs = False
    timer = model.tp.time_collectives()
    sessions, toks = synthetic_sessions(model, n, ctx, iters + 16, seed=n)

    def step():
        ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode="native")

    try:
        for _ in range(2):
            step()
        run.sync()
        timer.reset()
        ms = median_ms(step, iters, 0, model.device)
        coll = timer.ms() / iters
        calls = timer.calls / iters
    finally:
        model.tp.comm.timer = None
        model.cuda_graphs = True
        for s in sessions:
            s.close()
    return ms, coll, calls


def exactness_tp(model, run: Run) -> bool:
    a = run.args
    rng = random.Random(1)
    sc = random_scenario(rng, model.vocab_size, a.exact_sessions, a.exact_steps, max_prompt=64,
                         max_ctx=64 + a.exact_steps + 8)
    rep = run_scenario(model, sc, mode="native")
    csc = random_scenario(random.Random(7), model.vocab_size, 4, 2, max_prompt=16, max_ctx=40)
    controls = run_controls(model, csc, mode="native", kinds=kinds_for(model))
    graphs = graph_exactness(model) if run.cuda else True
    ok_here = rep.ok and graphs and all(c.caught for c in controls)
    ok = run.all_ok(ok_here)
    run.log("| check | rows | states | mismatches | paths |")
    run.log("|---|---|---|---|---|")
    run.log(f"| harness native vs ordered (rank 0's shard) | {rep.rows} | {rep.states} | {rep.mismatches} | {rep.paths} |")
    run.log(f"| CUDA graph replay == eager (per rank) | - | - | {0 if graphs else 'DIFFER'} | native |")
    for c in controls:
        run.log(f"| control: {c.kind} | {c.report.rows} | {c.report.states} | {c.report.mismatches} | {c.verdict} |")
    run.log(f"\nexactness under TP={run.size}, all ranks: {'PASS' if ok else 'FAIL'}")
    return ok


def rank_plans(name: str, run: Run, dt, cap) -> bool:
    """Step 0: every rank's memory plan (its shard built on 'meta': shapes only), the largest N of ``--ns``
    sessions at ``--ctx`` (plus the steps timed), a step of N rows + one 1024-token prompt chunk, against
    ``cap`` bytes (None: not checked). Logs one row per rank; whether every rank fits."""
    from ds4t.serve.planner import every_rank, fmt_bytes, plan

    a = run.args
    n = max(a.ns)
    shard = ds4t.load(name, device="meta", dtype=dt, tp=run.size)
    every = every_rank(plan(shard, n, a.ctx + a.iters + 32, n + 1024, memory_limit=cap))
    del shard
    run.log(f"Memory plan a rank ({n} sessions at {a.ctx} tokens; ds4t.serve.planner; CUDA graphs counted as a "
            f"GPU keeps them), against {fmt_bytes(cap) if cap else 'no limit'}:\n")
    run.log("| rank | weights | sessions | workspace | total | fits |")
    run.log("|---|---|---|---|---|---|")
    for r, q in enumerate(every):
        run.log(f"| {r} | {fmt_bytes(q.weights)} | {fmt_bytes(q.sessions)} | {fmt_bytes(q.workspace)} | "
                f"{fmt_bytes(q.total)} | {'yes' if q.fits else 'NO'} |")
    run.log("")
    return all(q.fits for q in every)


def bench_preset(name: str, run: Run, bw: float) -> bool:
    a = run.args
    run.log(f"\n## {name}\n")
    dt = getattr(torch, a.dtype) if a.dtype else None
    meta = ds4t.load(name, device="meta", dtype=dt)
    full_bytes = meta.weight_bytes()
    del meta
    cap = torch.cuda.get_device_properties(0).total_memory if run.cuda else float("inf")
    tp1 = run.agree(full_bytes < 0.8 * cap and not a.no_tp1)
    if not rank_plans(name, run, dt, None if math.isinf(cap) else cap):
        run.log(f"{name}: skipped, a rank's plan does not fit its GPU")
        return True
    free0 = torch.cuda.mem_get_info()[0] if run.cuda else 0
    t = time.time()
    m = ds4t.load(name, device=a.device, tp=run.size, dtype=dt)
    run.sync()
    load_s = time.time() - t
    used = (free0 - torch.cuda.mem_get_info()[0]) / 2**30 if run.cuda else float("nan")
    run.log(f"TP={run.size} loaded in {load_s:.0f} s: {m!r}")
    run.log(f"weights {full_bytes / 1e9:.1f} GB in all; this rank's shard {m.weight_bytes() / 1e9:.1f} GB "
            f"(GPU memory taken by the load {used:.1f} GiB)\n")
    ok = exactness_tp(m, run)
    logits2, routes2 = reference_run(m, PROMPT, 4)
    same = run.all_ok(bool(torch.equal(logits2, _from_rank0(logits2, run))))
    run.log(f"every rank ends with the same logits: {'yes' if same else 'NO'}")
    ok &= same
    results = {}
    run.log(f"\n### Decode step, TP={run.size}, {a.ctx} tokens of context (median of {a.iters})\n")
    run.log("| N | graphs ms | eager ms | collectives ms (eager) | calls/step | floor/GPU ms | floor / graphs | tok/s |")
    run.log("|---|---|---|---|---|---|---|---|")
    for n in a.ns:
        if not run.time_left():
            run.log(f"| {n} | skipped: time budget | | | | | | |")
            continue
        g_ms = time_native(m, n, a.ctx, a.iters)
        e_ms, c_ms, calls = eager_with_collectives(m, n, a.ctx, a.iters, run)
        floor = tp_floor_bytes(m, n, a.ctx) / bw * 1e3
        results[n] = dict(model=name, n=n, ctx=a.ctx, tp=run.size, graphs_ms=g_ms, eager_ms=e_ms, coll_ms=c_ms,
                          coll_calls=calls, floor_ms=floor, load_s=load_s, exact=ok)
        run.log(f"| {n} | {g_ms:.2f} | {e_ms:.2f} | {c_ms:.2f} ({100 * c_ms / e_ms:.0f}%) | {calls:.0f} | "
                f"{floor:.3f} | {100 * floor / g_ms:.0f}% | {n / g_ms * 1e3:.0f} |")
    if a.scatter and results and run.time_left():
        ok &= scatter_rows(m, run, results, logits2)
    del m
    gc.collect()
    if run.cuda:
        torch.cuda.empty_cache()
    dist.barrier()
    if tp1 and run.time_left():
        run.log("\n### TP=1 on rank 0 (same weights)\n")
        if run.rank == 0:
            m1 = ds4t.load(name, device=a.device, dtype=dt)
            logits1, routes1 = reference_run(m1, PROMPT, 4)
            nudged, routes_n = reference_run(m1, PROMPT, 4, perturb=True)
            scale = logits1.abs().max()
            err = ((logits2 - logits1).abs().max() / scale).item()
            floor = ((nudged - logits1).abs().max() / scale).item()
            flips, pairs = route_differences(routes2, routes1)
            flips_n, _ = route_differences(routes_n, routes1)
            run.log(f"TP={run.size} vs TP=1 logits ({len(PROMPT)}-token prompt + 4 teacher-forced steps): max relative error "
                    f"{err:.2e}; bitwise equal: {torch.equal(logits1, logits2)} (another sum order: not expected); "
                    f"expert sets differing in {flips} of {pairs} token-layer pairs")
            run.log(f"noise floor, TP=1 vs TP=1 with every mixer/FFN output moved by 1 fp32 ulp (a sum-order-sized "
                    f"change, ds4t.testing.parallel.reference_run): {floor:.2e}, expert sets differing in {flips_n} "
                    f"of {pairs}")
            run.log(f"\n| N | TP=1 graphs ms | TP=1 floor ms | TP={run.size} graphs ms | speed-up |")
            run.log("|---|---|---|---|---|")
            for n in a.ns:
                if time.time() - run.t0 > a.budget_s or n not in results:
                    continue
                ms1 = time_native(m1, n, a.ctx, a.iters)
                f1 = step_floor_bytes(m1, n, a.ctx)["total"] / bw * 1e3
                r = results[n]
                r.update(tp1_ms=ms1, tp1_floor_ms=f1, tp1_rel_err=err, tp1_noise_floor=floor, route_flips=flips)
                run.log(f"| {n} | {ms1:.2f} | {f1:.3f} | {r['graphs_ms']:.2f} | {ms1 / r['graphs_ms']:.2f}x |")
            del m1
            gc.collect()
            if run.cuda:
                torch.cuda.empty_cache()
        dist.barrier()
    elif not tp1:
        run.log(f"\nTP=1 not run: {full_bytes / 1e9:.0f} GB of weights do not fit one device (or --no-tp1)")
    run.rows += list(results.values())
    return ok


def scatter_rows(m, run: Run, results: dict, base_logits: torch.Tensor) -> bool:
    """The two-phase reduction (ds4t.parallel.comm.scattered_sum: all-to-all of column slices, rank-order sum,
    all-gather; 2 x the output's bytes instead of K x) on every reduction: the reference logits bitwise the
    default path's, then the decode steps again (graphs captured anew, and eager with the collectives timed).
    The default choice is restored after."""
    from ds4t.batch.graphs import graphs_for

    a, comm = run.args, m.tp.comm
    default = comm.scatter_from

    def regraph():
        g = graphs_for(m)
        if g is not None:
            g.clear()

    comm.scatter_from = 0
    regraph()
    try:
        logits, _ = reference_run(m, PROMPT, 4)
        same = run.all_ok(bool(torch.equal(logits, base_logits)))
        run.log(f"\n### Two-phase reduction (all-to-all + rank-order sum + all-gather) on every reduction\n\n"
                f"logits bitwise the default reduction's: {'yes' if same else 'NO'}\n")
        run.log("| N | graphs ms | vs default | eager ms | collectives ms (eager) | calls/step |")
        run.log("|---|---|---|---|---|---|")
        for n, r in results.items():
            if not run.time_left():
                break
            g_ms = time_native(m, n, a.ctx, a.iters)
            e_ms, c_ms, calls = eager_with_collectives(m, n, a.ctx, a.iters, run)
            r.update(scatter_graphs_ms=g_ms, scatter_coll_ms=c_ms)
            run.log(f"| {n} | {g_ms:.2f} | {g_ms / r['graphs_ms']:.2f}x | {e_ms:.2f} | {c_ms:.2f} | {calls:.0f} |")
    finally:
        comm.scatter_from = default
        regraph()
    return same


def _from_rank0(t: torch.Tensor, run: Run) -> torch.Tensor:
    x = t.to("cuda" if run.cuda else "cpu").contiguous()
    dist.broadcast(x, src=0)
    return x.cpu()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=DEFAULT_MODELS)
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-sessions", type=int, default=6)
    ap.add_argument("--exact-steps", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip what is left after this many seconds")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                    help="model dtype (default: the preset's); float32 separates sum-order noise from sharding bugs")
    ap.add_argument("--no-tp1", action="store_true", help="skip the TP=1 comparison")
    ap.add_argument("--scatter", action="store_true",
                    help="also run the steps with the two-phase reduction on every reduction (bits checked)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a gloo smoke run")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=5))
    run = Run(args)
    if run.rank == 0:
        os.makedirs(args.out, exist_ok=True)
    bw = copy_bandwidth("cuda") if cuda else 20e9
    dev = torch.cuda.get_device_name() if cuda else "cpu (smoke run)"
    run.log(f"# ds4t tensor + expert parallel: TP={run.size} on {run.size}x {dev}\n")
    run.log(f"commit {args.commit}; torch {torch.__version__}; NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}; "
            f"copy bandwidth {bw / 1e12:.2f} TB/s (rank 0, read + write)")
    run.log(f"command: NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node {run.size} bench/bench_tp.py {' '.join(sys.argv[1:])}")
    run.log("collectives: all-gather of fp32 partial sums, summed in rank order on every rank (ds4t.parallel.comm)")
    ok = True
    for name in [m for m in args.models.split(",") if m]:
        if not run.time_left():
            run.log(f"\n## {name}: skipped (time budget of {args.budget_s:.0f} s spent)")
            continue
        try:
            ok &= bench_preset(name, run, bw)
        except Exception:   # noqa: BLE001 - a broken preset is a failed section, the others still run
            run.log(f"\n{name}: FAILED on rank 0:\n```\n{traceback.format_exc()}```")
            ok = False
    ok = run.all_ok(ok)
    run.log("\n## Summary\n")
    K = run.size
    run.log(f"| model | N | TP={K} ms | tok/s | collectives ms | floor/GPU ms | floor / TP={K} | TP=1 ms | "
            f"TP={K} vs TP=1 rel err | public anchor tok/s |")
    run.log("|---|---|---|---|---|---|---|---|---|---|")
    for r in run.rows:
        tp1 = f"{r['tp1_ms']:.2f}" if "tp1_ms" in r else "-"
        err = f"{r['tp1_rel_err']:.1e}" if "tp1_rel_err" in r else "-"
        src, anchor = ANCHORS.get(r["model"], ("", {}))
        ref = f"{anchor[r['n']]:.0f} ({src})" if r["n"] in anchor else "-"
        run.log(f"| {r['model']} | {r['n']} | {r['graphs_ms']:.2f} | {r['n'] / r['graphs_ms'] * 1e3:.0f} | "
                f"{r['coll_ms']:.2f} | {r['floor_ms']:.3f} | {100 * r['floor_ms'] / r['graphs_ms']:.0f}% | {tp1} | "
                f"{err} | {ref} |")
    run.log(f"\nexactness under TP={run.size} (all ranks): {'PASS' if ok else 'FAIL'}; "
            f"total {time.time() - run.t0:.0f} s")
    if run.rank == 0:
        with open(os.path.join(args.out, "tp.md"), "w") as f:
            f.write("\n".join(run.lines) + "\n")
        with open(os.path.join(args.out, "tp.jsonl"), "w") as f:
            for r in run.rows:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The results are written and the group destroyed; skip the interpreter's finalisation, where gloo's worker
    # threads can still hold work objects whose tensors need the GIL (a SIGABRT after a good run, seen once under
    # load in CI; pytorch/pytorch#179291 describes it).
    os._exit(code)
