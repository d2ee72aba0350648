"""A/B prefill variants in one process: config entries, pass-through overrides and state layouts.

Two ``bench_prefill`` runs of the same tree differ by up to 5-8 % in tokens/s (one session, chunks of 1024;
bench/results/2026-12-04-h200-gdn-dk-state.md): a change of that size cannot be read from two processes.
This script loads the model once and, for ``--rounds`` rounds, prefills the same ``--prompt``-token prompt
under each variant in turn (the order alternates every round) -- one session in chunks of ``--chunk``, and
for each N in ``--sessions`` above 1, N sessions that each take ``chunk // N`` rows of every step (every
session's chunk in one launch per layer, as a server's prefill budget runs them). The whole prompt is timed
(CUDA events on a GPU; opening the sessions included, copying results to the host not); the median of the
rounds is reported with its spread.

Each variant's result is also compared with the base's: ``bits`` -- the last chunk's logits and every
session's state after the prompt, bit for bit. A config entry or layout that changes a reduction's order
gives other bits (say so in the results file); one that only moves work (a launch option, a prefetch) must
keep them.

    python bench/prefill_ab.py --model qwen3-next-80b-4l --sessions 1,8 --rounds 6 \\
        --variant dv='{"state_order": {"recurrent": null}}' \\
        --variant nopf='{"gdn": [{"key": [32, 128, 128, "dk"], "fields": {"prefetch": false}}]}'

Variants are ``bench/step_ab.py``'s: ``NAME=SPEC``, SPEC inline JSON or a JSON file in the
``ds4t.kernels.config.overridden`` format plus optional ``"passthrough"``, ``"state_order"`` and ``"options"``
(load options set for the variant, e.g. ``{"options": {"attention_products": "cache"}}``).
``--device cpu`` runs the script on a tiny preset (a smoke run: the interpreter ignores GPU entries).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import ds4t  # noqa: E402,F401  (first: it picks the backend before triton loads)
import torch  # noqa: E402
from bench import model_spec  # noqa: E402
from bench.hf_peer import median_ms  # noqa: E402
from bench.step_ab import ab_setup, applied, same_result  # noqa: E402
from ds4t.batch.engine import run_segments  # noqa: E402


def prefill_prompt(model, prompt: list, chunk: int, n: int, collect: bool = True):
    """Prefill ``prompt`` as one session in ``chunk``-token pieces (n = 1) or as n sessions, each a 1/n slice
    of it, taking ``chunk // n`` rows of every step. Returns (last step's logits, the sessions' states) on the
    host, or None when not ``collect`` (what is timed: the copies to the host would take 20 ms of an 8-session
    prompt); the sessions are closed."""
    each, per = len(prompt) // n, chunk // n
    if per < 1 or each < 1:
        raise SystemExit(f"prefill_ab: {n} sessions need chunk >= {n} and prompt >= {n} tokens")
    sessions = [model.new_session(each + 8) for _ in range(n)]
    try:
        if n == 1:
            s = sessions[0]
            logits = None
            for p0 in range(0, each, chunk):
                logits = s.prefill(prompt[p0:p0 + chunk], chunk=chunk)
        else:
            parts = [prompt[i * each:(i + 1) * each] for i in range(n)]
            for p0 in range(0, each, per):
                logits = run_segments(model, [(s, p[p0:p0 + per]) for s, p in zip(sessions, parts)])
        if not collect:
            return None
        return logits.detach().float().cpu(), [s.state_dict("cpu") for s in sessions]
    finally:
        for s in sessions:
            s.close()


def random_prompt(vocab_size: int, n: int, seed: int = 0) -> list:
    """n tokens drawn uniformly from the vocabulary by one seeded generator: rows of a chunk route to the experts as
    a real prompt's spread over them (one token repeated would send every row to the same few)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]


def run(model, prompt: list, chunk: int, ns, variants, rounds: int, device, log):
    """Rows {n, variant, ms (median of rounds), lo, hi, tok_s, vs_base, bits, rounds}."""
    rows = []
    for n in ns:
        results = {}
        for name, spec in variants:   # warm-up (compiles) and the bits, once per variant
            with applied(model, spec):
                prefill_prompt(model, prompt, chunk, n)
                results[name] = prefill_prompt(model, prompt, chunk, n)
        times = {name: [] for name, _ in variants}
        for r in range(rounds):
            order = variants if r % 2 == 0 else variants[::-1]
            for name, spec in order:
                with applied(model, spec):
                    times[name].append(median_ms(lambda: prefill_prompt(model, prompt, chunk, n, collect=False), 1, 0,
                                                  device))
        base = statistics.median(times[variants[0][0]])
        for name, _ in variants:
            ms = statistics.median(times[name])
            rows.append(dict(n=n, variant=name, ms=ms, lo=min(times[name]), hi=max(times[name]),
                             tok_s=len(prompt) / (ms * 1e-3), vs_base=ms / base,
                             bits=same_result(results[name], results[variants[0][0]]), rounds=times[name]))
            log(f"sessions {n} {name}: {ms:.2f} ms ({min(times[name]):.2f}-{max(times[name]):.2f}) "
                f"= {rows[-1]['tok_s']:,.0f} tok/s, x{ms / base:.3f} of base, bits {'same' if rows[-1]['bits'] else 'DIFFER'}")
    return rows


def table(rows, chunk: int) -> str:
    out = ["| sessions | rows a step | variant | prompt ms (median of rounds) | rounds min-max | tok/s | vs base | "
           "bits as base |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        step = str(chunk) if r["n"] == 1 else f"{r['n']} x {chunk // r['n']}"
        out.append(f"| {r['n']} | {step} | {r['variant']} | "
                   f"{r['ms']:.2f} | {r['lo']:.2f}-{r['hi']:.2f} | {r['tok_s']:,.0f} | {r['vs_base']:.3f} | "
                   f"{'yes' if r['bits'] else 'NO'} |")
    return "\n".join(out)


def models_ab(specs: str, ns, variants, device, log, prompts: bool = True) -> bool:
    """Each model of ``specs`` ("preset[:quantize],...") loaded once, its variants timed on whole prompts (with
    ``prompts``: 4096 tokens in chunks of 1024, one session; :func:`run`) and on decode steps at 4096 tokens of
    context for each N of ``ns`` (``bench/step_ab.py``'s ``run``); a tiny run on a CPU device. False if any
    variant's bits differ from the first's, or native != ordered."""
    import time

    from bench import bench_decode
    from bench.step_ab import run as step_run

    dev = torch.device(device)
    bench_decode.DEVICE = dev
    cpu = dev.type == "cpu"
    P, C, CTX, IT, R = (40, 16, 32, 2, 1) if cpu else (4096, 1024, 4096, 20, 3)
    bw = bench_decode.copy_bandwidth(dev)
    ok = True
    for spec in specs.split(","):
        t0 = time.time()
        model = model_spec.load(spec, dev)
        log(f"\n## {spec} (load {time.time() - t0:.0f} s): " +
            (f"prompt {P} in chunks of {C}; " if prompts else "") + f"decode at {CTX} tokens")
        rows = []
        if prompts:
            prompt = random_prompt(model.vocab_size, P)
            rows += run(model, prompt, C, [1], variants, R, dev, log)
        rows += step_run(model, list(ns), CTX, variants, R, IT, bw, log)
        ok &= all(r["bits"] and r.get("exact") is not False for r in rows)
        del model
        if not cpu:
            torch.cuda.empty_cache()
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a preset or path, optionally :fp8 (quantize at load)")
    ap.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--chunk", type=int, default=1024, help="rows a prefill step")
    ap.add_argument("--sessions", default="1", help="N values: 1 = one session in chunks; N > 1 sessions share a step")
    ap.add_argument("--variant", action="append", default=[], help="NAME=SPEC (JSON file or inline JSON)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--commit", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.prompt < 1 or args.chunk < 1:
        raise SystemExit("prefill_ab: --rounds, --prompt and --chunk must be at least 1")
    variants, dev, model, log = ab_setup(args, "prefill_ab")
    ns = [int(x) for x in args.sessions.split(",") if x.strip()]
    prompt = random_prompt(model.vocab_size, args.prompt)
    log(f"# prefill A/B: {args.model}, {args.prompt}-token prompt, chunks of {args.chunk}, commit {args.commit or '?'}")
    log(f"{args.rounds} rounds, variant order alternating")
    for n_, spec in variants[1:]:
        log(f"variant {n_}: {json.dumps(spec)}")
    rows = run(model, prompt, args.chunk, ns, variants, args.rounds, dev, log)
    log("")
    log(table(rows, args.chunk))
    log.write(args.out, "prefill_ab.md")
    with open(os.path.join(args.out, "prefill_ab.json"), "w") as f:
        json.dump(dict(model=args.model, prompt=args.prompt, chunk=args.chunk, commit=args.commit,
                       variants=dict(variants), rows=rows), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
