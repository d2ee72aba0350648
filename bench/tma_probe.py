#!/usr/bin/env python
"""Probe: a plain Triton GEMM fed through tensor descriptors (TMA), plain, persistent and warp-specialised grids,
against ds4t's 16-bit row tile and cuBLAS at 1024 rows; its bits against the row tile with the decode split set
to 1 (the probe has no split-K). Results: bench/results/2026-12-06-h100-linear-rows.md (section 2).

    PYTHONUNBUFFERED=1 python bench/tma_probe.py
"""
import dataclasses
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from bench.bench_kernels import time_calls  # noqa: E402
from ds4t.kernels import linear as L  # noqa: E402


@triton.jit
def _tma_gemm(x_desc, w_desc, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              PERSIST: tl.constexpr, NUM_SMS: tl.constexpr, WS: tl.constexpr):
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    tiles = n_m * n_n
    start = tl.program_id(0)
    step = NUM_SMS if PERSIST else tiles
    for tile in tl.range(start, tiles, step, flatten=PERSIST, warp_specialize=WS):
        # m fastest: programs sharing a weight tile run together
        pid_m = tile % n_m
        pid_n = tile // n_m
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, K, BK):
            a = x_desc.load([pid_m * BM, k])
            b = w_desc.load([pid_n * BN, k])
            acc = tl.dot(a, b.T, acc)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc, mask=(rm < M)[:, None] & (rn < N)[None, :])


def tma(x, w, y, BM, BN, BK, warps, stages, persist, ws):
    """y fp32 [M, N] = x [M, K] @ w [N, K]^T, bf16 operands through tensor descriptors, one accumulator in K order
    (``persist``: one program an SM looping over the tiles; ``ws``: Triton's warp specialisation of that loop)."""
    M, K = x.shape
    N = w.shape[0]
    xd = TensorDescriptor.from_tensor(x, [BM, BK])
    wd = TensorDescriptor.from_tensor(w, [BN, BK])
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    grid = (min(nsm, tiles),) if persist else (tiles,)
    _tma_gemm[grid](xd, wd, y, M, N, K, BM=BM, BN=BN, BK=BK, PERSIST=persist, NUM_SMS=nsm, WS=ws,
                    num_warps=warps, num_stages=stages)
    return y


CONFIGS = ((128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4))
"""(BM, BN, BK, warps, stages) of the probe, each on a plain, a persistent and a warp-specialised grid."""


def main():
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = 1024
    for (K, N) in ((5120, 14336), (5120, 24576), (2048, 12352), (7168, 36864), (12288, 5120)):
        w = (torch.randn(N, K, generator=g, device="cuda") / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(rows, K, generator=g, device="cuda").to(torch.bfloat16)
        y = torch.empty(rows, N, device="cuda")
        cfg = L.linear_config(K, N, torch.bfloat16)
        tiles = L.linear_row_tiles(K, N, torch.bfloat16)
        one = dataclasses.replace(cfg, split=1)   # the row tile without the decode config's split: the probe's sums

        def row_tile_unsplit(out):
            return L._launch(x, w, None, out, one, torch.bfloat16, tiles)

        base = L.linear(x, w).clone()
        ref1 = row_tile_unsplit(torch.empty_like(y)).clone()
        flop = 2.0 * rows * K * N

        def rep(label, fn, ref):
            try:
                fn()
                torch.cuda.synchronize()
                bits = torch.equal(y.view(torch.int32), ref.view(torch.int32)) if ref is not None else "-"
                ms, _ = time_calls([fn])
                print(f"| {K}x{N} split {cfg.split} | {label} | {ms * 1e3:.1f} us | {flop / ms / 1e9:.0f} TFLOP/s "
                      f"| bits {bits} |", flush=True)
            except Exception as e:   # a config that does not fit (shared memory) is reported, the rest still run
                print(f"| {K}x{N} | {label} | FAILED {type(e).__name__}: {str(e)[:200]} |", flush=True)

        rep("ds4t table", lambda: L.linear(x, w, out=y), base)
        rep("ds4t row tile split 1", lambda: row_tile_unsplit(y), ref1)
        for (bm, bn, bk, wa, st) in CONFIGS:
            for persist, ws in ((False, False), (True, False), (True, True)):
                rep(f"tma {bm}x{bn}x{bk}w{wa}s{st} persist={persist} ws={ws}",
                    lambda: tma(x, w, y, bm, bn, bk, wa, st, persist, ws), ref1)
        rep("cuBLAS", lambda: torch.matmul(x, w.t()), None)


if __name__ == "__main__":
    main()
