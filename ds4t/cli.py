"""The ``ds4t`` command (also ``python -m ds4t``)."""
from __future__ import annotations

import argparse
import sys


def _table(headers, rows) -> str:
    cols = [list(map(str, c)) for c in zip(headers, *rows)]
    widths = [max(len(x) for x in c) for c in cols]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def cmd_check(args) -> int:
    """Run every kernel against its reference on this device and print a table."""
    import ds4t  # noqa: F401
    from ds4t.backend import default_device, device_name
    from ds4t.kernels.registry import all_checks

    device = default_device()
    print(f"ds4t check on {device_name()}")
    rows, failed = [], 0
    for check in all_checks():
        try:
            results = check(device)
        except Exception as e:  # a broken kernel is a row in the table, not a crash
            rows.append([getattr(check, "__module__", "?"), "-", "error", "-", "-", "-", repr(e)[:60]])
            failed += 1
            continue
        for r in results:
            rows.append([r.kernel, r.shapes, f"{r.max_err:.2e}", f"{r.tol:.0e}",
                         "yes" if r.batch_invariant else "NO", f"{r.ms:.3f}", "ok" if r.ok else "FAIL"])
            failed += not r.ok
    print(_table(["kernel", "shapes", "max err", "tol", "batch-invariant", "ms", "status"], rows))
    print(f"{len(rows) - failed}/{len(rows)} ok")
    return 1 if failed else 0


def _load(args):
    """ds4t.load with --model/--device/--dtype and the --opt KEY=VALUE load options."""
    import ds4t

    opts = {}
    for kv in args.opt:
        if "=" not in kv:
            raise SystemExit(f"--opt {kv!r}: expected KEY=VALUE")
        k, v = kv.split("=", 1)
        opts[k] = int(v) if v.lstrip("-").isdigit() else v
    return ds4t.load(args.model, device=args.device, dtype=args.dtype, **opts)


def _prompts(n: int, vocab: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]


def cmd_demo(args) -> int:
    """N sessions, greedy decode, ordered then native; tok/s, speed-up, and a bit-exactness check."""
    import time

    import torch

    import ds4t
    from ds4t.backend import device_name

    model = _load(args)
    print(f"ds4t demo: {args.model} ({model.family}, {model.dtype}) on {device_name()}; "
          f"{args.sessions} sessions x {args.steps} greedy steps")
    prompts = _prompts(args.sessions, model.vocab_size)
    # Prefill once; the native run starts from copies of the same states (state_dict / load).
    first = [model.new_session(max_ctx=64 + args.steps) for _ in prompts]
    first_tok = [int(s.prefill(p).argmax()) for s, p in zip(first, prompts)]
    snapshots = [(s.state_dict(), s.pos, list(s.tokens)) for s in first]
    runs = {}
    for mode in ("ordered", "native"):
        if mode == "ordered":
            sessions = first
        else:
            sessions = [model.new_session(max_ctx=64 + args.steps) for _ in prompts]
            for s, (state, pos, toks_) in zip(sessions, snapshots):
                s.load_state_dict(state, pos, toks_)
        toks = list(first_tok)
        rows = []
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode=mode)
            rows.append(res.logits)
            toks = [int(t) for t in res.logits.argmax(dim=1).tolist()]
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        runs[mode] = (torch.stack(rows), dt, res.paths, [s.tokens[-args.steps:] for s in sessions])
        for s in sessions:
            s.close()
    n_tok = args.sessions * args.steps
    (lo, to, _, txt_o), (ln, tn, paths, txt_n) = runs["ordered"], runs["native"]
    exact = torch.equal(lo, ln) and txt_o == txt_n
    print(_table(["mode", "steps", "tokens", "seconds", "tok/s"], [
        ["ordered", args.steps, n_tok, f"{to:.2f}", f"{n_tok / to:.1f}"],
        ["native", args.steps, n_tok, f"{tn:.2f}", f"{n_tok / tn:.1f}"],
    ]))
    print(f"native paths: {sorted(set(paths))}")
    print(f"speed-up (native vs ordered): {to / tn:.2f}x")
    print(f"bit-exact: {'yes' if exact else 'NO'} ({lo.numel()} float32 logits compared)")
    return 0 if exact else 1


def cmd_exactness(args) -> int:
    """Random session mixes: native against ordered, bitwise; then the negative control."""
    import random

    from ds4t.backend import device_name
    from ds4t.exactness.harness import Report, plant, random_scenario, run_scenario

    model = _load(args)
    print(f"ds4t exactness: {args.model} ({model.family}, {model.dtype}) on {device_name()}")
    rng = random.Random(args.seed)
    total = Report()
    rows = []
    for r in range(args.rounds):
        sc = random_scenario(rng, model.vocab_size, args.sessions, args.steps, max_prompt=args.max_prompt,
                             max_ctx=args.max_prompt + args.steps + 8)
        rep = run_scenario(model, sc, mode=args.mode)
        total.merge(rep)
        rows.append([r, rep.sessions, rep.steps, rep.rows, rep.states, rep.mismatches,
                     " ".join(f"{k}={v}" for k, v in sorted(rep.paths.items())), rep.first_mismatch or "-"])
    print(_table(["round", "sessions", "steps", "rows compared", "states compared", "mismatches", "paths",
                  "first mismatch"], rows))
    ok = total.ok
    if args.negative_control:
        caught = []
        for kind in ("ulp", "batch-dependent"):
            sc = random_scenario(random.Random(args.seed + 1), model.vocab_size, max(2, min(args.sessions, 4)),
                                 min(args.steps, 3), max_prompt=8, max_ctx=64)
            with plant(kind):
                rep = run_scenario(model, sc, mode=args.mode)
            caught.append([kind, rep.mismatches, "caught" if rep.mismatches else "NOT CAUGHT"])
            ok = ok and rep.mismatches > 0
        print("negative control (planted deviations):")
        print(_table(["planted", "mismatches", "verdict"], caught))
    print("exact: yes" if total.ok else f"exact: NO ({total.mismatches} mismatches, "
          f"{total.native_missing} rows not native)")
    return 0 if ok else 1


def cmd_diagnose(args) -> int:
    """One decode step native vs ordered, compared op call by op call; names the first that differs."""
    from ds4t.exactness.diagnose import diagnose

    model = _load(args)
    d = diagnose(model, sessions=args.sessions, ctx=args.ctx, seed=args.seed)
    print(f"ds4t diagnose: {args.model} ({model.family}, {model.dtype})")
    print(d.table())
    return 0 if d.first is None and d.logits_equal else 1


def import_user_modules(names) -> None:
    """``--import MODULE``: import each module (e.g. one calling ``ds4t.kernels.override``) before
    the command runs; the current directory is importable, as for ``python -m``."""
    import importlib
    import os

    if names and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise SystemExit(f"ds4t: --import {name}: {e}") from None


def cmd_support(args) -> int:
    """The support matrix, read from each family's NativeRule data (what the engine uses)."""
    from ds4t.models.registry import _families

    rows = []
    for model_type, (cls, *_rest) in sorted(_families().items()):
        rules = cls.__dict__.get("native_rules", getattr(cls, "native_rules", ()))
        if isinstance(rules, property):  # rules that depend on load options: the defaults
            rules = cls.default_native_rules() if hasattr(cls, "default_native_rules") else ()
        for rule in rules:
            rows.append([model_type, rule.path, rule.condition, rule.fallback])
    print(_table(["model_type", "path", "native when", "otherwise"], rows))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="ds4t", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    user = argparse.ArgumentParser(add_help=False)   # shared by the commands that run kernels
    user.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first, e.g. one that registers kernel overrides (repeatable)")
    sub.add_parser("check", parents=[user], help="run every kernel against its reference on this device")
    sub.add_parser("support", help="print the support matrix: model x native path x condition")

    def model_args(sp, default="tiny-qwen"):
        sp.add_argument("--model", default=default, help="preset name or HF checkpoint directory")
        sp.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
        sp.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 (default: checkpoint's)")
        sp.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE",
                        help="model load option, e.g. native_path=ds4 (DeepSeek) or native_window=20 (GLM)")

    d = sub.add_parser("demo", parents=[user], help="batched vs ordered decode on a tiny model, with a bit-exactness check")
    model_args(d)
    d.add_argument("--sessions", type=int, default=8)
    d.add_argument("--steps", type=int, default=32)

    e = sub.add_parser("exactness", parents=[user], help="native vs ordered, bitwise, on random session mixes")
    model_args(e)
    e.add_argument("--sessions", type=int, default=6)
    e.add_argument("--steps", type=int, default=6)
    e.add_argument("--rounds", type=int, default=1)
    e.add_argument("--max-prompt", type=int, default=40)
    e.add_argument("--mode", default="native", choices=["native", "auto"])
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-negative-control", dest="negative_control", action="store_false",
                   help="skip the planted-deviation runs")
    g = sub.add_parser("diagnose", parents=[user],
                       help="one native step vs ordered, op call by op call: the first op whose rows differ")
    model_args(g)
    g.add_argument("--sessions", type=int, default=8)
    g.add_argument("--ctx", type=int, default=64, help="longest random prompt")
    g.add_argument("--seed", type=int, default=0)
    from ds4t.serve import cli as serve_cli

    serve_cli.add_parser(sub)
    args = p.parse_args(argv)
    import_user_modules(getattr(args, "imports", []))
    return {"check": cmd_check, "demo": cmd_demo, "exactness": cmd_exactness, "diagnose": cmd_diagnose,
            "support": cmd_support, "serve": serve_cli.run}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
