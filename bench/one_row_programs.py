#!/usr/bin/env python
"""More programs for one-row decode launches, the same bits: value-column parts and ordered K splits.

A decode step of one session launches kernels with too few programs to keep an H100 / H200 busy: Qwen3-Next's
attention at one row is 2 kv heads x 16 splits = 32 programs (22 us inside a step for 8.4 MB of cache), its FP8
gate/up 10 experts x 16 weight-row tiles = 160 programs of 2 warps (0.2 waves). Two knobs add programs without
changing a bit, so a table may take them for a few rows only:

* ``AttentionConfig.dv_parts`` / ``dv_rows``: each (row, kv head, split) of a launch of <= dv_rows rows runs as
  dv_parts programs, each over a part of the value columns (the same scores and softmax in every part).
* ``MoEConfig.ordered_split`` in an FP8 gate/up few-rows entry: K splits that store each scale block's dot, added
  in block order by the activation kernel (the unsplit kernel's FMA chain).

    python bench/one_row_programs.py kernels [--out DIR]
        decode attention (Qwen3-Next's 16 / 2 heads at d 256, GLM-4.5's 96 / 8 at d 128) at 4096 and 32768 tokens,
        1 / 2 / 4 / 8 rows: the table against 2 and 4 value-column parts; the FP8 grouped MoE at Qwen3-Next's and
        GLM-4.5's expert shapes at 1 and 2 rows: the table against ordered splits 2 / 4 / 8; absorbed MLA
        (DeepSeek-V3) at 4k / 8k / 32k and 1-8 rows: the table against few-row entries of ``MLAConfig.few_rows``
        -- three stages, 16 heads a program -- (``--only mla``: this section alone). us a call (CUDA graphs over
        rotated inputs), bits against the table.
    python bench/one_row_programs.py models --models qwen3-next-80b-4l:fp8 [--ns 1,2]
        whole decode steps (4096 tokens of context) under the table and each candidate (``bench/step_ab.py``'s
        rounds, bits and native == ordered compared).
    TRITON_INTERPRET=1 python bench/one_row_programs.py models --device cpu --models tiny-qwen:fp8   # smoke run

Exit status 1 if any candidate's bits differ from the table's.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import ds4t  # noqa: E402
from ds4t.kernels import attention as A, mla as MLA, moe as M  # noqa: E402
from bench.report import checked_run  # noqa: E402

PARTS = (2, 4)
SPLITS = (2, 4, 8)


@contextlib.contextmanager
def attention_parts(parts: int, rows: int = 1, gpu: bool = not ds4t.backend.INTERPRET):
    """Every decode-attention entry with ``parts`` value-column parts for launches of <= ``rows`` rows (``gpu``:
    the GPU table's entries, else the interpreter's rule)."""
    table = dict(A.ATTENTION_CONFIGS.gpu) if gpu else {}
    rule = A.ATTENTION_CONFIGS.gpu_rule if gpu else A.ATTENTION_CONFIGS.interp_rule

    def parted(*key):
        return dataclasses.replace(table.get(key) or rule(*key), dv_parts=parts, dv_rows=rows)

    with A.ATTENTION_CONFIGS.forced(parted):
        yield


@contextlib.contextmanager
def ordered_split(split: int, rows: int = 2, gpu: bool = not ds4t.backend.INTERPRET):
    """Every FP8 gate/up few-rows entry (the decode entry where a K has none) with an ordered K split of ``split``
    for launches of <= ``rows`` rows; every other key as the table has it (``gpu``: the GPU table, else the
    interpreter's rule, which has no few-rows entries)."""
    table = dict(M.MOE_CONFIGS.gpu) if gpu else {}
    rule = M.MOE_CONFIGS.gpu_rule if gpu else M.MOE_CONFIGS.interp_rule

    def lookup(kernel, *fmt):
        c = table.get((kernel, *fmt) if fmt else kernel)
        c = c if c is not None else rule(kernel, *fmt)
        if kernel == "gate_up" and fmt[:2] == ("fp8", "few") and c is not None:
            c = dataclasses.replace(c, split=split, ordered_split=True, max_rows=rows)
        return c

    with M.MOE_CONFIGS.forced(lookup):
        yield


def candidates():
    """(name, context-manager factory) of the table and every candidate."""
    out = [("table", contextlib.nullcontext)]
    out += [(f"attn-parts-{p}", lambda p=p: attention_parts(p)) for p in PARTS]
    out += [(f"moe-ordered-{s}", lambda s=s: ordered_split(s)) for s in SPLITS]
    return out


def _against_table(candidates, fns):
    """(us a call under the table then under each candidate context, whether every candidate's first call equals
    the table's bit for bit): ``fns`` one call per input rotation, timed together in a CUDA graph."""
    from bench.bench_kernels import time_calls

    ref = fns[0]().clone()
    us = [time_calls(fns)[0] * 1e3]
    same = True
    for cand in candidates:
        with cand():
            same &= torch.equal(fns[0](), ref)
            us.append(time_calls(fns)[0] * 1e3)
    return us, same


@contextlib.contextmanager
def mla_few_rows(rows: int, stages=None, heads=None):
    """Every MLA entry of the GPU table with ``few_rows`` = rows, ``few_stages`` = stages and ``few_heads`` = heads
    (None: the table's)."""
    table, rule = dict(MLA.MLA_CONFIGS.gpu), MLA.MLA_CONFIGS.gpu_rule

    def few(*key):
        c = table.get(key) or rule(*key)
        return dataclasses.replace(c, few_rows=rows, few_stages=c.few_stages if stages is None else stages,
                                   few_heads=c.few_heads if heads is None else heads)

    with MLA.MLA_CONFIGS.forced(few):
        yield


def mla_kernels(log) -> bool:
    """Absorbed MLA (DeepSeek-V3's 128 heads, 512 + 64, bf16 cache) at 1-8 rows: the table against few-row
    entries (``MLAConfig.few_rows``): three stages for 1 / 2 rows, 16 heads a program (twice the programs) at one
    row, both (four stages do not fit shared memory: 262 KB); us a call, bits against the table."""
    from bench.bench_attention import MLA_SHAPE, mla_problem, run_mla

    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    sched = MLA.default_split_schedule(MLA_SHAPE[1], MLA_SHAPE[2], torch.bfloat16)
    cfg = MLA.MLA_CONFIGS(*MLA_SHAPE, sched.min_split)
    log(f"\n## Absorbed MLA, bf16 cache: us a call; table {cfg}\n")
    variants = [("3 stages at 1 row", lambda: mla_few_rows(1, 3)), ("3 stages at <= 2 rows", lambda: mla_few_rows(2, 3)),
                ("16 heads at 1 row", lambda: mla_few_rows(1, heads=16)),
                ("16 heads, 3 stages at 1 row", lambda: mla_few_rows(1, 3, 16))]
    log("| L | B | table | " + " | ".join(n for n, _ in variants) + " | bits as table |")
    log("|---|---|---|" + "---|" * len(variants) + "---|")
    for L in (4096, 8192, 32768):
        for B in (1, 2, 4, 8):
            p = mla_problem(*MLA_SHAPE, L, B, gen)
            fns = [lambda s=s, p=p: run_mla(p, s, sched, None) for s in p["slot_sets"]]
            us, same = _against_table([v for _, v in variants], fns)
            ok &= same
            log(f"| {L} | {B} | " + " | ".join(f"{u:.1f}" for u in us) + f" | {'yes' if same else 'NO'} |")
            del p
            torch.cuda.empty_cache()
    return ok


def kernels(args, log) -> bool:
    from bench.bench_attention import gqa_problem, run_gqa
    from ds4t.kernels.weights import quantize

    if args.only == "mla":
        return mla_kernels(log)
    ok = True
    gen = torch.Generator(device="cuda").manual_seed(0)
    log("\n## Decode attention, bf16 cache: us a call; value-column parts\n")
    log("| heads | L | B | table | " + " | ".join(f"{p} parts" for p in PARTS) + " | bits as table |")
    log("|---|---|---|---|" + "---|" * len(PARTS) + "---|")
    for hq, hkv, d in [(16, 2, 256), (96, 8, 128)]:
        sched = A.default_split_schedule(d, d, torch.bfloat16)
        for L in (4096, 32768):
            for B in (1, 2, 4, 8):
                p = gqa_problem(hq, hkv, d, L, B, gen)
                fns = [lambda s=s, p=p: run_gqa(p, s, sched, None) for s in p["slot_sets"]]
                parted = [lambda parts=parts: attention_parts(parts, B) for parts in PARTS]
                us, same = _against_table(parted, fns)
                ok &= same
                log(f"| {hq} / {hkv}, d {d} | {L} | {B} | " + " | ".join(f"{u:.1f}" for u in us) +
                    f" | {'yes' if same else 'NO'} |")
                del p
                torch.cuda.empty_cache()
    log("\n## FP8 grouped MoE, bf16 activations: us a call; ordered gate/up K splits\n")
    log("| experts | B | table | " + " | ".join(f"split {s}" for s in SPLITS) + " | bits as table |")
    log("|---|---|---|" + "---|" * len(SPLITS) + "---|")
    for name, E, I, D, k in [("Qwen3-Next", 512, 512, 2048, 10), ("GLM-4.5", 160, 1536, 5120, 8)]:
        ws = [quantize(torch.randn(*s, device="cuda", generator=gen) * s[-1] ** -0.5)
              for s in ((E + 1, I, D), (E + 1, I, D), (E + 1, D, I))]
        for B in (1, 2):
            # rotations: other experts each call, so the weights come from DRAM as in a step
            calls = []
            for r in range(8):
                h = torch.randn(B, D, device="cuda", generator=gen).bfloat16()
                ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:k] for _ in range(B)]).int()
                wts = torch.softmax(torch.randn(B, k, device="cuda", generator=gen), -1)
                calls.append(lambda h=h, ids=ids, wts=wts, ws=ws: M.moe_experts(h, ids, wts, *ws,
                                                                                shared_expert=E))
            us, same = _against_table([lambda split=split: ordered_split(split, B) for split in SPLITS], calls)
            ok &= same
            log(f"| {name} ({E} + 1, I {I}, D {D}, top {k}) | {B} | " + " | ".join(f"{u:.1f}" for u in us) +
                f" | {'yes' if same else 'NO'} |")
        del ws
        torch.cuda.empty_cache()
    return mla_kernels(log) and ok


def models(args, log) -> bool:
    """Whole decode steps (``prefill_ab.models_ab``, no prompts) under the table and each candidate; False if bits
    differ."""
    from bench.prefill_ab import models_ab

    return models_ab(args.models, [int(n) for n in args.ns.split(",")], candidates(), args.device, log,
                     prompts=False)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["kernels", "models"])
    ap.add_argument("--models", default="qwen3-next-80b-4l:fp8")
    ap.add_argument("--ns", default="1,2", help="models: decode rows")
    ap.add_argument("--only", choices=["all", "mla"], default="all", help="kernels: every section, or MLA's alone")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args(argv)
    return checked_run("one_row_programs", args, kernels, models)

if __name__ == "__main__":
    sys.exit(main())
