"""Load benchmark of ``ds4t serve``: aggregate tok/s and inter-token latency vs concurrency and the
coalescing window.

For every (mode, window) a server is started as a subprocess (``python -m ds4t.serve``, loopback,
a free port); for every concurrency C, C clients each send ``--requests`` streaming greedy
completions one after the other (distinct random prompts). Client-side timestamps of every
token give:

* tok/s: all generated tokens / wall time of the run,
* ITL p50 / p99: time between consecutive tokens of a request,
* TTFT p50: request sent to its first token,
* mean batch items: from the server's /metrics (sessions per eval_batch call).

Writes ``<out>/<tag>.csv`` and ``<out>/<tag>.md``.

CPU (Triton interpreter):
    python bench/bench_serve.py --model tiny-qwen --concurrency 1,2,4 --windows 0,2000
GPU:
    python bench/bench_serve.py --model qwen3-next-80b-4l --device cuda --slots 64 \
        --concurrency 1,4,16,32,64 --windows 0,500,2000 --requests 4 --max-tokens 64 --tag DATE-h200-serve
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import platform
import random
import re
import subprocess
import sys
import time

import aiohttp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from ds4t.serve import cli as serve_cli  # noqa: E402


def ints(s: str):
    return [int(x) for x in s.split(",") if x.strip()]


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def start_server(a, window: int, mode: str):
    argv = ["--model", a.model, "--batched-session", str(a.slots), "--max-ctx", str(a.max_ctx), "--port", "0",
            "--coalesce-us", str(window), "--mode", mode, "--prefill-chunk", str(a.prefill_chunk)]
    if a.device:
        argv += ["--device", a.device]
    if a.dtype:
        argv += ["--dtype", a.dtype]
    try:
        return serve_cli.spawn(argv, timeout=a.start_timeout, cwd=ROOT)
    except RuntimeError as e:
        raise SystemExit(str(e)) from None


async def one_request(s, url, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "ignore_eos": True}
    t0 = time.perf_counter()
    times = []
    async with s.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if line.startswith(b"data: ") and b"token_ids" in line:
                n = len(json.loads(line[6:])["choices"][0].get("token_ids", []))
                times += [time.perf_counter()] * n
    return t0, times


async def run_load(url, conc, requests, max_tokens, prompt_len, vocab, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(conc * requests)]
    results = []

    async def client(i, s):
        for k in range(requests):
            results.append(await one_request(s, url, prompts[i * requests + k], max_tokens))

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as s:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(i, s) for i in range(conc)))
        wall = time.perf_counter() - t0
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    return results, wall, metrics


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def fetch_metrics(url):
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as r:
        return await r.text()


async def warmup(url, a):
    """One round at the largest concurrency (GPU: compiles the kernels for every batch shape)."""
    await run_load(url, max(a.concurrency), 1, max(2, min(4, a.max_tokens)), a.prompt_len, a.vocab, seed=12345)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--concurrency", type=ints, default=[1, 2, 4], help="comma list, e.g. 1,4,16,64")
    ap.add_argument("--windows", type=ints, default=[0, 2000], help="coalescing windows in us, comma list")
    ap.add_argument("--modes", default="auto", help="eval_batch modes, comma list (auto,ordered)")
    ap.add_argument("--slots", type=int, default=None, help="--batched-session (default: the largest concurrency)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client, sent one after the other")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-ctx", type=int, default=256)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"), help="output directory")
    ap.add_argument("--tag", default=time.strftime("%Y-%m-%d") + "-serve", help="output file name (no extension)")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="skip the warm-up round at the largest concurrency before measuring")
    ap.add_argument("--start-timeout", type=float, default=900)
    a = ap.parse_args(argv)
    a.slots = a.slots or max(a.concurrency)
    os.makedirs(a.out, exist_ok=True)
    rows, device_line = [], ""
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        for window in a.windows:
            p, url, banner = start_server(a, window, mode)
            m = re.search(r"ds4t serve: \S+ on (.+?): ", banner)
            device_line = m.group(1) if m else "?"
            try:
                if a.warmup:
                    asyncio.run(warmup(url, a))
                for conc in a.concurrency:
                    before = asyncio.run(fetch_metrics(url))
                    results, wall, metrics = asyncio.run(
                        run_load(url, conc, a.requests, a.max_tokens, a.prompt_len, a.vocab, seed=conc))
                    itl, ttft, ntok = [], [], 0
                    for t0, times in results:
                        ntok += len(times)
                        if times:
                            ttft.append(times[0] - t0)
                            itl += [b - x for x, b in zip(times, times[1:])]
                    d = {k: metric(metrics, k) - metric(before, k) for k in
                         ("ds4t_serve_batch_items_sum", "ds4t_serve_batch_items_count", "ds4t_serve_batch_rows_sum")}
                    batches = d["ds4t_serve_batch_items_count"] or float("nan")
                    row = {"mode": mode, "window_us": window, "concurrency": conc, "slots": a.slots,
                           "requests": len(results), "tokens": ntok, "wall_s": round(wall, 3),
                           "tok_per_s": round(ntok / wall, 2),
                           "itl_p50_ms": round(pct(itl, 0.5) * 1e3, 2), "itl_p99_ms": round(pct(itl, 0.99) * 1e3, 2),
                           "ttft_p50_ms": round(pct(ttft, 0.5) * 1e3, 1),
                           "batches": int(d["ds4t_serve_batch_items_count"]),
                           "mean_batch_items": round(d["ds4t_serve_batch_items_sum"] / batches, 2),
                           "mean_batch_rows": round(d["ds4t_serve_batch_rows_sum"] / batches, 2)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            finally:
                p.terminate()
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
    path = os.path.join(a.out, a.tag)
    with open(path + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = ["mode", "window_us", "concurrency", "tok_per_s", "itl_p50_ms", "itl_p99_ms", "ttft_p50_ms",
            "mean_batch_items", "mean_batch_rows", "tokens", "wall_s"]
    md = [f"# ds4t serve load benchmark: {a.model} on {device_line}", "",
          f"`{' '.join(['python', 'bench/bench_serve.py'] + (argv if argv is not None else sys.argv[1:]))}`", "",
          f"{a.slots} resident sessions (--batched-session), max ctx {a.max_ctx}; each of C clients sends "
          f"{a.requests} streaming greedy completions in turn ({a.prompt_len}-token random prompts, "
          f"{a.max_tokens} tokens each, ignore_eos). Client-side timings over loopback. "
          f"Host: {platform.node() or '?'} ({os.cpu_count()} CPUs), Python {platform.python_version()}.", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    md += ["", "tok/s: generated tokens / wall time; ITL: inter-token latency of a request; TTFT: time to first "
               "token; mean batch items / rows: sessions / token rows per eval_batch call (server /metrics).", ""]
    with open(path + ".md", "w") as f:
        f.write("\n".join(md))
    print(f"wrote {path}.md and {path}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
