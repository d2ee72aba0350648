#!/usr/bin/env python
"""Prefill tiles of the 8-bit and 4-bit weight kernels: how many activation rows share one dequantized weight tile.

A decode launch of a GGUF or FP8 weight holds 16 activation rows a tile, and every tile dequantizes (converts) its
weight tile again, so a 1024-row prefill chunk converts every weight 64 times. Two knobs change that without
changing a bit -- each row still meets the same weight tile in the same MMA steps, its sums in the same K order:

* GGUF linear / MoE: the *rows entry* (``qlinear`` / ``qmoe`` table key + ``"rows"``) holds ``block_m`` rows (pairs)
  a tile, from ``min_rows`` rows (MoE: ``block_m_rows``); its warps stay the decode entry's (other warps can change
  the MMA layout and the bits).
* FP8 linear: ``LinearConfig.m_sub`` 16-row sub-tiles a program on one converted weight tile.

This script times candidates against each other in one process, bits checked:

    python bench/prefill_tiles.py kernels [--rows 1024,300] [--out DIR]
        GGUF linear (7168 x 36864, 2048 x 12352; Q8_0 / Q4_K / Q6_K) and MoE (Qwen3-Next's and GLM-4.5's experts)
        at 1024 rows under rows entries of (block_m, warps); FP8 linear under m_sub 1 / 2 / 4 at 64 and 1024 rows;
        cuBLAS on the bf16 weight beside them. Bits: the whole output against the decode tiles'.
    python bench/prefill_tiles.py models --models qwen3-next-80b-4l:q4_k,qwen3-next-80b-4l:fp8 [--ns 16,64]
        whole prompts (4096 tokens, chunks of 1024) and decode steps (4096 tokens of context) under the committed
        tables ("new") and the tables before the rows entries ("before": no GGUF linear rows entries, 16-pair GGUF
        MoE tiles, FP8 m_sub 1), bits and native == ordered compared.
    TRITON_INTERPRET=1 python bench/prefill_tiles.py models --device cpu --models tiny-qwen:q4_k    # smoke run

Results: bench/results/2026-12-06-h100-gguf-row-tiles.md (the script's first version ran as scratch files there).
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

import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
from ds4t.backend import INTERPRET  # noqa: E402
from ds4t.kernels import linear as L, moe as M, qlinear as Q, qmoe as QM  # noqa: E402
from ds4t.kernels.weights import FP8_DTYPE  # noqa: E402
from bench.report import checked_run  # noqa: E402

_LIN = (dict(L.LINEAR_CONFIGS.gpu), L.LINEAR_CONFIGS.gpu_rule, L.LINEAR_CONFIGS.interp_rule)
_QLIN = (dict(Q.QLINEAR_CONFIGS.gpu), Q.QLINEAR_CONFIGS.gpu_rule, Q.QLINEAR_CONFIGS.interp_rule)
_QMOE = (dict(QM.QMOE_CONFIGS.gpu), QM.QMOE_CONFIGS.gpu_rule, QM.QMOE_CONFIGS.interp_rule)


def _table(saved, key):
    """What the table answered for ``key`` before any forcing (the interpreter's rule in the interpreter)."""
    gpu, rule, interp = saved
    if INTERPRET:
        return interp(*key)
    c = gpu.get(key)
    return c if c is not None else rule(*key)


@contextlib.contextmanager
def candidate(lin=None, moe=None, fp8_m_sub=None):
    """GGUF rows entries of ``lin`` / ``moe`` = (block_m, warps or None: the decode entry's) -- linear from 128 rows,
    MoE in row programs from 64 rows, ``block_m`` from 128 -- or none (``lin`` None: decode tiles at every size;
    ``moe`` None: 16-pair row programs); ``fp8_m_sub``: every FP8 linear entry's m_sub (None: the table's)."""
    def lrule(*key):
        c = _table(_LIN, key)
        return dataclasses.replace(c, m_sub=fp8_m_sub) if fp8_m_sub and len(key) > 2 and key[2] == FP8_DTYPE else c

    def qrule(K, N, qt, adt, *rows):
        dec = _table(_QLIN, (K, N, qt, adt))
        if not rows:
            return dec
        if INTERPRET and lin is None:   # the interpreter's own table: no rows entries
            return _table(_QLIN, (K, N, qt, adt, *rows))
        return None if lin is None else dataclasses.replace(dec, block_m=lin[0], min_rows=128,
                                                             num_warps=lin[1] or dec.num_warps)

    def mrule(kernel, qt, *rows):
        dec = _table(_QMOE, (kernel, qt))
        if not rows:
            return dec
        if INTERPRET and moe is None:
            return _table(_QMOE, (kernel, qt, *rows))
        bm, wp = moe or (16, None)
        return dataclasses.replace(dec, row_programs=True, min_rows=64, block_m=bm, block_m_rows=128,
                                   num_warps=wp or dec.num_warps)

    with L.LINEAR_CONFIGS.forced(lrule), Q.QLINEAR_CONFIGS.forced(qrule), QM.QMOE_CONFIGS.forced(mrule):
        yield


@contextlib.contextmanager
def before():
    """The tables before the rows entries: no GGUF linear rows entries, 16-pair GGUF MoE tiles, FP8 m_sub 1."""
    with candidate(None, None, 1):
        yield


def _time(fn) -> float:
    from bench.bench_kernels import time_calls
    return time_calls([fn], min_calls=6, iters=9)[0]


def kernels(args, log) -> bool:
    from ds4t.kernels.quant_blocks import quantize
    from ds4t.kernels.weights import quantize as fp8_quantize

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    lin_v = [None, (32, None), (64, None), (64, 4)]
    log("\n## GGUF linear, bf16 activations: us (TFLOP/s); rows entries (block_m, warps)\n")
    log("| K x N | type | B | decode tiles | " + " | ".join(map(str, lin_v[1:])) + " | cuBLAS bf16 | bits as decode |")
    log("|---|---|---|---|---|---|---|---|---|")
    for K, N in [(7168, 36864), (2048, 12352)]:
        wf = torch.randn(N, K, device=dev, generator=g) * K ** -0.5
        wb = wf.bfloat16()
        for qt in ("Q8_0", "Q4_K", "Q6_K"):
            w = quantize(wf, qt, torch.bfloat16)
            for B in rows:
                x = torch.randn(B, K, device=dev, generator=g).bfloat16()
                outs, ms = {}, {}
                for v in lin_v:
                    with candidate(lin=v):
                        try:
                            outs[v] = L.linear(x, w).clone()
                            ms[v] = _time(lambda: L.linear(x, w))
                        except Exception as e:  # noqa: BLE001 (out of shared memory: report, go on)
                            log(f"{K}x{N} {qt} {v}: {type(e).__name__}")
                            outs[v], ms[v] = None, float("nan")
                cub = _time(lambda: x @ wb.T)
                fl = 2 * B * K * N
                bits = " / ".join("-" if outs[v] is None else "=" if torch.equal(outs[v], outs[None]) else "DIFF"
                                  for v in lin_v[1:])
                log(f"| {K} x {N} | {qt} | {B} | " + " | ".join(f"{ms[v] * 1e3:.0f} ({fl / ms[v] / 1e9:.0f})"
                                                               for v in lin_v) +
                    f" | {cub * 1e3:.0f} ({fl / cub / 1e9:.0f}) | {bits} |")
            del w
        del wf, wb
        torch.cuda.empty_cache()
    moe_v = [None, (32, None), (32, 4), (64, None)]
    log("\n## GGUF MoE experts, 1024 tokens, bf16 activations: ms; rows entries (block_m, warps)\n")
    log("| experts | type | 16-pair tiles | " + " | ".join(map(str, moe_v[1:])) + " | bf16 ds4t | bits as 16 |")
    log("|---|---|---|---|---|---|---|---|")
    for name, E, I, D, k in [("Qwen3-Next", 512, 512, 2048, 10), ("GLM-4.5", 160, 1536, 5120, 8)]:
        wf = [torch.randn(*s, device=dev, generator=g, dtype=torch.bfloat16) * s[-1] ** -0.5
              for s in ((E, I, D), (E, I, D), (E, D, I))]
        B = 1024
        h = torch.randn(B, D, device=dev, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(B)]).to(torch.int32)
        wts = torch.softmax(torch.randn(B, k, device=dev, generator=g), -1)
        bf = _time(lambda: M.moe_experts(h, ids, wts, *wf))
        for qt in ("Q8_0", "Q4_K", "Q6_K"):
            ws = [quantize(t.float(), qt, torch.bfloat16) for t in wf]
            outs, ms = {}, {}
            for v in moe_v:
                with candidate(moe=v):
                    outs[v] = M.moe_experts(h, ids, wts, *ws).clone()
                    ms[v] = _time(lambda: M.moe_experts(h, ids, wts, *ws))
            bits = " / ".join("=" if torch.equal(outs[v], outs[None]) else "DIFF" for v in moe_v[1:])
            log(f"| {name} (E {E}, I {I}, D {D}, top {k}) | {qt} | " + " | ".join(f"{ms[v]:.3f}" for v in moe_v) +
                f" | {bf:.3f} | {bits} |")
            del ws
        del wf
        torch.cuda.empty_cache()
    log("\n## FP8 linear, bf16 activations: us; m_sub 1 / 2 / 4\n")
    log("| K x N | B | m_sub 1 | m_sub 2 | m_sub 4 | cuBLAS bf16 | rows 0, B-1 == alone | output == m_sub 1 |")
    log("|---|---|---|---|---|---|---|---|")
    ok = True
    for K, N in [(2048, 12352), (4096, 2048), (5120, 14336), (12288, 5120), (7168, 18432), (18432, 7168)]:
        wf = torch.randn(N, K, device=dev, generator=g) * K ** -0.5
        w, wb = fp8_quantize(wf), wf.bfloat16()
        del wf
        for B in (64, 1024):
            x = torch.randn(B, K, device=dev, generator=g).bfloat16()
            outs, ms, alone = {}, {}, {}
            for m in (1, 2, 4):
                with candidate(fp8_m_sub=m):
                    outs[m] = L.linear(x, w).clone()
                    al = [L.linear(x[i:i + 1], w)[0] for i in (0, B - 1)]
                    alone[m] = torch.equal(outs[m][0], al[0]) and torch.equal(outs[m][B - 1], al[1])
                    ms[m] = _time(lambda: L.linear(x, w))
            same = all(torch.equal(outs[m], outs[1]) for m in (2, 4))
            ok &= same and all(alone.values())
            log(f"| {K} x {N} | {B} | " + " | ".join(f"{ms[m] * 1e3:.0f}" for m in (1, 2, 4)) +
                f" | {_time(lambda: x @ wb.T) * 1e3:.0f} | {all(alone.values())} | {same} |")
        del w, wb
        torch.cuda.empty_cache()
    return ok


def models(args, log) -> bool:
    """Whole prompts and decode steps (``prefill_ab.models_ab``) under the tables before the rows entries and the
    committed ones, bits compared with "before"; False if any differ (or native != ordered)."""
    from bench.prefill_ab import models_ab

    return models_ab(args.models, [int(n) for n in args.ns.split(",")],
                     [("before", before), ("new", contextlib.nullcontext)], args.device, log)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["kernels", "models"])
    ap.add_argument("--rows", default="1024,300", help="kernels: GGUF linear launch rows")
    ap.add_argument("--models", default="qwen3-next-80b-4l:q4_k,qwen3-next-80b-4l:fp8,glm-4.5-4l:q4_k")
    ap.add_argument("--ns", default="16,64", help="models: decode rows")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    args = ap.parse_args()
    return checked_run("prefill_tiles", args, kernels, models)


if __name__ == "__main__":
    sys.exit(main())
