"""``ds4t serve --tp 2``: rank 0 serves HTTP, rank 1 replays its steps; greedy text equals the one-rank
model's; SIGTERM drains and exits 0 (followers ignore SIGINT/SIGTERM, so a signal to the whole process
group cannot take them away first: rank 0's stop releases them)."""
import json
import os
import signal
import urllib.request

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


def test_serve_tp_refuses_kv_cache_dir(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ds4t", "serve", "--tp", "2", "--kv-cache-dir", str(tmp_path / "kv")],
                       env=dict(os.environ, **ENV), capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--kv-cache-dir is not supported with --tp" in r.stderr
