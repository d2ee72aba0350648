"""Compile every Triton kernel a workload launches for an NVIDIA GPU, on a machine without one.

The Triton interpreter (the CPU path) runs kernels as Python and accepts code the GPU compiler
rejects. This tool closes that gap without a GPU:
  1. record: run the workload in the interpreter with the GPU's launcher paths (the
     interpreter-only fast paths switched off) and note every launch: kernel, argument dtypes,
     constexpr values, warps and stages. The launches are noted, not run (``--execute`` runs them):
     on the GPU's launcher paths no launch depends on a kernel's output -- the host never reads the
     device mid-step (tests/batch/test_no_host_sync.py) -- so the host code makes the same launches
     over unwritten outputs. Measured: the same 365 records in the same order, 1.8 s instead of 73 s;
  2. compile: in a child process with ``TRITON_INTERPRET=0`` (the kernels then take their GPU
     branches, e.g. ``tl.dot``), compile each distinct launch to a cubin for an sm_90 (H100 /
     H200) target with Triton's own compiler and ptxas.
A launch that does not compile is reported with its error, and the exit status is non-zero.
Block sizes are the interpreter's (its launchers pick their own configs), so this proves the
GPU frontend accepts each kernel's code paths, not that the GPU's exact configs compile.

Each launch is compiled with the specializations Triton's launcher would give it on the GPU
(:func:`specialize`): ints equal to 1 become constexprs, ints divisible by 16 and 16-byte aligned
tensors carry ``tt.divisibility = 16``. Without them the compiler cannot prove alignment and emits
byte loads where the GPU's binary has 16-byte ``cp.async`` (an FP8 MoE tile: 256 ``LDG.U8`` a thread
instead of 16 ``LDGSTS.128``), so an offline SASS reading would be of another program.

``--sass NAME``: for each launch of a kernel whose name contains NAME, print its registers, shared
memory and instruction mix, whole and per loop (:func:`sass_report`) -- how many conversions, MMAs and
address computations a K step costs, read without a GPU (the tables of
bench/results/2026-12-01-h200-fp8-options.md) -- and a digest of its SASS (:func:`sass_digest`): a refactor
that keeps every launch's digest changes nothing the GPU runs. To look at a table's GPU config, record under
``ConfigTable.forced`` (the records keep block sizes, warps and stages as launched).

``--triton DIR``: compile with another Triton (the GPU machine's version): each Triton release rejects code
others accept (3.6, the H200's, refuses a loop step or constexpr computed by a ``@triton.jit`` helper, which 3.9
and the interpreter accept), so a change meant for the GPU is checked with its Triton before it goes there.

Usage: python bench/compile_check.py [--presets tiny-qwen,tiny-glm,tiny-deepseek,tiny-llama] [--checks] [--no-fp8]
                                     [--gguf-tables] [--triton /tmp/triton-3.6]
                                     [--sass _moe_down_kernel]
(FP8-weight launches of linear, linear_heads and moe_experts, GGUF-block (Q8_0 / Q4_K / Q6_K) launches of
linear and moe_experts, and the 16-bit linear's prefill row tiles -- folded splits and tensor-descriptor loads
among them -- are recorded unless --no-fp8.)
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

_TL_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "int32": "int32", "int64": "int64",
              "i32": "int32", "i64": "int64", "int8": "int8", "uint8": "uint8"}
_TORCH_PTR = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "int32": "i32", "int64": "i64",
              "int8": "i8", "uint8": "u8", "bool": "i1", "int16": "i16", "float8_e4m3fn": "fp8e4nv"}


# ----------------------------------------------------------------------------------------------
# 1. record (interpreter)
# ----------------------------------------------------------------------------------------------
def _encode(v):
    import torch
    import triton.language as tl

    if isinstance(v, torch.Tensor):
        return {"tensor": str(v.dtype).replace("torch.", ""), "align16": v.data_ptr() % 16 == 0}
    if isinstance(v, tl.dtype):
        return {"tl": str(v)}
    if isinstance(v, tl.constexpr):
        return _encode(v.value)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if type(v).__name__ == "TensorDescriptor":   # triton.tools.tensor_descriptor: a TMA load's operand
        return {"tensordesc": str(v.base.dtype).replace("torch.", ""), "block": [int(b) for b in v.block_shape]}
    raise TypeError(f"cannot record a launch argument of type {type(v).__name__}")


def record_fp8() -> None:
    """Launches with FP8 weights (W8A16), which the presets do not load: linear (with the
    interpreter's config, the GPU's FP8 heuristic, split-K and 2 / 4 row sub-tiles), linear_heads
    and moe_experts (the interpreter's tiles and the GPU's FP8 ``MOE_CONFIGS`` entries), each with
    fp32 and bf16 activations. Call inside the GPU-variant selection of :func:`record`."""
    import torch

    from ds4t.kernels import linear as L
    from ds4t.kernels import moe as M
    from ds4t.kernels.weights import quantize

    g = torch.Generator().manual_seed(0)
    for adt in (torch.float32, torch.bfloat16):
        for K, N in ((300, 200), (8192, 64)):
            x = torch.randn(3, K, generator=g)
            w = quantize(torch.randn(N, K, generator=g) / K ** 0.5)
            b = torch.randn(N, generator=g)
            routes = ((L.LinearConfig(block_n=32, block_k=128, split=2, swap=True, num_warps=2, fp8_route="f16"),
                       L.LinearConfig(block_n=64, block_k=128, split=2, swap=True, num_warps=4, fp8_route="x2"))
                      if adt == torch.bfloat16 else ())
            # fp8 weight tiles through a descriptor (bf16 x, fp8 rows of 16-byte multiples: where a launch takes it)
            tma = ((dataclasses.replace(L._gpu_fp8_heuristic(K, N, 128), tma=True),
                    L.LinearConfig(block_n=32, block_k=128, split=2, swap=True, num_warps=2, m_sub=2, tma=True))
                   if adt == torch.bfloat16 and K % 16 == 0 else ())
            for cfg in (None, L._gpu_fp8_heuristic(K, N, 128), *tma,
                        L.LinearConfig(block_n=64, block_k=64, split=2, swap=False, m_sub=2),
                        L.LinearConfig(block_n=32, block_k=128, split=3, swap=True, m_sub=4),
                        L.LinearConfig(block_n=32, block_k=128, split=3, swap=True, m_sub=4, fused_sum=True),
                        *routes):
                L.linear(x, w, b, config=cfg, act_dtype=adt)
            L.linear(x, w.dequantize(torch.bfloat16), b,   # a 16-bit weight with the fused split-K sum
                     config=L.LinearConfig(block_n=64, block_k=64, split=2, swap=True, fused_sum=True))
        xh = torch.randn(3, 4, 128, generator=g)
        L.linear_heads(xh, quantize(torch.randn(4, 96, 128, generator=g) / 128 ** 0.5), act_dtype=adt)
        E, I, D = 5, 136, 300
        wg, wu, wd = (quantize(torch.randn(*s, generator=g) / s[-1] ** 0.5) for s in ((E, I, D), (E, I, D), (E, D, I)))
        ids = torch.tensor([[0, 2], [1, 2], [3, 0]], dtype=torch.int32)
        wts = torch.rand(3, 2, generator=g)
        rule = M.MOE_CONFIGS.interp_rule
        gpu_entry = M.MOE_CONFIGS.gpu_entries()
        other = lambda fmt: "rows" in fmt or "few" in fmt   # noqa: E731  (row-tile / few-rows keys: none here)
        split = lambda kernel, *fmt: None if other(fmt) else dataclasses.replace(  # noqa: E731
            gpu_entry(kernel, *fmt), split=2)
        # the GPU table's tiles again at dims divisible by 16, as the real expert shapes are (the compiler
        # then knows the K masks are 16-aligned: the code --sass reports is the GPU's)
        wga, wua, wda = (quantize(torch.randn(*s, generator=g) / s[-1] ** 0.5) for s in ((8, 128, 256),) * 2
                         + ((8, 256, 128),))
        # the GPU table's tiles on the 16-bit-activation routes that convert no weight to bf16
        f16 = lambda kernel, *fmt: None if other(fmt) else dataclasses.replace(  # noqa: E731
            gpu_entry(kernel, *fmt), fp8_route="f16")
        x2 = lambda kernel, *fmt: None if other(fmt) else dataclasses.replace(  # noqa: E731
            gpu_entry(kernel, *fmt), fp8_route="x2", tile_n=64, num_warps=4)
        # the GPU table's tiles with the fp8 weight tiles through tensor descriptors (MoEConfig.tma)
        tma = lambda kernel, *fmt: None if other(fmt) else dataclasses.replace(  # noqa: E731
            gpu_entry(kernel, *fmt), tma=True)
        try:
            for tiles in (rule, gpu_entry, split):   # the interpreter's, the GPU table's, split K
                M.MOE_CONFIGS.interp_rule = tiles
                M.moe_experts(torch.randn(3, D, generator=g), ids, wts, wg, wu, wd, shared_expert=E - 1,
                              act_dtype=adt)
            for tiles in (gpu_entry, *((tma, f16, x2) if adt == torch.bfloat16 else ())):
                M.MOE_CONFIGS.interp_rule = tiles
                M.moe_experts(torch.randn(3, 256, generator=g), ids, wts, wga, wua, wda, act_dtype=adt)
        finally:
            M.MOE_CONFIGS.interp_rule = rule


def record_gguf() -> None:
    """Launches with GGUF block weights (every kernel type), which the presets do not load: linear with the
    GPU rule's config, split-K, pair and fold; moe_experts with the GPU table's tiles (gate/up and down of
    different types; the table has an entry for every expert type, so a GPU never runs the rule's); fp32 and
    bf16 activations. Types beyond Q8_0 / Q4_K / Q6_K take the same config paths (split, pair, tiles) through
    their own block steps, so their linear compiles at the GPU rule's config only, their MoE with bf16
    activations (the suite's compile time; their exact routes and scale planes compile in the linear). The
    interpreter's configs are left out: a GPU never runs them. Call inside the GPU-variant selection."""
    import torch

    from ds4t.kernels import linear as L
    from ds4t.kernels import moe as M
    from ds4t.kernels import qlinear as Q
    from ds4t.kernels import qmoe as QM
    from ds4t.kernels.quant_blocks import K_HEADER, QTYPES, quantize

    g = torch.Generator().manual_seed(0)
    full_types = ("Q8_0", "Q4_K", "Q6_K")   # every config path; the others' linear at the GPU rule's
    for adt in (torch.float32, torch.bfloat16):
        for qt in QTYPES:
            K, N = 512, 80
            x = torch.randn(3, K, generator=g)
            w = quantize(torch.randn(N, K, generator=g) / K ** 0.5, qt)
            b = torch.randn(N, generator=g)
            paths = (Q.QLinearConfig(block_n=32, split=2, group=2),
                     Q.QLinearConfig(block_n=32, split=2, group=2, pair=True),
                     Q.QLinearConfig(block_n=32, split=2, group=2, fold=True))   # fold: bf16 only
            for cfg in (Q._gpu_rule(K, N, qt, adt), *(paths if qt in full_types else ())):
                L.linear(x, w, b, config=cfg, act_dtype=adt)
                if qt in K_HEADER:   # rows with a scale plane (read on the fold route only)
                    L.linear(x, w.with_scale_plane(), b, config=cfg, act_dtype=adt)
        E, I, D = 4, 256, 256
        for qg, qd in (("Q4_K", "Q6_K"), ("Q8_0", "Q8_0"), ("Q5_K", "Q5_K"), ("Q4_1", "Q4_0")):
            full = qg in full_types
            if not full and adt != torch.bfloat16:   # their exact routes: the linear's launches above
                continue
            wg, wu = (quantize(torch.randn(E, I, D, generator=g) / D ** 0.5, qg) for _ in range(2))
            wd = quantize(torch.randn(E, D, I, generator=g) / I ** 0.5, qd)
            ids = torch.tensor([[0, 2], [1, 2], [3, 0]], dtype=torch.int32)
            wts = torch.rand(3, 2, generator=g)
            # the GPU table's entries (every expert type has one; the rule is for types without), with a shared
            # expert and without (the same specialization: a Triton cache hit)
            with QM.QMOE_CONFIGS.forced(QM.QMOE_CONFIGS.gpu_entries()):
                M.moe_experts(torch.randn(3, D, generator=g), ids, wts, wg, wu, wd, shared_expert=E - 1, act_dtype=adt)
                if qg in K_HEADER and full:   # gate / up rows with a scale plane
                    M.moe_experts(torch.randn(3, D, generator=g), ids, wts, wg.with_scale_plane(),
                                  wu.with_scale_plane(), wd, shared_expert=E - 1, act_dtype=adt)
                if full:
                    M.moe_experts(torch.randn(3, D, generator=g), ids, wts, wg, wu, wd, act_dtype=adt)


def record_gguf_tables() -> None:
    """The GGUF decode linear's measured GPU table entries (``qlinear._GPU_TABLE``) at their own K, one N
    tile (or pair) of 16 rows: their loops are the H200's, for ``--sass _qlinear`` (instructions a weight);
    Q4_K also with its scale plane, Q5_K at the rule's config for the Q4_K entries' shapes and Q4_0 / Q4_1 at the
    Q8_0 entries' (what the rule gives each), and the grouped MoE's Q4_K and Q5_K kernels at real expert dims (``--sass _qmoe``).
    Call inside the GPU-variant selection."""
    import torch

    from ds4t.kernels import linear as L
    from ds4t.kernels import qlinear as Q
    from ds4t.kernels.quant_blocks import quantize

    g = torch.Generator().manual_seed(0)
    for (K, N, qt, adt), cfg in Q._GPU_TABLE.items():
        def x():   # in the activation dtype, as the models' norms and swiglu hand it over
            return torch.randn(16, K, generator=g).to(adt)

        w = quantize(torch.randn(cfg.block_n * (2 if cfg.pair else 1), K, generator=g) / K ** 0.5, qt)
        L.linear(x(), w, None, config=cfg, act_dtype=adt)
        if qt == "Q4_K":   # the same entry reading the scale plane (FMT 3), and Q5_K with and without (FMT 4 / 5)
            L.linear(x(), w.with_scale_plane(), None, config=cfg, act_dtype=adt)
            w5 = quantize(torch.randn(w.shape[0], K, generator=g) / K ** 0.5, "Q5_K")
            for plane in (False, True):
                L.linear(x(), w5.with_scale_plane(plane), None, config=Q._gpu_rule(K, N, "Q5_K", adt), act_dtype=adt)
        if qt == "Q8_0":   # Q4_0 and Q4_1 (FMT 6 / 7) at the same config
            for q4 in ("Q4_0", "Q4_1"):
                w4 = quantize(torch.randn(w.shape[0], K, generator=g) / K ** 0.5, q4)
                L.linear(x(), w4, None, config=cfg, act_dtype=adt)
    # the grouped MoE at Qwen3-Next-80B's expert dims (D 2048, I 512; 3 experts stand for 512) with the GPU
    # rule's tiles, bf16 Q4_K experts with and without their scale planes
    from ds4t.kernels import moe as M
    from ds4t.kernels import qmoe as QM

    E, I, D = 3, 512, 2048
    ids, wts = torch.tensor([[0, 1]], dtype=torch.int32), torch.rand(1, 2, generator=g)
    for qt in ("Q4_K", "Q5_K"):
        ws = [quantize(torch.randn(*s, generator=g) / s[-1] ** 0.5, qt) for s in ((E, I, D), (E, I, D), (E, D, I))]
        with QM.QMOE_CONFIGS.forced(QM.QMOE_CONFIGS.gpu_rule):
            for plane in (False, True):
                M.moe_experts(torch.randn(1, D, generator=g), ids, wts, *(w.with_scale_plane(plane) for w in ws),
                              act_dtype=torch.bfloat16)


def record_row_tiles() -> None:
    """The 16-bit linear's prefill row tiles as the GPU launches them (BLOCK_K 64, where the interpreter keeps the
    decode config's): the rule's tile, a folded split-K tile, and tensor-descriptor loads unsplit, split and folded
    -- launches no preset makes in the interpreter, whose row tiles are off."""
    import torch

    from ds4t.kernels import linear as L

    g = torch.Generator().manual_seed(0)
    K, N, B = 512, 1024, 256
    w = torch.randn(N, K, generator=g).to(torch.bfloat16)
    x = torch.randn(B, K, generator=g).to(torch.bfloat16)
    fold = dataclasses.replace(L._ROW_TILES_16BIT[0], block_n=128, num_stages=4, fold_splits=True)
    tma = dataclasses.replace(L._ROW_TILES_16BIT[0], num_stages=4, tma=True)
    saved = L.INTERPRET
    L.INTERPRET = False   # _row_launch: the row tile's own BLOCK_K, as on the GPU
    try:
        for split, tile in ((1, L._ROW_TILES_16BIT[0]), (2, fold), (1, tma), (2, tma),
                            (2, dataclasses.replace(fold, tma=True))):
            cfg = L.LinearConfig(block_n=64, block_k=128, split=split, num_warps=4, num_stages=4, swap=True)
            L._launch(x, w, None, torch.empty(B, N), cfg, None, (tile,))
    finally:
        L.INTERPRET = saved


def record(presets, checks: bool, fp8: bool = True, gguf_tables: bool = False, execute: bool = False,
           extra: tuple = ()) -> list:
    """Distinct launches of a decode step, mixed prefill + decode steps (short runs, and long runs that fold their
    attention splits), (``fp8``) the FP8-weight, GGUF-block and 16-bit row-tile launches of :func:`record_fp8`,
    :func:`record_gguf` and :func:`record_row_tiles`, (``extra``) those of each callable given, and (``checks``)
    every registered kernel self-check, with the GPU's launcher paths. ``execute``: run each kernel (the
    self-checks need it; see the module docstring)."""
    import ds4t

    if not ds4t.backend.INTERPRET:
        raise SystemExit("compile_check records launches in the Triton interpreter: run it where "
                         "TRITON_INTERPRET=1 (a machine without a GPU); on a GPU, run the tests instead")
    import triton.runtime.interpreter as interp

    from ds4t.kernels import registry

    seen, out = set(), []
    original = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        named = dict(zip(self.arg_names, args))
        named.update(kwargs)
        rec = {"module": self.fn.__module__, "name": self.fn.__name__,
               "args": {k: _encode(v) for k, v in named.items()}}
        key = json.dumps(rec, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(rec)
        if execute:
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run
    try:
        with registry.use_variants({o.name: registry.GPU for o in registry.ops_with_variants()}):
            for preset in presets:
                model = ds4t.load(preset)
                a, b, c = (model.new_session(64) for _ in range(3))
                a.prefill([1, 2, 3])
                b.prefill([4, 5])
                ds4t.eval_batch([ds4t.DecodeItem(a, 6), ds4t.DecodeItem(b, 7)], mode="native")
                ds4t.eval_batch([ds4t.DecodeItem(a, 8), ds4t.DecodeItem(c, [1, 2, 3, 4])], mode="native")
                # runs long enough to fold their splits in one program (the interpreter's tables: >= 16 rows)
                # past the shortest split, beside a short run and a decode row: the attention kernels'
                # fused-run paths with a runs table of two runs
                d = model.new_session(256)
                d.prefill(list(range(1, 140)))
                ds4t.eval_batch([ds4t.DecodeItem(a, 9), ds4t.DecodeItem(d, list(range(1, 21))),
                                 ds4t.DecodeItem(c, [5, 6, 7])], mode="native")
            if fp8:   # the kernel-level records no preset launches in the interpreter (too big to execute there)
                record_fp8()
                record_gguf()
                record_row_tiles()
            if gguf_tables:
                record_gguf_tables()
            for fn in extra:
                fn()
            if checks:
                for check in registry.all_checks():
                    check("cpu")
    finally:
        interp.InterpretedFunction.run = original
    return out


# ----------------------------------------------------------------------------------------------
# 2. compile (child process, TRITON_INTERPRET=0)
# ----------------------------------------------------------------------------------------------
_LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def _signature(jit, args: dict):
    import triton.language as tl

    sig, consts = {}, {}
    for p in jit.params:
        name = p.name
        if name in args:
            v = args[name]
        elif p.default is not inspect.Parameter.empty:
            v = p.default
        else:
            raise TypeError(f"{jit.__name__}: launch did not pass {name}")
        if isinstance(v, dict) and "tl" in v:
            v = getattr(tl, _TL_DTYPES[v["tl"]])
        if isinstance(v, dict) and "const" in v:   # an int the launcher specializes to a constexpr
            sig[name] = "constexpr"
            consts[name] = v["const"]
            continue
        if p.is_constexpr or v is None:
            sig[name] = "constexpr"
            consts[name] = v
        elif isinstance(v, dict) and "tensor" in v:
            sig[name] = "*" + _TORCH_PTR[v["tensor"]]
        elif isinstance(v, dict) and "tensordesc" in v:
            sig[name] = f"tensordesc<{_TORCH_PTR[v['tensordesc']]}[{', '.join(map(str, v['block']))}]>"
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{jit.__name__}: cannot type argument {name}={v!r}")
    return sig, consts


_DIV16 = [["tt.divisibility", 16]]


def specialize(jit, args: dict):
    """(signature, constexprs, attrs) of a recorded launch as Triton's launcher specializes it on the GPU:
    an int argument equal to 1 is the constexpr 1, an int divisible by 16 and a tensor whose address is
    16-byte aligned get ``tt.divisibility = 16`` -- unless the kernel lists the parameter in
    ``do_not_specialize`` (``do_not_specialize_on_alignment`` for the divisibility). Records without an
    alignment flag count as aligned (torch's allocations are)."""
    args = dict(args)
    for p in jit.params:
        v = args.get(p.name)
        if (not p.is_constexpr and not p.do_not_specialize and isinstance(v, int) and not isinstance(v, bool)
                and v == 1):
            args[p.name] = {"const": 1}
    sig, consts = _signature(jit, args)
    attrs = {}
    for i, p in enumerate(jit.params):
        v = args.get(p.name)
        if p.is_constexpr or p.do_not_specialize or p.do_not_specialize_on_alignment or sig.get(p.name) == "constexpr":
            continue
        if isinstance(v, dict) and "tensor" in v and v.get("align16", True):
            attrs[(i,)] = _DIV16
        elif isinstance(v, int) and not isinstance(v, bool) and v % 16 == 0:
            attrs[(i,)] = _DIV16
    return sig, consts, attrs


def _cuda_tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


def sass_digest(sass: str) -> tuple:
    """(sha256 prefix, instruction count) of cuobjdump's SASS listing with the addresses and comments left out:
    two builds that issue the same instructions on the same registers in the same order share it. A kernel
    refactor whose launches keep their digests (``--sass KERNEL`` before and after) changes nothing the GPU
    runs -- no timing or bits to re-check on a GPU."""
    import hashlib
    import re

    ins = [m.group(1).strip() for m in (re.match(r"\s+/\*[0-9a-f]{4,6}\*/\s+(.*?);", line)
                                        for line in sass.splitlines()) if m]
    return hashlib.sha256("\n".join(ins).encode()).hexdigest()[:16], len(ins)


def sass_report(cubin: bytes, label: str) -> str:
    """Registers, shared memory and the instruction mix of a cubin, whole and per loop (a backward branch
    and the instructions it jumps back over): the loop with the most instructions first."""
    import re

    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        sass = subprocess.run([_cuda_tool("cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([_cuda_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ins = []   # (address, opcode)
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*)(\S*)\s*(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(2) + m.group(3), m.group(4)))

    def mix(rows, top=12):
        count = {}
        for r in rows:
            count[r[1]] = count.get(r[1], 0) + 1
        return ", ".join(f"{k} {v}" for k, v in sorted(count.items(), key=lambda t: -t[1])[:top])

    def memory(rows):
        return ", ".join(sorted({r[2] for r in rows if r[1] in ("LDG", "LDGSTS", "LDS", "STG", "STS", "LDSM")}))

    usage = " ".join(re.findall(r"(REG:\d+|SHARED:\d+|STACK:\d+)", res)[:3])
    out = [f"{label}: {usage}; {len(ins)} instructions: {mix(ins)}; memory ops: {memory(ins)}; "
           f"SASS digest {sass_digest(sass)[0]}"]
    loops = []
    for addr, op, _, operands in ins:
        t = re.match(r"(0x[0-9a-f]+)", operands.strip())
        if op == "BRA" and t and int(t.group(1), 16) < addr:
            body = [r for r in ins if int(t.group(1), 16) <= r[0] <= addr]
            loops.append((len(body), int(t.group(1), 16), addr, body))
    for n, lo, hi, body in sorted(loops, key=lambda t: -t[0]):
        out.append(f"  loop {lo:#06x}-{hi:#06x}: {n} instructions: {mix(body)}; memory ops: {memory(body)}")
    return "\n".join(out)


def dot_layouts(ttgir: str) -> str:
    """The MMA a TTGIR listing's dots became (wgmma / mma.sync) and the ``kWidth`` of their operand layouts: how many
    consecutive K elements a thread holds. 16-bit operands get 2; operands converted from 8-bit loads get 4 on
    mma.sync (Triton follows the conversion back to the load), which permutes the K order inside each MMA step and
    so changes the sums' bits against any tile with kWidth 2 (docs/kernel-conventions.md)."""
    import re

    kind = "wgmma" if "ttng.warp_group_dot" in ttgir else "mma.sync" if re.search(r"\btt\.dot\b", ttgir) else "no dot"
    ops = sorted(set(re.findall(r"dot_op<\{opIdx = (\d), parent = #[\w]+, kWidth = (\d+)\}>", ttgir)))
    return f"dot layouts: {kind}; " + ", ".join(f"operand {i} kWidth {w}" for i, w in ops)


def compile_all(records: list, arch: int, sass: str = "", layouts: str = "", paths_only: bool = False) -> list:
    """Compile each distinct launch (records the GPU's launcher would specialize alike count once); returns
    [(kernel, ok, seconds, error)]. ``sass`` / ``layouts``: launches of
    kernels whose name contains it report their SASS mix (:func:`sass_report`) / dot layouts (:func:`dot_layouts`)
    in place of the error. ``paths_only``: one compile per code path -- launches that differ only in integer
    constexprs (sizes, tile shapes, split counts) or in the launcher's divisibility specializations count once;
    argument types, flags, dtypes and launch options (warps, stages) still tell paths apart."""
    os.environ["TRITON_INTERPRET"] = "0"
    import torch

    torch.cuda.is_available = lambda: True   # ds4t.backend: take the GPU branches, no device needed
    torch.cuda.get_device_capability = lambda *a: divmod(arch, 10)   # ds4t.backend.PDL follows the target
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    results, seen = [], set()
    for rec in records:
        jit = getattr(importlib.import_module(rec["module"]), rec["name"])
        label = f"{rec['module'].rsplit('.', 1)[-1]}.{rec['name']}"
        t0 = time.time()
        try:
            sig, consts, attrs = specialize(jit, rec["args"])
            opts = {k: rec["args"][k] for k in _LAUNCH_OPTIONS if rec["args"].get(k) is not None}
            # launches that differ only in values the launcher does not specialize on (sizes, strides) compile
            # to one binary: compiled once (a third of the records of a model step)
            if paths_only:
                key = json.dumps([rec["module"], rec["name"], sig, opts,
                                  sorted((str(k), repr(v)) for k, v in consts.items() if type(v) is not int)],
                                 default=repr)
            else:
                key = json.dumps([rec["module"], rec["name"], sig, sorted(attrs.items()), opts,
                                  sorted((str(k), repr(v)) for k, v in consts.items())], default=repr)
            if key in seen:
                continue
            seen.add(key)
            ck = triton.compile(ASTSource(fn=jit, signature=sig, constexprs=consts, attrs=attrs), target=target,
                                options=opts)
            report = ""
            if sass and sass in rec["name"]:
                shown = {k: v for k, v in {**rec["args"], **consts}.items()
                         if k.isupper() and isinstance(v, (int, str)) and not isinstance(v, bool)}
                # the cubin's SHARED is the static part; Triton sizes the dynamic shared memory (pipeline
                # buffers, layout conversions) itself and asks for it at launch
                report = sass_report(ck.asm["cubin"], f"{label} {opts} {shown} dynamic shared "
                                                      f"{ck.metadata.shared} B")
            if layouts and layouts in rec["name"]:
                report = "\n".join(r for r in (report, f"{label}: {dot_layouts(ck.asm['ttgir'])}") if r)
            results.append((label, True, time.time() - t0, report))
        except Exception as e:  # report every failure, keep compiling the rest
            root = e
            while root.__cause__ is not None:   # Triton chains the call sites; the innermost says what failed
                root = root.__cause__
            msg = str(e).strip().splitlines()[-6:]
            if root is not e:
                msg += [type(root).__name__ + ":", *str(root).strip().splitlines()[-8:]]
            results.append((label, False, time.time() - t0, " | ".join(msg)[-1500:]))
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny-qwen,tiny-glm,tiny-deepseek,tiny-llama")
    ap.add_argument("--checks", action="store_true", help="also every registered kernel self-check")
    ap.add_argument("--gguf-tables", action="store_true",
                    help="also the GGUF decode linear's GPU table entries at their own K (for --sass _qlinear)")
    ap.add_argument("--no-fp8", action="store_true", help="skip the kernel-level launches (record_fp8, record_gguf, record_row_tiles)")
    ap.add_argument("--execute", action="store_true",
                    help="run each kernel while recording (the default notes launches without running them)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    ap.add_argument("--sass", default="", help="print the SASS instruction mix of kernels whose name contains this")
    ap.add_argument("--layouts", default="", help="print the dot operand layouts (kWidth) of kernels whose name "
                                                  "contains this")
    ap.add_argument("--triton", default="",
                    help="compile with the Triton package in this folder (e.g. the GPU machine's version, unpacked "
                         "from its wheel: `pip download --no-deps triton==3.6.0`, then unzip); the interpreter "
                         "that records stays this environment's")
    ap.add_argument("--paths-only", action="store_true",
                    help="one compile per code path: launches that differ only in integer constexprs (sizes, tile "
                         "shapes) or divisibility specializations compile once (about half the compiles)")
    ap.add_argument("--compile", dest="records_file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.records_file:   # child: compile and print JSON results
        with open(args.records_file) as f:
            records = json.load(f)
        results = compile_all(records, args.arch, args.sass, args.layouts, args.paths_only)
        import triton

        print(f"triton {triton.__version__}")   # the release that compiled (--triton may put another first)
        print(json.dumps(results))
        return 0
    records = record([p for p in args.presets.split(",") if p], args.checks, fp8=not args.no_fp8,
                     execute=args.execute or args.checks,
                     gguf_tables=args.gguf_tables)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(records, f)
    env = dict(os.environ, TRITON_INTERPRET="0")
    if args.triton:   # ahead of everything on the path: its triton shadows the installed one
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.triton), env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, __file__, "--compile", f.name, "--arch", str(args.arch), "--sass", args.sass,
                           "--layouts", args.layouts] + (["--paths-only"] if args.paths_only else []),
                          capture_output=True, text=True, env=env, cwd=ROOT)
    os.unlink(f.name)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        return 2
    *_, ver_line, last = proc.stdout.strip().splitlines()
    results = json.loads(last)
    bad = [r for r in results if not r[1]]
    for label, ok, secs, err in results:
        if ok and err:   # a --sass report
            print(f"ok   {label:40s} {secs:5.1f} s\n{err}")
        else:
            print(f"{'ok  ' if ok else 'FAIL'} {label:40s} {secs:5.1f} s {err}")
    kernels = len({r[0] for r in results})
    ver = ver_line.removeprefix("triton ")
    print(f"{len(results)} distinct launches ({len(records)} recorded) of {kernels} kernels compiled for "
          f"sm_{args.arch} (Triton {ver}): {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
