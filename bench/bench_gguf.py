"""GGUF blocks (Q8_0, Q4_K, Q6_K) on the GPU, in one call: correctness, kernel bandwidth, decode steps.

1. Correctness (always): every kernel type against gguf-py's dequantize + torch (fp64), the blocks decoded
   bitwise (identity rows), rows alone == rows in a batch of 16 (bitwise), the grouped MoE against its
   reference; fp32 and bf16 activations.
2. Kernels (``--kernels``): the quantized linear at weights whose blocks are >= 100 MB (K x N = 7168 x 36864,
   2048 x 151936) and the grouped MoE at Qwen3-Next-80B's expert shape (E 512, I 512, D 2048, top 10), B = 1,
   4, 16, bf16 activations. Bytes = the quantized blocks a call reads (MoE: the experts it touches); % of the
   device-to-device copy bandwidth measured in the same run; two weight copies rotated (beyond the 60 MB L2),
   CUDA-graph timing (bench_kernels.time_calls). Next to them: cuBLAS (torch.matmul) on the dequantized bf16
   weight and ds4t's bf16 kernels.
3. Models (``--models``): each preset in bf16 and quantized at load (``preset:q4_k``, ``preset:q8_0``):
   load, exactness on the GPU (harness native == ordered with both negative controls), decode step time
   at each N against the bytes floor (bench/floor.py's count: weights once, every session's state), via
   bench_fp8.bench_model.

Full results under ``--out`` (``gguf.md``, ``gguf.jsonl``); the short table is printed last.

    python bench/bench_gguf.py --kernels --models deepseek-v3-4l,glm-4.5-4l,qwen3-next-80b-4l \\
        --formats bf16,q4_k,q8_0 --ns 1,16 --ctx 1024 --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ds4t  # noqa: E402
from bench.bench_decode import copy_bandwidth  # noqa: E402
from bench.bench_fp8 import bench_model, median_ms  # noqa: E402
from ds4t.kernels import linear as L, moe as M  # noqa: E402
from ds4t.kernels.quant_blocks import QTYPES, dequantize, quantize  # noqa: E402

SHAPES = ((7168, 36864), (2048, 151936))
MOE = dict(E=512, I=512, D=2048, k=10)


def _rel(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def correctness(dev, log) -> bool:
    """Against gguf-py's dequantize + torch, bitwise decoding, row invariance, MoE: one line per case."""
    ok = True
    g = torch.Generator(device="cpu").manual_seed(0)
    log("| case | type | act | max rel err | bitwise / invariant | ok |")
    log("|---|---|---|---|---|---|")
    for qt in QTYPES:
        K, N = (1024, 300) if torch.device(dev).type == "cuda" else (256, 40)
        w = quantize(torch.randn(N, K, generator=g) * K ** -0.5, qt).to(dev)
        deq = dequantize(w.data.cpu(), qt, K).to(dev)
        eye = L.linear(torch.eye(256, K, device=dev), w)        # decodes the first 256 columns bitwise
        bitwise = torch.equal(eye.t(), deq[:, :256])
        for adt in (torch.float32, torch.bfloat16):
            x = torch.randn(16, K, generator=g).to(dev)
            y = L.linear(x, w, act_dtype=adt)
            err = _rel(y, x.to(adt).double() @ deq.double().t())
            inv = all(torch.equal(L.linear(x[i:i + 1], w, act_dtype=adt)[0], y[i]) for i in range(16))
            good = err <= 1e-4 and inv and bitwise
            ok &= good
            log(f"| linear {K}x{N} | {qt} | {str(adt)[6:]} | {err:.1e} | decode {bitwise}, rows {inv} | {good} |")
        E, I, D, k = 8, 256, 512, 2
        ws = [quantize(torch.randn(*s, generator=g) * s[-1] ** -0.5, qt).to(dev) for s in ((E, I, D), (E, I, D), (E, D, I))]
        h = torch.randn(16, D, generator=g).to(dev)
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(16)]).to(dev, torch.int32)
        wts = torch.rand(16, k, generator=g).to(dev)
        for adt in (torch.float32, torch.bfloat16):
            o = M.moe_experts(h, ids, wts, *ws, shared_expert=E - 1, act_dtype=adt)
            ref = M.moe_experts_ref(h, ids, wts, *ws, shared_expert=E - 1, act_dtype=adt)
            err = _rel(o, ref.double())
            inv = all(torch.equal(M.moe_experts(h[i:i + 1], ids[i:i + 1], wts[i:i + 1], *ws, shared_expert=E - 1,
                                                act_dtype=adt)[0], o[i]) for i in range(16))
            good = err <= (1e-4 if adt == torch.float32 else 3e-2) and inv
            ok &= good
            log(f"| moe E={E} I={I} D={D} | {qt} | {str(adt)[6:]} | {err:.1e} | rows {inv} | {good} |")
    return ok


def _timed(fns, dev):
    if torch.device(dev).type == "cuda":
        from bench.bench_kernels import time_calls

        return time_calls(fns)[0]
    return median_ms(lambda: [f() for f in fns], 2, 1, dev) / len(fns)


def kernel_rows(bw: float, dev, log, shapes=SHAPES, moe=MOE, types=QTYPES):
    """ms, GB/s and % of copy bandwidth: quantized linear / MoE next to cuBLAS and ds4t on bf16."""
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    bf = torch.bfloat16
    for K, N in shapes:
        w = torch.randn(N, K, device=dev, generator=g, dtype=bf) * K ** -0.5
        for B in (1, 4, 16):
            x = [torch.randn(B, K, device=dev, generator=g, dtype=bf) for _ in range(2)]
            ws = [w, w.clone()]
            nb = w.numel() * 2
            for fmt, fn in (("bf16 cuBLAS", lambda i: torch.matmul(x[i], ws[i].t())),
                            ("bf16 ds4t", lambda i: L.linear(x[i], ws[i]))):
                ms = _timed([lambda i=i: fn(i) for i in range(2)], dev)
                rows.append(dict(kernel="linear", fmt=fmt, shape=f"K={K} N={N}", B=B, mb=nb / 1e6, ms=ms,
                                 gbs=nb / ms / 1e6, pct=100 * nb / ms / 1e-3 / bw))
            del ws
        for qt in types:
            q = [quantize(w, qt, act_dtype=bf) for _ in range(2)]
            nb = q[0].nbytes
            for B in (1, 4, 16):
                x = [torch.randn(B, K, device=dev, generator=g, dtype=bf) for _ in range(2)]
                ms = _timed([lambda i=i: L.linear(x[i], q[i]) for i in range(2)], dev)
                rows.append(dict(kernel="linear", fmt=qt, shape=f"K={K} N={N}", B=B, mb=nb / 1e6, ms=ms,
                                 gbs=nb / ms / 1e6, pct=100 * nb / ms / 1e-3 / bw))
            del q
        del w
    E, I, D, k = moe["E"], moe["I"], moe["D"], moe["k"]
    wf = [torch.randn(*s, device=dev, generator=g, dtype=bf) * s[-1] ** -0.5 for s in ((E, I, D), (E, I, D), (E, D, I))]
    formats = [("bf16", wf)] + [(qt, [quantize(t, qt, act_dtype=bf) for t in wf]) for qt in types]
    for B in (1, 4, 16):
        h = torch.randn(B, D, device=dev, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(B)]).to(torch.int32)
        wts = torch.softmax(torch.randn(B, k, device=dev, generator=g), -1)
        touched = len(set(ids.flatten().tolist()))
        for fmt, ws in formats:
            nb = sum(getattr(t, "nbytes", None) or t.numel() * 2 for t in ws) / E * touched
            ms = _timed([lambda ws=ws: M.moe_experts(h, ids, wts, *ws)], dev)
            rows.append(dict(kernel="moe_experts", fmt=fmt, shape=f"E={E} I={I} D={D} top{k} ({touched} experts)",
                             B=B, mb=nb / 1e6, ms=ms, gbs=nb / ms / 1e6, pct=100 * nb / ms / 1e-3 / bw))
    log("| kernel | weights | shape | B | MB read | ms | GB/s | % of copy BW |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        log(f"| {r['kernel']} | {r['fmt']} | {r['shape']} | {r['B']} | {r['mb']:.0f} | {r['ms']:.4f} | "
            f"{r['gbs']:.0f} | {r['pct']:.0f}% |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--models", default="", help="comma list of presets")
    ap.add_argument("--formats", default="bf16,q4_k,q8_0", help="bf16 and/or load(quantize=) types")
    ap.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--exact-sessions", type=int, default=4)
    ap.add_argument("--commit", default=None)
    ap.add_argument("--device", default="cuda", help="cuda; cpu only for a smoke run of the script (tiny shapes)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    lines = []

    def log(s=""):
        print(s, flush=True)
        lines.append(s)

    cuda = torch.device(args.device).type == "cuda"
    bw = copy_bandwidth("cuda") if cuda else 20e9
    t_start = time.time()
    log(f"# ds4t GGUF blocks on {torch.cuda.get_device_name() if cuda else 'cpu (smoke run)'}\ncommit {args.commit}; "
        f"torch {torch.__version__}; copy bandwidth {bw / 1e12:.2f} TB/s (read + write)\n"
        f"command: python bench/bench_gguf.py {' '.join(sys.argv[1:])}\n")
    log("## Correctness (gguf-py dequantize + torch fp64; bitwise decoding; rows alone == in a batch of 16)\n")
    ok = correctness(args.device, log)
    krows, mrows = [], []
    if args.kernels:
        log("\n## Kernels (bf16 activations)\n")
        if cuda:
            krows = kernel_rows(bw, args.device, log)
        else:
            krows = kernel_rows(bw, args.device, log, shapes=((512, 96),), moe=dict(E=8, I=256, D=256, k=2))
    for name in [m for m in args.models.split(",") if m]:
        for fmt in [f for f in args.formats.split(",") if f]:
            spec = name if fmt == "bf16" else f"{name}:{fmt}"
            ok &= bench_model(spec, args, bw, log, mrows)
    with open(os.path.join(args.out, "gguf.jsonl"), "w") as f:
        for r in krows + mrows:
            f.write(json.dumps(r) + "\n")
    log("\n## Summary\n")
    if krows:
        log("| weights | kernel | B | % of copy BW (blocks >= 100 MB) |")
        log("|---|---|---|---|")
        for fmt in ["bf16 cuBLAS", "bf16 ds4t", *QTYPES]:
            for kern in ("linear", "moe_experts"):
                for B in (1, 4, 16):
                    sel = [r for r in krows if r["fmt"] == fmt and r["kernel"] == kern and r["B"] == B
                           and (r["mb"] >= 100 or kern == "moe_experts" or not cuda)]
                    if sel:
                        pcts = ", ".join("%.0f%%" % r["pct"] for r in sel)
                        log(f"| {fmt} | {kern} | {B} | {pcts} |")
    if mrows:
        log("\n| model | N | native ms | floor ms | native / floor |")
        log("|---|---|---|---|---|")
        for r in mrows:
            log(f"| {r['model']} | {r['n']} | {r['native_ms']:.2f} | {r['floor_ms']:.2f} | {r['ratio']:.2f}x |")
    log(f"\nexactness and correctness on {'GPU' if cuda else 'CPU'}: {'PASS' if ok else 'FAIL'}; "
        f"{time.time() - t_start:.0f} s")
    with open(os.path.join(args.out, "gguf.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
