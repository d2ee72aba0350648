#!/usr/bin/env python
"""Probe (not a ds4t route): Q4_K decode linear with int8 activations and integer dot products -- the
arithmetic llama.cpp's GPU path uses (activations quantized per row in blocks of 32, ``Q8_1``) -- against
ds4t's Q4_K kernel (bf16 activations, fold route) and cuBLAS on the bf16 weight, in one process.

    PYTHONUNBUFFERED=1 python bench/int8_probe.py [--shapes 7168x36864,2048x151936,5120x12288] [--rows 1,2,4,16]
    TRITON_INTERPRET=1 python bench/int8_probe.py --device cpu     # correctness only, tiny shapes

Why it exists: on the H200 the Q4_K fold route reads its blocks at 31-42 % of copy bandwidth, bound by the
instructions that turn nibbles into bf16 weights (~4.7 a weight, bench/results/2026-12-05-h200-gguf-fp8-restate.md).
With int8 activations a nibble needs no conversion: ``dp4a`` (4 products a instruction) or an int8 MMA sums
a sub-block exactly in int32, and only each sub-block's sum is scaled in fp32. The question this answers:
how fast is that, and at which row counts.

Arithmetic (both kernels here, bit for bit the same -- integer sums are exact, the fp32 tail is one
expression and one fixed tree): per activation row m and 32-column block j, ``dx = amax / 127``,
``q = rne(x / dx)`` (int8), ``s = sum(q)``; per weight row n, 256-block b, sub-block j (scale sc_j, min m_j,
d, dmin from the header), ``i_j = sum(nibble * q)`` (int32) and

    v_j = fma(float(i_j), (d * sc_j) * dx_j, float(-s_j) * ((dmin * m_j) * dx_j));   acc += pair_sum_j(v_j)

in K order over the blocks. Kernels: ``v2`` -- one activation row a program loop, weight words loaded
coalesced (a row's 128 quant bytes across 8 threads), ``dp4a`` on int32 words; ``mma`` -- 16-row tiles,
nibbles unpacked to int8 (3 instructions a 4-byte word) and ``tl.dot`` int8 -> int32 per sub-block.

Measured (H100, bench/results/2026-12-06-h100-int8-probe.md): at one row ``v2`` beats the fold route (the
vocabulary shape 85 % against 64 % of copy bandwidth), from two rows it loses (each row re-runs the
integer dots), and the int8 MMA kernel's per-sub-block fp32 tail (offline sm_90 SASS: ~6 instructions a
weight at 16 rows, FMUL / I2F) costs more than the fold route's conversion. Not adopted (the design doc says
why); kept so the measurement can be re-run.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import ds4t  # noqa: E402,F401  (sets the backend up)
from ds4t.backend import _INTERPRET_C, pair_sum  # noqa: E402
from ds4t.kernels.qlinear import _k_header, _raw_bytes  # noqa: E402


@triton.jit
def _sbyte(a, k: tl.constexpr):
    return (a << (24 - 8 * k)) >> 24


@triton.jit
def dp4a(a, b, c):
    """c + the dot of a's and b's four signed bytes (int32 words)."""
    if _INTERPRET_C:
        out = c + _sbyte(a, 0) * _sbyte(b, 0) + _sbyte(a, 1) * _sbyte(b, 1) + _sbyte(a, 2) * _sbyte(b, 2) \
            + _sbyte(a, 3) * _sbyte(b, 3)
    else:
        out = tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c], dtype=tl.int32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def nibbles_i8(b):
    """(low, high) nibbles of uint8 ``b`` as int8 (3 instructions a 4-byte word on the GPU)."""
    if _INTERPRET_C:
        w = b.to(tl.int32)
        lo = (w & 15).to(tl.int8)
        hi = (w >> 4).to(tl.int8)
    else:
        lo, hi = tl.inline_asm_elementwise(
            "{\n.reg .b32 t;\nand.b32 $0, $2, 0x0F0F0F0F;\nshr.u32 t, $2, 4;\nand.b32 $1, t, 0x0F0F0F0F;\n}",
            "=r,=r,r", [b], dtype=(tl.int8, tl.int8), is_pure=True, pack=4)
    return lo, hi


@triton.jit
def imma(a, b):
    """int32 a @ b of int8 tiles (exact)."""
    if _INTERPRET_C:
        out = tl.sum(a.to(tl.int32)[:, :, None] * b.to(tl.int32)[None, :, :], axis=1)
    else:
        out = tl.dot(a, b, out_dtype=tl.int32)
    return out


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, d_ptr, s_ptr, stride_x, K: tl.constexpr, BK: tl.constexpr):
    r = tl.program_id(0)
    c0 = tl.program_id(1) * BK
    cols = c0 + tl.arange(0, BK)
    xb = tl.reshape(tl.load(x_ptr + r * stride_x + cols).to(tl.float32), (BK // 32, 32))
    d = tl.math.div_rn(tl.max(tl.abs(xb), axis=1), 127.0)
    y = tl.math.div_rn(xb, tl.where(d > 0, d, 1.0)[:, None])
    qi = ((y + 12582912.0) - 12582912.0).to(tl.int32)      # round half to even (|y| <= 127)
    tl.store(q_ptr + r * K + cols, tl.reshape(qi, (BK,)).to(tl.int8))
    blk = c0 // 32 + tl.arange(0, BK // 32)
    tl.store(d_ptr + r * (K // 32) + blk, d)
    tl.store(s_ptr + r * (K // 32) + blk, tl.sum(qi, axis=1))


def quant_rows(x):
    """x [B, K] float -> (q int8 [B, K], dx fp32 [B, K / 32], s int32 [B, K / 32])."""
    B, K = x.shape
    q = torch.empty(B, K, dtype=torch.int8, device=x.device)
    d = torch.empty(B, K // 32, dtype=torch.float32, device=x.device)
    s = torch.empty(B, K // 32, dtype=torch.int32, device=x.device)
    BK = 256 if K % 256 == 0 else 32
    _quant_rows_kernel[(B, K // BK)](x, q, d, s, x.stride(0), K=K, BK=BK)
    return q, d, s


def quant_rows_ref(x):
    B, K = x.shape
    xb = x.float().reshape(B, K // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    q = torch.round(xb / torch.where(d > 0, d, torch.ones_like(d))[..., None])
    return q.to(torch.int8).reshape(B, K), d, q.sum(-1).to(torch.int32)


@triton.jit
def _q4k_scales8(w1, w2, w3):
    """[BN, 8] int32 (sc_j, m_j) of the packed K-quant header words w1, w2, w3 [BN]."""
    j = tl.arange(0, 8)[None, :]
    a = w1[:, None]
    b = w2[:, None]
    c = w3[:, None]
    jl = tl.where(j < 4, j, j - 4)
    sc_hi = ((c >> (8 * jl)) & 15) | (((a >> (8 * jl + 6)) & 3) << 4)
    m_hi = ((c >> (8 * jl + 4)) & 15) | (((b >> (8 * jl + 6)) & 3) << 4)
    return tl.where(j < 4, (a >> (8 * jl)) & 63, sc_hi), tl.where(j < 4, (b >> (8 * jl)) & 63, m_hi)


@triton.jit
def _tail(isum, sc, mn, d, dmin, dx, bs):
    """pair_sum over the last axis (8 sub-blocks) of fma(isum, (d sc) dx, -bs (dmin m) dx)."""
    t = (d * sc.to(tl.float32)) * dx
    u = (dmin * mn.to(tl.float32)) * dx
    return pair_sum(tl.fma(isum.to(tl.float32), t, (0 - bs).to(tl.float32) * u))


@triton.jit
def _q4k_v2_kernel(q_ptr, d_ptr, s_ptr, w_ptr, y_ptr, B, stride_wn, stride_ys,
                   N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, KPS: tl.constexpr, BM: tl.constexpr):
    pid_n = tl.program_id(0)
    m0 = tl.program_id(1) * BM
    ps = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn
    w32 = w_row.to(tl.pointer_type(tl.int32))
    x32 = q_ptr.to(tl.pointer_type(tl.int32))
    i32 = tl.arange(0, 32)
    xo = (i32 // 8) * 16 + i32 % 8          # word w of a block's 128 quant bytes: run w // 8, low nibbles' x word
    j8 = tl.arange(0, 8)
    for mi in tl.static_range(BM):
        m = m0 + mi
        if m < B:
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for b in range(ps * (KPS // 256), tl.minimum(ps * KPS + KPS, K) // 256):
                d, dmin, w1, w2, w3 = _k_header(w_row, K // 2 + b * 16)
                wq = tl.load(w32[:, None] + (b * 32 + i32)[None, :])
                xl = tl.load(x32 + m * (K // 4) + b * 64 + xo)
                xh = tl.load(x32 + m * (K // 4) + b * 64 + 8 + xo)
                z = tl.zeros((BLOCK_N, 32), tl.int32)
                pl = tl.sum(tl.reshape(dp4a(wq & 0x0F0F0F0F, xl[None, :], z), (BLOCK_N, 4, 8)), axis=2)
                ph = tl.sum(tl.reshape(dp4a((wq >> 4) & 0x0F0F0F0F, xh[None, :], z), (BLOCK_N, 4, 8)), axis=2)
                isum = tl.reshape(tl.join(pl, ph), (BLOCK_N, 8))
                sc, mn = _q4k_scales8(w1, w2, w3)
                dx = tl.load(d_ptr + m * (K // 32) + b * 8 + j8)[None, :]
                bs = tl.load(s_ptr + m * (K // 32) + b * 8 + j8)[None, :]
                acc += _tail(isum, sc, mn, d[:, None], dmin[:, None], dx, bs)
            tl.store(y_ptr + ps * stride_ys + m * N + rn, acc, mask=rn < N)


@triton.jit
def _stack4(a0, a1, a2, a3):
    return tl.reshape(tl.join(tl.join(a0, a2), tl.join(a1, a3)), a0.shape + [4])


@triton.jit
def _q4k_mma_kernel(q_ptr, d_ptr, s_ptr, w_ptr, y_ptr, B, stride_wn, stride_ys,
                    N: tl.constexpr, K: tl.constexpr, BLOCK_N: tl.constexpr, KPS: tl.constexpr, BM: tl.constexpr):
    pid_n = tl.program_id(0)
    ps = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_row = w_ptr + tl.minimum(rn, N - 1).to(tl.int64) * stride_wn
    rm = tl.program_id(1) * BM + tl.arange(0, BM)
    rmc = tl.minimum(rm, B - 1)
    i32 = tl.arange(0, 32)
    j8 = tl.arange(0, 8)
    acc = tl.zeros((BLOCK_N, BM), dtype=tl.float32)
    for b in range(ps * (KPS // 256), tl.minimum(ps * KPS + KPS, K) // 256):
        d, dmin, w1, w2, w3 = _k_header(w_row, K // 2 + b * 16)
        for c in tl.static_range(4):
            lo, hi = nibbles_i8(_raw_bytes(w_row, b * 128 + 32 * c, 32))
            xl = tl.load(q_ptr + rmc[None, :] * K + (b * 256 + 64 * c + i32)[:, None])
            xh = tl.load(q_ptr + rmc[None, :] * K + (b * 256 + 64 * c + 32 + i32)[:, None])
            if c == 0:
                l0 = imma(lo, xl)
                h0 = imma(hi, xh)
            elif c == 1:
                l1 = imma(lo, xl)
                h1 = imma(hi, xh)
            elif c == 2:
                l2 = imma(lo, xl)
                h2 = imma(hi, xh)
            else:
                l3 = imma(lo, xl)
                h3 = imma(hi, xh)
        isum = tl.reshape(tl.join(_stack4(l0, l1, l2, l3), _stack4(h0, h1, h2, h3)), (BLOCK_N, BM, 8))
        sc, mn = _q4k_scales8(w1, w2, w3)
        dx = tl.load(d_ptr + rmc[:, None] * (K // 32) + b * 8 + j8[None, :])[None, :, :]
        bs = tl.load(s_ptr + rmc[:, None] * (K // 32) + b * 8 + j8[None, :])[None, :, :]
        acc += _tail(isum, sc[:, None, :], mn[:, None, :], d[:, None, None], dmin[:, None, None], dx, bs)
    y = y_ptr + ps * stride_ys + rm[None, :] * N + rn[:, None]
    tl.store(y, acc, mask=(rm < B)[None, :] & (rn < N)[:, None])


def q4k_int8(x, w, kernel="v2", block_n=64, warps=4, split=1, bm=1, qds=None):
    """fp32 [B, N]: ``x`` [B, K] against a Q4_K :class:`ds4t.kernels.quant_blocks.GGUFWeight` (no scale plane),
    activations quantized by :func:`quant_rows` (or ``qds``); split-K partials summed in order."""
    B, K = x.shape
    N = w.shape[0]
    q, d, s = qds if qds is not None else quant_rows(x)
    kps = triton.cdiv(triton.cdiv(K, split), 256) * 256
    split = triton.cdiv(K, kps)
    y = torch.empty(split, B, N, dtype=torch.float32, device=x.device)
    fn = _q4k_v2_kernel if kernel == "v2" else _q4k_mma_kernel
    fn[(triton.cdiv(N, block_n), triton.cdiv(B, bm), split)](
        q, d, s, w.data, y, B, w.data.stride(0), y.stride(0), N=N, K=K, BLOCK_N=block_n, KPS=kps, BM=bm,
        num_warps=warps, num_stages=3)
    out = y[0]
    for i in range(1, split):
        out = out + y[i]
    return out


def q4k_int8_ref(x, w):
    """float64 of the same quantized arithmetic (the kernels differ from it by their fp32 rounding)."""
    B, K = x.shape
    q, d, _ = quant_rows_ref(x.cpu())
    xq = (q.double().reshape(B, K // 32, 32) * d.double()[..., None]).reshape(B, K)
    return xq @ w.to("cpu").dequantize().double().T


def _graph_ms(fn) -> float:
    """Median ms a call: a CUDA graph of 20 calls replayed 7 times (``bench.bench_kernels.time_calls``)."""
    from bench.bench_kernels import time_calls
    return time_calls([fn], min_calls=20, iters=7)[0]


def main() -> int:
    from ds4t.kernels import linear as L
    from ds4t.kernels.quant_blocks import quantize

    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--shapes", default="7168x36864,2048x151936,5120x12288")
    ap.add_argument("--rows", default="1,2,4,16,1024")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = args.device
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    g = torch.Generator(device=dev).manual_seed(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if dev == "cuda" else [(768, 40)]
    ok = True
    bw = None
    if dev == "cuda":
        from bench.bench_decode import copy_bandwidth
        bw = copy_bandwidth(dev)
        log(f"{torch.cuda.get_device_name()}; copy bandwidth {bw / 1e12:.2f} TB/s")
    table = []
    for K, N in shapes:
        wf = torch.randn(N, K, device=dev, generator=g) * 0.02
        w = quantize(wf, "Q4_K")
        wb = quantize(wf, "Q4_K", torch.bfloat16)       # the model's weight (fold route, its layout)
        del wf
        x = torch.randn(16, K, device=dev, generator=g)
        # correctness: quantizer exact, kernels == each other and row-invariant, near the f64 of the arithmetic
        q, d, s = quant_rows(x)
        qr, dr, sr = quant_rows_ref(x.cpu())
        quant_ok = torch.equal(q.cpu(), qr) and torch.equal(d.cpu(), dr) and torch.equal(s.cpu(), sr)
        bn = 16 if dev == "cpu" else 64
        y1 = q4k_int8(x[:1], w, "v2", bn)
        y16 = q4k_int8(x, w, "v2", bn, bm=4)
        ym = q4k_int8(x, w, "mma", bn, bm=16)
        rows_ok = torch.equal(y1[0], y16[0]) and torch.equal(y16, ym)
        nref = 4
        ref = q4k_int8_ref(x[:nref], w)
        exact = x[:nref].double().cpu() @ w.to("cpu").dequantize().double().T
        err = ((y16[:nref].double().cpu() - ref).abs().max() / ref.abs().max()).item()
        err_x = ((y16[:nref].double().cpu() - exact).abs().max() / exact.abs().max()).item()
        err_fold = ((L.linear(x[:nref].bfloat16(), wb).double().cpu() - exact).abs().max() / exact.abs().max()).item()
        good = quant_ok and rows_ok and err < 1e-5
        ok &= good
        log(f"{K}x{N}: quantizer == torch {quant_ok}; v2 row alone == in 16 == mma {rows_ok}; vs f64 of the int8 "
            f"arithmetic {err:.1e}; vs x . dequant(w): int8 {err_x:.1e}, fold route (bf16) {err_fold:.1e} -- "
            f"{'PASS' if good else 'FAIL'}")
        if dev != "cuda":
            continue
        nbytes = N * K // 256 * 144
        wbf = torch.randn(N, K, device=dev, dtype=torch.bfloat16, generator=g)
        for B in [int(r) for r in args.rows.split(",")]:
            xb = torch.randn(B, K, device=dev, generator=g).bfloat16()
            qds = quant_rows(xb)
            res = {"fold (ds4t)": _graph_ms(lambda: L.linear(xb, wb)),
                   "cublas bf16": _graph_ms(lambda: xb @ wbf.T),
                   "quantize x": _graph_ms(lambda: quant_rows(xb))}
            cands = [("v2", 64, 4, 1, 1), ("v2", 32, 2, 1, 1), ("v2", 64, 4, 2, 1)] if B <= 16 else []
            if 4 <= B <= 16:
                cands += [("v2", 64, 4, 1, 4)]
            cands += [("mma", 32, 2, 1, 16), ("mma", 32, 2, 2, 16)]
            if B >= 64:
                cands += [("mma", 32, 4, 1, 64)]
            for kern, bn, wp, sp, bm in cands:
                res[f"int8 {kern} bn{bn} w{wp} s{sp} bm{bm}"] = _graph_ms(
                    lambda: q4k_int8(xb, w, kern, bn, wp, sp, bm, qds))
            for name, ms in res.items():
                by = N * K * 2 if name == "cublas bf16" else (0 if name == "quantize x" else nbytes)
                pct = by / (ms / 1e3) / bw * 100 if by else 0.0
                table.append((f"{K}x{N}", B, name, ms * 1e3, pct))
                log(f"{K}x{N} B={B:2d} {name:28s} {ms * 1e3:8.1f} us {pct:6.1f} %")
        del w, wb, wbf
        torch.cuda.empty_cache()
    if table:
        log("\n| shape | B | fold (ds4t) | best int8 (kernel) | cuBLAS bf16 |\n|---|---|---|---|---|")
        for shape in dict.fromkeys(t[0] for t in table):
            for B in dict.fromkeys(t[1] for t in table if t[0] == shape):
                rows = [t for t in table if t[0] == shape and t[1] == B]
                fold = next(t for t in rows if t[2] == "fold (ds4t)")
                cub = next(t for t in rows if t[2] == "cublas bf16")
                best = min((t for t in rows if t[2].startswith("int8")), key=lambda t: t[3])
                log(f"| {shape} | {B} | {fold[3]:.1f} us ({fold[4]:.0f} %) | {best[3]:.1f} us ({best[4]:.0f} %, "
                    f"{best[2][5:]}) | {cub[3]:.1f} us ({cub[4]:.0f} %) |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    log("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
