"""Find the first kernel call whose rows differ between a native step and the ordered steps.

Twins of N sessions (same prompts) take one decode step: set A ordered (N one-row forwards),
set B native (one N-row forward). Every kernel launcher call is recorded; call j of the native
forward is compared, row by row, with call j of each ordered forward. Prints, per kernel call,
whether the rows agree bitwise, and the first call that does not.

Usage: python bench/diagnose_invariance.py --model qwen3-next-80b-4l --sessions 8 [--ctx 64]
"""
from __future__ import annotations

import argparse
import importlib
import os
import random
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import ds4t  # noqa: E402

RECORD = [True]
MODULES = ["linear", "norm", "activation", "embedding", "attention", "conv", "gdn", "moe", "router", "rope", "mla"]


def install_recorder(log):
    for mod in MODULES:
        try:
            m = importlib.import_module(f"ds4t.kernels.{mod}")
        except ImportError:
            continue
        for name in dir(m):
            f = getattr(m, name)
            if callable(f) and not name.startswith("_") and hasattr(m, name + "_ref") and getattr(f, "__module__", "") == m.__name__:
                def wrap(f=f, key=f"{mod}.{name}"):
                    def w(*a, **k):
                        out = f(*a, **k)
                        if RECORD[0]:
                            log.append((key, out))
                        return out
                    return w
                setattr(m, name, wrap())


def rows_of(out, r):
    outs = out if isinstance(out, tuple) else (out,)
    res = []
    for o in outs:
        if isinstance(o, torch.Tensor) and o.dim() >= 1 and o.shape[0] % r == 0:
            res.append(o.detach().reshape(r, -1).clone())
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-next-80b-4l")
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=64)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--harness-sessions", type=int, default=0, help="then run the exactness harness too")
    ap.add_argument("--harness-steps", type=int, default=8)
    args = ap.parse_args()
    log = []
    install_recorder(log)
    model = ds4t.load(args.model, dtype=args.dtype)
    model.cuda_graphs = False   # the recorder sees only kernels launched from Python
    rng = random.Random(0)
    prompts = [[rng.randrange(model.vocab_size) for _ in range(rng.randint(1, args.ctx))] for _ in range(args.sessions)]
    A = [model.new_session(args.ctx + 8) for _ in prompts]
    B = [model.new_session(args.ctx + 8) for _ in prompts]
    for a, b, p in zip(A, B, prompts):
        a.prefill(p)
        b.prefill(p)
    toks = [rng.randrange(model.vocab_size) for _ in prompts]
    log.clear()
    for a, t in zip(A, toks):
        ds4t.eval_batch([ds4t.DecodeItem(a, t)], mode="ordered")
    n = args.sessions
    per = len(log) // n
    ordered = [log[i * per:(i + 1) * per] for i in range(n)]
    log.clear()
    ds4t.eval_batch([ds4t.DecodeItem(b, t) for b, t in zip(B, toks)], mode="native")
    native = list(log)
    print(f"{args.model}: {per} kernel calls per forward (native {len(native)})")
    first = None
    for j, (key, out) in enumerate(native):
        nat = rows_of(out, n)
        bad = []
        for i in range(n):
            okey, oout = ordered[i][j]
            assert okey == key, (okey, key)
            one = rows_of(oout, 1)
            for x, (nr, orow) in enumerate(zip(nat, one)):
                if not torch.equal(nr[i], orow[0]):
                    d = (nr[i].float() - orow[0].float()).abs().max().item()
                    bad.append(f"row {i} out{x} max|d|={d:.2e}")
        status = "ok" if not bad else f"DIFFERS ({len(bad)}): {bad[:3]}"
        print(f"{j:3d} {key:28s} {status}")
        if bad and first is None:
            first = (j, key)
    print("first differing call:", first)
    if args.harness_sessions:
        from ds4t.exactness.harness import random_scenario, run_scenario

        RECORD[0] = False
        log.clear()
        sc = random_scenario(random.Random(1), model.vocab_size, args.harness_sessions, args.harness_steps,
                             max_prompt=200, max_ctx=200 + args.harness_steps + 8)
        rep = run_scenario(model, sc, mode="native")
        print("harness:", rep)


if __name__ == "__main__":
    main()
