"""A target process for Nsight Compute: builds one quantized kernel's inputs at a real shape and launches the
kernel a few times, so ``ncu`` can profile one launch (how bench/results/2026-11-30-h200-gguf-round3.md and
-fp8-round3.md got their stall and occupancy figures).

    ncu --kernel-name regex:_qlinear_kernel --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \\
        python bench/ncu_target.py linear --weights q4_k --k 7168 --n 36864 --b 1
    ncu --kernel-name regex:_moe_gate_up_kernel --launch-skip 2 --launch-count 1 ... \\
        python bench/ncu_target.py moe --weights fp8 --b 16            # Qwen3-Next-80B's experts

Weights: ``bf16``, ``fp8`` (128 x 128 blocks, bf16 activations) or a GGUF type (``q8_0``, ``q4_k``, ``q6_k``);
random values, the configs ds4t's tables pick. Kernel names: ``_linear_kernel`` (bf16 / FP8), ``_qlinear_kernel``
(GGUF), ``_moe_gate_up_kernel`` / ``_moe_down_kernel`` (bf16 / FP8), ``_qmoe_gate_up_kernel`` /
``_qmoe_down_kernel`` (GGUF), ``_mla_split_kernel`` (``mla --b 8 --ctx 32768 [--tile 64x64x8x2]``: absorbed MLA
decode at DeepSeek-V3's shape).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import ds4t  # noqa: E402,F401
from ds4t.kernels import linear as L, moe as M  # noqa: E402
from ds4t.kernels import quant_blocks, weights  # noqa: E402


def make_weight(shape, kind: str, g: torch.Generator, dev: str):
    """A random weight [..., N, K] in ``kind`` (bf16, fp8 or a GGUF type), with bf16 activations."""
    K = shape[-1]
    w = torch.randn(*shape, device=dev, generator=g, dtype=torch.bfloat16) * K ** -0.5
    if kind == "bf16":
        return w
    if kind == "fp8":
        return weights.quantize(w).with_act_dtype(torch.bfloat16)
    return quant_blocks.quantize(w, kind.upper(), act_dtype=torch.bfloat16)


def _mla_run(B: int, ctx: int, tile, g: torch.Generator, dev: str):
    """DeepSeek-V3's absorbed MLA decode (128 heads, latent 512 + 64, bf16 cache) over B rows of ``ctx``
    tokens, q_latent in bf16 as the model passes it; ``tile`` "64x64x8x2" forces the launch config."""
    import contextlib

    from ds4t.kernels import mla

    H, R, Dr = 128, 512, 64
    cache = (torch.randn(B, ctx, R + Dr, device=dev, generator=g) * 0.5).bfloat16()
    ql = (torch.randn(B, H, R, device=dev, generator=g) * 0.05).bfloat16()
    qp = torch.randn(B, H, Dr, device=dev, generator=g) * 0.05
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    lengths = torch.full((B,), ctx, device=dev, dtype=torch.int32)
    cfg = None
    if tile:
        from bench.bench_attention import mla_tile

        cfg = mla_tile(tile)

    def run():
        with mla.MLA_CONFIGS.forced(lambda *k: cfg) if cfg else contextlib.nullcontext():
            mla.mla_decode(ql, qp, cache, slots, lengths, (R // 4 + Dr) ** -0.5, kv_lora_rank=R)
    return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("linear", "moe", "mla"))
    ap.add_argument("--weights", default="fp8", help="bf16, fp8, q8_0, q4_k or q6_k")
    ap.add_argument("--k", type=int, default=7168, help="linear: K")
    ap.add_argument("--n", type=int, default=18432, help="linear: N")
    ap.add_argument("--b", type=int, default=1, help="rows (linear) or tokens (MoE)")
    ap.add_argument("--experts", default="512,512,2048,10", help="MoE: E, I, D, top-k (Qwen3-Next-80B)")
    ap.add_argument("--ctx", type=int, default=32768, help="mla: tokens of context of every row")
    ap.add_argument("--tile", default=None, help="mla: heads x tokens x warps x stages a program (default: the table's)")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ncu_target: needs a CUDA GPU (it is a target for Nsight Compute)")
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    if args.what == "linear":
        w = make_weight((args.n, args.k), args.weights, g, dev)
        x = torch.randn(args.b, args.k, device=dev, generator=g).bfloat16()
        run = lambda: L.linear(x, w)   # noqa: E731
    elif args.what == "mla":
        run = _mla_run(args.b, args.ctx, args.tile, g, dev)
    else:
        E, I, D, k = (int(v) for v in args.experts.split(","))
        wg, wu = (make_weight((E, I, D), args.weights, g, dev) for _ in range(2))
        wd = make_weight((E, D, I), args.weights, g, dev)
        h = torch.randn(args.b, D, device=dev, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(args.b)]).to(torch.int32)
        wts = torch.softmax(torch.randn(args.b, k, device=dev, generator=g), -1)
        run = lambda: M.moe_experts(h, ids, wts, wg, wu, wd)   # noqa: E731
    for _ in range(args.launches):
        run()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
