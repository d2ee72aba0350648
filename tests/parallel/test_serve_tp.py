"""``ds4t serve --tp 2``: rank 0 serves HTTP, rank 1 replays its steps; greedy text equals the one-rank
model's; SIGTERM drains and exits 0 (followers ignore SIGINT/SIGTERM, so a signal to the whole process
group cannot take them away first: rank 0's stop releases them)."""
import contextlib
import json
import os
import signal
import urllib.request

import pytest

import ds4t
from ds4t.serve.cli import spawn
from ds4t.testing.markers import cpu_interpreter_only

pytestmark = cpu_interpreter_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _greedy_tp1(prompt: bytes, n: int, model: str = "tiny-llama") -> list:
    m = ds4t.load(model)
    s = m.new_session(64)
    logits, out = s.prefill(list(prompt)), []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = ds4t.eval_batch([ds4t.DecodeItem(s, out[-1])]).logits[0]
    return out


def _serve_tp2_greedy(model: str, n: int, *extra: str) -> str:
    """``ds4t serve --model M --tp 2 [extra]``: one greedy completion of n tokens checked against one-rank
    plain decoding, then SIGTERM (rank 0 drains, then releases rank 1) and exit 0. Returns /metrics."""
    p, url, _ = spawn(["--model", model, "--tp", "2", *extra, "--batched-session", "2", "--port", "0"], env=ENV,
                      program=("-m", "ds4t", "serve"), timeout=240)
    try:
        body = json.dumps({"model": model, "prompt": [104, 105, 33], "max_tokens": n, "temperature": 0,
                           "logprobs": None}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            ans = json.loads(r.read())
        assert ans["usage"]["completion_tokens"] == n
        want = bytes(_greedy_tp1(bytes([104, 105, 33]), n, model)).decode("utf-8", errors="replace")
        assert ans["choices"][0]["text"] == want
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        p.send_signal(signal.SIGTERM)
        code = p.wait(timeout=120)
    assert code == 0
    return metrics


def test_serve_tp2_answers_like_tp1_and_stops_cleanly():
    _serve_tp2_greedy("tiny-llama", 4)


def test_serve_tp2_with_mtp_answers_like_plain_tp1():
    """``--tp 2 --mtp 2``: the followers replay the speculative step's model calls (verify forward, MTP
    head, rollback of Qwen3-Next's recurrent state); the greedy text equals one-rank plain decoding."""
    metrics = _serve_tp2_greedy("tiny-qwen", 6, "--mtp", "2")
    drafted = [float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("ds4t_serve_spec_drafted_tokens_total")]
    assert drafted and drafted[0] > 0, "the steps were speculative (drafts verified)"


def _complete(url: str, model: str, prompt: list, n: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _counter(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        lines = [x for x in r.read().decode().splitlines() if x.startswith(f"ds4t_serve_{name} ")]
    return float(lines[0].split()[-1]) if lines else 0.0


@pytest.mark.parametrize("model", ["tiny-qwen", "tiny-deepseek"])
def test_serve_tp2_saves_and_restores_sessions_in_kv_cache_dir(tmp_path, model):
    """``--tp 2 --kv-cache-dir``: with one slot, a second conversation evicts the first, whose state (both
    ranks' shards, gathered to rank 0: one file) is saved; the first conversation's next turn is restored
    from it (each rank loads its shard) and answers as one-rank plain decoding does from scratch. A
    follower that kept a stale shard (or none) would answer otherwise. Then a second server on the same
    directory at --tp 2 restores the state again, and a one-rank server ignores it (another state layout)."""
    kv = str(tmp_path / "kv")
    first = [104, 105, 33]

    @contextlib.contextmanager
    def serving(tp: int):
        """A server on the one directory (--tp 2, or one rank); SIGTERM at the end, exit 0."""
        args = ["--model", model, "--kv-cache-dir", kv, "--batched-session", "1", "--port", "0"]
        p, url, _ = spawn(args + (["--tp", str(tp)] if tp > 1 else []), env=ENV, program=("-m", "ds4t", "serve"),
                          timeout=240)
        try:
            yield url
        finally:
            p.send_signal(signal.SIGTERM)
            assert p.wait(timeout=120) == 0

    with serving(2) as url:
        a = _complete(url, model, first, 3)
        _complete(url, model, [7, 8, 9, 10], 2)                  # the only slot goes to another conversation
        turn = first + a["choices"][0]["token_ids"] + [32, 63]
        b = _complete(url, model, turn, 3)
        assert _counter(url, "kv_saves_total") >= 1 and _counter(url, "kv_restores_total") == 1
        assert b["choices"][0]["token_ids"] == _greedy_tp1(bytes(turn), 3, model)
    from safetensors import safe_open

    files = [f for f in os.listdir(kv) if f.endswith(".kv.safetensors")]
    with safe_open(os.path.join(kv, files[0]), "pt") as f:
        ranks = {k.split(".")[1] for k in f.keys() if k.startswith("state.")}
    # both ranks' shards; MLA's latent cache (the same on every rank) once, as rank 0's
    assert ranks == ({"tp0"} if model == "tiny-deepseek" else {"tp0", "tp1"}), ranks
    # the saved files outlive the server (restored again at --tp 2); states of 2 ranks do not fit one
    for tp, restores in ((2, 1), (1, 0)):
        with serving(tp) as url:
            assert _complete(url, model, turn, 3)["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
            assert _counter(url, "kv_restores_total") == restores


def test_a_gathered_state_splits_by_rank_and_foreign_ones_are_named():
    import torch

    from ds4t.parallel.mirror import split_ranks

    t = torch.zeros(2)
    assert split_ranks({"tp0.a": t, "tp1.a": t, "tp1.b": t}, 2) == [{"a": t}, {"a": t, "b": t}]
    with pytest.raises(ValueError, match="another --tp"):
        split_ranks({"a": t}, 2)                        # a one-rank state
    with pytest.raises(ValueError, match="another --tp"):
        split_ranks({"tp0.a": t, "tp2.a": t}, 2)        # a state of more ranks
    with pytest.raises(ValueError, match=r"nothing for rank\(s\) \[1\]"):
        split_ranks({"tp0.a": t}, 2)
    assert split_ranks({"tp0.a": t}, 2, frozenset({"a"})) == [{"a": t}, {"a": t}]   # replicated: rank 0's copy


def test_plan_a_tp_deployment_on_meta():
    """``ds4t serve --tp 2 --device meta --plan-only``: every rank plans its shard from shapes alone (Qwen3-Next-80B
    in bf16, 159 GB: ~80 GB a rank); rank 0 prints each rank's total; exit 0 when all fit, 2 when one does not."""
    import subprocess
    import sys

    def plan(limit):
        return subprocess.run([sys.executable, "-m", "ds4t", "serve", "--model", "qwen3-next-80b", "--tp", "2",
                               "--device", "meta", "--plan-only", "--memory-limit", limit, "--batched-session", "16"],
                              env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=300)

    ok = plan("139GiB")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = [x for x in ok.stdout.splitlines() if x.strip().startswith("rank ")]
    assert len(lines) == 2 and all(": fits" in x for x in lines), ok.stdout
    short = plan("60GiB")
    assert short.returncode == 2 and "DOES NOT FIT" in short.stdout, short.stdout + short.stderr
