#!/usr/bin/env python
"""Prefill-chunk attention on the GPU: one chunk of a long prompt through ds4t's attention kernels, with
config variants A/B'd in one process, their bits checked, and FlashAttention (SDPA) as the same-run peer.

    PYTHONUNBUFFERED=1 python bench/prefill_attention.py [--at 0,31744] [--chunk 1024] [--only glm,qwen,mla] \\
        [--variant NAME=JSON ...] [--out $OUT/pattn]
    TRITON_INTERPRET=1 python bench/prefill_attention.py --device cpu --only glm --chunk 8 --at 0,24 --rounds 1 --iters 1

A prefill chunk is ``--chunk`` rows of one slot at positions ``at .. at + chunk - 1``: row t attends to the
``at + t + 1`` cached positions before and at it (causal), so a chunk late in a 32k prompt reads the whole
cache per row. That is where a long prompt's time goes (bench_prefill --profile-at: the attention kernels
are ~80 % of a GLM-4.5 / DeepSeek-V3 chunk at 31744). Shapes (bf16 caches):

  * glm  -- GQA 96 q / 8 kv heads, d 128 (GLM-4.5): ``decode_attention(..., same_slot_runs=<the chunk's run>)``
  * qwen -- GQA 16 q / 2 kv heads, d 256 (Qwen3-Next's gated attention)
  * mla  -- absorbed MLA, 128 heads, latent 512 + rope 64 (DeepSeek-V3): ``mla_decode(..., same_slot_runs=...)``
    (no runs kernel: a program a row; ``MLAConfig.fuse_rows`` folds a long run's splits in the row's program)

The chunk's runs hint is what a model passes (``blocks.runs_hint``: a :class:`ds4t.kernels.splits.SameSlotRuns`
table of the one run). To A/B the MLA fusion (off in the GPU table until timed):
``--only mla --variant fuse='{"mla_decode": [{"key": [128, 512, 64, 128], "fields": {"fuse_rows": 512}}]}'``.

FLOPs count what the math needs, causal: 2 * H * (D + Dv) per (row, cached position) -- no padding heads,
no hi / lo halves, no masked work. % is of a bf16 ``torch.matmul`` 8192^3 timed in the same process.
Timing: on a GPU a CUDA graph of 4 back-to-back calls captured under the variant's tables
(``bench.bench_kernels.time_calls``: no host launch cost in the time -- timed a call at a time from the host,
a 0.3 ms chunk read up to 60 % slower and a variant's table switch counted against it), the median of
``--iters`` replays a round, the median of ``--rounds`` round medians, variants interleaved round by round;
on the CPU wall time a call.

Bits: each variant's output is compared with the base's (the table's), bit for bit -- a variant that only
moves work (tile rows per program, warps, stages) must keep them; one with ``"products": "cache"`` computes
other numerics and differs by design -- and the base is compared with the split kernels
(``same_slot_runs=None``, what decode runs): a prefill row must get its decode row's bits.
A planted control (another split schedule) must differ, so the comparison can fail.

Peer: ``torch.nn.functional.scaled_dot_product_attention`` with a lower-right causal mask (FlashAttention
2 on the H200 for d <= 256; bf16, not batch invariant), on the same q / K / V (K / V expanded to the query heads, untimed), GQA only (MLA's 576-wide
heads have no flash kernel in torch). A short table is printed last; everything goes to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_kernels import time_calls  # noqa: E402
from bench.report import Report  # noqa: E402
from bench.bench_prefill import matmul_peak  # noqa: E402
from bench.hf_peer import median_ms  # noqa: E402
from bench.step_ab import parse_variant  # noqa: E402
from ds4t.kernels import attention as A  # noqa: E402
from ds4t.kernels import config as C  # noqa: E402
from ds4t.kernels import mla as M  # noqa: E402
from ds4t.kernels.splits import SameSlotRuns  # noqa: E402

SHAPES = {"glm": ("gqa", 96, 8, 128), "qwen": ("gqa", 16, 2, 256), "mla": ("mla", 128, 512, 64)}


def chunk_case(kind: str, shape, at: int, chunk: int, device, seed: int = 0):
    """(inputs dict, useful FLOPs) of one chunk at position ``at``: a cache of at + chunk positions (slot 0
    holds them; slot 1 is NaN and never read), q rows for positions at .. at + chunk - 1, and the chunk's
    runs hint (``runs``), built once here as a model's step metadata is -- inside the timed call its table's
    host-to-device copy cost ~0.3 ms a call (bench/results/2026-12-05-h200-prefill-runs.md)."""
    g = torch.Generator(device=device).manual_seed(seed)
    L = at + chunk
    lengths = torch.arange(at + 1, at + chunk + 1, dtype=torch.int32, device=device)
    slots = torch.zeros(chunk, dtype=torch.int32, device=device)
    runs = chunk_runs(slots)
    total = (at + 1 + at + chunk) * chunk // 2          # sum of the rows' lengths
    if kind == "gqa":
        _, hq, hkv, d = shape
        kc = torch.randn(2, L, hkv, d, device=device, generator=g).to(torch.bfloat16)
        vc = torch.randn(2, L, hkv, d, device=device, generator=g).to(torch.bfloat16)
        kc[1] = float("nan")
        vc[1] = float("nan")
        q = torch.randn(chunk, hq, d, device=device, generator=g)
        return dict(q=q, kc=kc, vc=vc, slots=slots, lengths=lengths, scale=d ** -0.5, runs=runs), \
            2 * hq * 2 * d * total
    _, h, r, dr = shape
    cache = (torch.randn(2, L, r + dr, device=device, generator=g) * 0.5).to(torch.bfloat16)
    cache[1] = float("nan")
    ql = (torch.randn(chunk, h, r, device=device, generator=g) * 0.1).to(torch.bfloat16)
    qp = (torch.randn(chunk, h, dr, device=device, generator=g) * 0.1).to(torch.bfloat16)
    return dict(ql=ql, qp=qp, cache=cache, slots=slots, lengths=lengths, scale=(192 ** -0.5), r=r, runs=runs), \
        2 * h * (r + dr + r) * total


def chunk_runs(slots: torch.Tensor) -> SameSlotRuns:
    """The runs hint of a chunk: one run of every row, slot 0 (as ``blocks.runs_hint`` builds it)."""
    n = slots.shape[0]
    return SameSlotRuns(torch.tensor([[0, n, 0, -1]], dtype=torch.int64, device=slots.device), n, n)


def run_ds4t(kind: str, x: dict, runs: bool = True, split_size=None, products: str = "split"):
    hint = x["runs"] if runs else None
    if kind == "gqa":
        return A.decode_attention(x["q"], x["kc"], x["vc"], x["slots"], x["lengths"], x["scale"],
                                  same_slot_runs=hint, split_size=split_size, products=products)
    if products != "split":
        raise SystemExit("a variant's products applies to GQA only (MLA multiplies in the cache dtype already)")
    return M.mla_decode(x["ql"], x["qp"], x["cache"], x["slots"], x["lengths"], x["scale"], kv_lora_rank=x["r"],
                        split_size=split_size, same_slot_runs=hint)


def sdpa_peer(x: dict, at: int, chunk: int):
    """FlashAttention through SDPA on the same chunk: q [1, Hq, chunk, D] against the slot's at + chunk
    positions, lower-right causal (row t sees positions <= at + t), GQA heads expanded by SDPA."""
    from torch.nn.attention.bias import causal_lower_right

    q = x["q"].to(torch.bfloat16).transpose(0, 1)[None]                     # [1, Hq, C, D]
    g = q.shape[1] // x["kc"].shape[2]
    # K / V expanded to the query heads once, untimed: the flash kernel then runs whatever SDPA's GQA support
    k, v = (c[0, :at + chunk].transpose(0, 1).repeat_interleave(g, 0).contiguous()[None] for c in (x["kc"], x["vc"]))
    mask = causal_lower_right(chunk, at + chunk)
    return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=x["scale"])


def timed_ms(fn, table, device, iters: int) -> float:
    """Median ms of one call of fn under the config tables ``table`` (None: as they are): a CUDA graph's
    replays on a GPU, wall time on the CPU."""
    with C.overridden(table or {}):
        if device.type == "cuda":
            return time_calls([fn], min_calls=4, iters=iters)[0]
        return median_ms(fn, iters, 0, device)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--at", default="0,31744", help="chunk start positions")
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--only", default="glm,qwen,mla")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=JSON: a ds4t.kernels.config.overridden spec (inline JSON or a file), optionally with "
                         "\"products\": \"cache\" (GQA: decode_attention's products; other numerics, other bits)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run (the interpreter, tiny chunks)")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    log = Report()

    variants = [("base", None)] + [parse_variant(v, i + 1) for i, v in enumerate(args.variant)]
    device = torch.device(args.device)
    peak = matmul_peak(device)
    log(f"# prefill-chunk attention on {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    log(f"commit {args.commit or '?'}; torch {torch.__version__}; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
        f"chunk {args.chunk} rows")
    log("command: python " + " ".join(sys.argv))
    rows = []
    for key in args.only.split(","):
        kind = SHAPES[key][0]
        for at in (int(a) for a in args.at.split(",")):
            x, flops = chunk_case(kind, SHAPES[key], at, args.chunk, device)
            outs, times = {}, {n: [] for n, _ in variants}
            fns = {}   # name: (call, its config tables)
            for name, spec in variants:
                spec = spec or {}
                table = {k: v for k, v in spec.items() if k != "products"}
                fns[name] = (lambda x=x, kind=kind, p=spec.get("products", "split"): run_ds4t(kind, x, products=p),
                             table)
                with C.overridden(table):
                    outs[name] = fns[name][0]()
            peer = sdpa_peer(x, at, args.chunk) if kind == "gqa" else None
            if peer is not None:
                fns["sdpa (flash, not invariant)"] = (peer, None)
                times["sdpa (flash, not invariant)"] = []
                peer()
            for rnd in range(args.rounds):
                order = list(fns) if rnd % 2 == 0 else list(fns)[::-1]
                for name in order:
                    times[name].append(timed_ms(*fns[name], device, args.iters))
            base = outs["base"]
            checks = []
            # the control: every row in splits half its longest row's (a fixed size, so few partials)
            sched = (A.default_split_schedule(SHAPES[key][3], SHAPES[key][3], torch.bfloat16) if kind == "gqa"
                     else M.default_split_schedule(SHAPES[key][2], SHAPES[key][3], torch.bfloat16))
            half = max(16, sched.split_of(at + args.chunk) // 2)
            ctl = run_ds4t(kind, x, split_size=half)
            split = run_ds4t(kind, x, runs=False)
            checks.append(f"runs == split kernel (decode's bits): {torch.equal(base, split)}")
            checks.append(f"control (splits of {half}) differs: {not torch.equal(ctl, base)}")
            checks.append(f"no NaN (slot 1 is NaN, never read): {not torch.isnan(base).any().item()}")
            log(f"\n## {key} {SHAPES[key][1:]} chunk at {at}: {flops / 1e9:.0f} GFLOP; " + "; ".join(checks))
            log("| variant | ms (rounds min-max) | TFLOP/s | % of peak | bits as base |")
            log("|---|---|---|---|---|")
            for name in fns:
                ms = statistics.median(times[name])
                same = "-" if name not in outs or name == "base" else str(torch.equal(outs[name], base))
                log(f"| {name} | {ms:.3f} ({min(times[name]):.3f}-{max(times[name]):.3f}) | "
                    f"{flops / ms / 1e9:.0f} | {100 * flops / ms / 1e9 / (peak / 1e12):.1f} % | {same} |")
                rows.append(dict(shape=key, at=at, variant=name, ms=ms, tflops=flops / ms / 1e9, bits=same))
            del x, outs
            if device.type == "cuda":
                torch.cuda.empty_cache()
    log.write(args.out, "prefill_attention.md")
    with open(os.path.join(args.out, "prefill_attention.json"), "w") as f:
        json.dump(rows, f, indent=1)
    log("\n| shape | at | variant | ms | TFLOP/s | bits |")
    log("|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['shape']} | {r['at']} | {r['variant']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['bits']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
