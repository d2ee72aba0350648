#!/usr/bin/env python
"""Prefill throughput on the GPU against the measured bf16 tensor-core peak, with the chunk-invariance
check, in one call (issue 17, item 4).

    PYTHONUNBUFFERED=1 python bench/bench_prefill.py [--models ...] [--chunks 1024] [--prompt 4096] [--profile]

Per model (the 4-layer presets by default): one session prefills a random prompt of --prompt tokens in
chunks of each size in --chunks; each chunk is timed with CUDA events after a two-chunk warm-up, and the
median chunk time gives tokens/s. FLOPs per chunk are counted from the model's shapes:

* every 2-D weight once per token (2 * N * K), the LM head for the chunk's last row only (prefill returns
  the last token's logits);
* routed experts: top-k per token (plus a shared expert stored as expert E) * 2 * (gate + up + down);
* attention products at each token's position p: GQA 2 * 2 * p * Hq * head_dim, absorbed MLA
  2 * p * H * (2 * R + Dr).

Gated DeltaNet's recurrence (elementwise, not tensor-core work) and norms are not counted. % of peak is
against a bf16 ``torch.matmul`` of 8192^3 timed in the same run (the tensor-core peak this GPU reaches).
Then ``ds4t.exactness.chunks.run_chunk_check`` on a --check-prompt-token prompt with chunk sizes
1, 17, 64 and the whole prompt (and token by token in a native batch), and its negative control.
``--profile``: per-kernel GPU time of one chunk (torch.profiler); ``--profile-at P``: of the chunk starting at
position P (the P tokens before it prefilled untimed), where a long prompt's attention shows. ``--sessions 1,8``: also N sessions
prefilling at once (each step one chunk of rows split over them; a server's batched prefill).
``--prompt 4096,32768``: each prompt length in turn (the sessions and profile use the first).

The peer, in the same run (``--no-hf`` skips it): HF transformers' forward on the same config and weights
(``ds4t.hf.hf_twin``) prefilling the same prompt in the same chunks with its dynamic cache, each chunk
timed the same way, the whole prompt ``--hf-passes`` times and the fastest pass kept: its work is cuBLAS,
SDPA, its experts implementation and flash-linear-attention's kernels for Qwen3-Next when installed (the
label says), but its experts wait on the host, and the same tree measured half the tok/s on one machine
that it had on another (bench/results/2026-12-04-h200-moe-row-programs.md). A fair peer, though not
batch-invariant. A short table is printed last.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import importlib.util
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402
from bench.bench_decode import copy_bandwidth  # noqa: E402
from bench.report import Report  # noqa: E402
from bench import hf_peer  # noqa: E402
from bench.hf_peer import median_ms  # noqa: E402
from ds4t.exactness.chunks import run_chunk_check  # noqa: E402
from ds4t.cli import key_value  # noqa: E402
from ds4t.exactness.harness import plant  # noqa: E402

log = Report()


def matmul_peak(device) -> float:
    """bf16 tensor-core FLOP/s of a large torch.matmul (median of 10), the peak this GPU reaches."""
    n = 8192 if device.type == "cuda" else 256
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, 10, 3, device)
    return 2 * n ** 3 / (ms * 1e-3)


def weight_flops_per_token(model) -> tuple:
    """(dense FLOPs per token without the LM head, LM head FLOPs per row): 2 * numel of every matrix a
    token passes through (routed experts: top-k of E, a stacked shared expert always)."""
    params = {k: v for k, v in model.parameters().items() if not k.startswith("mtp.")}
    rc = getattr(model, "router_cfg", None)
    E = rc.num_experts if rc else 0
    dense, head = 0.0, 0.0
    for name, t in params.items():
        if name == "embed" or t.dim() < 2 or name.endswith((".scale", ".scales")):
            continue
        if name.startswith("lm_head"):
            head = 2.0 * t.numel()
        elif E and t.dim() == 3 and t.shape[0] in (E, E + 1):
            dense += 2.0 * t.numel() / t.shape[0] * (rc.top_k + (t.shape[0] - E))
        else:
            dense += 2.0 * t.numel()
    if not head:   # tied: the embedding is the head
        head = 2.0 * params["embed"].numel()
    return dense, head


def weight_bytes_per_chunk(model, n: int) -> float:
    """Bytes of weights an n-token chunk must read once: every matrix, routed experts weighted by the
    expected fraction hit by n tokens of top-k uniform routing, E * (1 - (1 - k/E)^n) of E."""
    params = {k: v for k, v in model.parameters().items() if not k.startswith("mtp.") and k != "embed"}
    rc = getattr(model, "router_cfg", None)
    E = rc.num_experts if rc else 0
    hit = 1 - (1 - rc.top_k / E) ** n if E else 1.0
    total = 0.0
    for t in params.values():
        b = float(t.nbytes)
        if E and t.dim() == 3 and t.shape[0] in (E, E + 1):
            b = b / t.shape[0] * (E * hit + (t.shape[0] - E))
        total += b
    return total


def attention_flops(model, p0: int, n: int) -> float:
    """Score and value products of n tokens at positions p0 .. p0 + n - 1 (each attends to p + 1 positions)."""
    c = model.cfg
    positions = n * p0 + n * (n + 1) / 2   # sum of (p + 1)
    total = 0.0
    for name, spec in model.pool.specs.items():
        if not spec.has_ctx or name.startswith(getattr(model, "mtp_state_prefix", None) or "\0"):
            continue
        if name.endswith(".k"):
            total += 4.0 * positions * c.num_heads * c.head_dim
        elif name.endswith(".latent"):
            R, width = c.kv_lora_rank, spec.concrete(1)[-1]
            total += 2.0 * positions * c.num_heads * (R + width)
    return total


def peak_ceiling(flops: float, floor_ms: float, peak: float) -> float:
    """The fraction of the bf16 peak a prefill would run at if it took exactly its roofline time
    ``floor_ms`` (each chunk the larger of its weight bytes over copy bandwidth and its FLOPs over the
    peak): 1.0 when every chunk is compute-bound, less where a chunk's weights take longer to stream than
    its FLOPs to compute (a chunk of 1024 rows through 512 small experts). No kernel can beat it."""
    return flops / (floor_ms * 1e-3) / peak


def bench_sessions(model, name, n, args, peak, bw, dense, head, prompt, device) -> dict:
    """n sessions prefill at once: each step feeds every session chunk // n tokens (the step's rows are
    one chunk, as a server's prefill budget), until each has prompt // n tokens -- the same tokens per
    step as one session's chunks, spread over n recurrences / caches (one launch per layer for all of
    them where a kernel takes segments)."""
    from ds4t.batch.engine import run_segments

    chunk = int(args.chunks.split(",")[0])
    per, each = chunk // n, len(prompt) // n
    if per < 1 or each < per:
        raise SystemExit(f"--sessions {n}: chunk {chunk} and prompt {len(prompt)} must give each session >= 1 token")
    parts = [prompt[i * each:(i + 1) * each] for i in range(n)]
    warm = [model.new_session(each + 8) for _ in range(n)]
    run_segments(model, [(s, p[:per]) for s, p in zip(warm, parts)])   # compile / warm up
    for s in warm:
        s.close()
    sessions = [model.new_session(each + 8) for _ in range(n)]
    times, flops = [], []
    try:
        for p0 in range(0, each, per):
            work = [(s, p[p0:p0 + per]) for s, p in zip(sessions, parts)]
            times.append(median_ms(lambda: run_segments(model, work), 1, 0, device))
            k = len(work[0][1])
            flops.append(n * (dense * k + head + attention_flops(model, p0, k)))
    finally:
        for s in sessions:
            s.close()
    ms = sum(times)
    tokens = n * each
    floor = sum(max(weight_bytes_per_chunk(model, n * per) / bw, f / peak) * 1e3 for f in flops)
    tflops = sum(flops) / (ms * 1e-3)
    log(f"{n} sessions, {per} tokens each a step ({n * per} rows): {tokens} tokens in {ms:.1f} ms = "
        f"{tokens / (ms * 1e-3):,.0f} tok/s; {tflops / 1e12:.1f} TFLOP/s = {100 * tflops / peak:.1f} % of peak; "
        f"roofline {floor:.1f} ms = {100 * floor / ms:.0f} %")
    return dict(model=name, opt=dict(args.opt), chunk=f"{n} x {per}", prompt=tokens, ms=ms, tok_s=tokens / (ms * 1e-3),
                tflops=tflops / 1e12, frac=tflops / peak, first_ms=times[0], last_ms=times[-1], floor_ms=floor,
                ceiling=peak_ceiling(sum(flops), floor, peak))


def chunk_times(prefill_chunk, prompt: list, chunk: int, device) -> tuple:
    """(ms of each ``chunk``-token piece of ``prompt`` in order, each run once under CUDA events; what
    the last call returned). ``prefill_chunk(tokens)`` prefills the next piece into the same session /
    cache and returns the last position's logits."""
    last = {}

    def run(part):
        last["out"] = prefill_chunk(part)

    times = [median_ms(lambda: run(prompt[p0:p0 + chunk]), 1, 0, device) for p0 in range(0, len(prompt), chunk)]
    return times, last["out"]


def hf_prefill_times(hf, prompt: list, chunk: int, device) -> list:
    """HF's forward over ``prompt`` in ``chunk``-token pieces with its dynamic cache (the last
    position's logits only): (ms of each piece, after two warm-up pieces in a cache of their own; the
    prompt's last logits fp32 [V])."""
    kw = hf_peer.cache_kwarg(hf)
    state = {"cache": None}

    @torch.no_grad()
    def step(part):
        ids = torch.tensor([part], device=device)
        cache = state["cache"]
        out = hf(input_ids=ids, use_cache=True, **({kw: cache} if cache is not None else {}),
                 **hf_peer._logits_kw(hf))
        state["cache"] = hf_peer.out_cache(out)
        return out.logits[0, -1]

    for p0 in (0, chunk):   # warm-up in a cache of its own: the first chunk and one after it (another path:
        step(prompt[p0:p0 + chunk])   # a cache to extend; kernels that autotune on first use, e.g. fla's)
    state["cache"] = None
    times, logits = chunk_times(step, prompt, chunk, device)
    state["cache"] = None
    return times, logits.float()


def _hf_peer(name, device):
    """(HF twin of the preset or None, a label saying what ran or why not)."""
    try:
        from ds4t.hf import hf_twin

        hf = hf_twin(name, device=device)
    except Exception as e:  # noqa: BLE001  (an HF version without this family: the row says so)
        return None, f"HF twin failed: {type(e).__name__}: {e}"
    fla = importlib.util.find_spec("fla") is not None
    import transformers

    impl = hf_peer.experts_implementation(hf)
    return hf, (f"transformers {transformers.__version__}, attention {hf.config._attn_implementation}, experts "
                f"{impl}, flash-linear-attention {'installed' if fla else 'not installed'}")


def bench_model(name, args, peak, device, rows, bw=float("inf")):
    """One model: ds4t's rows (and checks), then the HF peer on the same prompts. True when the chunk
    check passed and its control was caught."""
    log(f"\n## {name}\n")
    mine, prompts, ok = _ds4t_part(name, args, peak, device, rows, bw)
    _free(device)   # every session and the model went with _ds4t_part's frame: the peer loads its own copy
    if args.hf:
        _hf_part(name, args, peak, device, mine, prompts)
    return ok


def _ds4t_part(name, args, peak, device, rows, bw):
    t0 = time.time()
    model = ds4t.load(name, device=device, **dict(args.opt))
    if device.type == "cuda":
        torch.cuda.synchronize()
    log(f"loaded in {time.time() - t0:.0f} s: {model!r}" + (f"; load options {dict(args.opt)}" if args.opt else ""))
    dense, head = weight_flops_per_token(model)
    rng = random.Random(0)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(p)] for p in ints(args.prompt)]
    mine = []
    for prompt in prompts:
        P = len(prompt)
        for chunk in ints(args.chunks):
            s = model.new_session(P + 8)
            s.prefill(prompt[:2 * chunk], chunk=chunk)   # compile and warm up: a first chunk and one after it
            s.close()
            s = model.new_session(P + 8)
            try:
                times, logits = chunk_times(lambda part: s.prefill(part, chunk=chunk), prompt, chunk, device)
            finally:
                s.close()
            flops = [dense * min(chunk, P - p0) + head + attention_flops(model, p0, min(chunk, P - p0))
                     for p0 in range(0, P, chunk)]
            ms = sum(times)
            tok_s = P / (ms * 1e-3)
            tflops = sum(flops) / (ms * 1e-3)
            # roofline of the whole prompt: each chunk needs max(its weight bytes / copy BW, its FLOPs / peak)
            floor = sum(max(weight_bytes_per_chunk(model, min(chunk, P - p0)) / bw, f / peak) * 1e3
                        for p0, f in zip(range(0, P, chunk), flops))
            row = dict(model=name, opt=dict(args.opt), chunk=chunk, prompt=P, ms=ms, tok_s=tok_s, tflops=tflops / 1e12,
                       frac=tflops / peak, first_ms=times[0], last_ms=times[-1], floor_ms=floor, flops=sum(flops),
                       ceiling=peak_ceiling(sum(flops), floor, peak), logits=logits.float().cpu())
            rows.append(row)
            mine.append(row)
            log(f"prompt {P}, chunk {chunk}: {ms:.1f} ms = {tok_s:,.0f} tok/s; {tflops / 1e12:.1f} TFLOP/s "
                f"= {100 * tflops / peak:.1f} % of the bf16 peak; first chunk {times[0]:.2f} ms, last {times[-1]:.2f} ms; "
                f"roofline {floor:.1f} ms (max of weight bytes / copy BW and FLOPs / peak per chunk) = "
                f"{100 * floor / ms:.0f} % of it reached; at the roofline {100 * row['ceiling']:.0f} % of the peak "
                f"(the most this chunking allows: bytes-bound chunks cap it)")
    for n in [int(x) for x in args.sessions.split(",") if int(x) > 1]:
        rows.append(bench_sessions(model, name, n, args, peak, bw, dense, head, prompts[0], device))
    if args.profile and device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        chunk = int(args.chunks.split(",")[0])
        at = args.profile_at
        extra = random.Random(1)   # its own stream: the chunk check's prompt below stays the same
        whole = prompts[0] if at + chunk <= len(prompts[0]) else [extra.randrange(model.vocab_size)
                                                                 for _ in range(at + chunk)]
        s = model.new_session(at + chunk + 8)
        if at:
            s.prefill(whole[:at], chunk=chunk)   # untimed: the chunk profiled attends to these positions
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            s.prefill(whole[at:at + chunk], chunk=chunk)
            torch.cuda.synchronize()
        s.close()
        evs = sorted(((e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0), e.count)
                      for e in prof.key_averages()), key=lambda r: -r[1])
        total = sum(r[1] for r in evs)
        log(f"\nprofile of one {chunk}-token chunk from position {at}: {total / 1e3:.2f} ms of kernels\n")
        log("| kernel | ms | calls | share |")
        log("|---|---|---|---|")
        for k, us, n in evs[:15]:
            log(f"| `{k[:80]}` | {us / 1e3:.3f} | {n} | {100 * us / max(total, 1e-9):.0f} % |")
    cp = [rng.randrange(model.vocab_size) for _ in range(args.check_prompt)]
    rep = run_chunk_check(model, cp, (1, 17, 64, len(cp)))
    with plant("batch-dependent"):
        ctl = run_chunk_check(model, cp, (1, 17), in_batch=False)
    log(f"\nchunk invariance ({len(cp)}-token prompt; chunks 1, 17, 64, {len(cp)}; token by token in a native "
        f"batch): {rep.rows} logit rows, {rep.states} states, {rep.mismatches} mismatches, paths {rep.paths}: "
        f"{'PASS' if rep.ok else 'FAIL: ' + str(rep.first_mismatch)}; control (batch-dependent linear): "
        f"{ctl.mismatches} mismatches, {'caught' if ctl.mismatches else 'NOT CAUGHT'}")
    for r in rows:
        if r["model"] == name:
            r["chunk_invariant"] = rep.ok and ctl.mismatches > 0
    return mine, prompts, rep.ok and ctl.mismatches > 0


def _hf_part(name, args, peak, device, mine, prompts) -> None:
    """HF's prefill of each of ``mine``'s (prompt, chunk) rows; fills their hf_ms / hf_note."""
    hf, label = _hf_peer(name, device)
    log(f"\nHF peer: {label}")
    if hf is not None:
        for row in mine:
            prompt = prompts[ints(args.prompt).index(row["prompt"])]
            try:   # the fastest of --hf-passes whole prompts: HF's prefill waits on the host, which varies
                passes = [hf_prefill_times(hf, prompt, row["chunk"], device) for _ in range(args.hf_passes)]
            except torch.OutOfMemoryError:
                row["hf_note"] = "OOM"
                log(f"HF prompt {row['prompt']}, chunk {row['chunk']}: out of memory")
                _free(device)
                continue
            times, hf_logits = min(passes, key=lambda p: sum(p[0]))
            row["hf_ms"] = sum(times)
            row["hf_passes_ms"] = [sum(p[0]) for p in passes]
            ref = row["logits"]
            rel = ((hf_logits.cpu() - ref).abs().max() / ref.abs().max()).item()
            log(f"HF prompt {row['prompt']}, chunk {row['chunk']}: {row['hf_ms']:.1f} ms = "
                f"{row['prompt'] / (row['hf_ms'] * 1e-3):,.0f} tok/s ({100 * row['flops'] / (row['hf_ms'] * 1e-3) / peak:.1f} "
                f"% of peak); HF time / ds4t time {row['hf_ms'] / row['ms']:.2f}; its last logits vs ds4t's: "
                f"max rel error {rel:.2e} (bf16: close, not equal); passes "
                f"{', '.join(f'{t:.1f}' for t in row['hf_passes_ms'])} ms")
        del hf
        _free(device)


def _free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def ints(spec: str) -> list:
    return [int(x) for x in str(spec).split(",")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="qwen3-next-80b-4l,glm-4.5-4l,deepseek-v3-4l")
    ap.add_argument("--chunks", default="1024", help="prefill chunk sizes, e.g. 256,1024,2048")
    ap.add_argument("--prompt", default="4096", help="prompt tokens prefilled per chunk size, e.g. 4096,32768")
    ap.add_argument("--check-prompt", type=int, default=200, help="prompt tokens of the chunk-invariance check")
    ap.add_argument("--sessions", default="1", help="also prefill N sessions at once, each chunk // N tokens a "
                                                    "step (e.g. 1,8,32)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-at", type=int, default=0, help="the profiled chunk starts at this position (its "
                    "attention reads that many cached tokens; the tokens before it are prefilled untimed)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF transformers peer")
    ap.add_argument("--hf-passes", type=int, default=3, help="HF's prompt timed this many times, the fastest kept")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--configs", default=None,
                    help="JSON file (or JSON text) of GPU config-table entries to use instead "
                         "(ds4t.kernels.config.overridden), e.g. the attention's run_rows")
    ap.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                    help="ds4t load option for every model, as `ds4t demo --opt` (e.g. attention_products=cache); "
                         "the HF peer runs as always")
    ap.add_argument("--device", default="cuda", help="cuda; cpu for a smoke run with tiny presets")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    device = torch.device(args.device)
    os.makedirs(args.out, exist_ok=True)
    peak = matmul_peak(device)
    bw = copy_bandwidth(device) if device.type == "cuda" else float("inf")   # CPU smoke: FLOPs alone
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU (smoke run)"
    log(f"# ds4t prefill on {where}")
    log(f"commit {args.commit or '?'}; torch {torch.__version__}; bf16 matmul peak {peak / 1e12:.0f} TFLOP/s; "
        f"copy bandwidth {bw / 1e12:.2f} TB/s")
    log("command: python bench/bench_prefill.py " + " ".join(sys.argv[1:]))
    rows, ok = [], True
    with contextlib.ExitStack() as stack:
        if args.configs:
            from ds4t.kernels.config import overridden

            spec = json.loads(args.configs) if args.configs.lstrip().startswith("{") else args.configs
            for table, key, cfg in stack.enter_context(overridden(spec)):
                log(f"config override: {table.kernel} {key!r} -> {cfg}")
        for name in args.models.split(","):
            ok &= bench_model(name, args, peak, device, rows, bw)
    log("\n| model | prompt | chunk | tok/s | TFLOP/s | % of bf16 peak | % of peak at the roofline | "
        "roofline ms / measured ms | HF tok/s | ds4t / HF | chunk-invariant (control caught) |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        hf = r.get("hf_ms")
        hf_cols = (f"{r['prompt'] / (hf * 1e-3):,.0f} | {hf / r['ms']:.2f}x" if hf else
                   f"{r.get('hf_note', '-')} | -")
        opt = "".join(f" {k}={v}" for k, v in r.get("opt", {}).items())
        log(f"| {r['model']}{opt} | {r['prompt']} | {r['chunk']} | {r['tok_s']:,.0f} | {r['tflops']:.1f} | "
            f"{100 * r['frac']:.1f} % | {100 * r['ceiling']:.0f} % | "
            f"{r['floor_ms']:.1f} / {r['ms']:.1f} = {100 * r['floor_ms'] / r['ms']:.0f} % | "
            f"{hf_cols} | {'yes' if r.get('chunk_invariant') else 'NO'} |")
    log.write(args.out, "prefill.md")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
