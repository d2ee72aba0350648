"""GGUF blocks (Q8_0, Q4_K, Q5_K, Q6_K) on the GPU, in one call: correctness, kernel bandwidth, decode steps.

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
   bench_fp8.bench_model. ``--formats q4_k+plane`` (with ``--scale-plane``) loads Q4_K with its scale plane
   (``quant_blocks.GGUF_LAYOUTS``); its floor counts the bytes held (the plane too, though the fold route reads
   the plane instead of the 16-byte header), so compare its steps with the q4_k rows in ms.

4. Sweep (``--sweep``, one call of a few minutes on an H200): per GGUF type, a small grid of launch configs
   (route -- ``--sweep-routes exact,fold`` --, N tile, warps, stages, split-K, Q8_0 blocks a step) of the quantized linear at
   SHAPES and of each grouped MoE kernel (gate_up, down) at MOE, all compiled first in ``--workers``
   processes; each checked (max error against gguf-py's dequantize on 256 weight rows / 3 MoE rows, rows
   alone == rows in a batch of 16, bitwise) and timed at B = 1, 4, 16 (linear: all at B = 1, the fastest 4
   also at 4 and 16). Printed: every config's GB/s, then the best
   per (shape, type) / (kernel, type) -- least summed time over the three batches -- as entries to paste
   into ``qlinear.QLINEAR_CONFIGS`` / ``qmoe.QMOE_CONFIGS`` (``sweep.csv`` has every row).

Full results under ``--out`` (``gguf.md``, ``gguf.jsonl``); the short table is printed last.

    python bench/bench_gguf.py --kernels --models deepseek-v3-4l,glm-4.5-4l,qwen3-next-80b-4l \\
        --formats bf16,q4_k,q8_0 --ns 1,16 --ctx 1024 --out $OUT
    python bench/bench_gguf.py --sweep --workers 15 --out $OUT
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import ds4t  # noqa: E402
from bench.bench_decode import copy_bandwidth  # noqa: E402
from bench.report import Report, bandwidth_table  # noqa: E402
from bench.bench_fp8 import bench_model, median_ms  # noqa: E402
from ds4t.kernels import linear as L, moe as M  # noqa: E402
from ds4t.kernels.qlinear import (QLINEAR_CONFIGS, QLinearConfig, _q8_group, folds, nibble_pack,  # noqa: E402
                                   qlinear_config)
from ds4t.kernels.config import overridden  # noqa: E402
from ds4t.kernels.qmoe import QMOE_CONFIGS, QMoEConfig  # noqa: E402
from ds4t.kernels.quant_blocks import K_HEADER, QTYPES, GGUFWeight, block_format, fold_weights, quantize  # noqa: E402

SHAPES = ((7168, 36864), (2048, 151936))
PLANE_ON = {"gguf_layout": [{"key": [qt, "torch.bfloat16"], "fields": {"scale_plane": True}} for qt in K_HEADER]}
"""The layout override that loads bf16 Q4_K / Q5_K weights with their scale plane (off in the GPU's table)."""
PLANE_TYPES = tuple(f"{qt}+plane" for qt in K_HEADER)
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
        deq = w.dequantize().to(dev)
        eye = L.linear(torch.eye(256, K, device=dev), w)        # decodes the first 256 columns bitwise
        bitwise = torch.equal(eye.t(), deq[:, :256])
        for adt in (torch.float32, torch.bfloat16):
            x = torch.randn(16, K, generator=g).to(dev)
            y = L.linear(x, w, act_dtype=adt)
            fold = folds(qlinear_config(K, N, qt, adt), adt)   # against the route's own weights
            err = _rel(y, x.to(adt).double() @ (fold_weights(w) if fold else deq).double().t())
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
        if qt in K_HEADER:   # the scale plane: the header route's bits (bf16 activations, fold route)
            bf = torch.bfloat16
            x = torch.randn(16, K, generator=g).to(dev)
            base, plane = (L.linear(x, t, act_dtype=bf) for t in (w, w.with_scale_plane()))
            # bitwise, but where the linear's tile has fewer than 64 weight rows on a GPU (mma.sync): there the
            # two routes' operands differ in kWidth and the fp32 sums round in another K order, each fixed per
            # config (tests/kernels/test_quant_blocks.py::test_scale_plane_changes_no_bit, the same bound)
            cfg = qlinear_config(K, N, qt, bf)   # nibble_pack: 2 at wgmma tiles, 4 at mma.sync ones
            mma_sync = torch.device(dev).type == "cuda" and nibble_pack(cfg.num_warps, cfg.block_n) == 4
            same = bool((plane - base).abs().max() <= 4e-6 * base.abs().max()) if mma_sync \
                else torch.equal(plane, base)
            o = M.moe_experts(h, ids, wts, *ws, shared_expert=E - 1, act_dtype=bf)
            op = M.moe_experts(h, ids, wts, *(t.with_scale_plane() for t in ws), shared_expert=E - 1, act_dtype=bf)
            same_moe = torch.equal(o, op)
            ok &= same and same_moe
            how = "linear within 4e-6 (mma.sync tile)" if mma_sync else "linear bitwise"
            log(f"| scale plane == header ({how}) / moe bitwise | {qt} | bfloat16 | - | {same} / {same_moe} | "
                f"{same and same_moe} |")
    return ok


def _timed(fns, dev):
    if torch.device(dev).type == "cuda":
        from bench.bench_kernels import time_calls

        return time_calls(fns)[0]
    return median_ms(lambda: [f() for f in fns], 2, 1, dev) / len(fns)


def _as_type(w: torch.Tensor, fmt: str) -> GGUFWeight:
    """``w`` quantized as ``fmt``: a kernel type, or "Q4_K+plane" / "Q5_K+plane" (rows with their scale plane)."""
    qt, _, plane = fmt.partition("+")
    return quantize(w, qt, act_dtype=torch.bfloat16).with_scale_plane(bool(plane))


def _block_bytes(w: GGUFWeight) -> int:
    """The bytes of ``w``'s blocks (repacked rows without a scale plane): what % of copy bandwidth counts, so
    a plane's extra bytes show as time, not as bandwidth."""
    return w.data[..., 0].numel() * w.format.row_bytes(w.k)


def kernel_rows(bw: float, dev, log, shapes=SHAPES, moe=MOE, types=QTYPES):
    """ms, GB/s and % of copy bandwidth: quantized linear / MoE next to cuBLAS and ds4t on bf16. ``types``
    may hold "Q4_K+plane" / "Q5_K+plane" (bytes counted without the plane)."""
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
            q = [_as_type(w, qt) for _ in range(2)]
            nb = _block_bytes(q[0])
            for B in (1, 4, 16):
                x = [torch.randn(B, K, device=dev, generator=g, dtype=bf) for _ in range(2)]
                ms = _timed([lambda i=i: L.linear(x[i], q[i]) for i in range(2)], dev)
                rows.append(dict(kernel="linear", fmt=qt, shape=f"K={K} N={N}", B=B, mb=nb / 1e6, ms=ms,
                                 gbs=nb / ms / 1e6, pct=100 * nb / ms / 1e-3 / bw))
            del q
        del w
    E, I, D, k = moe["E"], moe["I"], moe["D"], moe["k"]
    wf = [torch.randn(*s, device=dev, generator=g, dtype=bf) * s[-1] ** -0.5 for s in ((E, I, D), (E, I, D), (E, D, I))]
    formats = [("bf16", wf)] + [(qt, [_as_type(t, qt) for t in wf]) for qt in types]
    for B in (1, 4, 16):
        h = torch.randn(B, D, device=dev, generator=g)
        ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(B)]).to(torch.int32)
        wts = torch.softmax(torch.randn(B, k, device=dev, generator=g), -1)
        touched = len(set(ids.flatten().tolist()))
        for fmt, ws in formats:
            nb = sum(_block_bytes(t) if isinstance(t, GGUFWeight) else t.numel() * 2 for t in ws) / E * touched
            ms = _timed([lambda ws=ws: M.moe_experts(h, ids, wts, *ws)], dev)
            rows.append(dict(kernel="moe_experts", fmt=fmt, shape=f"E={E} I={I} D={D} top{k} ({touched} experts)",
                             B=B, mb=nb / 1e6, ms=ms, gbs=nb / ms / 1e6, pct=100 * nb / ms / 1e-3 / bw))
    bandwidth_table(log, rows)
    return rows


ROWS_B = (1, 2, 4, 8, 15, 16, 17, 32)


def padding_rows(bw: float, dev, log, types=QTYPES, shape=SHAPES[0]) -> bool:
    """``--rows``: the quantized linear at shape (K, N) for B = ROWS_B rows, timed alone and with the rows padded
    by zero rows to a multiple of 16 (the launch then sees only full 16-row tiles); the real rows' bits must be
    equal. A tile's padding rows must cost nothing: B = 1 should take no longer than B = 16."""
    K, N = shape
    g = torch.Generator(device=dev).manual_seed(3)
    w = torch.randn(N, K, device=dev, generator=g, dtype=torch.bfloat16) * K ** -0.5
    log("| type | B | ms | ms padded to 16-row tiles | % of copy BW | bits equal |")
    log("|---|---|---|---|---|---|")
    ok = True
    for qt in types:
        q = [_as_type(w, qt) for _ in range(2)]
        nb = _block_bytes(q[0])
        for B in ROWS_B:
            x = [torch.randn(B, K, device=dev, generator=g, dtype=torch.bfloat16) for _ in range(2)]
            xp = [torch.cat([t, t.new_zeros(-B % 16, K)]) for t in x]
            y = [L.linear(x[i], q[i]) for i in range(2)]
            yp = [L.linear(xp[i], q[i]) for i in range(2)]
            same = all(torch.equal(yp[i][:B], y[i]) for i in range(2))
            ok &= same
            ms = _timed([lambda i=i: L.linear(x[i], q[i], out=y[i]) for i in range(2)], dev)
            msp = _timed([lambda i=i: L.linear(xp[i], q[i], out=yp[i]) for i in range(2)], dev)
            log(f"| {qt} | {B} | {ms:.4f} | {msp:.4f} | {100 * nb / ms / 1e-3 / bw:.0f}% | {same} |")
        del q
    return ok


# ----------------------------------------------------------------------------------------------
# --sweep: launch configs of the quantized linear and the grouped MoE kernels
# ----------------------------------------------------------------------------------------------
SWEEP_B = (1, 4, 16)
TOP = 4
"""Linear configs timed at every B: the TOP fastest at B = 1 (the linear's time hardly moves with B <= 16)."""


def linear_grid(K: int, N: int, qt: str, routes=("exact", "fold")):
    """The linear configs tried for one (shape, type). Exact route: 32- to 128-row tiles, split-K 1 or 2
    (the FP8 sweeps' winners split K = 7168 in two), 2 or 4 warps (FP8's winners had 2), 1-4 stages (1: no
    cp.async pipeline: the bytes load to registers, fewer instructions), Q8_0 at 4 and 8 blocks a step,
    32- / 64-row tiles also in pairs (``pair``). Fold route (bf16 activations): 32- to 128-row tiles,
    split 1 / 2 / 4, 2 / 4 / 8 warps, Q8_0 at 4 / 8 / 16 blocks a step. Plus the table's config."""
    out = []
    if "exact" in routes:
        groups = sorted({_q8_group(K, 4), _q8_group(K, 8)}) if qt == "Q8_0" else [1]
        out += [QLinearConfig(block_n=bn, split=sp, group=g, num_warps=w, num_stages=st, pair=pr)
                for bn, sp in ((32, 1), (32, 2), (64, 1), (64, 2), (128, 1))
                for w, st in ((2, 1), (2, 2), (2, 3), (4, 1), (4, 3), (4, 4)) for g in groups
                for pr in ((False, True) if bn <= 64 else (False,))]
    if "fold" in routes:
        groups = sorted({_q8_group(K, 4), _q8_group(K, 8), _q8_group(K, 16)}) if qt == "Q8_0" else [1]
        out += [QLinearConfig(block_n=bn, split=sp, group=g, num_warps=w, num_stages=st, fold=True)
                for bn, sp in ((32, 2), (32, 4), (64, 1), (64, 2), (128, 2))
                for w, st in ((2, 3), (4, 1), (4, 3), (8, 3)) for g in groups]
    base = QLINEAR_CONFIGS(K, N, qt, torch.bfloat16)   # the table's (or rule's) current choice
    return list(dict.fromkeys(out + [base] + _prefetch_variants(base, routes)))


def _prefetch_variants(base, routes):
    """Route ``prefetch``: the table's config asking L2 for the quant bytes one or two steps ahead."""
    if "prefetch" not in routes:
        return []
    return [dataclasses.replace(base, prefetch_l2=a) for a in (1, 2)]


def moe_grid(kernel: str, qt: str, routes=("exact", "fold")):
    """The configs tried for one grouped kernel and type (the other kernel keeps its table config)."""
    out = []
    if "exact" in routes:
        out += [QMoEConfig(tile_n=bn, q8_group=g, num_warps=w, num_stages=st, interleave=il)
                for bn in (16, 32, 64, 128) for w, st in ((2, 1), (2, 3), (4, 1), (4, 3))
                for g in ((4, 8) if qt == "Q8_0" else (4,)) for il in ((True, False) if kernel == "gate_up" else (True,))]
    if "fold" in routes:
        out += [QMoEConfig(tile_n=bn, q8_group=4, num_warps=w, num_stages=st, fold=True)
                for bn in (32, 64) for w, st in ((2, 3), (4, 1), (4, 3))]
    base = QMOE_CONFIGS(kernel, qt)
    return list(dict.fromkeys(out + [base] + _prefetch_variants(base, routes)))


def _moe_rule(kernel: str, cfg: QMoEConfig):
    """QMOE_CONFIGS' rule with ``cfg`` for ``kernel`` and the table's config for the other kernel (no
    ("rows",) entries: ``cfg`` at every launch size)."""
    table = {(k, q): QMOE_CONFIGS(k, q) for k in ("gate_up", "down") for q in QTYPES}
    return lambda k, q, *rows: None if rows else cfg if k == kernel else table[(k, q)]


def _zeros_weight(shape, qt):
    *lead, K = shape
    return GGUFWeight(torch.zeros(*lead, block_format(qt).row_bytes(K), dtype=torch.uint8, device="cuda"), qt, K,
                      torch.bfloat16)


def _moe_routes(B, moe=MOE, dev="cuda"):
    g = torch.Generator(device=dev).manual_seed(B)
    E, D, k = moe["E"], moe["D"], moe["k"]
    h = torch.randn(B, D, device=dev, generator=g)
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:k] for _ in range(B)]).to(torch.int32)
    wts = torch.softmax(torch.randn(B, k, device=dev, generator=g), -1)
    return h, ids, wts


def _compile_worker(jobs):
    """Compile (and run once on zero weights) the sweep's configs in a separate process: fills Triton's
    cache for the main process. The launches specialise on the same shapes, strides and dtypes."""
    import torch as _t

    import ds4t as _d  # noqa: F401
    errs = []
    for job in jobs:
        try:
            if job[0] == "linear":
                _, K, N, qt, fields = job
                w = _zeros_weight((N, K), qt)
                L.linear(_t.zeros(1, K, device="cuda", dtype=_t.bfloat16), w, config=QLinearConfig(**fields))
            else:
                _, kernel, qt, fields = job
                E, I, D = MOE["E"], MOE["I"], MOE["D"]
                ws = [_zeros_weight(s, qt) for s in ((E, I, D), (E, I, D), (E, D, I))]
                with QMOE_CONFIGS.forced(_moe_rule(kernel, QMoEConfig(**fields))):
                    M.moe_experts(*_moe_routes(1), *ws)
            _t.cuda.synchronize()
            errs.append(None)
        except Exception as e:   # reported in the table; the sweep goes on
            errs.append(f"{type(e).__name__}: {str(e)[:160]}")
    return errs


def precompile(jobs, workers, log):
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    chunks = [jobs[i::workers] for i in range(workers)]
    errors = {}
    try:
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
            for chunk, errs in zip(chunks, ex.map(_compile_worker, chunks)):
                errors.update({json.dumps(j): e for j, e in zip(chunk, errs) if e})
    except Exception as e:
        log(f"precompile failed ({e!r}); compiling in the main process instead")
    log(f"precompiled {len(jobs)} configs in {time.time() - t0:.0f} s with {workers} processes, {len(errors)} failed")
    return errors


def _job(kind, *key, cfg):
    return (kind, *key, dataclasses.asdict(cfg))


def _entry(key, cfg) -> str:
    fields = ", ".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))
    return f"    {key}: {type(cfg).__name__}({fields}),"


def sweep(bw: float, log, workers: int, types=QTYPES, what=("linear", "moe"), dev="cuda", shapes=SHAPES, moe=MOE,
          routes=("exact", "fold")):
    """Try each config of the grids: correctness, row invariance, GB/s at B = 1, 4, 16. Returns the rows.
    (``dev="cpu"`` with tiny ``shapes`` / ``moe`` and ``workers=0``: a smoke run of the script's logic.)"""
    bf = torch.bfloat16
    jobs = []
    if "linear" in what:
        jobs += [_job("linear", K, N, qt, cfg=c) for K, N in shapes for qt in types
                 for c in linear_grid(K, N, qt, routes)]
    if "moe" in what:
        jobs += [_job("moe", kern, qt, cfg=c)
                 for qt in types for kern in ("gate_up", "down") for c in moe_grid(kern, qt, routes)]
    errors = precompile(jobs, min(workers, len(jobs)), log) if workers > 0 else {}
    rows, best = [], []
    g = torch.Generator(device=dev).manual_seed(0)

    def time_at(r, cfg, bs, fns_for, nbytes_for):
        for B in bs:
            ms = _timed(fns_for(B, cfg), dev)
            r[f"ms_b{B}"], r[f"pct_b{B}"] = ms, 100 * nbytes_for(B) / ms / 1e-3 / bw

    def measure(key, cfg, fns_for, nbytes_for, check, bs=SWEEP_B, tol=1e-4):
        job = json.dumps(_job(*key, cfg=cfg))
        r = dict(kernel=key[0], key=" ".join(map(str, key[1:])), config=str(cfg))
        if job in errors:
            r["status"] = "compile: " + errors[job][:100]
        else:
            try:
                err, inv = check(cfg)
                r.update(err=err, inv=inv)
                time_at(r, cfg, bs, fns_for, nbytes_for)
                r["status"] = "ok" if err <= tol and inv else "BAD"
            except Exception as e:
                if dev != "cpu":
                    torch.cuda.synchronize()
                r["status"] = f"error: {type(e).__name__}: {str(e)[:100]}"
        rows.append(r)
        if r["status"] == "ok":
            log(f"  {r['kernel']} {r['key']} {cfg}: " + ", ".join(f"B={B} {r[f'pct_b{B}']:.0f}%" for B in bs))
        else:
            log(f"  {r['kernel']} {r['key']} {cfg}: {r['status']}")
        return r

    def pick(sel, table_key, log_key):
        good = [r for r in sel if r["status"] == "ok" and all(f"ms_b{B}" in r for B in SWEEP_B)]
        if not good:
            log(f"{log_key}: no config passed")
            return
        b = min(good, key=lambda r: sum(r[f"ms_b{B}"] for B in SWEEP_B))
        best.append((log_key, table_key, b))

    if "linear" in what:
        for K, N in shapes:
            w32 = torch.randn(N, K, device=dev, generator=g, dtype=bf) * K ** -0.5
            xs = {B: [torch.randn(B, K, device=dev, generator=g, dtype=bf) for _ in range(2)] for B in SWEEP_B}
            for qt in types:
                q = [quantize(w32, qt, act_dtype=bf) for _ in range(2)]
                # gguf-py on 256 weight rows (exact route), the fold route's bf16 weights (fold)
                refs = {fo: xs[16][0].double() @ (fold_weights(q[0][:256]) if fo else q[0][:256].dequantize()).double().t()
                        for fo in (False, True)}
                outs = {B: torch.empty(B, N, device=dev) for B in SWEEP_B}

                def check(cfg, q=q, refs=refs):
                    x = xs[16][0]
                    y = L.linear(x, q[0], config=cfg)
                    ref = refs[cfg.fold]
                    err = ((y[:, :256].double() - ref).abs().max() / ref.abs().max()).item()
                    inv = all(torch.equal(L.linear(x[i:i + 1], q[0], config=cfg)[0], y[i]) for i in (0, 7, 15))
                    return err, inv

                def fns(B, cfg, q=q, outs=outs):
                    return [lambda i=i: L.linear(xs[B][i], q[i], config=cfg, out=outs[B]) for i in range(2)]

                nbytes = lambda B, q=q: q[0].nbytes   # noqa: E731
                sel = [measure(("linear", K, N, qt), c, fns, nbytes, check, bs=SWEEP_B[:1])
                       for c in linear_grid(K, N, qt, routes)]
                top = sorted((r for r in sel if r["status"] == "ok"), key=lambda r: r["ms_b1"])[:TOP]
                for r in top:
                    time_at(r, _cfg_of(r), SWEEP_B[1:], fns, nbytes)
                    log(f"  top {r['config']}: " + ", ".join(f"B={B} {r[f'pct_b{B}']:.0f}%" for B in SWEEP_B))
                pick(sel, f"({K}, {N}, {qt!r}, torch.bfloat16)", f"linear K={K} N={N} {qt}")
                del q
            del w32
    if "moe" in what:
        E, I, D = moe["E"], moe["I"], moe["D"]
        routing = {B: _moe_routes(B, moe, dev) for B in SWEEP_B}
        touched = {B: len(set(routing[B][1].flatten().tolist())) for B in SWEEP_B}
        wf = [torch.randn(*s, device=dev, generator=g, dtype=bf) * s[-1] ** -0.5
              for s in ((E, I, D), (E, I, D), (E, D, I))]
        for qt in types:
            ws = [quantize(t, qt, act_dtype=bf) for t in wf]
            per_expert = sum(w.nbytes for w in ws) / E
            # gguf-py's dequantize of all 512 experts takes too long: the reference covers rows 0..2 of the
            # B = 16 batch, over just the experts they use (ids renumbered)
            h3, ids3, wts3 = (t[:3] for t in routing[16])
            used, ids_used = torch.unique(ids3, return_inverse=True)
            exact = [w[used] for w in ws]
            table = {k: QMOE_CONFIGS(k, qt).fold for k in ("gate_up", "down")}

            def moe_ref(fold):   # fold: {kernel: route} -- gate / up through gate_up's, down through down's
                wr = [fold_weights(w) if fo else w for w, fo in zip(exact, (fold["gate_up"], fold["gate_up"], fold["down"]))]
                return M.moe_experts_ref(h3, ids_used.to(torch.int32), wts3, *wr)   # activations in bf16 either way

            for kern in ("gate_up", "down"):
                refs = {fo: moe_ref({**table, kern: fo}) for fo in (False, True)}

                def check(cfg, ws=ws, refs=refs, kern=kern):
                    ref = refs[cfg.fold]
                    with QMOE_CONFIGS.forced(_moe_rule(kern, cfg)):
                        h, ids, wts = routing[16]
                        o = M.moe_experts(h, ids, wts, *ws)
                        err = ((o[:3] - ref).abs().max() / ref.abs().max()).item()
                        inv = all(torch.equal(M.moe_experts(h[i:i + 1], ids[i:i + 1], wts[i:i + 1], *ws)[0], o[i])
                                  for i in (0, 7, 15))
                    return err, inv

                def fns(B, cfg, ws=ws, kern=kern):
                    h, ids, wts = routing[B]
                    out = torch.empty(B, D, device=dev)

                    def call():
                        with QMOE_CONFIGS.forced(_moe_rule(kern, cfg)):
                            M.moe_experts(h, ids, wts, *ws, out=out)
                    return [call]

                # tol: silu(g) * u is rounded to bf16 before the down product, so a last-bit difference of an
                # fp32 sum (kernel vs reference order) moves an activation by a bf16 ulp: ~1e-4..3e-4 at D = 2048
                sel = [measure(("moe", kern, qt), c, fns, lambda B: per_expert * touched[B], check, tol=1e-3)
                       for c in moe_grid(kern, qt, routes)]
                pick(sel, f"({kern!r}, {qt!r})", f"moe_experts {kern} E={E} I={I} D={D} top{moe['k']} {qt}")
            del ws
    log("\n### Best config per (shape, type): least summed time over B = 1, 4, 16\n")
    log("| what | config | % of copy BW at B = 1 / 4 / 16 | GB/s at B = 1 / 4 / 16 |")
    log("|---|---|---|---|")
    for log_key, _, r in best:
        pct = " / ".join(f"{r[f'pct_b{B}']:.0f}%" for B in SWEEP_B)
        gbs = " / ".join(f"{r[f'pct_b{B}'] * bw / 100 / 1e9:.0f}" for B in SWEEP_B)
        log(f"| {log_key} | {r['config']} | {pct} | {gbs} |")
    log("\n(MoE % counts the whole moe_experts call -- grouping, both kernels, combine -- against the bytes of the\n"
        "experts touched; each kernel's sweep keeps the other kernel at its table config.)\n")
    log("Paste into ds4t/kernels/qlinear.py QLINEAR_CONFIGS gpu={...} (key: K, N, type, act dtype):\n")
    for _, key, r in best:
        if r["kernel"] == "linear":
            log(_entry(key, _cfg_of(r)))
    log("\nPaste into ds4t/kernels/qmoe.py QMOE_CONFIGS gpu={...} (key: kernel, type):\n")
    for _, key, r in best:
        if r["kernel"] == "moe":
            log(_entry(key, _cfg_of(r)))
    return rows


def _cfg_of(row):
    return eval(row["config"], {"QLinearConfig": QLinearConfig, "QMoEConfig": QMoEConfig})   # our own repr


def write_sweep_csv(path, rows):
    keys = ["kernel", "key", "config", "status", "err", "inv"] + [f"{m}_b{B}" for B in SWEEP_B for m in ("ms", "pct")]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--scale-plane", action="store_true",
                    help="--kernels: Q4_K and Q5_K with their scale planes too; --formats may then name q4_k+plane, q5_k+plane")
    ap.add_argument("--rows", action="store_true",
                    help="the linear at B = 1 .. 32 rows, alone and padded with zero rows to 16-row tiles (bits equal; "
                         "padding rows must cost nothing)")
    ap.add_argument("--sweep", action="store_true", help="sweep launch configs (GPU; section 4 above)")
    ap.add_argument("--sweep-types", default=",".join(QTYPES), help="GGUF types the sweep tries")
    ap.add_argument("--sweep-what", default="linear,moe", help="linear and/or moe")
    ap.add_argument("--sweep-routes", default="exact,fold",
                    help="exact, fold and/or prefetch (the table's config with an L2 prefetch): what the sweep tries")
    ap.add_argument("--workers", type=int, default=15, help="compile processes for --sweep")
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
    log = Report()

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
        types = QTYPES + (PLANE_TYPES if args.scale_plane else ())
        if cuda:
            krows = kernel_rows(bw, args.device, log, types=types)
        else:
            krows = kernel_rows(bw, args.device, log, shapes=((512, 96),), moe=dict(E=8, I=256, D=256, k=2),
                                types=types)
    if args.rows:
        log("\n## Padding rows (bf16 activations)\n")
        ok &= padding_rows(bw, args.device, log, shape=SHAPES[0] if cuda else (512, 96))
    if args.sweep:
        log("\n## Sweep (bf16 activations)\n")
        types, what = [t for t in args.sweep_types.split(",") if t], [w for w in args.sweep_what.split(",") if w]
        routes = [r for r in args.sweep_routes.split(",") if r]
        if cuda:
            srows = sweep(bw, log, args.workers, types, what, routes=routes)
        else:   # a smoke run of the sweep's logic in the interpreter: tiny shapes, no compile processes
            srows = sweep(bw, log, 0, types, what, dev=args.device, shapes=((512, 96),),
                          moe=dict(E=8, I=256, D=256, k=2), routes=routes)
            write_sweep_csv(os.path.join(args.out, "sweep.csv"), srows)
            ok &= not any(r["status"] == "BAD" for r in srows)
    for name in [m for m in args.models.split(",") if m]:
        for fmt in [f for f in args.formats.split(",") if f]:
            spec = name if fmt == "bf16" else f"{name}:{fmt}"
            if fmt.endswith("+plane"):   # rows with their scale plane: the layout table says so at load
                with overridden(PLANE_ON):
                    ok &= bench_model(spec.removesuffix("+plane"), args, bw, log, mrows, label=spec)
            else:
                ok &= bench_model(spec, args, bw, log, mrows)
    with open(os.path.join(args.out, "gguf.jsonl"), "w") as f:
        for r in krows + mrows:
            f.write(json.dumps(r) + "\n")
    log("\n## Summary\n")
    if krows:
        log("| weights | kernel | B | % of copy BW (blocks >= 100 MB) |")
        log("|---|---|---|---|")
        for fmt in ["bf16 cuBLAS", "bf16 ds4t", *QTYPES, *PLANE_TYPES]:
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
    log.write(args.out, "gguf.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
