#!/usr/bin/env python
"""Does a row's bits depend on the MMA tile shape? (the question behind a fast prefill, issue 17 item 4)

    PYTHONUNBUFFERED=1 python bench/mma_shapes.py [--rows 1024,4096] [--commit HASH]

Decode runs ``linear`` with 16-row activation tiles; a fast prefill wants 64-256-row tiles (wgmma).
Both keep each output element's K order (one fp32 accumulator, BLOCK_K steps in K order, no split-K
here), but the tensor-core instruction differs (mma.sync m16n8k16, wgmma m64nNk16 with N = 16 .. 256),
and whether its internal sums round the same way is a property of the hardware, not of the code. So
this script computes ``round_bf16(x) @ w^T`` (bf16 weights, then block-FP8 weights with 128-column
scale blocks) with a plain Triton GEMM over a grid of tile shapes, warps and stages, and compares every
output bitwise with ``ds4t.kernels.linear`` (the decode config of that weight shape, forced to one K
split). It also reports TFLOP/s per config and whether the PTX used wgmma.

Then ``linear`` itself at B = 64 .. 4096 rows: with its row tiles (``LINEAR_ROW_TILES``) against the
decode config alone, bitwise equal, each timed. Short tables are printed last.

``--fp8-wgmma``: FP8 decode configs that run wgmma, timed against the table's at B = 1 / 16, each checked
for the bits of a wgmma row tile at 1024 rows (what FP8 row tiles need; see below).

``--kwidth`` (no GPU needed: compiles for sm_90 with Triton's own compiler): for bf16 weights and for fp8
weights converted to bf16 three ways, at mma.sync and wgmma tile shapes, whether the dot became wgmma and
the ``kWidth`` of its operand layouts. A dot whose operands come from 8-bit loads gets kWidth 4 on mma.sync
(each thread holds 4 consecutive K elements: the K order inside the MMA steps is permuted, the same for
both operands, so the product is right but summed in another order) and kWidth 2 on wgmma; every bf16 dot
gets kWidth 2. That is why FP8 rows differ between the decode config (mma.sync) and wgmma tiles while bf16
rows do not.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

if "--kwidth" in sys.argv:   # compile-only: real GPU kernels (not the interpreter), no device needed
    os.environ["TRITON_INTERPRET"] = "0"
    torch.cuda.is_available = lambda: True
    torch.cuda.get_device_capability = lambda *a: (9, 0)
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.hf_peer import median_ms  # noqa: E402
from bench.bench_kernels import time_calls  # noqa: E402
from ds4t.backend import cast, fp8_to, scaled_add  # noqa: E402
from ds4t.kernels import linear as lin  # noqa: E402
from ds4t.kernels.weights import quantize  # noqa: E402


@triton.jit
def _step(x_ptrs, w_ptrs, rm, M, acc, SWAP: tl.constexpr, A_DT: tl.constexpr):
    """acc + round(x tile) @ w tile (w converted to A_DT through fp32: exact for bf16 and fp8)."""
    x = cast(tl.load(x_ptrs, mask=(rm < M)[:, None], other=0.0).to(tl.float32), A_DT)
    w = cast(tl.load(w_ptrs).to(tl.float32), A_DT)
    if SWAP:
        acc = tl.dot(tl.trans(w), tl.trans(x), acc)
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _gemm(x_ptr, w_ptr, s_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr,
          BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, SBK: tl.constexpr,
          A_DT: tl.constexpr):
    """y[M, N] fp32 = round(x) @ w^T; SBK > 0: w fp8 with fp32 scales [N, K / SBK] per SBK columns
    (each block's dot from zero, then acc += scale * dot, as ds4t's FP8 linear)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    x_ptrs = x_ptr + rm.to(tl.int64)[:, None] * K + rk[None, :]
    w_ptrs = w_ptr + rn.to(tl.int64)[None, :] * K + rk[:, None]
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    if SBK == 0:
        for k in range(0, K, BK):
            acc = _step(x_ptrs, w_ptrs, rm, M, acc, SWAP, A_DT)
            x_ptrs += BK
            w_ptrs += BK
    else:
        KB: tl.constexpr = K // SBK
        for kb in range(0, KB):
            p = tl.zeros(acc.shape, dtype=tl.float32)
            for ks in tl.static_range(0, SBK, BK):
                p = _step(x_ptrs, w_ptrs, rm, M, p, SWAP, A_DT)
                x_ptrs += BK
                w_ptrs += BK
            sc = tl.load(s_ptr + rn.to(tl.int64) * KB + kb)
            if SWAP:
                acc = scaled_add(acc, p, sc[:, None])
            else:
                acc = scaled_add(acc, p, sc[None, :])
    if SWAP:
        acc = tl.trans(acc)
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None])


def gemm(x, w, scale, sbk, bm, bn, bk, swap, warps, stages):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    k = _gemm[grid](x, w, scale if scale is not None else w, y, M, N=N, K=K, BM=bm, BN=bn, BK=bk, SWAP=swap,
                    SBK=sbk, A_DT=tl.bfloat16, num_warps=warps, num_stages=stages)
    return y, k


CONFIGS = [  # (BM, BN, BK, swap, warps, stages)
    (16, 64, 128, True, 4, 3), (16, 64, 64, False, 4, 3), (16, 32, 128, True, 2, 3),
    (64, 64, 64, False, 4, 3), (64, 128, 64, False, 4, 4), (64, 256, 64, False, 8, 3),
    (128, 128, 64, False, 4, 3), (128, 128, 64, False, 8, 3), (128, 256, 64, False, 8, 3),
    (128, 128, 128, False, 8, 3), (256, 128, 64, False, 8, 3), (128, 64, 64, True, 4, 3),
    (64, 128, 64, True, 4, 3), (128, 128, 64, True, 8, 3),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1024,4096")
    ap.add_argument("--shapes", default="4096x14336,2048x12288,7168x18432")
    ap.add_argument("--linear-rows", default="64,128,256,1024,4096")
    ap.add_argument("--skip-probe", action="store_true", help="only the linear row-tile table")
    ap.add_argument("--kwidth", action="store_true", help="compile-only layout table (no GPU needed), then exit")
    ap.add_argument("--fp8-wgmma", action="store_true",
                    help="only: FP8 decode configs on wgmma vs the table's, and their bits vs a wgmma row tile")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args()
    if a.kwidth:
        print("\n".join(kwidth_table()))
        return
    dev = torch.device("cuda")
    torch.manual_seed(0)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    if a.fp8_wgmma:
        lines = fp8_wgmma(a, dev)
        with open(os.path.join(out, "fp8_wgmma.md"), "w") as f:
            f.write("\n".join(lines) + "\n")
        return
    rows = []
    print(f"# mma tile shape vs bits  commit={a.commit}  {torch.cuda.get_device_name()}")
    for shape in ([] if a.skip_probe else a.shapes.split(",")):
        K, N = map(int, shape.split("x"))
        wb = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        w8 = quantize(wb.float(), (128, 128))
        for fmt in ("bf16", "fp8"):
            for M in map(int, a.rows.split(",")):
                x = torch.randn(M, K, device=dev)
                if fmt == "bf16":
                    cfg = lin.linear_config(K, N, torch.bfloat16, torch.float32)
                    ref = lin.linear(x, wb, config=lin.LinearConfig(**{**cfg.__dict__, "split": 1}))
                    w, s, sbk = wb, None, 0
                else:
                    cfg = lin.linear_config(K, N, w8.data.dtype, torch.bfloat16, 128)
                    ref = lin.linear(x, w8, act_dtype=torch.bfloat16,
                                     config=lin.LinearConfig(**{**cfg.__dict__, "split": 1}))
                    w, s, sbk = w8.data, w8.scale, 128
                for bm, bn, bk, swap, warps, stages in CONFIGS:
                    try:
                        y, k = gemm(x, w, s, sbk, bm, bn, bk, swap, warps, stages)
                        torch.cuda.synchronize()
                    except Exception as e:  # noqa: BLE001 (an over-large tile: report, go on)
                        print(f"{fmt} {shape} M={M} {(bm, bn, bk, swap, warps, stages)}: {type(e).__name__}")
                        continue
                    diff = int((y.view(torch.int32) != ref.view(torch.int32)).sum())
                    ms = median_ms(lambda: gemm(x, w, s, sbk, bm, bn, bk, swap, warps, stages), 10, 3, dev)
                    tf = 2 * M * N * K / (ms * 1e-3) / 1e12
                    wg = "wgmma" in k.asm.get("ptx", "")
                    r = (fmt, shape, M, f"{bm}x{bn}x{bk}{' swap' if swap else ''} w{warps} s{stages}", wg, diff, ms, tf)
                    rows.append(r)
                    print(f"{fmt} {shape} M={M} {r[3]:<26} wgmma={wg!s:5} diff_elems={diff:<9} {ms:.3f} ms "
                          f"{tf:.0f} TFLOP/s", flush=True)
    lines = ["| fmt | K x N | rows | tile | wgmma | elements != decode | ms | TFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]} | {r[5]} | {r[6]:.3f} | {r[7]:.0f} |" for r in rows]
    lines += ["", *fp8_causes(dev), "", *linear_rows(a, dev)]
    with open(os.path.join(out, "mma_shapes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


@triton.jit
def _cvt(src_ptr, dst_ptr, C: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr, ROUTE: tl.constexpr):
    r = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.arange(0, BC)
    for c0 in range(0, C, BC):
        w = tl.load(src_ptr + r[:, None] * C + (c0 + c)[None, :])
        tl.store(dst_ptr + r[:, None] * C + (c0 + c)[None, :], fp8_to(w, tl.bfloat16, ROUTE).to(tl.float32))


@triton.jit
def _opaque_bf16(x):
    """Identity on bf16 pairs through inline PTX (the compiler cannot see the values' origin)."""
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=True, pack=2)


@triton.jit
def _kwidth_probe(x_ptr, w_ptr, y_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MODE: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, 512, BK):
        x = tl.load(x_ptr + rm[:, None] * 512 + (kk + rk)[None, :]).to(tl.bfloat16)
        w = tl.load(w_ptr + rn[None, :] * 512 + (kk + rk)[:, None])
        if MODE == 1:
            w = w.to(tl.bfloat16)
        elif MODE == 2:
            w = w.to(tl.float32).to(tl.bfloat16)
        elif MODE == 3:
            w = _opaque_bf16(w.to(tl.bfloat16))
        acc = tl.dot(x, w, acc)
    tl.store(y_ptr + rm[:, None] * BN + rn[None, :], acc)


def kwidth_table() -> list:
    """Compile-only (sm_90): wgmma or not and the dot operands' kWidth, per weight type and tile."""
    import re

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    out = ["| weights | rows x warps | wgmma | kWidth |", "|---|---|---|---|"]
    for wt, mode, name in (("*bf16", 0, "bf16"), ("*fp8e4nv", 1, "fp8 -> bf16"), ("*fp8e4nv", 2, "fp8 -> fp32 -> bf16"),
                           ("*fp8e4nv", 3, "fp8 -> bf16 -> inline-asm identity")):
        for bm, warps in ((16, 2), (16, 4), (32, 4), (64, 4), (128, 8)):
            sig = {"x_ptr": "*fp32", "w_ptr": wt, "y_ptr": "*fp32"}
            c = triton.compile(ASTSource(fn=_kwidth_probe, signature=sig,
                                         constexprs=dict(BM=bm, BN=64, BK=64, MODE=mode)),
                               target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=3))
            kw = ",".join(sorted(set(re.findall(r"kWidth = (\d+)", c.asm["ttgir"]))))
            out.append(f"| {name} | {bm} x {warps} | {'wgmma' in c.asm['ptx']} | {kw} |")
    return out


def fp8_causes(dev) -> list:
    """Why FP8 rows change with the tile: (1) every fp8 code converted to bf16 by each route in tiles of
    several shapes, against torch's conversion; (2) the FP8 GEMM probe again on weights whose
    subnormal fp8 codes are zeroed."""
    out = ["| check | tile | route | elements != torch |", "|---|---|---|---|"]
    codes = torch.arange(256, dtype=torch.uint8, device=dev).repeat(64, 4).view(torch.float8_e4m3fn)   # [64, 1024]
    want = codes.float()
    nan = torch.isnan(want)
    for br, bc, warps in ((16, 64, 2), (16, 128, 4), (64, 64, 4), (128, 128, 8), (32, 256, 8)):
        for route in (0, 1):
            got = torch.empty_like(want)
            _cvt[(64 // br,)](codes, got, C=1024, BR=br, BC=bc, ROUTE=route, num_warps=warps)
            bad = int(((got != want) & ~nan).sum() + (torch.isnan(got) != nan).sum())
            out.append(f"| fp8 -> bf16 convert | {br}x{bc} w{warps} | {route} | {bad} |")
    K, N, M = 2048, 12288, 1024
    wb = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
    w8 = quantize(wb.float(), (128, 128))
    bits = w8.data.view(torch.uint8)
    sub = ((bits & 0x78) == 0) & ((bits & 0x07) != 0)
    out.append(f"| subnormal fp8 codes in the {N}x{K} weight | | | {int(sub.sum())} |")
    data = torch.where(sub, torch.zeros_like(bits), bits).view(torch.float8_e4m3fn)
    x = torch.randn(M, K, device=dev)
    cfg = lin.linear_config(K, N, torch.float8_e4m3fn, torch.bfloat16, 128)
    from ds4t.kernels.weights import FP8Weight
    w8z = FP8Weight(data, w8.scale, w8.block_k)
    ref = lin.linear(x, w8z, act_dtype=torch.bfloat16, config=lin.LinearConfig(**{**cfg.__dict__, "split": 1}))
    for bm, bn, bk, swap, warps, stages in CONFIGS[:6]:
        y, k = gemm(x, data, w8.scale, 128, bm, bn, bk, swap, warps, stages)
        diff = int((y.view(torch.int32) != ref.view(torch.int32)).sum())
        out.append(f"| GEMM, subnormals zeroed, vs decode | {bm}x{bn}x{bk}{' swap' if swap else ''} w{warps} "
                   f"(wgmma={'wgmma' in k.asm.get('ptx', '')}) | f32 | {diff} |")
    for line in out:
        print(line, flush=True)
    return out


FP8_SHAPES = ("7168x18432", "18432x7168", "16384x7168", "1536x24576", "2048x12288")
"""The FP8 decode table's weight shapes (ds4t.kernels.linear._GPU_TABLE)."""


def fp8_wgmma(a, dev) -> list:
    """FP8 decode configs that run wgmma (swapped, >= 64 weight rows as the MMA's M, 4 warps; kWidth 2
    like a wgmma row tile) against the table's: decode bandwidth at B = 1 and 16 (bytes = fp8 + scales,
    two weight copies rotated past the L2), and whether rows computed by a wgmma row tile (this script's
    GEMM, 128 x 128 x 128, 8 warps) at 1024 rows equal the candidate's rows bitwise. A candidate that is
    about as fast as the table's and bit-equal to the row tile lets FP8 prefill use row tiles."""
    out = ["| K x N | decode config | B=1 TB/s | B=16 TB/s | 1024 rows == wgmma row tile |", "|---|---|---|---|---|"]
    for shape in FP8_SHAPES:
        K, N = map(int, shape.split("x"))
        ws = [quantize((torch.randn(N, K, device=dev) * 0.02), (128, 128)) for _ in range(2)]
        nbytes = ws[0].data.numel() + 4 * ws[0].scale.numel()
        table = lin.linear_config(K, N, torch.float8_e4m3fn, torch.bfloat16, 128)
        cands = [("table", table)] + [
            (f"swap bn{bn} w4 s{st} {route}", lin.LinearConfig(block_n=bn, block_k=128, split=table.split, num_warps=4,
                                                              num_stages=st, swap=True, fp8_route=route))
            for bn in (64, 128) for st in (2, 3) for route in ("f32", "direct")]
        xl = torch.randn(1024, K, device=dev)
        tile, _ = gemm(xl, ws[0].data, ws[0].scale, 128, 128, 128, 128, False, 8, 3)
        for name, cfg in cands:
            tb = []
            for B in (1, 16):
                x = torch.randn(B, K, device=dev)
                # CUDA-graph replay, the two copies rotated past the L2 (one eager call is host-bound)
                ms = time_calls([lambda w=w: lin.linear(x, w, act_dtype=torch.bfloat16, config=cfg) for w in ws])[0]
                tb.append(nbytes / (ms * 1e-3) / 1e12)
            same = torch.equal(lin.linear(xl, ws[0], act_dtype=torch.bfloat16,
                                          config=lin.LinearConfig(**{**cfg.__dict__, "split": 1})), tile)
            line = f"| {shape} | {name} | {tb[0]:.2f} | {tb[1]:.2f} | {same} |"
            print(line, flush=True)
            out.append(line)
    return out


def linear_rows(a, dev) -> list:
    """``linear`` with its row tiles vs the decode config alone at several B: bits and times."""
    out = ["| fmt | K x N | B | row tile | decode config ms | with row tile ms | TFLOP/s | speed-up | bitwise |",
           "|---|---|---|---|---|---|---|---|---|"]
    for shape in a.shapes.split(","):
        K, N = map(int, shape.split("x"))
        wb = (torch.randn(N, K, device=dev) * 0.02).to(torch.bfloat16)
        for fmt, w, kw, key in (("bf16", wb, {}, (K, N, torch.bfloat16, torch.float32)),
                                ("fp8", quantize(wb.float(), (128, 128)), dict(act_dtype=torch.bfloat16),
                                 (K, N, torch.float8_e4m3fn, torch.bfloat16, 128))):
            tiles = lin.linear_row_tiles(*key)
            for B in map(int, a.linear_rows.split(",")):
                x = torch.randn(B, K, device=dev)
                y = lin.linear(x, w, **kw)
                dec_cfg = lin.linear_config(*key)
                y0 = lin.linear(x, w, config=dec_cfg, **kw)   # config=: the decode config, no row tiles
                ms = median_ms(lambda: lin.linear(x, w, **kw), 10, 3, dev)
                ms0 = median_ms(lambda: lin.linear(x, w, config=dec_cfg, **kw), 10, 3, dev)
                t = [t_ for t_ in tiles if B >= t_.min_rows]
                desc = f"{t[-1].block_m}x{t[-1].block_n}x{t[-1].block_k} w{t[-1].num_warps}" if t else "-"
                line = (f"| {fmt} | {shape} | {B} | {desc} | {ms0:.3f} | {ms:.3f} | {2 * B * N * K / ms / 1e9:.0f} | "
                        f"{ms0 / ms:.2f}x | {torch.equal(y, y0)} |")
                print(line, flush=True)
                out.append(line)
    return out


if __name__ == "__main__":
    main()
