"""``ds4t serve``: an OpenAI-compatible server with N resident sessions batched into one decode step.

Wired into ``ds4t/cli.py`` with ``add_parser(sub)`` and dispatch to ``run(args)``; also
``python -m ds4t.serve ...``.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

ENV_COALESCE = "DS4T_DECODE_COALESCE_US"
ENV_BATCH_LOG = "DS4T_BATCH_LOG"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server: N resident sessions, decode steps batched",
        description="Serve a model over HTTP with --batched-session N resident sessions whose ready decode "
                    "steps run as one batched step (bit-identical to running each alone).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-qwen", help="preset name or HF checkpoint directory")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: the checkpoint's)")
    p.add_argument("--batched-session", type=int, default=1, metavar="N",
                   help="resident sessions allocated at start; requests beyond N wait (FIFO)")
    p.add_argument("--max-ctx", type=int, default=None, metavar="C",
                   help="context of every session (default: min(4096, the model's max positions))")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--memory-limit", default=None, metavar="SIZE",
                   help="refuse to start when the plan exceeds SIZE (e.g. 80GiB); default: the device's free memory")
    p.add_argument("--coalesce-us", type=int, default=None, metavar="US",
                   help=f"after new arrivals, wait up to US for more before the step, while slots are free "
                        f"(default ${ENV_COALESCE} or 2000; 0: never wait)")
    p.add_argument("--batch-log", action="store_true", default=None,
                   help=f"log every batch: items, rows, paths, elapsed (or ${ENV_BATCH_LOG}=1)")
    p.add_argument("--prefill-chunk", type=int, default=128, metavar="T",
                   help="prompt tokens per step while anything decodes (default 128)")
    p.add_argument("--prefill-chunk-idle", type=int, default=512, metavar="T",
                   help="prompt tokens per step while nothing decodes (default 512)")
    p.add_argument("--kv-cache-dir", default=None, metavar="DIR",
                   help="save idle sessions' states here before reusing their slot; restore them when the "
                        "conversation returns")
    p.add_argument("--kv-cache-max-entries", type=int, default=256, metavar="K",
                   help="saved states kept in --kv-cache-dir (least recently used dropped first)")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before answering 503")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: preset or directory name)")
    p.add_argument("--mode", default="auto", choices=["auto", "ordered"],
                   help="eval_batch mode: auto (native where the model allows) or ordered (each session "
                        "alone, for comparison)")
    p.add_argument("--plan-only", action="store_true", help="print the memory plan and exit (0: fits, 2: does not)")


def build(args, model=None):
    """(server, plan) from parsed arguments; server is None when the plan does not fit."""
    import ds4t
    from ds4t.serve.http import Server
    from ds4t.serve.planner import parse_size, plan

    if args.batched_session < 1:
        raise SystemExit("ds4t serve: --batched-session must be >= 1")
    if model is None:
        model = ds4t.load(args.model, device=args.device, dtype=args.dtype)
    max_ctx = args.max_ctx or min(4096, model.max_position)
    if max_ctx < 1 or max_ctx > model.max_position:
        raise SystemExit(f"ds4t serve: --max-ctx must be in [1, {model.max_position}] for this model, got {max_ctx}")
    limit = parse_size(args.memory_limit) if args.memory_limit else None
    coalesce = args.coalesce_us if args.coalesce_us is not None else int(os.environ.get(ENV_COALESCE, "2000"))
    batch_log = args.batch_log if args.batch_log is not None else _env_flag(ENV_BATCH_LOG)
    p = plan(model, args.batched_session, max_ctx, args.batched_session + max(args.prefill_chunk, args.prefill_chunk_idle),
             memory_limit=limit)
    if not p.fits or args.plan_only:
        return None, p
    model_id = args.served_model_name or (args.model if not os.path.isdir(args.model)
                                          else os.path.basename(os.path.abspath(args.model)))
    server = Server(model, slots=args.batched_session, max_ctx=max_ctx, model_id=model_id, coalesce_us=coalesce,
                    prefill_chunk=args.prefill_chunk, prefill_chunk_idle=args.prefill_chunk_idle,
                    kv_cache_dir=args.kv_cache_dir, kv_cache_max_entries=args.kv_cache_max_entries,
                    max_waiting=args.max_waiting, batch_log=batch_log, mode=args.mode)
    server.aliases.add(args.model)
    return server, p


def run(args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    from ds4t.backend import device_name

    print(f"ds4t serve: loading {args.model} ...", flush=True)
    server, p = build(args)
    print(p.format(), flush=True)
    if server is None:
        if not p.fits:
            print(p.refusal(), file=sys.stderr, flush=True)
            return 2
        return 0
    w = server.worker
    print(f"ds4t serve: {server.model_id} on {device_name()}: {len(server.pool)} session(s) x ctx {server.max_ctx}, "
          f"coalesce {w.coalesce_s * 1e6:.0f} us, prefill chunk {w.prefill_chunk} "
          f"(idle {w.prefill_chunk_idle}), kv-cache-dir {args.kv_cache_dir or '-'}", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"ds4t serve: WARNING: binding {args.host}: reachable from other machines, no authentication",
              flush=True)

    async def main():
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, server.request_stop)
            except (NotImplementedError, RuntimeError):
                pass

        def ready(port):
            print(f"ds4t serve: listening on http://{args.host}:{port}", flush=True)

        await server.serve_forever(args.host, args.port, ready=ready)

    try:
        asyncio.run(main())
    except OSError as e:
        print(f"ds4t serve: cannot listen on {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    print("ds4t serve: stopped", flush=True)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ds4t serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def spawn(argv, env=None, timeout: float = 180.0, cwd=None):
    """Start ``python -m ds4t.serve *argv`` in a subprocess and wait until it listens.

    Returns (process, base URL such as ``http://127.0.0.1:PORT``, what it printed up to then: the
    memory plan and banner). The server's output is drained in
    a background thread from then on, so it never blocks on a full pipe. Raises RuntimeError with
    what it printed when it exits or stays silent past ``timeout`` seconds. (Used by the serving
    tests and bench/bench_serve.py; pass ``--port 0`` to get a free port.)
    """
    import re
    import subprocess
    import threading
    import time

    p = subprocess.Popen([sys.executable, "-m", "ds4t.serve", *argv], cwd=cwd,
                         env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    lines = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://\S+)", line)
        if m:
            threading.Thread(target=lambda: [None for _ in p.stdout], daemon=True).start()
            return p, m.group(1), "".join(lines)
    p.kill()
    raise RuntimeError("server did not start:\n" + "".join(lines))
