"""Find the first op call whose rows differ between a native step and the ordered steps.

A thin command line over :func:`ds4t.exactness.diagnose.diagnose` (also ``ds4t diagnose``): every
op call made through the kernel registry is recorded; prints, per call, whether its rows agree
bitwise, and names the first that does not (an overridden op as such).

Usage: python bench/diagnose_invariance.py --model qwen3-next-80b-4l --sessions 8 [--ctx 64]
       [--import mymodule]   (a module that registers kernel overrides when imported)
"""
from __future__ import annotations

import argparse
import importlib
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402
from ds4t.exactness.diagnose import diagnose  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-next-80b-4l")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                    help="import MODULE first (its kernel overrides apply)")
    ap.add_argument("--harness-sessions", type=int, default=0, help="then run the exactness harness too")
    ap.add_argument("--harness-steps", type=int, default=8)
    args = ap.parse_args()
    for name in args.imports:
        importlib.import_module(name)
    model = ds4t.load(args.model, dtype=args.dtype)
    d = diagnose(model, sessions=args.sessions, ctx=args.ctx)
    print(f"{args.model}:")
    print(d.table())
    if args.harness_sessions:
        from ds4t.exactness.harness import random_scenario, run_scenario

        sc = random_scenario(random.Random(1), model.vocab_size, args.harness_sessions, args.harness_steps,
                             max_prompt=200, max_ctx=200 + args.harness_steps + 8)
        print("harness:", run_scenario(model, sc, mode="native"))
    return 0 if d.first is None else 1


if __name__ == "__main__":
    sys.exit(main())
