"""HF transformers as the decode benchmark's peer: the preset's config and exactly its weights
(``ds4t.hf.hf_twin``), one batched decode step of N rows at a context, timed two ways.

* **eager**: the model's forward with its default dynamic cache, as ``model(input_ids, cache)`` runs
  (host-bound at small N: hundreds of small launches; the cache grows by concatenation each step).
* **static**: what ``generate(..., cache_implementation="static")`` runs per token in this
  transformers version: a ``StaticCache`` and the forward compiled by ``model.get_compiled_call``
  with generate's default ``CompileConfig`` (torch.compile, mode "reduce-overhead": CUDA graphs),
  under generate's own decode-time settings (e.g. the MoE experts implementation it switches to,
  ``_optimize_model_for_decode``). A short ``generate`` call on a StaticCache sized to the context
  compiles it; the compiled call's inputs of its last decode step are recorded and that call is
  then timed on its own (so generate's host loop, sampling and stopping checks are not counted,
  as ds4t's timing counts only its step). Whatever transformers does for a family (Qwen3-Next's
  linear-attention layers, graph breaks around fla kernels) is what runs; the label says what ran.

Contexts: the eager cache holds the real ``ctx`` tokens (one row prefilled in chunks, replicated to
N rows with ``reorder_cache``). The static cache is sized ``ctx + STATIC_SPARE`` per row but holds a
short prompt: a static step reads and masks every position of the cache whatever its fill (static
shapes), so its cost is the cost at ``ctx``, without prefilling N x ctx tokens through HF.

Both are pure-torch and device-agnostic except the compile (generate compiles only on an
accelerator), so a CPU smoke run exercises the eager path and the recording (``compile_all_devices``).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import statistics
import time
import traceback
from typing import Callable, Dict, List, Optional

import torch

STATIC_SPARE = 64
"""Static cache positions beyond ctx: the prompt, generate's steps and the timed replays (each
replay advances the cache's write position in transformers >= 5.2x) fit in them."""
PROMPT = 16
"""Tokens of the prompt that starts a static-cache generate."""


def median_ms(fn: Callable[[], object], iters: int, warmup: int, device) -> float:
    """Median wall time of fn in ms: CUDA events on a GPU, perf_counter elsewhere (``device``: a
    torch.device or its name)."""
    for _ in range(warmup):
        fn()
    ts = []
    cuda = torch.device(device).type == "cuda"
    for _ in range(iters):
        if cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            ts.append(s.elapsed_time(e))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def cache_kwarg(hf) -> str:
    """The forward's cache argument: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"


def out_cache(out):
    """The cache an HF forward returned (``.cache`` or ``.past_key_values`` by version)."""
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def cache_bytes(cache) -> int:
    """Bytes of every tensor a cache object holds (its layers' keys/values, conv and recurrent
    states), whatever the transformers version calls them."""
    seen, total = set(), 0

    def walk(obj, depth):
        nonlocal total
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.numel() * obj.element_size()
        elif depth < 4 and isinstance(obj, (list, tuple)):
            for o in obj:
                walk(o, depth + 1)
        elif depth < 4 and isinstance(obj, dict):
            for o in obj.values():
                walk(o, depth + 1)
        elif depth < 4 and hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
            for o in vars(obj).values():
                walk(o, depth + 1)

    walk(cache, 0)
    return total


def free_bytes(device: torch.device) -> Optional[int]:
    """Device memory free for new tensors (free + cached by this process), None off the GPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def _logits_kw(hf) -> dict:
    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(hf.forward).parameters else {}


@torch.no_grad()
def prefill_one_row(hf, tokens: torch.Tensor, chunk: int = 2048):
    """The cache of one row after ``tokens`` [1, T] (eager forward, chunks of ``chunk`` tokens) and
    the last position's logits fp32 [V]."""
    kw, cache, out = cache_kwarg(hf), None, None
    for s in range(0, tokens.shape[1], chunk):
        out = hf(input_ids=tokens[:, s:s + chunk], use_cache=True, **({kw: cache} if cache is not None else {}),
                 **_logits_kw(hf))
        cache = out_cache(out)
    return cache, out.logits[0, -1].float()


@torch.no_grad()
def eager_step(hf, cache1, toks: torch.Tensor, iters: int, warmup: int) -> dict:
    """HF eager decode step of N = len(toks) rows whose caches are copies of the one-row ``cache1``:
    {"ms", "row0": logits fp32 [V] of row 0 in the first step}."""
    n = toks.shape[0]
    cache = copy.deepcopy(cache1)
    cache.reorder_cache(torch.zeros(n, dtype=torch.long, device=toks.device))   # row 0, N times
    kw, lk = cache_kwarg(hf), _logits_kw(hf)
    out = hf(input_ids=toks, use_cache=True, **{kw: cache}, **lk)
    row0 = out.logits[0, -1].float().clone()
    state = {"cache": out_cache(out)}
    del out

    def step():
        state["cache"] = out_cache(hf(input_ids=toks, use_cache=True, **{kw: state["cache"]}, **lk))

    try:
        return {"ms": median_ms(step, iters, warmup, toks.device), "row0": row0}
    finally:
        state.clear()
        del cache


@dataclasses.dataclass
class StaticRun:
    """What one static-cache measurement found."""
    ms: Optional[float] = None
    row0: Optional[torch.Tensor] = None      # row 0's logits of the first compiled step
    compile_s: float = 0.0                   # wall time of the generate call (compilation included)
    compiled: bool = False                   # generate ran its compiled forward
    oom: bool = False                        # ran out of device memory
    label: str = ""                          # what ran / why not
    error: Optional[str] = None


def _set_dynamo_limits() -> None:
    """Room for one compiled graph per (N, cache length) without dynamo falling back to eager."""
    cfg = torch._dynamo.config
    for name, value in (("cache_size_limit", 64), ("recompile_limit", 64), ("accumulated_cache_size_limit", 512),
                        ("accumulated_recompile_limit", 512)):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), value))


class _Recorder:
    """Wraps ``hf.get_compiled_call`` so the compiled forward generate uses is kept, with the
    inputs of its last call (a decode step)."""

    def __init__(self, hf):
        self.hf, self.real = hf, hf.get_compiled_call
        self.compiled = None
        self.args, self.kwargs = (), None
        self.calls = 0

    def __enter__(self):
        def get_compiled_call(compile_config):
            fn = self.real(compile_config)

            def recorded(*args, **kwargs):
                self.compiled, self.args, self.kwargs = fn, args, kwargs
                self.calls += 1
                return fn(*args, **kwargs)

            return recorded

        self.hf.get_compiled_call = get_compiled_call
        return self

    def __exit__(self, *exc):
        del self.hf.get_compiled_call   # back to the class's method


def experts_implementation(hf) -> str:
    """The MoE experts implementation in force (inside generate's decode context when called there)."""
    get = getattr(hf, "get_experts_implementation", None)
    if get is None:
        return "n/a"
    try:
        impl = get()
    except Exception:   # noqa: BLE001  (a model without experts)
        return "n/a"
    vals = sorted({str(v) for v in impl.values()}) if isinstance(impl, dict) else [str(impl)]
    return ",".join(vals)


@torch.no_grad()
@contextlib.contextmanager
def _decode_settings(hf, keep_experts: bool):
    """generate's decode-time settings (its MoE switch grouped_mm -> batched_mm), or, with
    ``keep_experts``, none: the model's own experts implementation stays (the fallback when
    batched_mm's per-pair copies of the expert weights do not fit)."""
    if keep_experts:
        hf._optimize_model_for_decode = contextlib.nullcontext   # generate calls it: switch nothing
        try:
            yield
        finally:
            del hf._optimize_model_for_decode
        return
    ctx = getattr(hf, "_optimize_model_for_decode", None)
    with (ctx() if ctx is not None else contextlib.nullcontext()):
        yield


def static_step(hf, prompts: torch.Tensor, ctx: int, iters: int, warmup: int, steps: int = 4,
                compile_config=None, keep_experts: bool = False) -> StaticRun:
    """HF static-cache compiled decode step for N = len(prompts) rows (prompts [N, PROMPT]) with a
    cache of ``ctx + STATIC_SPARE`` positions per row. See the module docstring; ``keep_experts``:
    see :func:`_decode_settings`."""
    import transformers
    from transformers import StaticCache

    run = StaticRun()
    n = prompts.shape[0]
    _set_dynamo_limits()
    try:
        cache = StaticCache(config=hf.config, max_cache_len=ctx + STATIC_SPARE)
    except Exception as e:  # noqa: BLE001
        run.error = f"StaticCache unsupported for {hf.config.model_type} in transformers {transformers.__version__}: " \
                    f"{type(e).__name__}: {e}"
        return run
    gen_kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, return_dict_in_generate=True,
                  output_logits=True, pad_token_id=0)
    gen_kw[cache_kwarg(hf)] = cache
    if compile_config is not None:
        gen_kw["compile_config"] = compile_config
    t0 = time.time()
    try:
        with _Recorder(hf) as rec, (_decode_settings(hf, True) if keep_experts else contextlib.nullcontext()):
            out = hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), **gen_kw)
        if prompts.device.type == "cuda":
            torch.cuda.synchronize()
    except torch.OutOfMemoryError:
        run.compile_s = time.time() - t0
        run.error, run.oom = "OOM", True
        return run
    except Exception as e:  # noqa: BLE001
        run.compile_s = time.time() - t0
        run.error = f"generate with a StaticCache failed: {type(e).__name__}: {e}"
        run.label = traceback.format_exc()[-1500:]
        return run
    run.compile_s = time.time() - t0
    run.compiled = rec.compiled is not None
    logits = out.logits
    run.row0 = logits[1][0].float().clone() if len(logits) > 1 else None
    del out, logits
    if not run.compiled:
        run.error = "generate did not compile the forward (its auto-compile criteria failed)"
        return run
    try:
        with _decode_settings(hf, keep_experts):
            impl = experts_implementation(hf)
            fn, args, kw = rec.compiled, rec.args, rec.kwargs
            run.ms = median_ms(lambda: fn(*args, **kw), iters, warmup, prompts.device)
    except torch.OutOfMemoryError:
        run.error, run.oom = "OOM", True
        return run
    cfg = compile_config or getattr(hf.generation_config, "compile_config", None)
    mode = getattr(cfg, "mode", "reduce-overhead") if cfg is not None else "reduce-overhead"
    dyn = getattr(cfg, "dynamic", None) if cfg is not None else None
    run.label = (f"StaticCache({ctx + STATIC_SPARE} positions) + get_compiled_call (mode={mode}, dynamic={dyn}); "
                 f"experts: {impl}; cache layers: {_layer_kinds(cache)}")
    del cache, rec
    return run


def _layer_kinds(cache) -> str:
    layers = getattr(cache, "layers", None)
    if not layers:
        return type(cache).__name__
    kinds: Dict[str, int] = {}
    for layer in layers:
        kinds[type(layer).__name__] = kinds.get(type(layer).__name__, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in kinds.items())


def reset_compiled(hf) -> None:
    """Drop compiled graphs and their CUDA-graph memory (between contexts and models)."""
    if hasattr(hf, "_compiled_call"):
        del hf._compiled_call
    torch.compiler.reset()


@dataclasses.dataclass
class HFRow:
    """One (ctx, N) of the HF peer: eager and static step times (None: not run; see the notes)."""
    ctx: int
    n: int
    eager_ms: Optional[float] = None
    static_ms: Optional[float] = None
    eager_note: str = ""
    static_note: str = ""
    eager_row0_equal: Optional[bool] = None
    static_row0_equal: Optional[bool] = None


@dataclasses.dataclass
class StaticBudget:
    """Seconds the static peer may spend (compilation dominates); a run is skipped when one more
    run as long as the last one would not fit in what is left, or would end later than ``reserve``
    seconds before the wall-clock ``deadline`` (time.time() value; None: none). The last run, not
    the longest: once a shape-generic graph is compiled, later sizes reuse it and cost seconds."""
    seconds: float
    deadline: Optional[float] = None
    reserve: float = 0.0
    used: float = 0.0
    last: float = 0.0

    def allows(self) -> bool:
        late = self.deadline is not None and time.time() + self.last + self.reserve > self.deadline
        return self.used + self.last <= self.seconds and not late

    def spend(self, s: float) -> None:
        self.used += s
        self.last = s


@torch.no_grad()
def bench_hf(hf, ctxs: List[int], ns: List[int], static_ns: List[int], iters: int, warmup: int,
             budget: StaticBudget, log, compile_config=None, margin: float = 4e9) -> List[HFRow]:
    """Every (ctx, N): eager (all ns) and static (static_ns, within ``budget``), with memory checks
    (per-row cache bytes measured from the one-row cache) and row-0 invariance checks (row 0's
    logits among N rows against the N=1 run; None without an N=1 run). ``ns`` ascending."""
    dev = next(hf.parameters()).device
    vocab = hf.config.vocab_size
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(vocab, (max(ns), 1), generator=g).to(dev)
    prompts = torch.randint(vocab, (max(ns), PROMPT), generator=g).to(dev)
    rows = []
    for ctx in ctxs:
        t0 = time.time()
        cache1, _ = prefill_one_row(hf, torch.randint(vocab, (1, ctx), generator=g).to(dev))
        per_row = cache_bytes(cache1)
        log(f"HF one-row cache at ctx {ctx}: {per_row / 1e6:.1f} MB (prefilled in {time.time() - t0:.1f} s)")
        eager0 = static0 = None
        for n in ns:
            r = HFRow(ctx, n)
            rows.append(r)
            free = free_bytes(dev)
            need = 2 * n * per_row + margin   # the dynamic cache is re-concatenated each step
            if free is not None and need > free:
                r.eager_note = f"skipped: needs ~{need / 1e9:.0f} GB (2 x N x {per_row / 1e6:.0f} MB cache), " \
                               f"{free / 1e9:.0f} GB free"
            else:
                try:
                    e = eager_step(hf, cache1, toks[:n], iters, warmup)
                    r.eager_ms = e["ms"]
                    eager0 = e["row0"] if n == 1 else eager0
                    r.eager_row0_equal = None if eager0 is None else bool(torch.equal(e["row0"], eager0))
                except torch.OutOfMemoryError:
                    r.eager_note = "OOM"
                _free_memory()
            if n not in static_ns:
                r.static_note = "not asked (--hf-static-ns)"
                continue
            free = free_bytes(dev)
            need = n * per_row * (ctx + STATIC_SPARE) / ctx + margin
            if free is not None and need > free:
                r.static_note = f"skipped: needs ~{need / 1e9:.0f} GB of static cache, {free / 1e9:.0f} GB free"
                continue
            if not budget.allows():
                r.static_note = f"skipped: time budget ({budget.used:.0f} of {budget.seconds:.0f} s used, the last " \
                                f"run took {budget.last:.0f} s; --hf-static-budget / --deadline)"
                continue
            s = static_step(hf, prompts[:n], ctx, iters, warmup, compile_config=compile_config)
            budget.spend(s.compile_s)
            if s.oom:
                reset_compiled(hf)   # free the CUDA-graph pools before anything else runs
                _free_memory()
                if experts_implementation(hf) not in ("n/a", "batched_mm") and budget.allows():
                    # generate's batched_mm copies each (row, expert) pair's weights: keep the
                    # model's own experts implementation instead (the next strongest static peer)
                    s = static_step(hf, prompts[:n], ctx, iters, warmup, compile_config=compile_config,
                                    keep_experts=True)
                    budget.spend(s.compile_s)
                    if s.ms is not None:
                        s.label += " (generate's batched_mm experts ran out of memory; kept the model's own)"
                    elif s.oom:
                        reset_compiled(hf)
            if s.ms is None:
                r.static_note = s.error or "failed"
                log(f"HF static ctx {ctx} N={n}: {r.static_note}")
                if s.label:
                    log(f"```\n{s.label}\n```")
            else:
                r.static_ms = s.ms
                r.static_note = s.label
                static0 = s.row0 if n == 1 else static0
                r.static_row0_equal = None if s.row0 is None or static0 is None else bool(torch.equal(s.row0, static0))
                log(f"HF static ctx {ctx} N={n}: {s.ms:.2f} ms (generate + compile {s.compile_s:.0f} s); {s.label}")
            _free_memory()
        del cache1
        _free_memory()   # compiled graphs stay: a later context may reuse them (dynamic shapes)
    return rows


def _free_memory() -> None:
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
