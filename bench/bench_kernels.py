#!/usr/bin/env python
"""GPU kernel benchmark for ds4t: correctness, decode linear bandwidth, decode attention bandwidth.

    PYTHONUNBUFFERED=1 python bench/bench_kernels.py 2>&1 | tee $OUT/log.txt

1. Correctness: ``pytest tests/kernels``, every kernel's tests (in the background,
   while step 2a compiles), plus every registered self-check (``ds4t check``).
2. Linear (bf16 weights, fp32 x), K x N in {4096x14336, 14336x4096, 2048x12288, 2048x151936}:
   a. ``--sweep``: every candidate config (BLOCK_N, BLOCK_K, split-K, stages, swap) compiled in
      parallel processes, checked (error, row batch invariance), timed at B=1 and the best few at
      B=16. The best config per shape is what ``ds4t/kernels/linear.py:_GPU_TABLE`` should hold.
   b. B in {1,2,4,8,16,32,64}: ds4t with its own config (``linear_config``), the sweep's best
      (if different) and ``torch.nn.functional.linear`` (bf16 x). Bytes = weight + x + y.
   ``--fp8``: the same with block-scaled FP8 weights (128x128 blocks; x fp32 rounded to bf16 in the
   kernel) at FP8_SHAPES (DeepSeek-V3's >= 100 MB linears); bytes = fp8 + scales + x + y; torch's
   row is cuBLAS on the dequantized bf16 weight. ``--fp8 --sweep`` sweeps FP8 configs (BLOCK_K
   64 / 128, splits on scale blocks) for an FP8 ``_GPU_TABLE`` entry.
3. Attention: ``ds4t.kernels.attention.decode_attention`` vs torch SDPA (bf16, enable_gqa) for
   B in {1,8,32}, L in {1k,8k,32k}, heads (16q/2kv, d256) and (64q/8kv, d128). Bytes = KV read.

Timing: CUDA graphs of >= 24 back-to-back calls (launch overhead removed, as decode runs),
rotating over weight / cache copies that together exceed 4x the 60 MB L2, median of 15 replays.
Device-to-device copy bandwidth (read + write bytes) is measured in the same run; fractions are
of that. Batch invariance: a row alone vs the same row inside the batch (random row order),
``torch.equal``. Results: $OUT (default ./out): kernels.md, linear.csv, sweep.csv,
attention.csv; a short table is printed last.
"""
from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import subprocess
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import ds4t  # noqa: E402,F401
from ds4t.backend import INTERPRET  # noqa: E402
from ds4t.kernels.linear import LinearConfig, linear, linear_config, linear_ref  # noqa: E402

OUT = os.environ.get("OUT", "./out")
L2_BYTES = 60e6
ROTATE_BYTES = 4 * L2_BYTES
LINEAR_SHAPES = [(4096, 14336), (14336, 4096), (2048, 12288), (2048, 151936)]  # (K, N)
# --fp8: block-scaled FP8 weights (128x128 blocks), DeepSeek-V3's big linears (dense MLP gate/up and
# down, o_proj: >= 100 MB of fp8) and q_b (37 MB). x fp32 rounded to bf16 in the kernel (act_dtype).
FP8_SHAPES = [(7168, 18432), (18432, 7168), (16384, 7168), (1536, 24576)]
FP8_BLOCK = (128, 128)
BATCHES = [1, 2, 4, 8, 16, 32, 64]
TEST_FILES = ["tests/kernels"]   # every kernel's tests (inputs follow the kernels' device: tests/kernels/devices.py)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------- timing
def _event():
    return torch.cuda.Event(enable_timing=True)


def time_calls(fns, min_calls=24, iters=15):
    """Median ms per call of the callables ``fns`` (one per rotation), replayed in a CUDA graph."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    reps = max(1, math.ceil(min_calls / len(fns)))
    n = reps * len(fns)
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for f in fns:
                f()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                for f in fns:
                    f()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(iters):
            a, b = _event(), _event()
            a.record()
            g.replay()
            b.record()
            b.synchronize()
            ts.append(a.elapsed_time(b) / n)
        del g
        return statistics.median(ts), "graph"
    except Exception as e:  # not capturable: time eagerly, one call at a time
        log(f"    (graph capture failed: {type(e).__name__}: {str(e)[:120]}; timing eagerly)")
        torch.cuda.synchronize()
        ts = []
        for _ in range(max(1, iters * reps // 4)):
            for f in fns:
                a, b = _event(), _event()
                a.record()
                f()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
        return statistics.median(ts), "eager"


def copy_bandwidth():
    n = 1 << 28  # 1 GiB of fp32
    src = torch.empty(n, device="cuda").normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    ts = []
    for _ in range(20):
        a, b = _event(), _event()
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    ms = statistics.median(ts)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * n / (ms * 1e-3), ms


# ------------------------------------------------------------------------------------- correctness
def start_pytest():
    # (pyproject addopts already has -q; a second -q would hide the "N passed" line.)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:benchmark", *TEST_FILES]
    try:
        import xdist  # noqa: F401
        cmd[3:3] = ["-n", "12"]
    except ImportError:
        pass
    log("pytest:", " ".join(cmd))
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish_pytest(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return False, "TIMEOUT\n" + out[-3000:]
    return proc.returncode == 0, out[-3000:]


def self_checks():
    from ds4t.kernels import registry
    try:
        checks = registry.all_checks()
    except Exception as e:  # another module failed to import: run the checks that did register
        log(f"all_checks: {e!r}")
        checks = list(registry._CHECKS)
    rows = []
    for check in checks:
        try:
            for r in check(torch.device("cuda")):
                rows.append([r.kernel, r.shapes, f"{r.max_err:.2e}", f"{r.tol:.0e}",
                             "yes" if r.batch_invariant else "NO", f"{r.ms:.3f}", "ok" if r.ok else "FAIL"])
        except Exception as e:
            rows.append([getattr(check, "__module__", "?"), "-", "-", "-", "-", "-", f"error {repr(e)[:80]}"])
    return rows


# ------------------------------------------------------------------------------------- linear
def cdiv(a, b):
    return -(-a // b)


def candidates(K, N, fp8=False):
    """Configs worth timing for a bf16 weight [N, K] (all keep the K order a function of K, N)."""
    if fp8:
        return fp8_candidates(K, N)
    out = []
    for swap in (True, False):
        for bn in (16, 32, 64, 128):
            if not swap and bn < 32:
                continue
            for bk in (128, 256, 512):
                if bn * bk * 2 > 64 * 1024:
                    continue
                for split in (1, 2, 4, 8):
                    if K % (split * bk) or K // split < 2 * bk:
                        continue
                    ctas = cdiv(N, bn) * split
                    if ctas < 128 or (split > 1 and (ctas > 1200 or cdiv(N, bn) >= 1000)):
                        continue
                    for stages in (3, 4):
                        if stages * (bn * bk * 2 + 16 * bk * 4) > 200 * 1024:
                            continue
                        if not swap and stages == 3:
                            continue
                        out.append(LinearConfig(block_n=bn, block_k=bk, split=split, num_warps=4,
                                                num_stages=stages, swap=swap))
    return out


FP8_ROUTES_SWEPT = ["f32"]
"""Routes the FP8 sweep tries (``--fp8-routes``): "f32" by default -- in the first two sweeps (2026-11-30)
"direct" lost everywhere by ~30 % and "tf32" by ~10 %; "fold" (not exact: the weight rounded once to bf16)
is measured on request."""


FP8_GRID = {"block_n": (32, 64, 128), "num_stages": (2, 3), "num_warps": (1, 2), "scale_blocks": (1, 2), "tma": (0,)}
"""The FP8 sweep's tile rows, pipeline stages, warps and scale blocks a K step (``--fp8-grid``, e.g.
``"scale_blocks=1"``; routes: :data:`FP8_ROUTES_SWEPT`). Two scale blocks a step in 2 stages keep the bytes in
flight of one block in 4, with half the waits: on an H100 the best cell of each big shape at the table's own
splits (bench/results/2026-12-06-h100-fp8-waves.md). ``tma=0,1``: weight tiles also through a tensor descriptor
(``LinearConfig.tma``, the same bits)."""


def fp8_candidates(K, N):
    """FP8 weights: BLOCK_K divides the 128-column scale block; splits on block boundaries; swapped
    operands (every bf16 sweep winner was); routes :data:`FP8_ROUTES_SWEPT`. Warps 1-2: the third
    sweep's top configs all had 2 warps (of 2-8), 16-row tiles lost by ~2x; route "x2": 4-8 warps, 64-128
    weight rows (a wgmma's M side is 64 rows a warpgroup)."""
    bk_scale = FP8_BLOCK[1]
    out = []
    for bn in FP8_GRID["block_n"]:
        for bk in (64, 128):
            for split in (1, 2, 4, 8, 16):
                if split > 1 and (K % (split * bk_scale) or K // split < 4 * bk_scale):
                    continue
                ctas = cdiv(N, bn) * split
                if ctas < 64 or (split > 1 and ctas > 4800):
                    continue
                for stages in FP8_GRID["num_stages"]:
                    if stages * (bn * bk + 16 * bk * 4) > 200 * 1024:
                        continue
                    for route in FP8_ROUTES_SWEPT:
                        # "x2" wants Hopper's wgmma: a warpgroup (4 warps) per 64 weight rows
                        for warps in ((4, 8)[:bn // 64] if route == "x2" else FP8_GRID["num_warps"]):
                            for sb in FP8_GRID["scale_blocks"]:
                                if sb > 1 and (K // split) % (sb * bk_scale):
                                    continue   # whole steps a split: the same splits as one block a step
                                out += [LinearConfig(block_n=bn, block_k=bk, split=split, num_warps=warps,
                                                     num_stages=stages, swap=True, fp8_route=route,
                                                     scale_blocks=sb, tma=bool(tma)) for tma in FP8_GRID["tma"]]
    return out


def cfg_str(c):
    return (f"BN{c.block_n}/BK{c.block_k}/S{c.split}/w{c.num_warps}/st{c.num_stages}/{'swap' if c.swap else 'xw'}"
            + (f"/m{c.m_sub}" if c.m_sub != 1 else "") + (f"/ev{c.evict}" if c.evict != 1 else "")
            + (f"/{c.fp8_route}" if c.fp8_route != "direct" else "")
            + (f"/sb{c.scale_blocks}" if c.scale_blocks != 1 else "") + ("/tma" if c.tma else ""))


# Variants of each shape's table config timed beside it (--variants). Run 2 (2026-11-29) tried
# m_sub 2 / 4 when every launch took all its sub-tiles: m_sub=2 lifted B=64 by ~20% but cost 5-45% at
# B <= 16. A launch now takes only the sub-tiles its rows fill (linear.launch_m_sub), so m_sub is
# timed again. The weight loads' cache hint (evict 0 / 2) and the fused split-K sum were timed on
# 2026-12-01 (bench/results/2026-12-01-h200-fp8-options.md): no gain / 5-25 % slower.
VARIANTS = {"ds4t-m2": dict(m_sub=2), "ds4t-m4": dict(m_sub=4), "ds4t-fused": dict(fused_sum=True),
            "ds4t-sb2": dict(scale_blocks=2), "ds4t-sb2st2": dict(scale_blocks=2, num_stages=2),
            "ds4t-tma": dict(tma=True)}


def _inv_word(inv) -> str:
    """The summary's word for a row-invariance check: None means not checked (the x-bf16 rows)."""
    return "inv-unchecked" if inv is None else ("inv" if inv else "NOT-inv")


def table_config(K, N, fp8=False):
    """The config ds4t picks: bf16 weights with fp32 x, or FP8 weights with bf16 activations."""
    if fp8:
        return linear_config(K, N, torch.float8_e4m3fn, torch.bfloat16, FP8_BLOCK[1])
    return linear_config(K, N, torch.bfloat16, torch.float32)


def table_key(K, N, fp8=False):
    """The linear table's key of a shape, JSON-ready (ds4t.kernels.config.overridden's format)."""
    if fp8:
        return [K, N, "torch.float8_e4m3fn", FP8_BLOCK[1], "torch.bfloat16"]
    return [K, N, "torch.bfloat16"]


def write_best_configs(path, best_cfgs, fp8=False):
    """The sweep's winners as ``{"linear": [{"key": ..., "fields": ...}]}``: what ``--configs`` of the
    decode benchmarks reads, so a model-level A/B of the winners runs in the same device call."""
    import dataclasses
    import json
    entries = [{"key": table_key(K, N, fp8), "fields": dataclasses.asdict(c)} for (K, N), c in best_cfgs.items()]
    with open(path, "w") as f:
        json.dump({"linear": entries}, f, indent=1)
    return path


def variant_cfgs(K, N, fp8=False):
    import dataclasses
    base = table_config(K, N, fp8)
    return [(name, dataclasses.replace(base, **kw)) for name, kw in VARIANTS.items()
            if (base.split > 1 or "fused_sum" not in kw) and (fp8 or ("scale_blocks" not in kw and "tma" not in kw))]


def _compile_worker(jobs):
    """Compile (and run once on garbage) configs in a separate process: fills Triton's cache."""
    import torch as _t

    import ds4t as _d  # noqa: F401
    from ds4t.kernels.linear import LinearConfig as _C
    from ds4t.kernels.linear import linear as _lin
    from ds4t.kernels.weights import quantize as _q
    errs = []
    for K, N, fields, fp8 in jobs:
        try:
            if fp8:
                w, adt = _q(_t.randn((N, K), device="cuda"), FP8_BLOCK), _t.bfloat16
            else:
                w, adt = _t.empty((N, K), dtype=_t.bfloat16, device="cuda"), None
            for B in (1, 16):
                _lin(_t.randn(B, K, device="cuda"), w, config=_C(**fields), act_dtype=adt)
            _t.cuda.synchronize()
            errs.append(None)
        except Exception as e:
            errs.append(f"{type(e).__name__}: {str(e)[:160]}")
    return errs


def precompile(jobs, workers, fp8=False):
    import concurrent.futures as cf
    import dataclasses
    import multiprocessing as mp
    t0 = time.time()
    chunks = [[] for _ in range(workers)]
    for i, (K, N, c) in enumerate(jobs):
        chunks[i % workers].append((K, N, dataclasses.asdict(c), fp8))
    errors = {}
    try:
        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
            for chunk, errs in zip(chunks, ex.map(_compile_worker, chunks)):
                for (K, N, f, _), e in zip(chunk, errs):
                    if e:
                        errors[(K, N, LinearConfig(**f))] = e
    except Exception as e:
        log(f"  precompile failed ({e!r}); compiling in the main process instead")
    log(f"  precompiled {len(jobs)} configs in {time.time() - t0:.0f}s with {workers} processes, "
        f"{len(errors)} failed")
    return errors


def check_rows(B):
    return sorted({0, min(17, B - 1), min(40, B - 1), B // 2, B - 1})


def rows_invariant(run, x, rows):
    full = run(x)
    return all(torch.equal(run(x[i:i + 1].contiguous())[0], full[i]) for i in rows)


class LinearCase:
    """Rotating copies of one weight shape: bf16, or (``fp8``) block-scaled FP8 run with bf16
    activations (bytes = fp8 values + fp32 scales; torch's row: cuBLAS on the dequantized bf16)."""
    def __init__(self, K, N, gen, fp8=False):
        self.K, self.N, self.fp8 = K, N, fp8
        self.adt = torch.bfloat16 if fp8 else None
        if fp8:
            from ds4t.kernels.weights import quantize
            self.wbytes = N * K + N * cdiv(K, FP8_BLOCK[1]) * 4
            self.n_rot = max(2, math.ceil(ROTATE_BYTES / self.wbytes))
            self.ws = [quantize(torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5, FP8_BLOCK)
                       for _ in range(self.n_rot)]
            self.tws = [w.dequantize(torch.bfloat16) for w in self.ws[:max(2, math.ceil(ROTATE_BYTES / (2 * N * K)))]]
        else:
            self.wbytes = N * K * 2
            self.n_rot = max(2, math.ceil(ROTATE_BYTES / self.wbytes))
            self.ws = [(torch.randn(N, K, device="cuda", generator=gen) * K ** -0.5).bfloat16()
                       for _ in range(self.n_rot)]
            self.tws = self.ws
        self.twbytes = N * K * 2
        self.pool = torch.randn(64, K, device="cuda", generator=gen)
        self.perm = torch.randperm(64, generator=torch.Generator().manual_seed(K + N)).tolist()
        self._refs = {}

    def x(self, B):
        return self.pool[self.perm[:B]].contiguous()

    def ds4t_fns(self, B, cfg, x_dtype=torch.float32):
        x = self.x(B).to(x_dtype)
        out = torch.empty(B, self.N, device="cuda")
        return [lambda w=w: linear(x, w, out=out, config=cfg, act_dtype=self.adt) for w in self.ws]

    def run(self, t, cfg):
        return linear(t, self.ws[0], config=cfg, act_dtype=self.adt)

    def torch_fns(self, B):
        x = self.x(B).bfloat16()
        return [lambda w=w: torch.nn.functional.linear(x, w) for w in self.tws]

    def check(self, cfg, B=16):
        x = self.x(B)
        y = self.run(x, cfg)
        if B not in self._refs:
            self._refs[B] = linear_ref(x, self.ws[0], act_dtype=self.adt)
        ref = self._refs[B]
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        inv = rows_invariant(lambda t: self.run(t, cfg), x, [0, B // 2, B - 1])
        return err, inv


def sweep_shape(case, errors, x_dtype=torch.float32, budget_s=None):
    """Every candidate config of one shape, timed at B = 1 and at B = 16 with x stored in ``x_dtype``
    (``--sweep-x``: a model whose producer writes bf16 hands its linears bf16 x); the best is the one whose
    slower row count is fastest, max(ms at B = 1, ms at B = 16): the target holds for every B <= 16 and a
    config never depends on B. (Until 2026-12-05 only the four fastest at B = 1 were timed at B = 16, so a
    tile that wins at 16 rows by reading the activations fewer times could not be chosen.) ``budget_s``
    (``--sweep-budget``): candidates left when this many seconds have gone are reported as skipped, so the
    next shape still gets its turn within one device call."""
    K, N = case.K, case.N
    res = []
    t0 = time.time()
    for c in candidates(K, N, case.fp8):
        if budget_s is not None and time.time() - t0 > budget_s:
            res.append(dict(K=K, N=N, config=cfg_str(c), status="skipped: sweep budget"))
            continue
        if (K, N, c) in errors:
            res.append(dict(K=K, N=N, config=cfg_str(c), status="compile: " + errors[(K, N, c)][:80]))
            continue
        try:
            err, inv = case.check(c)
            ms1, _ = time_calls(case.ds4t_fns(1, c, x_dtype))
            ms16, _ = time_calls(case.ds4t_fns(16, c, x_dtype))
            res.append(dict(K=K, N=N, config=cfg_str(c), cfg=c, err=err, inv=inv, ms_b1=ms1,
                            tbs_b1=case.wbytes / (ms1 * 1e-3) / 1e12, ms_b16=ms16,
                            tbs_b16=case.wbytes / (ms16 * 1e-3) / 1e12,
                            status="ok" if err < 1e-3 and inv else "BAD"))
        except Exception as e:
            torch.cuda.synchronize()
            res.append(dict(K=K, N=N, config=cfg_str(c), status=f"error: {type(e).__name__}: {str(e)[:80]}"))
    good = [r for r in res if r["status"] == "ok"]
    best = min(good, key=_worse_ms)["cfg"] if good else None
    return res, best


def _worse_ms(r) -> float:
    """A swept config's slower time of B = 1 and B = 16 (what the sweep minimises)."""
    return max(r["ms_b1"], r["ms_b16"])


def bench_linear(case, cfgs, copy_bw):
    rows = []
    for B in BATCHES:
        xb = case.x(B)
        for name, cfg in cfgs:
            ms, how = time_calls(case.ds4t_fns(B, cfg))
            nbytes = case.wbytes + B * case.K * 4 + B * case.N * 4
            inv = rows_invariant(lambda t: case.run(t, cfg), xb, check_rows(B))
            rows.append(dict(K=case.K, N=case.N, B=B, impl=name, config=cfg_str(cfg), ms=ms, timing=how,
                             bytes=nbytes, gbs=nbytes / (ms * 1e-3) / 1e9, frac=nbytes / (ms * 1e-3) / copy_bw,
                             invariant=inv))
            if case.fp8:
                # The same config fed activations already rounded to bf16 (same bits: the kernel's
                # rounding is then a no-op): what a producer that writes bf16 would buy.
                ms, how = time_calls(case.ds4t_fns(B, cfg, torch.bfloat16))
                nbytes = case.wbytes + B * case.K * 2 + B * case.N * 4
                rows.append(dict(K=case.K, N=case.N, B=B, impl=name + " x-bf16", config=cfg_str(cfg), ms=ms,
                                 timing=how, bytes=nbytes, gbs=nbytes / (ms * 1e-3) / 1e9,
                                 frac=nbytes / (ms * 1e-3) / copy_bw, invariant=None))
        ms, how = time_calls(case.torch_fns(B))
        nbytes = case.twbytes + B * case.K * 2 + B * case.N * 2
        xt = xb.bfloat16()
        inv = rows_invariant(lambda t: torch.nn.functional.linear(t, case.tws[0]), xt, check_rows(B))
        rows.append(dict(K=case.K, N=case.N, B=B, impl="torch", config="cuBLAS bf16" + (" (dequantized)" if case.fp8 else ""), ms=ms, timing=how,
                         bytes=nbytes, gbs=nbytes / (ms * 1e-3) / 1e9, frac=nbytes / (ms * 1e-3) / copy_bw,
                         invariant=inv))
    return rows


def negative_control(case):
    """The bench's invariance check must flag a launcher whose split-K count follows B."""
    a = LinearConfig(block_n=64, block_k=256, split=4, num_stages=4, swap=True)
    b = LinearConfig(block_n=64, block_k=256, split=8, num_stages=4, swap=True)
    bad = lambda t: linear(t, case.ws[0], config=a if t.shape[0] == 1 else b)  # noqa: E731
    return not rows_invariant(bad, case.x(16), [0, 8, 15])


# ------------------------------------------------------------------------------------- attention
def bench_attention(copy_bw):
    try:
        from ds4t.kernels.attention import decode_attention
    except Exception as e:
        return None, f"ds4t.kernels.attention.decode_attention unavailable: {e!r}"
    import torch.nn.functional as F
    rows = []
    gen = torch.Generator(device="cuda").manual_seed(7)
    for hq, hkv, d in [(16, 2, 256), (64, 8, 128)]:
        for L in [1024, 8192, 32768]:
            for B in [1, 8, 32]:
                try:
                    kv_bytes = B * L * hkv * d * 2 * 2
                    n_rot = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
                    S = B * n_rot
                    kc = torch.randn(S, L, hkv, d, device="cuda", generator=gen).bfloat16()
                    vc = torch.randn(S, L, hkv, d, device="cuda", generator=gen).bfloat16()
                    q = torch.randn(B, hq, d, device="cuda", generator=gen)
                    scale = d ** -0.5
                    lengths = torch.full((B,), L, dtype=torch.int32, device="cuda")
                    perm = torch.randperm(B, generator=torch.Generator().manual_seed(B)).cuda()
                    slot_sets = [(r * B + perm).to(torch.int32) for r in range(n_rot)]
                    out = torch.empty(B, hq, d, device="cuda")
                    fns = [lambda s=s: decode_attention(q, kc, vc, s, lengths, scale, out=out) for s in slot_sets]
                    ms, how = time_calls(fns)
                    y = decode_attention(q, kc, vc, slot_sets[0], lengths, scale)
                    idx = sorted({0, B // 2, B - 1})
                    inv = all(torch.equal(decode_attention(q[i:i + 1], kc, vc, slot_sets[0][i:i + 1],
                                                           lengths[i:i + 1], scale)[0], y[i]) for i in idx)
                    rows.append(dict(hq=hq, hkv=hkv, d=d, L=L, B=B, impl="ds4t", ms=ms, timing=how, bytes=kv_bytes,
                                     gbs=kv_bytes / (ms * 1e-3) / 1e9, frac=kv_bytes / (ms * 1e-3) / copy_bw,
                                     invariant=inv, max_diff_vs_sdpa=float("nan")))
                    # torch SDPA on the same data, gathered per rotation outside the timed region.
                    qt = q.bfloat16().unsqueeze(2)
                    ks = [kc[s.long()].transpose(1, 2).contiguous() for s in slot_sets]
                    vs = [vc[s.long()].transpose(1, 2).contiguous() for s in slot_sets]
                    del kc, vc
                    sd = lambda k, v, qq=qt: F.scaled_dot_product_attention(qq, k, v, scale=scale, enable_gqa=True)  # noqa: E731
                    ms_t, how_t = time_calls([lambda k=k, v=v: sd(k, v) for k, v in zip(ks, vs)])
                    yt = sd(ks[0], vs[0])
                    inv_t = all(torch.equal(sd(ks[0][i:i + 1], vs[0][i:i + 1], qt[i:i + 1])[0], yt[i]) for i in idx)
                    diff = (y - yt.squeeze(2).float()).abs().max().item()
                    rows[-1]["max_diff_vs_sdpa"] = diff
                    rows.append(dict(hq=hq, hkv=hkv, d=d, L=L, B=B, impl="torch-sdpa", ms=ms_t, timing=how_t,
                                     bytes=kv_bytes, gbs=kv_bytes / (ms_t * 1e-3) / 1e9,
                                     frac=kv_bytes / (ms_t * 1e-3) / copy_bw, invariant=inv_t,
                                     max_diff_vs_sdpa=0.0))
                    del ks, vs
                except Exception as e:
                    log(f"  attention hq={hq} hkv={hkv} d={d} L={L} B={B}: {type(e).__name__}: {str(e)[:200]}")
                    rows.append(dict(hq=hq, hkv=hkv, d=d, L=L, B=B, impl="ds4t", ms=float("nan"), timing="error",
                                     bytes=0, gbs=float("nan"), frac=float("nan"), invariant=None,
                                     max_diff_vs_sdpa=float("nan")))
                finally:
                    torch.cuda.empty_cache()
                log(f"  attn hq{hq}/kv{hkv}/d{d} L={L} B={B}: " + "  ".join(
                    f"{r['impl']} {r['ms']:.4f} ms {r['gbs'] / 1e3:.2f} TB/s inv={r['invariant']}"
                    for r in rows if (r['hq'], r['L'], r['B']) == (hq, L, B)))
    return rows, None


# ------------------------------------------------------------------------------------- output
def write_csv(path, rows, keys=None):
    if not rows:
        return
    keys = keys or [k for k in rows[0] if k != "cfg"]
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})


def md_table(headers, rows):
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="sweep linear configs (slow: compiles ~200)")
    ap.add_argument("--variants", action="store_true", help="also time m_sub variants of the table configs")
    ap.add_argument("--fp8", action="store_true",
                    help="FP8 weights (128x128 blocks, bf16 activations) at FP8_SHAPES instead of bf16 at LINEAR_SHAPES")
    ap.add_argument("--shapes", default=None, help="comma-separated KxN to run instead of the default shapes")
    ap.add_argument("--fp8-routes", default="f32", help="--fp8 --sweep: fp8 routes to try (ds4t.backend.FP8_ROUTES)")
    ap.add_argument("--fp8-grid", default=None,
                    help="--fp8 --sweep: replace grid axes, e.g. 'block_n=32;num_stages=3,4,6,8;num_warps=2' "
                         f"(default {FP8_GRID})")
    ap.add_argument("--sweep-x", default="float32", choices=["float32", "bfloat16"],
                    help="--sweep: the dtype x is stored in while configs are timed")
    ap.add_argument("--sweep-budget", type=float, default=None,
                    help="seconds of timing per shape in --sweep; the candidates left are reported as skipped")
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--no-attention", action="store_true")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--pytest-timeout", type=int, default=400)
    ap.add_argument("--budget", type=float, default=230.0,
                    help="seconds; attention is skipped when the run has used this much before it")
    args = ap.parse_args()
    assert not INTERPRET and torch.cuda.is_available(), "needs a CUDA GPU"
    os.makedirs(OUT, exist_ok=True)
    import triton
    t_start = time.time()
    md = ["# ds4t kernel benchmark\n",
          f"- device: {torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).multi_processor_count} SMs)",
          f"- torch {torch.__version__}, triton {triton.__version__}, python {sys.version.split()[0]}",
          f"- command: {' '.join(sys.argv)}"]
    log("\n".join(md))

    proc = None if args.no_pytest else start_pytest()
    gen = torch.Generator(device="cuda").manual_seed(0)

    errors = {}
    fp8 = args.fp8
    FP8_ROUTES_SWEPT[:] = args.fp8_routes.split(",")
    for axis in filter(None, (args.fp8_grid or "").split(";")):
        name, values = axis.split("=")
        if name not in FP8_GRID:
            raise SystemExit(f"--fp8-grid: no axis {name!r} (axes: {sorted(FP8_GRID)})")
        FP8_GRID[name] = tuple(int(v) for v in values.split(","))
    shapes = FP8_SHAPES if fp8 else LINEAR_SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in kn.split("x")) for kn in args.shapes.split(",")]
    jobs = [(K, N, table_config(K, N, fp8)) for K, N in shapes]
    if args.variants:
        jobs += [(K, N, c) for K, N in shapes for _, c in variant_cfgs(K, N, fp8)]
    if args.sweep:
        jobs += [(K, N, c) for K, N in shapes for c in candidates(K, N, fp8)]
    jobs = list(dict.fromkeys(jobs))
    log(f"compiling {len(jobs)} linear configs in parallel")
    errors = precompile(jobs, min(args.workers, len(jobs)), fp8)

    if proc is not None:
        ok, tail = finish_pytest(proc, args.pytest_timeout)
        log(f"pytest {'PASSED' if ok else 'FAILED'}:\n{tail[-1500:]}")
        md += ["\n## Correctness\n", f"pytest ({', '.join(TEST_FILES)}): **{'passed' if ok else 'FAILED'}**",
               "```", tail.strip()[-1200:], "```"]
    checks = self_checks()
    log(md_table(["kernel", "shapes", "max err", "tol", "invariant", "ms", "status"], checks))
    md += ["\n### Self-checks (ds4t check)\n",
           md_table(["kernel", "shapes", "max err", "tol", "batch-invariant", "ms", "status"], checks)]

    bw, copy_ms = copy_bandwidth()
    log(f"device-to-device copy: {bw / 1e12:.3f} TB/s (1 GiB in {copy_ms:.3f} ms, read + write bytes)")
    md += [f"\n## Copy bandwidth\n\n{bw / 1e12:.3f} TB/s (1 GiB fp32 `copy_`, read + write bytes, median of 20)"]

    sweep_rows, lin_rows, best_cfgs, neg = [], [], {}, None
    for K, N in shapes:
        t0 = time.time()
        case = LinearCase(K, N, gen, fp8)
        table_cfg = table_config(K, N, fp8)
        cfgs = [("ds4t", table_cfg)]
        if args.variants:
            cfgs += [(n, c) for n, c in variant_cfgs(K, N, fp8) if (K, N, c) not in errors]
        if args.sweep:
            res, best = sweep_shape(case, errors, getattr(torch, args.sweep_x), budget_s=args.sweep_budget)
            sweep_rows += res
            if best is not None:
                best_cfgs[(K, N)] = best
                if best != table_cfg:
                    cfgs.append(("ds4t-best", best))
            ok = sorted([r for r in res if r["status"] == "ok"], key=_worse_ms)
            log(f"sweep {K}x{N}: {len(ok)}/{len(res)} ok; top (by the slower of B = 1, 16): " + "; ".join(
                f"{r['config']} B1 {r['tbs_b1']:.2f} | B16 {r['tbs_b16']:.2f} TB/s" for r in ok[:5]))
            skipped = sum(r["status"].startswith("skipped") for r in res)
            if skipped:
                log(f"   {skipped} configs not timed: --sweep-budget {args.sweep_budget:.0f} s reached")
            bad = [r for r in res if r["status"] != "ok" and not r["status"].startswith("skipped")]
            for r in bad[:6]:
                log(f"   not ok: {r['config']}: {r['status']} err={r.get('err')} inv={r.get('inv')}")
        rows = bench_linear(case, cfgs, bw)
        lin_rows += rows
        if (K, N) == (14336, 4096) and not fp8:
            neg = negative_control(case)
            log(f"negative control (split-K from B) caught by the invariance check: {neg}")
        for r in rows:
            if r["B"] in (1, 16, 64):
                log(f"  {K}x{N} B={r['B']:3d} {r['impl']:10s} {r['ms']:.4f} ms {r['gbs'] / 1e3:.3f} TB/s "
                    f"{100 * r['frac']:5.1f}% inv={r['invariant']} [{r['config']}]")
        log(f"  ({time.time() - t0:.0f}s)")
        del case
        torch.cuda.empty_cache()
        write_csv(os.path.join(OUT, "linear.csv"), lin_rows)  # after every shape: survives a timeout
        if sweep_rows:
            keys = ["K", "N", "config", "status", "err", "inv", "ms_b1", "tbs_b1", "ms_b16", "tbs_b16"]
            write_csv(os.path.join(OUT, "sweep.csv"), sweep_rows, keys)

    md += ["\n## Linear (FP8 128x128-block weight, fp32 x rounded to bf16 in the kernel for ds4t; cuBLAS on the "
           "dequantized bf16 weight with bf16 x for torch)\n" if fp8 else
           "\n## Linear (bf16 weight, fp32 x for ds4t / bf16 x for torch)\n",
           "bytes = weight (FP8: fp8 values + fp32 scales) + x + y; % = of the copy bandwidth above; inv = row alone == row in batch "
           "(torch.equal, rows 0, 17, 40, B/2, B-1 (those < B) of a random row order).\n"]
    md.append(md_table(["K x N", "B", "impl", "config", "ms", "TB/s", "% copy", "inv"],
                       [[f"{r['K']}x{r['N']}", r["B"], r["impl"], r["config"], f"{r['ms']:.4f}",
                         f"{r['gbs'] / 1e3:.3f}", f"{100 * r['frac']:.1f}", r["invariant"]] for r in lin_rows]))
    if neg is not None:
        md.append(f"\nNegative control (split-K count chosen from B, 14336x4096) flagged as not invariant: **{neg}**")
    if best_cfgs:
        md += ["\n### Sweep best configs (least max(ms at B = 1, ms at B = 16) over every candidate)\n"]
        md += [f"- {K}x{N}: `{best}`" for (K, N), best in best_cfgs.items()]
        path = write_best_configs(os.path.join(OUT, "best_configs.json"), best_cfgs, fp8)
        md.append(f"\nAs table overrides for `bench_decode.py --configs` / `bench_fp8.py --configs`: `{path}`")

    if args.no_attention:
        attn_rows, attn_err = None, "skipped (--no-attention)"
    elif time.time() - t_start > args.budget:
        attn_rows, attn_err = None, f"skipped: {time.time() - t_start:.0f}s used, over --budget {args.budget:.0f}s"
    else:
        attn_rows, attn_err = bench_attention(bw)
    md.append("\n## Decode attention (bf16 KV cache; bytes = K + V read)\n")
    if attn_rows is None:
        log(f"attention: MISSING: {attn_err}")
        md.append(f"**missing**: {attn_err}")
    else:
        write_csv(os.path.join(OUT, "attention.csv"), attn_rows)
        md.append(md_table(["heads q/kv", "d", "L", "B", "impl", "ms", "TB/s", "% copy", "inv", "max|ds4t-sdpa|"],
                           [[f"{r['hq']}/{r['hkv']}", r["d"], r["L"], r["B"], r["impl"], f"{r['ms']:.4f}",
                             f"{r['gbs'] / 1e3:.3f}", f"{100 * r['frac']:.1f}", r["invariant"],
                             f"{r['max_diff_vs_sdpa']:.2e}"] for r in attn_rows]))
    md.append(f"\nTotal script time {time.time() - t_start:.0f}s.")
    with open(os.path.join(OUT, "kernels.md"), "w") as f:
        f.write("\n".join(md) + "\n")

    # Short table last.
    log("\n==== summary (TB/s, % of copy BW, batch-invariant) ====")
    log(f"copy {bw / 1e12:.3f} TB/s")
    for K, N in shapes:
        for B in (1, 16, 64):
            parts = [f"{r['impl']} {r['gbs'] / 1e3:.2f} {100 * r['frac']:.0f}% {_inv_word(r['invariant'])}"
                     for r in lin_rows if (r["K"], r["N"], r["B"]) == (K, N, B)]
            log(f"linear {K:>5}x{N:<6} B={B:<2} " + " | ".join(parts))
    if attn_rows:
        for r in attn_rows:
            if r["B"] >= 8 and r["L"] >= 8192:
                log(f"attn {r['hq']}/{r['hkv']} d{r['d']} L={r['L']:<5} B={r['B']:<2} {r['impl']:10s} "
                    f"{r['gbs'] / 1e3:.2f} TB/s {100 * r['frac']:.0f}% inv={r['invariant']}")
    else:
        log(f"attention: MISSING ({attn_err})")
    if best_cfgs:
        for (K, N), best in best_cfgs.items():
            log(f"best {K}x{N}: {best}")


if __name__ == "__main__":
    try:
        main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
