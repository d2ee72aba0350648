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


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    try:
        v = int(text) if text else default
    except ValueError:
        v = -1
    if v < 0:
        raise SystemExit(f"ds4t serve: ${name} must be an integer >= 0, got {text!r}")
    return v


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return v


def _size(text: str) -> int:
    from ds4t.serve.planner import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _cache_dir(text: str) -> str:
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    return text


def _device(text: str) -> str:
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"not a device: {text!r} (cuda, cuda:N or cpu)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: no CUDA GPU is available on this machine")
    if dev.type not in ("cuda", "cpu", "meta"):
        raise argparse.ArgumentTypeError(f"{text}: ds4t runs on cuda or cpu (meta: --plan-only)")
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server: N resident sessions, decode steps batched",
        description="Serve a model over HTTP with --batched-session N resident sessions whose ready decode "
                    "steps run as one batched step (bit-identical to running each alone).")
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ds4t.cli import int_at_least

    pos, nonneg = int_at_least(1), int_at_least(0)
    p.add_argument("--model", default="tiny-qwen", help="preset name or HF checkpoint directory")
    p.add_argument("--device", default=None, type=_device,
                   help="cuda or cpu (default: cuda if present); meta with --plan-only: plan for hardware that is "
                        "not here (shapes only, no weights read or drawn; give its memory with --memory-limit)")
    from ds4t.models.checkpoint import DTYPES

    p.add_argument("--dtype", default=None, choices=sorted(DTYPES),
                   help="weights and activations (default: the checkpoint's)")
    p.add_argument("--dequantize", action="store_true",
                   help="GGUF: dequantize every quantized tensor at load (the float kernels run its weights)")
    p.add_argument("--batched-session", type=pos, default=1, metavar="N",
                   help="resident sessions allocated at start; requests beyond N wait (FIFO)")
    p.add_argument("--max-ctx", type=pos, default=None, metavar="C",
                   help="context of every session (default: min(4096, the model's max positions))")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_at_least(0, 65535), default=8000, help="port (0: any free port; the chosen one is printed)")
    p.add_argument("--memory-limit", default=None, type=_size, metavar="SIZE",
                   help="refuse to start when the plan exceeds SIZE (e.g. 80GiB); default: the device's free memory")
    p.add_argument("--coalesce-us", type=nonneg, default=None, metavar="US",
                   help=f"after new arrivals, wait up to US for more before the step, while slots are free "
                        f"(default ${ENV_COALESCE} or 2000; 0: never wait)")
    p.add_argument("--batch-log", action="store_true", default=None,
                   help=f"log every batch: items, rows, paths, elapsed (or ${ENV_BATCH_LOG}=1)")
    p.add_argument("--prefill-chunk", type=pos, default=128, metavar="T",
                   help="prompt tokens per step while anything decodes (default 128)")
    p.add_argument("--prefill-chunk-idle", type=pos, default=512, metavar="T",
                   help="prompt tokens per step while nothing decodes (default 512)")
    p.add_argument("--kv-cache-dir", default=None, type=_cache_dir, metavar="DIR",
                   help="save idle sessions' states here (created 0700, one server per directory) before "
                        "reusing their slot; restore them when the conversation returns")
    p.add_argument("--kv-cache-max-entries", type=pos, default=256, metavar="K",
                   help="saved states kept in --kv-cache-dir (least recently used dropped first)")
    p.add_argument("--max-waiting", type=nonneg, default=1024, metavar="Q",
                   help="requests that may wait for a busy slot; more get 503 (0: no queue, only idle slots "
                        "are taken; default 1024)")
    p.add_argument("--drain-timeout", type=_seconds, default=30.0, metavar="S",
                   help="at SIGTERM/SIGINT: new requests get 503 while held ones finish for up to S seconds; "
                        "then open streams end with an error event and [DONE] (default 30)")
    p.add_argument("--idle-timeout", type=_seconds, default=30.0, metavar="S",
                   help="close a connection that has not sent a complete request (headers) within S seconds, "
                        "at its start or between keep-alive requests (default 30)")
    p.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                   help="answer 408 when a request body has not arrived within S seconds (default 30)")
    p.add_argument("--served-model-name", default=None, help="model id in the API (default: preset or directory name)")
    p.add_argument("--mode", default="auto", choices=["auto", "ordered"],
                   help="eval_batch mode: auto (native where the model allows) or ordered (each session "
                        "alone, for comparison)")
    p.add_argument("--plan-only", action="store_true", help="print the memory plan and exit (0: fits, 2: does not)")
    p.add_argument("--mtp", type=nonneg, default=0, metavar="K",
                   help="speculative decoding: K drafts per slot per step from the model's MTP head, verified in "
                        "the step's one batched call; the same tokens as without it (0: off)")
    p.add_argument("--tp", type=pos, default=1, metavar="K",
                   help="tensor + expert parallel over K ranks (started here, one per GPU; or torchrun's): rank 0 "
                        "serves HTTP, the others replay its steps on their shards; the memory plan is per rank")


def build(args, model=None):
    """(server, plan) from parsed arguments; server is None when the plan does not fit."""
    import ds4t
    from ds4t.serve.http import Server
    from ds4t.serve.persistence import KVStoreError
    from ds4t.serve.planner import plan

    if model is None:
        try:
            model = ds4t.load(args.model, device=args.device, dtype=args.dtype, dequantize=args.dequantize)
        except (ds4t.CheckpointError, ValueError, KeyError, OSError) as e:
            raise SystemExit(f"ds4t serve: cannot load {args.model!r}: {e}") from None
    max_ctx = args.max_ctx if args.max_ctx is not None else min(4096, model.max_position)
    if max_ctx > model.max_position:
        raise SystemExit(f"ds4t serve: --max-ctx must be in [1, {model.max_position}] for this model, got {max_ctx}")
    coalesce = args.coalesce_us if args.coalesce_us is not None else _env_int(ENV_COALESCE, 2000)
    batch_log = args.batch_log if args.batch_log is not None else _env_flag(ENV_BATCH_LOG)
    p = plan(model, args.batched_session, max_ctx, args.batched_session + max(args.prefill_chunk, args.prefill_chunk_idle),
             memory_limit=args.memory_limit)
    if not p.fits or args.plan_only:
        return None, p
    # a preset by its name; a checkpoint directory or a .gguf file by its base name (not the whole path)
    model_id = args.served_model_name or (os.path.basename(os.path.abspath(args.model))
                                          if os.path.exists(args.model) else args.model)
    try:
        server = Server(model, slots=args.batched_session, max_ctx=max_ctx, model_id=model_id, coalesce_us=coalesce,
                        prefill_chunk=args.prefill_chunk, prefill_chunk_idle=args.prefill_chunk_idle,
                        kv_cache_dir=args.kv_cache_dir, kv_cache_max_entries=args.kv_cache_max_entries,
                        max_waiting=args.max_waiting, batch_log=batch_log, mode=args.mode,
                        drain_timeout=args.drain_timeout, idle_timeout=args.idle_timeout,
                        body_timeout=args.body_timeout, mtp=args.mtp)
    except KVStoreError as e:
        raise SystemExit(f"ds4t serve: --kv-cache-dir: {e}") from None
    except ValueError as e:   # e.g. --mtp on a model without an MTP head
        raise SystemExit(f"ds4t serve: {e}") from None
    server.aliases.add(args.model)
    return server, p


def run(args) -> int:
    if args.device == "meta" and not (args.plan_only and args.memory_limit):
        raise SystemExit("ds4t serve: --device meta only plans: add --plan-only and the target's --memory-limit "
                         "(e.g. 139GiB for one H200)")
    if getattr(args, "tp", 1) > 1:
        from ds4t.parallel.launch import run_spmd

        return run_spmd(serve_rank, args.tp, args)
    return _serve(args)


def serve_rank(args) -> int:
    """One rank of ``ds4t serve --tp K``: rank 0 serves (:class:`ds4t.parallel.mirror.Leader`), the
    others follow its steps."""
    import torch.distributed as dist

    import ds4t
    from ds4t.parallel.mirror import Leader, follow

    try:
        model = ds4t.load(args.model, device=args.device, dtype=args.dtype, tp=args.tp, dequantize=args.dequantize)
    except (ds4t.CheckpointError, ValueError, KeyError, OSError) as e:
        raise SystemExit(f"ds4t serve: cannot load {args.model!r} with --tp {args.tp}: {e}") from None
    if args.plan_only:
        return _plan_ranks(args, model)
    ctrl = dist.new_group(backend="gloo")   # the step list travels as CPU objects
    if dist.get_rank() != 0:
        return follow(model, ctrl)
    leader = Leader(model, ctrl)
    try:
        return _serve(args, model)
    finally:
        leader.stop()


def _plan_ranks(args, model) -> int:
    """``--plan-only`` under ``--tp``: every rank's plan (its shard, the sessions' state shard, the step's
    workspace); rank 0 prints its own plan and every rank's total. 0 when every rank fits, else 2."""
    import torch.distributed as dist

    from ds4t.serve.planner import every_rank, fmt_bytes

    _, p = build(args, model)
    every = every_rank(p)
    if dist.get_rank() == 0:
        print(p.format() + "\n  (rank 0's plan; every rank below)", flush=True)
        for r, q in enumerate(every):
            print(f"  rank {r}: weights {fmt_bytes(q.weights)}, sessions {fmt_bytes(q.sessions)}, workspace "
                  f"{fmt_bytes(q.workspace)}, total {fmt_bytes(q.total)} of "
                  f"{fmt_bytes(q.available) if q.available else '?'}: {'fits' if q.fits else 'DOES NOT FIT'}",
                  flush=True)
    return 0 if all(q.fits for q in every) else 2


def _serve(args, model=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    from ds4t.backend import device_name

    print(f"ds4t serve: loading {args.model} ...", flush=True)
    server, p = build(args, model)
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
    if server.exit_code:
        print(f"ds4t serve: stopped: {server.worker.fatal} (exit {server.exit_code}: restart me)",
              file=sys.stderr, flush=True)
        return server.exit_code
    print("ds4t serve: stopped", flush=True)
    return 0


def main(argv=None) -> int:
    from ds4t.cli import Parser

    p = Parser(prog="ds4t serve", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


def spawn(argv, env=None, timeout: float = 180.0, cwd=None, program=("-m", "ds4t.serve")):
    """Start ``python -m ds4t.serve *argv`` (or ``python *program *argv``) in a subprocess and wait
    until it listens.

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

    p = subprocess.Popen([sys.executable, *program, *argv], cwd=cwd,
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
