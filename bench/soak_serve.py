"""Soak test of ``ds4t serve``: many concurrent clients for minutes, then the books are checked.

A server is started as a subprocess (``python -m ds4t.serve``, loopback, a free port). ``--clients``
clients loop for ``--duration`` seconds, each request drawn at random:

* prompt: random token ids, length from ``--prompt-lens`` (mixed short and long: chunked prefill
  runs beside decoders), or a short chat message (``--chat-frac``);
* ``max_tokens`` in [``--min-tokens``, ``--max-tokens``], ``ignore_eos`` so the count is exact;
* streaming or not (``--stream-frac``); greedy, or seeded sampling (``--sampled-frac``);
* some cancelled (``--cancel-frac``): a stream hung up after a few tokens, a plain request abandoned
  after a random delay (often still queued: more clients than slots).

Checked afterwards (exit 1 on any failure):

* nothing lost: every request not cancelled answered 200 with exactly ``max_tokens`` tokens
  (streams end with ``[DONE]``); the server's /health shows no request held; its
  ``requests_total`` counts no error and at least the finished requests;
* equal to the request alone: ``--check`` finished requests (greedy and seeded) are sent again one at
  a time and must return the same token ids;
* memory flat: the server's GPU memory (nvidia-smi, per process) and host RSS, sampled every few
  seconds, after warm-up.

Reported: requests/s, generated tokens/s, TTFT p50/p99, inter-token latency p50/p99 (client-side,
streaming requests), mean batch items/rows (server /metrics). Full records in ``<out>/<tag>.json``,
the summary in ``<out>/<tag>.md`` (also printed last).

CPU smoke run (Triton interpreter):
    python bench/soak_serve.py --model tiny-qwen --slots 4 --clients 12 --duration 20 --max-ctx 256 \
        --prompt-lens 4,16,64 --max-tokens 8 --check 8
H200:
    python bench/soak_serve.py --model qwen3-next-80b-4l --device cuda --slots 64 --clients 256 \
        --duration 300 --max-ctx 4096 --out $OUT --tag DATE-h200-soak
"""
from __future__ import annotations

import argparse
import asyncio
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
from bench.bench_serve import metric, pct  # noqa: E402


def ints(s: str):
    return [int(x) for x in s.split(",") if x.strip()]


class Rec(dict):
    """One request: what was asked and what came back (JSON-serialisable)."""


def draw(rng: random.Random, a, vocab: int) -> Rec:
    chat = rng.random() < a.chat_frac
    stream = rng.random() < a.stream_frac
    sampled = rng.random() < a.sampled_frac
    n = rng.randint(a.min_tokens, a.max_tokens)
    body = {"max_tokens": n, "stream": stream, "ignore_eos": True, "return_token_ids": True}
    if chat:
        words = " ".join(rng.choice(["tea", "red", "kernel", "batch", "ok", "why", "seven"]) for _ in range(rng.randint(2, 12)))
        body["messages"] = [{"role": "user", "content": words}]
    else:
        body["prompt"] = [rng.randrange(vocab) for _ in range(rng.choice(a.prompt_lens))]
    if sampled:
        body.update(temperature=0.8, top_k=50, top_p=0.95, seed=rng.randrange(1 << 62))
    else:
        body["temperature"] = 0
    cancel = rng.random() < a.cancel_frac
    return Rec(body=body, chat=chat, cancel=cancel, cancel_after=rng.randint(1, max(1, n - 1)) if cancel else 0,
               cancel_delay=rng.uniform(0.05, 2.0) if cancel else 0.0)


async def send(s, url, rec: Rec) -> Rec:
    body = rec["body"]
    path = "/v1/chat/completions" if rec["chat"] else "/v1/completions"
    t0 = time.perf_counter()
    rec.update(t0=t0, status=None, tokens=[], times=[], done=False, finish=None, error=None, cancelled=False)
    try:
        if not body["stream"]:
            coro = s.post(url + path, json=body)
            if rec["cancel"]:
                try:
                    async with asyncio.timeout(rec["cancel_delay"]):
                        async with coro as r:
                            j = await r.json()
                except TimeoutError:
                    rec["cancelled"] = True
                    return rec
            else:
                async with coro as r:
                    j = await r.json()
            rec["status"] = r.status
            if r.status == 200:
                c = j["choices"][0]
                rec.update(tokens=c["token_ids"], finish=c["finish_reason"], done=True)
                rec["times"] = [time.perf_counter()]
            else:
                rec["error"] = j.get("error")
            return rec
        async with s.post(url + path, json=body) as r:
            rec["status"] = r.status
            if r.status != 200:
                rec["error"] = (await r.json()).get("error")
                return rec
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    rec["done"] = True
                    break
                ev = json.loads(data)
                if "error" in ev:
                    rec["error"] = ev["error"]
                    continue
                for c in ev.get("choices", []):
                    ids = c.get("token_ids") or []
                    rec["tokens"] += ids
                    rec["times"] += [time.perf_counter()] * len(ids)
                    if c.get("finish_reason"):
                        rec["finish"] = c["finish_reason"]
                if rec["cancel"] and len(rec["tokens"]) >= rec["cancel_after"]:
                    rec["cancelled"] = True
                    r.close()
                    return rec
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec["error"] = {"message": f"client: {type(e).__name__}: {e}"}
    return rec


def compact(r: Rec) -> dict:
    """A request's record without its token lists (the JSON stays small for 10^4+ requests)."""
    body = {k: v for k, v in r["body"].items() if k not in ("prompt", "messages")}
    out = {k: v for k, v in r.items() if k not in ("times", "tokens", "body")}
    out.update(body=body, prompt_len=len(r["body"].get("prompt", [])), n_tokens=len(r["tokens"]),
               ttft_ms=(r["times"][0] - r["t0"]) * 1e3 if r["times"] else None)
    return out


def sample_memory(pid: int) -> dict:
    """The server process's GPU memory (MiB, nvidia-smi) and host RSS (MiB)."""
    out = {"t": time.time(), "gpu_mib": None, "rss_mib": None}
    try:
        q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=10).stdout
        for line in q.splitlines():
            p, m = [x.strip() for x in line.split(",")[:2]]
            if int(p) == pid:
                out["gpu_mib"] = float(m)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    try:
        with open(f"/proc/{pid}/status") as f:
            m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
            out["rss_mib"] = int(m.group(1)) / 1024 if m else None
    except OSError:
        pass
    return out


async def soak(url, a, vocab, pid):
    rng = random.Random(a.seed)
    recs = []
    stop_at = time.perf_counter() + a.duration
    mem = []

    async def client(i, s):
        crng = random.Random(rng.randrange(1 << 62))
        while time.perf_counter() < stop_at:
            recs.append(await send(s, url, draw(crng, a, vocab)))

    async def watch():
        while time.perf_counter() < stop_at:
            mem.append(await asyncio.to_thread(sample_memory, pid))
            await asyncio.sleep(a.mem_every)

    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None), connector=conn) as s:
        t0 = time.perf_counter()
        await asyncio.gather(watch(), *(client(i, s) for i in range(a.clients)))
        wall = time.perf_counter() - t0
        mem.append(await asyncio.to_thread(sample_memory, pid))
    return recs, wall, mem


async def get(url, path):
    async with aiohttp.ClientSession() as s, s.get(url + path) as r:
        return r.status, (await r.json() if path == "/health" else await r.text())


async def settle(url, timeout=120):
    """Wait until the server holds no request (cancellations are applied between steps)."""
    deadline = time.time() + timeout
    while True:
        st, h = await get(url, "/health")
        if (h["active"] == 0 and h["waiting"] == 0) or time.time() > deadline:
            return h
        await asyncio.sleep(0.2)


async def alone(url, recs):
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
        for r in recs:
            again = Rec(body=dict(r["body"]), chat=r["chat"], cancel=False, cancel_after=0, cancel_delay=0.0)
            out.append(await send(s, url, again))
    return out


def summarize(a, recs, wall, mem, before, metrics_text, health, alone_pairs):
    fails = []
    cancelled = [r for r in recs if r["cancelled"]]
    finished = [r for r in recs if not r["cancelled"]]
    bad = [r for r in finished if not (r["status"] == 200 and r["done"] and r["finish"] == "length"
                                       and len(r["tokens"]) == r["body"]["max_tokens"] and not r["error"])]
    if bad:
        fails.append(f"{len(bad)} requests lost or short, e.g. {json.dumps({k: bad[0][k] for k in ('status', 'error', 'finish')})}")
    if health["active"] or health["waiting"] or health["busy"]:
        fails.append(f"server still holds requests after the soak: {health}")
    def delta(name):
        return metric(metrics_text, name) - metric(before, name)

    ok_srv = delta('ds4t_serve_requests_total{status="ok"}')
    err_srv = delta('ds4t_serve_requests_total{status="error"}')
    cancel_srv = delta('ds4t_serve_requests_total{status="cancelled"}')
    if err_srv:
        fails.append(f"server counted {err_srv:.0f} failed requests")
    if ok_srv < len(finished):  # a request the client cancelled may still have finished: >=, not ==
        fails.append(f"server counted {ok_srv:.0f} finished requests, clients {len(finished)}")
    mism = [(r, b) for r, b in alone_pairs if b["tokens"] != r["tokens"]]
    if mism:
        fails.append(f"{len(mism)}/{len(alone_pairs)} outputs differ from the same request alone")
    gpu = [m["gpu_mib"] for m in mem if m["gpu_mib"] is not None]
    rss = [m["rss_mib"] for m in mem if m["rss_mib"] is not None]
    tokens = sum(len(r["tokens"]) for r in recs)
    streams = [r for r in finished if r["body"]["stream"] and r["times"]]
    ttft = [(r["times"][0] - r["t0"]) * 1e3 for r in recs if r["times"]]
    itl = [(b - a_) * 1e3 for r in streams for a_, b in zip(r["times"], r["times"][1:]) if b > a_]
    n_batches = metric(metrics_text, "ds4t_serve_batch_items_count")
    row = {
        "requests": len(recs), "finished": len(finished), "cancelled": len(cancelled),
        "lost_or_short": len(bad), "server_ok": ok_srv, "server_cancelled": cancel_srv, "server_errors": err_srv,
        "req_per_s": len(recs) / wall, "tok_per_s": tokens / wall, "tokens": tokens, "wall_s": wall,
        "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
        "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
        "alone_checked": len(alone_pairs), "alone_equal": len(alone_pairs) - len(mism),
        "gpu_mib_first": gpu[0] if gpu else None, "gpu_mib_last": gpu[-1] if gpu else None,
        "gpu_mib_max": max(gpu) if gpu else None, "rss_mib_first": rss[0] if rss else None,
        "rss_mib_last": rss[-1] if rss else None, "rss_mib_max": max(rss) if rss else None,
        "mean_batch_items": metric(metrics_text, "ds4t_serve_batch_items_sum") / max(1, n_batches),
        "mean_batch_rows": metric(metrics_text, "ds4t_serve_batch_rows_sum") / max(1, n_batches),
    }
    if gpu and gpu[-1] > gpu[0] * 1.05 + 64:
        fails.append(f"GPU memory grew {gpu[0]:.0f} -> {gpu[-1]:.0f} MiB")
    if rss and rss[-1] > rss[0] * 1.25 + 256:
        fails.append(f"host RSS grew {rss[0]:.0f} -> {rss[-1]:.0f} MiB")
    return row, fails


def render(a, row, fails, mem, commit):
    lines = [f"# ds4t serve soak: {a.model} on {a.device or 'default device'}", "",
             f"- commit: `{commit}`",
             f"- command: `python bench/soak_serve.py {' '.join(sys.argv[1:])}`",
             f"- host: {platform.node()} ({os.cpu_count()} CPUs), Python {platform.python_version()}",
             f"- {a.slots} slots, max ctx {a.max_ctx}, {a.clients} concurrent clients for {a.duration:.0f} s; prompt "
             f"lengths {a.prompt_lens} tokens (+ {a.chat_frac:.0%} chat), {a.min_tokens}-{a.max_tokens} tokens each, "
             f"{a.stream_frac:.0%} streaming, {a.sampled_frac:.0%} seeded sampling, {a.cancel_frac:.0%} cancelled",
             "", "## Result: " + ("PASS" if not fails else "FAIL"), ""]
    lines += [f"- {f}" for f in fails]
    lines += ["", "| metric | value |", "|---|---|"]
    for k, v in row.items():
        lines.append(f"| {k} | {v:.2f} |" if isinstance(v, float) else f"| {k} | {v} |")
    lines += ["", "Memory samples (s since start, GPU MiB, RSS MiB):", ""]
    t0 = mem[0]["t"] if mem else 0
    lines.append(", ".join(f"{m['t'] - t0:.0f}s: {m['gpu_mib']}/{m['rss_mib'] and round(m['rss_mib'])}" for m in mem))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--max-ctx", type=int, default=256)
    ap.add_argument("--clients", type=int, default=12)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load (after warm-up)")
    ap.add_argument("--warmup", type=float, default=None, help="seconds of the same load first, not counted "
                    "(compiles kernels, captures graphs); default: min(60, duration / 4)")
    ap.add_argument("--prompt-lens", type=ints, default=[8, 32, 128, 512, 1024])
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--stream-frac", type=float, default=0.5)
    ap.add_argument("--chat-frac", type=float, default=0.1)
    ap.add_argument("--sampled-frac", type=float, default=0.25)
    ap.add_argument("--cancel-frac", type=float, default=0.1)
    ap.add_argument("--check", type=int, default=32, help="finished requests re-sent alone and compared")
    ap.add_argument("--mem-every", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prefill-chunk", type=int, default=128)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    ap.add_argument("--tag", default="soak")
    ap.add_argument("--commit", default=None)
    a = ap.parse_args(argv)
    if max(a.prompt_lens) + a.max_tokens > a.max_ctx:
        ap.error(f"the longest prompt ({max(a.prompt_lens)}) + --max-tokens ({a.max_tokens}) exceeds --max-ctx")
    commit = a.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                        text=True).stdout.strip() or "?"
    argv_srv = ["--model", a.model, "--batched-session", str(a.slots), "--max-ctx", str(a.max_ctx), "--port", "0",
                "--prefill-chunk", str(a.prefill_chunk), "--max-waiting", str(4 * a.clients)]
    argv_srv += ["--device", a.device] if a.device else []
    argv_srv += ["--dtype", a.dtype] if a.dtype else []
    p, url, banner = serve_cli.spawn(argv_srv, timeout=a.start_timeout, cwd=ROOT)
    print(banner, flush=True)
    try:
        _, models = asyncio.run(get(url, "/v1/models"))
        vocab = json.loads(models)["data"][0]["vocab_size"]
        warm = a.warmup if a.warmup is not None else min(60.0, a.duration / 4)
        if warm > 0:
            wa = argparse.Namespace(**vars(a))
            wa.duration, wa.seed = warm, a.seed + 1
            print(f"warm-up {warm:.0f} s ...", flush=True)
            asyncio.run(soak(url, wa, vocab, p.pid))
            asyncio.run(settle(url))
        _, before = asyncio.run(get(url, "/metrics"))
        print(f"soak: {a.clients} clients for {a.duration:.0f} s ...", flush=True)
        recs, wall, mem = asyncio.run(soak(url, a, vocab, p.pid))
        health = asyncio.run(settle(url))
        _, metrics_text = asyncio.run(get(url, "/metrics"))
        done = [r for r in recs if not r["cancelled"] and r["status"] == 200 and r["done"]]
        pick = random.Random(a.seed + 2).sample(done, min(a.check, len(done)))
        print(f"re-sending {len(pick)} finished requests alone ...", flush=True)
        again = asyncio.run(alone(url, pick))
    finally:
        p.send_signal(2)
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
    row, fails = summarize(a, recs, wall, mem, before, metrics_text, health, list(zip(pick, again)))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"{a.tag}.json"), "w") as f:
        json.dump({"summary": row, "fails": fails, "memory": mem, "server_rc": p.returncode,
                   "requests": [compact(r) for r in recs]}, f)
    text = render(a, row, fails, mem, commit)
    with open(os.path.join(a.out, f"{a.tag}.md"), "w") as f:
        f.write(text)
    print(text)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
