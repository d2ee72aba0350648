"""The ``ds4t`` command (also ``python -m ds4t``)."""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional


class UsageError(Exception):
    """Bad input the user can fix: printed as one line, exit code 2 (no traceback)."""


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show each option's default, except where it is None / off or the help already says it."""

    def _get_help_string(self, action):
        h = action.help or ""
        if action.default in (None, [], argparse.SUPPRESS) or isinstance(action.default, bool) \
                or "default" in h.lower():
            return h
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help and errors as one line (``ds4t demo: error: ...``), exit 2."""

    def __init__(self, *a, **kw):
        kw.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*a, **kw)

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def int_at_least(lo: int, hi: Optional[int] = None):
    """An argparse type: an integer >= ``lo`` (1: "a positive integer") and, given ``hi``, <= ``hi``, else
    a one-line error."""
    what = f"an integer in [{lo}, {hi}]" if hi is not None else "a positive integer" if lo == 1 \
        else f"an integer >= {lo}"

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    parse.__name__ = what
    return parse


_positive_int = int_at_least(1)
_non_negative_int = int_at_least(0)


def _chunk_sizes(text: str) -> List[int]:
    try:
        sizes = [int(x) for x in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(c < 1 for c in sizes):
        raise argparse.ArgumentTypeError(f"expected positive chunk sizes like 1,17,64, got {text!r}")
    return sizes


def key_value(text: str):
    """``KEY=VALUE`` (a ``--opt`` load option) -> (key, value), the value an int when it reads as one; an
    argparse error otherwise. Also the bench scripts' ``--opt``."""
    k, eq, v = text.partition("=")
    if not eq or not k:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return k, int(v) if v.lstrip("-").isdigit() else v


def _progress(args, total: int, desc: str):
    """A tqdm bar on stderr: on when stderr is a terminal, or when --progress asks (off: --no-progress)."""
    from tqdm import tqdm

    show = args.progress if args.progress is not None else sys.stderr.isatty()
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not show, leave=False, dynamic_ncols=True)


def _table(headers, rows) -> str:
    cols = [list(map(str, c)) for c in zip(headers, *rows)]
    widths = [max(len(x) for x in c) for c in cols]
    line = lambda r: "  ".join(str(x).ljust(w) for x, w in zip(r, widths))  # noqa: E731
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    return "\n".join(out)


def _select_checks(checks, names):
    """(checks to run, op names to keep or None for all) for --kernel NAME: a kernel module
    (``linear``) or an op (``linear_heads``, ``rms_norm``; see ds4t.testing.kernel_ops)."""
    from ds4t.testing import kernel_ops

    if not names:
        return checks, None
    ops = kernel_ops()
    known = sorted(set(ops) | {o for v in ops.values() for o in v})
    bad = [n for n in names if n not in known]
    if bad:
        raise UsageError(f"--kernel {bad[0]!r}: no such kernel; names: {', '.join(known)}")
    modules = {m for m, v in ops.items() if m in names or set(v) & set(names)}
    whole = {m for m in modules if m in names}
    keep = None if whole == modules else set(names) | {o for m in whole for o in ops[m]}
    return [c for c in checks if c.__module__.rsplit(".", 1)[-1] in modules], keep


def cmd_check(args) -> int:
    """Run every kernel against its reference on this device and print a table."""
    import ds4t  # noqa: F401
    from ds4t.backend import default_device, device_name
    from ds4t.kernels.registry import all_checks

    checks, keep = _select_checks(all_checks(), args.kernel)
    device = default_device()
    print(f"ds4t check on {device_name()}")
    rows, failed = [], 0
    bar = _progress(args, len(checks), "check")
    for check in checks:
        bar.set_postfix_str(check.__module__.rsplit(".", 1)[-1])
        try:
            results = check(device)
        except Exception as e:  # a broken kernel is a row in the table, not a crash
            rows.append([getattr(check, "__module__", "?"), "-", "error", "-", "-", "-", repr(e)[:60]])
            failed += 1
            bar.update()
            continue
        bar.update()
        for r in results:
            if keep is not None and r.kernel.split()[0] not in keep:
                continue
            rows.append([r.kernel, r.shapes, f"{r.max_err:.2e}", f"{r.tol:.0e}",
                         "yes" if r.batch_invariant else "NO", f"{r.ms:.3f}", "ok" if r.ok else "FAIL"])
            failed += not r.ok
    bar.close()
    print(_table(["kernel", "shapes", "max err", "tol", "batch-invariant", "ms", "status"], rows))
    print(f"{len(rows) - failed}/{len(rows)} ok")
    return 1 if failed else 0


def _load(args):
    """ds4t.load with --model/--device/--dtype and the --opt KEY=VALUE load options; what the user
    got wrong (no GPU, unknown model, bad option) raises UsageError."""
    import ds4t
    from ds4t.backend import default_device

    kernel_device = default_device().type
    if args.device is not None and args.device != kernel_device:
        raise UsageError(f"--device {args.device}: ds4t's kernels run on {kernel_device} on this machine"
                         + (" (no CUDA GPU found)" if kernel_device == "cpu" else ""))
    tp = getattr(args, "tp", 1)
    try:
        return ds4t.load(args.model, device=args.device, dtype=args.dtype, **dict(args.opt),
                         **({"tp": tp} if tp > 1 else {}), **({"dequantize": True} if args.dequantize else {}))
    except (ds4t.CheckpointError, TypeError, ValueError) as e:
        raise UsageError(str(e)) from None


def _prompts(n: int, vocab: int, seed: int = 0):
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(4, 24))] for _ in range(n)]


DEMO_QUESTIONS = ("What is the capital of France?", "Name three primary colors.", "What is 12 times 12?",
                  "Write a haiku about the sea.", "Why is the sky blue?", "Give me a synonym for happy.",
                  "What do bees make?", "How many legs does a spider have?")
"""Chat prompts of ``ds4t demo`` for a checkpoint with a tokenizer (session i asks question i mod 8)."""


def _text_prompts(model, n: int):
    """(questions, token ids) of n chat prompts rendered with the checkpoint's chat template."""
    from ds4t.text import TextCodec

    codec = TextCodec.for_model(model)
    qs = [DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)] for i in range(n)]
    ids = [codec.encode(codec.chat_prompt([{"role": "user", "content": q}]), add_special_tokens=False) for q in qs]
    return codec, qs, ids


def _one_line_error(args, err: Exception) -> int:
    """Print a command's error as one line; exit status 2 for a usage error, 1 for a model whose logits held a
    NaN (FloatingPointError: the command ran, the model failed)."""
    print(f"ds4t {args.cmd}: error: {err}", file=sys.stderr)
    return _error_code(err)


def _error_code(err: Exception) -> int:
    return 2 if isinstance(err, UsageError) else 1


def _greedy(logits, where: str) -> list:
    """Greedy tokens of logits [B, V] through ds4t.sampling (whose argmax gives a row holding a NaN
    ``NO_TOKEN``, where torch's argmax gives the NaN's index, a token the demo would feed back):
    FloatingPointError naming the session and ``where`` for such a row."""
    from ds4t import sampling

    toks = [int(t) for t in sampling.sample(logits).tolist()]
    if sampling.NO_TOKEN in toks:
        raise FloatingPointError(f"session {toks.index(sampling.NO_TOKEN)}'s logits hold a NaN {where}: "
                                 "no token to choose")
    return toks


def cmd_demo(args) -> int:
    """N sessions, greedy decode, ordered then native; tok/s, speed-up, and a bit-exactness check.
    A checkpoint with a tokenizer (not a preset) gets chat prompts and its generated text printed."""
    import time

    import torch

    import ds4t
    from ds4t.backend import device_name

    model = _load(args)
    if args.mtp and getattr(model, "mtp", None) is None:
        raise UsageError(f"--mtp {args.mtp}: {args.model!r} has no MTP head to draft with (its checkpoint holds "
                         "no MTP weights)")
    text = args.model not in ds4t.presets() and model.tokenizer is not None
    print(f"ds4t demo: {args.model} ({model.family}, {model.dtype}) on {device_name()}; "
          f"{args.sessions} sessions x {args.steps} greedy steps"
          + ("; chat prompts through the checkpoint's tokenizer and chat template" if text else ""))
    if text:
        codec, questions, prompts = _text_prompts(model, args.sessions)
    else:
        prompts = _prompts(args.sessions, model.vocab_size)
    max_ctx = max(64, max(len(p) for p in prompts)) + args.steps
    # Prefill once; the native run starts from copies of the same states (state_dict / load).
    first = [model.new_session(max_ctx=max_ctx) for _ in prompts]
    pre = ds4t.eval_batch([ds4t.DecodeItem(s, p) for s, p in zip(first, prompts)], mode="auto")   # one call
    first_tok = _greedy(pre.logits, "after the prompt")
    snapshots = [(s.state_dict(), s.pos, list(s.tokens)) for s in first]
    runs = {}
    for mode in ("ordered", "native"):
        if mode == "ordered":
            sessions = first
        else:
            sessions = [model.new_session(max_ctx=max_ctx) for _ in prompts]
            for s, (state, pos, toks_) in zip(sessions, snapshots):
                s.load_state_dict(state, pos, toks_)
        toks = list(first_tok)
        rows = []
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        bar = _progress(args, args.steps, mode)
        t0 = time.perf_counter()
        for step in range(args.steps):
            res = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode=mode)
            rows.append(res.logits)
            toks = _greedy(res.logits, f"at {mode} step {step + 1}")
            bar.update()
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bar.close()
        runs[mode] = (torch.stack(rows), dt, res.paths, [s.tokens[len(p):] for s, p in zip(sessions, prompts)])
        for s in sessions:
            s.close()
    n_tok = args.sessions * args.steps
    (lo, to, _, txt_o), (ln, tn, paths, txt_n) = runs["ordered"], runs["native"]
    exact = torch.equal(lo, ln) and txt_o == txt_n
    last = _greedy(ln[-1], "at the last step")   # each session's last choice (fed tokens are in txt_n)
    print(_table(["mode", "steps", "tokens", "seconds", "tok/s"], [
        ["ordered", args.steps, n_tok, f"{to:.2f}", f"{n_tok / to:.1f}"],
        ["native", args.steps, n_tok, f"{tn:.2f}", f"{n_tok / tn:.1f}"],
    ]))
    print(f"native paths: {sorted(set(paths))}")
    print(f"speed-up (native vs ordered): {to / tn:.2f}x")
    if text:
        print("generated text (greedy; the native run, equal to the ordered one when bit-exact):")
        stops = set(codec.eos_ids)
        for i, (q, toks) in enumerate(zip(questions, txt_n)):
            gen = toks + [last[i]]   # every token fed, then the last step's choice
            cut = next((k for k, t in enumerate(gen) if t in stops), len(gen))
            print(f"  {q!r} -> {codec.decode(gen[:cut])!r}")
    print(f"bit-exact: {'yes' if exact else 'NO'} ({lo.numel()} float32 logits compared)")
    if args.mtp:
        emitted = [toks + [last[i]] for i, toks in enumerate(txt_n)]
        exact = _demo_mtp(args, model, prompts, max_ctx, emitted, tn) and exact
    return 0 if exact else 1


def _demo_mtp(args, model, prompts, max_ctx, native_tokens, native_s) -> bool:
    """The demo's speculative run: MTP drafts (k = args.mtp), one verify call per step for all
    sessions; acceptance, calls, tok/s against the native run, and the tokens compared."""
    import time

    import torch

    from ds4t.batch import speculative as spec

    sessions = [model.new_session(max_ctx=max_ctx) for _ in prompts]
    try:
        first = spec.prefill([spec.DecodeItem(s, p) for s, p in zip(sessions, prompts)])
        out = [[t] for t in _greedy(first, "after the prompt (speculative run)")]
        want = args.steps + 1
        drafted = accepted = calls = 0
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        while any(len(o) < want for o in out):
            live = [i for i, o in enumerate(out) if len(o) < want]
            res, _ = spec.spec_step([spec.SpecItem(sessions[i], out[i][-1], k=args.mtp, max_tokens=want - len(out[i]))
                                     for i in live])
            calls += 1
            for i, r in zip(live, res):
                out[i] += r.tokens
                drafted += r.drafted
                accepted += r.accepted
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    finally:
        for s in sessions:
            s.close()
    same = out == native_tokens
    n_tok = len(prompts) * args.steps
    print(f"speculative (MTP, k = {args.mtp}): {calls} verify calls for {args.steps} steps, "
          f"{accepted}/{drafted} drafts accepted ({100 * accepted / max(drafted, 1):.0f} %), "
          f"{n_tok / dt:.1f} tok/s, {native_s / dt:.2f}x the native run (random weights rarely draft right)")
    print(f"speculative tokens equal to the native run: {'yes' if same else 'NO'}")
    return same


def cmd_exactness(args) -> int:
    """Random session mixes: native against ordered, bitwise; then the negative control.
    With --mtp K: speculative decoding against plain decoding instead."""
    import random

    if args.mtp:
        return _exactness_mtp(args)

    from ds4t.backend import device_name
    from ds4t.exactness.controls import kinds_for, run_controls
    from ds4t.exactness.harness import Report, random_scenario, run_scenario

    model = _load(args)
    tp = getattr(model, "tp", None)
    print(f"ds4t exactness: {args.model} ({model.family}, {model.dtype}) on {device_name()}"
          + (f"; tensor parallel over {tp.size} ranks ({tp.backend}), rank 0 shown, exit code the worst rank's"
             if tp is not None else ""))
    kinds = kinds_for(model)
    rng = random.Random(args.seed)
    total = Report()
    rows = []
    control_steps = min(args.steps, 3)
    bar = _progress(args, args.rounds * args.steps + args.negative_control * len(kinds) * control_steps,
                    "exactness")
    for r in range(args.rounds):
        sc = random_scenario(rng, model.vocab_size, args.sessions, args.steps, max_prompt=args.max_prompt,
                             max_ctx=args.max_prompt + args.steps + 8)
        rep = run_scenario(model, sc, mode=args.mode, on_step=lambda _: bar.update())
        total.merge(rep)
        rows.append([r, rep.sessions, rep.steps, rep.rows, rep.states, rep.mismatches,
                     " ".join(f"{k}={v}" for k, v in sorted(rep.paths.items())), rep.first_mismatch or "-"])
    controls = []
    if args.negative_control:
        sc = random_scenario(random.Random(args.seed + 1), model.vocab_size, max(2, min(args.sessions, 4)),
                             control_steps, max_prompt=8, max_ctx=64)
        for kind in kinds:   # one at a time, so the bar moves
            controls += run_controls(model, sc, mode=args.mode, kinds=(kind,))
            bar.update(control_steps)
    bar.close()
    print(_table(["round", "sessions", "steps", "rows compared", "states compared", "mismatches", "paths",
                  "first mismatch"], rows))
    if not total.paths.get("native"):
        print("note: no row ran natively (every row fell back to ordered), so native was never compared "
              "against ordered")
    if controls:
        print("negative control (planted deviations):")
        print(_table(["planted", "mismatches", "verdict"], [[c.kind, c.report.mismatches, c.verdict]
                                                              for c in controls]))
        if not all(c.applicable for c in controls):
            print("note: a control that is not applicable had nothing to show in (no native call of 2+ rows "
                  "in its scenario); it neither passes nor fails the run")
    chunks_ok = _chunk_check(model, args) if args.chunks else True
    soak_ok = _soak(model, args) if args.soak else True
    print("exact: yes" if total.ok and soak_ok else f"exact: NO ({total.mismatches} mismatches, "
          f"{total.native_missing} rows not native" + ("" if soak_ok else "; a soak case differed") + ")")
    return 0 if total.ok and chunks_ok and soak_ok and all(c.ok for c in controls) else 1


SOAK_KINDS = ("scenario", "chunks", "speculative")
"""What a soak case checks, chosen by its seed (``seed % len(SOAK_KINDS)``), so ``--soak 1 --seed S`` replays
case S."""


def _soak(model, args) -> bool:
    """--soak N: N random cases, the case of seed S (args.seed, args.seed + 1, ...) being the kind
    SOAK_KINDS[S % len(SOAK_KINDS)]: a session mix (native vs ordered), a prompt of random length in random
    chunk sizes (vs whole and token by token in a batch), or speculative decoding with 1-4 drafts (vs plain
    decoding) -- bitwise, each with its sizes drawn from the seed within --sessions / --steps /
    --max-prompt. Stops at the first case that differs and names its seed."""
    import random
    import time

    from ds4t.exactness.chunks import run_chunk_check
    from ds4t.exactness.harness import random_scenario, run_scenario
    from ds4t.exactness.speculative import run_speculative

    counts = {k: [0, 0, 0] for k in SOAK_KINDS}   # cases, rows compared, mismatches
    bad, t0 = None, time.time()
    bar = _progress(args, args.soak, "soak")
    for seed in range(args.seed, args.seed + args.soak):
        rng, kind = random.Random(seed), SOAK_KINDS[seed % len(SOAK_KINDS)]
        if kind == "scenario":
            sc = random_scenario(rng, model.vocab_size, rng.randint(2, max(2, args.sessions)),
                                 rng.randint(2, max(2, args.steps)), max_prompt=args.max_prompt,
                                 max_ctx=args.max_prompt + args.steps + 8)
            rep = run_scenario(model, sc, mode=args.mode)
            rows, what = rep.rows, rep.first_mismatch
            diff = rep.mismatches + rep.native_missing
        elif kind == "chunks":
            n = rng.randint(2, max(2, args.max_prompt))
            sizes = sorted({1, rng.randint(2, 40), rng.randint(2, n), n})
            rep = run_chunk_check(model, [rng.randrange(model.vocab_size) for _ in range(n)], sizes)
            rows, diff, what = rep.rows, rep.mismatches, rep.first_mismatch
            what = f"{n}-token prompt in chunks {sizes}: {what}" if diff else what
        else:
            k = rng.randint(1, 4)
            rep = run_speculative(model, k=k, sessions=rng.randint(2, max(2, args.sessions)),
                                  new_tokens=min(args.steps, 8), seed=seed,
                                  max_ctx=args.max_prompt + args.steps + k + 16)
            rows, diff, what = rep.calls, rep.mismatches, rep.first_mismatch
        c = counts[kind]
        c[0], c[1], c[2] = c[0] + 1, c[1] + rows, c[2] + diff
        bar.update()
        if diff:
            bad = (seed, kind, what)
            break
    bar.close()
    print(f"soak: {sum(c[0] for c in counts.values())} of {args.soak} random cases in {time.time() - t0:.0f} s "
          f"(seeds from {args.seed}; bitwise):")
    print(_table(["kind", "cases", "rows / calls compared", "mismatches"], [[k, *counts[k]] for k in SOAK_KINDS]))
    if bad is not None:
        print(f"soak case {bad[0]} ({bad[1]}) differed: {bad[2]}; replay it alone with --soak 1 --seed {bad[0]}")
    return bad is None


def _chunk_check(model, args) -> bool:
    """--chunks: one random prompt of --max-prompt tokens, whole vs each chunk size vs token by token in
    a native batch, bitwise; with the negative control, the same under a batch-dependent linear."""
    import random

    from ds4t.exactness.chunks import run_chunk_check
    from ds4t.exactness.harness import plant

    rng = random.Random(args.seed + 2)
    prompt = [rng.randrange(model.vocab_size) for _ in range(args.max_prompt)]
    rep = run_chunk_check(model, prompt, args.chunks)
    rows = [["prefill chunks " + ",".join(map(str, args.chunks)) + " + token by token in a batch", rep.rows,
             rep.states, rep.mismatches, " ".join(f"{k}={v}" for k, v in sorted(rep.paths.items())),
             rep.first_mismatch or "-"]]
    ok = rep.ok
    if args.negative_control:
        with plant("batch-dependent"):
            ctl = run_chunk_check(model, prompt, args.chunks, in_batch=False)
        caught = ctl.mismatches > 0
        ok &= caught
        rows.append(["control: batch-dependent linear", ctl.rows, ctl.states, ctl.mismatches, "-",
                     "caught" if caught else "NOT CAUGHT"])
    print(f"prefill chunk invariance ({len(prompt)}-token prompt, whole vs chunks; bitwise):")
    print(_table(["check", "rows compared", "states compared", "mismatches", "paths", "first mismatch / verdict"],
                 rows))
    return ok


def _exactness_mtp(args) -> int:
    from ds4t.backend import device_name
    from ds4t.exactness.speculative import has_recurrent_rollback, plant, run_speculative

    model = _load(args)
    print(f"ds4t exactness --mtp {args.mtp}: {args.model} ({model.family}, {model.dtype}) on {device_name()}; "
          f"speculative decoding against plain decoding"
          + ("" if getattr(model, "mtp", None) is not None else " (no MTP head: replayed drafts only)"))
    rows, ok = [], True
    for r in range(args.rounds):
        rep = run_speculative(model, k=args.mtp, sessions=args.sessions, new_tokens=args.steps, seed=args.seed + r,
                              max_ctx=args.max_prompt + args.steps + args.mtp + 16)
        ok = ok and rep.ok
        rows.append([r, rep.sessions, rep.calls, rep.emitted, f"{rep.accepted}/{rep.drafted}", rep.mismatches,
                     rep.first_mismatch or "-"])
    print(_table(["round", "sessions", "verify calls", "tokens", "drafts accepted", "mismatches",
                  "first mismatch"], rows))
    controls_ok = True
    if args.negative_control:
        kinds = ["accept-one-more"] + (["skip-rollback"] if has_recurrent_rollback(model) else [])
        crow = []
        for kind in kinds:
            with plant(kind, model):
                rep = run_speculative(model, k=max(args.mtp, 2), sessions=min(args.sessions, 4),
                                      new_tokens=min(args.steps, 8), seed=args.seed)
            crow.append([kind, rep.mismatches, "caught" if rep.mismatches else "NOT CAUGHT"])
            controls_ok = controls_ok and rep.mismatches > 0
        print("negative control (planted deviations):")
        print(_table(["planted", "mismatches", "verdict"], crow))
    soak_ok = _soak(model, args) if args.soak else True
    print("exact: yes" if ok and soak_ok else "exact: NO")
    return 0 if ok and controls_ok and soak_ok else 1


def cmd_diagnose(args) -> int:
    """One decode step native vs ordered, compared op call by op call; names the first that differs."""
    from ds4t.exactness.diagnose import diagnose

    model = _load(args)
    d = diagnose(model, sessions=args.sessions, ctx=args.ctx, seed=args.seed)
    print(f"ds4t diagnose: {args.model} ({model.family}, {model.dtype})")
    print(d.table())
    return 0 if d.first is None and d.logits_equal else 1


def _on_ranks(run, args) -> int:
    """``run(args)`` on every rank of ``--tp`` (ds4t.parallel.launch: spawned here, or torchrun's); the
    worst exit code. Rank 0 prints; the others' output is dropped."""
    from ds4t.parallel.launch import run_spmd

    return run_spmd(_rank_main, args.tp, run.__name__, args)


def _rank_main(name: str, args) -> int:
    """One rank of ``_on_ranks`` (module level: spawned ranks import it by name). A usage error or a NaN is
    the same on every rank (the checks and the logits are), so rank 0 alone prints its line, as it alone
    prints the output; the other ranks' lines only with ``DS4T_TP_VERBOSE=1``. Their exit codes still count."""
    import torch.distributed as dist

    import_user_modules(getattr(args, "imports", []))
    try:
        return globals()[name](args)
    except (UsageError, FloatingPointError) as err:
        if dist.is_initialized() and dist.get_rank() != 0 and os.environ.get("DS4T_TP_VERBOSE", "0") == "0":
            return _error_code(err)
        return _one_line_error(args, err)


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
            raise UsageError(f"--import {name}: {e}") from None


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


def cmd_convert(args) -> int:
    from ds4t.models import convert
    from ds4t.models.checkpoint import CheckpointError

    if not args.dst.lower().endswith(".gguf"):
        raise UsageError(f"{args.dst!r}: the output must be a .gguf file")
    folder = os.path.dirname(os.path.abspath(args.dst))
    if not os.path.isdir(folder):
        raise UsageError(f"{args.dst!r}: the folder {folder!r} does not exist")
    try:
        convert.check_tensor_types(args.type, convert.tensor_type_rules(args.tensor_type))
    except ValueError as e:
        raise UsageError(str(e)) from None
    try:
        return convert.main(args)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    except OSError as e:   # the destination cannot be written (permissions, a full disk)
        raise UsageError(f"{args.dst!r}: cannot write ({e.strerror or e})") from None


def main(argv=None) -> int:
    import ds4t

    p = Parser(prog="ds4t", description=__doc__)
    p.add_argument("--version", action="version", version=f"ds4t {ds4t.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)

    def progress_arg(sp):
        sp.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bar on stderr (default: when stderr is a terminal)")

    user = argparse.ArgumentParser(add_help=False)   # shared by the commands that run kernels
    user.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                      help="import MODULE first, e.g. one that registers kernel overrides (repeatable)")
    c = sub.add_parser("check", parents=[user], help="run every kernel against its reference on this device")
    c.add_argument("--kernel", action="append", default=[], metavar="NAME",
                   help="only this kernel module (e.g. linear) or op (e.g. rms_norm); repeatable")
    progress_arg(c)
    sub.add_parser("support", help="print the support matrix: model x native path x condition")

    def model_args(sp, default="tiny-qwen"):
        sp.add_argument("--model", default=default, help="preset name, HF checkpoint directory or .gguf file")
        sp.add_argument("--device", default=None, choices=["cuda", "cpu"],
                        help="where the model lives; must be where the kernels run (cuda when a GPU is present)")
        sp.add_argument("--dtype", default=None,
                        help="cast the weights to fp32, bf16 or fp16 (otherwise the checkpoint's dtype)")
        sp.add_argument("--opt", action="append", default=[], metavar="KEY=VALUE", type=key_value,
                        help="model load option, e.g. native_path=ds4 (DeepSeek) or native_window=20 (GLM)")
        sp.add_argument("--dequantize", action="store_true",
                        help="GGUF: dequantize every quantized tensor at load, so the float kernels run the "
                             "file's weights (several times faster in the CPU interpreter; more memory)")
        progress_arg(sp)

    def tp_arg(sp):
        sp.add_argument("--tp", type=_positive_int, default=1,
                        help="tensor + expert parallel over this many ranks: starts them itself (one per GPU, "
                             "nccl; gloo processes on the CPU), or joins those torchrun started; every rank "
                             "runs the command on its shard and the exit code is the worst rank's")

    d = sub.add_parser("demo", parents=[user], help="batched vs ordered decode on a tiny model, with a bit-exactness check")
    model_args(d)
    d.add_argument("--sessions", type=_positive_int, default=8, help="resident sessions, decoded together")
    d.add_argument("--steps", type=_positive_int, default=32, help="greedy decode steps per session")
    d.add_argument("--mtp", type=_non_negative_int, default=0, metavar="K",
                   help="also decode speculatively with K drafts per step from the model's MTP head: "
                        "acceptance, speed-up, and the tokens checked against the native run")
    tp_arg(d)

    e = sub.add_parser("exactness", parents=[user], help="native vs ordered, bitwise, on random session mixes")
    model_args(e)
    e.add_argument("--sessions", type=_positive_int, default=6, help="sessions per round (joining and leaving)")
    e.add_argument("--steps", type=_positive_int, default=6, help="batched steps per round")
    e.add_argument("--rounds", type=_positive_int, default=1, help="random scenarios to run")
    e.add_argument("--max-prompt", type=_positive_int, default=40, help="longest prompt, in tokens")
    e.add_argument("--mode", default="native", choices=["native", "auto"],
                   help="eval_batch mode under test: native (every row must run natively) or auto "
                        "(rows the model cannot take natively fall back to ordered)")
    e.add_argument("--seed", type=int, default=0, help="seed of the random scenarios")
    e.add_argument("--no-negative-control", dest="negative_control", action="store_false",
                   help="skip the planted-deviation runs")
    e.add_argument("--chunks", type=_chunk_sizes, default=None, metavar="C,C,...",
                   help="also check prefill chunk invariance: a --max-prompt-token prompt whole vs in chunks of "
                        "each size (e.g. 1,17,64) vs token by token in a native batch, logits and state bitwise; "
                        "on a GPU a prompt of >= 128 tokens also covers the row tiles of long prefill chunks")
    e.add_argument("--soak", type=_non_negative_int, default=0, metavar="N",
                   help="also N random cases in turn -- session mixes, prefill chunkings, speculative decoding, "
                        "sizes drawn from the case's seed within --sessions / --steps / --max-prompt -- stopping "
                        "at the first that differs (its seed replays it: --soak 1 --seed S)")
    e.add_argument("--mtp", type=_non_negative_int, default=0, metavar="K",
                   help="check speculative decoding instead: K drafts per step (the MTP head's, and replayed "
                        "ones with planted errors) against plain decoding -- tokens, logits, state -- bitwise")
    tp_arg(e)
    g = sub.add_parser("diagnose", parents=[user],
                       help="one native step vs ordered, op call by op call: the first op whose rows differ")
    model_args(g)
    g.add_argument("--sessions", type=_positive_int, default=8, help="sessions in the native step")
    g.add_argument("--ctx", type=_positive_int, default=64, help="longest random prompt")
    g.add_argument("--seed", type=int, default=0)
    v = sub.add_parser("convert", help="write a GGUF file (as llama.cpp writes it) from a preset or HF checkpoint dir")
    v.add_argument("src", help="preset name or HF checkpoint directory (llama / qwen3 so far)")
    v.add_argument("dst", help="the .gguf file to write")
    from ds4t.models.convert import TYPES as convert_types

    v.add_argument("--type", default="F32", type=str.upper, choices=convert_types,
                   help="type of the matrices (1-D tensors stay F32; rows a type does not fit fall back: "
                        "K-quants -> Q8_0 -> F16)")
    v.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="write the matrices whose GGUF name matches the regex PATTERN in TYPE (llama-quantize's "
                        "option; repeatable, the first match wins), e.g. attn_v=Q6_K for a Q4_K_M-like mix")
    v.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights")
    from ds4t.serve import cli as serve_cli

    serve_cli.add_parser(sub)
    args = p.parse_args(argv)
    run = {"check": cmd_check, "demo": cmd_demo, "exactness": cmd_exactness, "diagnose": cmd_diagnose,
           "support": cmd_support, "serve": serve_cli.run, "convert": cmd_convert}[args.cmd]
    try:
        import_user_modules(getattr(args, "imports", []))
        if getattr(args, "tp", 1) > 1 and args.cmd != "serve":   # serve starts its ranks itself
            return _on_ranks(run, args)
        return run(args)
    except (UsageError, FloatingPointError) as err:
        return _one_line_error(args, err)


if __name__ == "__main__":
    sys.exit(main())
