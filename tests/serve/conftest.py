"""Shared helpers for the server tests: a tiny model, greedy references, a real server on loopback."""
import asyncio
import json

import pytest

import ds4t
from ds4t import DecodeItem, eval_batch
from ds4t.kernels import sampling


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


def greedy_ref(model, prompt, n, max_ctx=64):
    """n greedy tokens of ``prompt`` on a fresh session, plus the logits of every step."""
    s = model.new_session(max_ctx)
    logits = s.prefill(prompt)
    out, all_logits = [], [logits]
    for i in range(n):
        t = int(sampling.argmax(logits[None])[0])
        out.append(t)
        if i < n - 1:
            logits = eval_batch([DecodeItem(s, t)]).logits[0]
            all_logits.append(logits)
    s.close()
    return out, all_logits


async def post(session, url, body, raw=None):
    data = raw if raw is not None else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


def run(coro):
    return asyncio.run(coro)


async def stream_events(resp):
    """Parsed SSE data payloads of a streaming response ('[DONE]' as the string)."""
    out = []
    async for line in resp.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[6:].decode()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def slow_steps(monkeypatch, seconds: float) -> None:
    """Every step of the decode worker takes at least ``seconds``: a GPU runs a tiny model's step in
    about a millisecond, too fast for tests that must catch a request mid-generation."""
    import time

    import ds4t.serve.worker as worker

    real = worker.eval_batch

    def slow(items, mode="auto"):
        time.sleep(seconds)
        return real(items, mode=mode)

    monkeypatch.setattr(worker, "eval_batch", slow)


SLOW_SERVER = """
import sys, time
import ds4t.serve.worker as worker

real = worker.eval_batch

def slow(items, mode="auto"):
    time.sleep(SECONDS)
    return real(items, mode=mode)

worker.eval_batch = slow
from ds4t.serve import cli
sys.exit(cli.main(sys.argv[1:]))
"""


def slow_server_program(seconds: float):
    """``python -c`` arguments for ``cli.spawn``: ``ds4t serve`` whose every step takes >= ``seconds``."""
    return ("-c", SLOW_SERVER.replace("SECONDS", repr(float(seconds))))
