"""A real server on loopback and a real HTTP client (aiohttp): concurrency, errors, disconnects, API shape."""
import asyncio
import json
import random
import re

import aiohttp
import pytest

from ds4t.serve.http import Server
from ds4t.text import TextCodec
from ds4t.serve.worker import GenParams, Request

from .conftest import greedy_ref, post, run, slow_steps, stream_events


@pytest.fixture(scope="module")
def server(model):
    srv = Server(model, slots=4, max_ctx=64, model_id="tiny-qwen", coalesce_us=2000)
    srv.start_in_thread()
    yield srv
    srv.stop_thread()


def session():
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900))


def metric(text, name):
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def _bodies():
    rng = random.Random(7)
    out = []
    for i in range(16):
        prompt = "".join(rng.choice("abcdefghij ") for _ in range(rng.randint(2, 5)))
        b = {"model": "tiny-qwen", "prompt": prompt, "max_tokens": 2 + i % 2, "return_token_ids": True}
        if i < 12:
            b["temperature"] = 0
        else:  # seeded sampling: the same text whatever else is running
            b.update(temperature=0.9, top_k=40, top_p=0.95, seed=1000 + i)
        out.append(b)
    return out


def test_64_concurrent_requests_match_each_request_alone(server):
    bodies = _bodies()
    url = server.url + "/v1/completions"

    async def main():
        async with session() as s:
            alone = [await post(s, url, b) for b in bodies]
            order = list(range(64))
            random.Random(1).shuffle(order)
            together = await asyncio.gather(*(post(s, url, bodies[i % 16]) for i in order))
            async with s.get(server.url + "/metrics") as r:
                return alone, order, together, await r.text()

    alone, order, together, metrics = run(main())
    assert all(st == 200 for st, _ in alone), alone
    assert len(together) == 64 and all(st == 200 for st, _ in together), [j for st, j in together if st != 200]
    for i, (st, j) in zip(order, together):
        ref = alone[i % 16][1]["choices"][0]
        got = j["choices"][0]
        assert got["token_ids"] == ref["token_ids"] and got["text"] == ref["text"], bodies[i % 16]
        assert j["usage"]["completion_tokens"] == bodies[i % 16]["max_tokens"] and got["finish_reason"] == "length"
    # the 64 really shared steps
    n_batches = metric(metrics, "ds4t_serve_batch_items_count")
    single = float(re.search(r'ds4t_serve_batch_items_bucket\{le="1"\} (\d+)', metrics).group(1))
    assert n_batches - single >= 10, metrics
    assert metric(metrics, "ds4t_serve_queue_length") == 0
    assert 'ds4t_serve_requests_total{status="ok"}' in metrics


ERRORS = [
    ("/v1/completions", '{"prompt": "x",', 400, "invalid JSON"),
    ("/v1/completions", [1, 2], 400, "must be an object"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "x"}, 404, "does not exist"),
    ("/v1/completions", {"prompt": "x" * 65, "max_tokens": 1}, 400, "context"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 64}, 400, "exceeds this server's context"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2, 256]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": [1, -2]}, 400, "outside the vocabulary"),
    ("/v1/completions", {"prompt": ""}, 400, "empty"),
    ("/v1/completions", {}, 400, "'prompt' is required"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, 400, "'n'"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 80}]}, 400, "context"),
    ("/v1/completions", {"model": ["x"], "prompt": "hi"}, 400, "'model' must be a string"),
    ("/v1/completions", {"model": {"a": 1}, "prompt": "hi"}, 400, "'model' must be a string"),
    ("/v1/completions", '{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\udfffb"}]}', 400, "surrogate"),
    ("/v1/completions", "[" * 100000, 400, "nested deeper"),
    ("/v1/completions", '{"prompt": ' + "[" * 70 + "]" * 70 + "}", 400, "nested deeper"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0.7, "top_k": 2147483648}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "top_k": 257}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("nan")}, 400, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "'wizard' is not one of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "no tool-call parser"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]}, 400,
     "'functions'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, 400,
     "'tool_choice'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, 400, "'json_object'"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    async def main():
        out = []
        async with session() as s:
            for path, body, _, _ in ERRORS:
                raw = body if isinstance(body, str) else json.dumps(body)
                out.append(await post(s, server.url + path, None, raw=raw))
            ok = await post(s, server.url + "/v1/completions", {"prompt": "ok", "max_tokens": 1, "temperature": 0})
        return out, ok

    out, ok = run(main())
    for (path, body, status, msg), (st, j) in zip(ERRORS, out):
        assert st == status and msg in j["error"]["message"], (body, st, j)
        assert j["error"]["type"] == "invalid_request_error"
    assert ok[0] == 200 and ok[1]["usage"]["completion_tokens"] == 1


def test_chat_fields_that_ask_for_nothing_are_accepted(server):
    """The refusals above are for what the server would drop; tools with tool_choice 'none', a text
    response_format and every OpenAI role are answered."""
    user = [{"role": "user", "content": "x"}]
    bodies = [{"messages": user, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
              {"messages": user, "response_format": {"type": "text"}, "tool_choice": "auto"}]
    bodies += [{"messages": [{"role": r, "content": "x"}]} for r in ("system", "developer", "assistant", "tool")]

    async def main():
        async with session() as s:
            return [await post(s, server.url + "/v1/chat/completions", dict(b, max_tokens=1, temperature=0))
                    for b in bodies]

    for b, (st, j) in zip(bodies, run(main())):
        assert st == 200 and j["usage"]["completion_tokens"] == 1, (b, st, j)


def test_client_disconnect_mid_stream_frees_its_slot(server):
    async def main():
        async with session() as s:
            async with s.get(server.url + "/metrics") as r:
                before = metric(await r.text(), 'ds4t_serve_requests_total{status="cancelled"}')
            body = {"prompt": "abc", "max_tokens": 50, "temperature": 0, "stream": True}
            async with s.post(server.url + "/v1/completions", json=body) as r:
                assert r.status == 200
                async for line in r.content:
                    if line.startswith(b"data: ") and b'"text"' in line:
                        break  # one token arrived: hang up
                r.close()
            for _ in range(600):
                async with s.get(server.url + "/health") as r:
                    h = await r.json()
                if h["busy"] == 0 and h["active"] == 0:
                    break
                await asyncio.sleep(0.1)
            async with s.get(server.url + "/metrics") as r:
                after = metric(await r.text(), 'ds4t_serve_requests_total{status="cancelled"}')
            nxt = await post(s, server.url + "/v1/completions", {"prompt": "z", "max_tokens": 1})
            return h, before, after, nxt

    h, before, after, nxt = run(main())
    assert h["busy"] == 0 and h["active"] == 0 and h["waiting"] == 0
    assert after == before + 1
    assert max(h["slot_positions"]) < 3 + 50  # it stopped early
    assert nxt[0] == 200


def test_api_shape_chat_stream_models_health_metrics(server):
    msgs = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}

    async def main():
        async with session() as s:
            async with s.get(server.url + "/v1/models") as r:
                models = await r.json()
            st, plain = await post(s, server.url + "/v1/chat/completions", msgs)
            async with s.post(server.url + "/v1/chat/completions",
                              json=dict(msgs, stream=True, stream_options={"include_usage": True})) as r:
                ctype = r.headers["Content-Type"]
                events = await stream_events(r)
            async with s.post(server.url + "/v1/completions",
                              json={"prompt": "hi", "max_tokens": 2, "temperature": 0, "stream": True}) as r:
                cevents = await stream_events(r)
            async with s.get(server.url + "/health") as r:
                health = (r.status, await r.json())
            async with s.get(server.url + "/metrics") as r:
                metrics = (r.headers["Content-Type"], await r.text())
        return models, st, plain, ctype, events, cevents, health, metrics

    models, st, plain, ctype, events, cevents, health, metrics = run(main())
    assert models["data"][0]["id"] == "tiny-qwen" and models["object"] == "list"
    assert st == 200 and plain["object"] == "chat.completion"
    assert plain["choices"][0]["message"]["role"] == "assistant" and plain["usage"]["completion_tokens"] == 2
    assert ctype.startswith("text/event-stream") and events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and events[-2]["usage"]["completion_tokens"] == 2
    assert cevents[-1] == "[DONE]" and cevents[-2]["choices"][0]["finish_reason"] == "length"
    assert health[0] == 200 and health[1]["status"] == "ok" and health[1]["slots"] == 4
    assert metrics[0].startswith("text/plain")
    for name in ("ds4t_serve_batch_items_bucket", "ds4t_serve_batch_rows_bucket", "ds4t_serve_queue_length",
                 "ds4t_serve_tokens_per_second", "ds4t_serve_generated_tokens_total", "ds4t_serve_step_seconds"):
        assert name in metrics[1]


def test_stop_strings_are_cut_and_held_back():
    """Request.on_token alone (no model): a stop string is never shown, even split over tokens."""
    codec = TextCodec(256)
    r = Request([1], GenParams(max_tokens=10, stop=("lo",)), lambda ev: None, codec.detokenizer())
    shown = []
    for ch in b"hello":
        text, finish = r.on_token(ch)
        shown.append(text)
        if finish:
            break
    assert shown == ["h", "e", "", "l", ""] and finish == "stop" and r.text == "hel"
    r = Request([1], GenParams(max_tokens=3), lambda ev: None, codec.detokenizer())
    assert [r.on_token(c) for c in "é!".encode()] == [("", None), ("é", None), ("!", "length")]


def test_http_layer_errors_are_json_and_counted(server):
    async def main():
        out = []
        async with session() as s:
            async with s.get(server.url + "/metrics") as r:
                before = await r.text()
            for method, path, data in (("GET", "/nope", None), ("GET", "/v1/completions", None),
                                       ("POST", "/v1/completions", b"x" * (17 << 20))):
                async with s.request(method, server.url + path, data=data) as r:
                    out.append((r.status, r.headers.get("Content-Type", ""), await r.json(), r.headers.get("Allow")))
            async with s.get(server.url + "/metrics") as r:
                after = await r.text()
        return before, out, after

    before, out, after = run(main())
    assert [o[0] for o in out] == [404, 405, 413]
    for status, ctype, j, _ in out:
        assert ctype.startswith("application/json") and j["error"]["message"], (status, j)
    assert "/nope" in out[0][2]["error"]["message"] and "POST" in out[1][3]
    for status in (404, 405, 413):
        name = f'ds4t_serve_http_errors_total{{status="{status}"}}'
        assert metric(after, name) == metric(before, name) + 1, (name, after)


def test_a_tiny_temperature_decodes_greedily(server):
    async def main():
        async with session() as s:
            body = {"prompt": [5, 6, 7], "max_tokens": 3, "return_token_ids": True}
            greedy = await post(s, server.url + "/v1/completions", dict(body, temperature=0))
            tiny = await post(s, server.url + "/v1/completions", dict(body, temperature=1e-40, seed=3))
        return greedy, tiny

    (st0, g), (st1, t) = run(main())
    assert st0 == st1 == 200 and t["choices"][0]["token_ids"] == g["choices"][0]["token_ids"]


def _variant_bodies(chat: bool, stream: bool):
    rng = random.Random(11)
    out = []
    for i in range(8):
        text = "".join(rng.choice("klmnop ") for _ in range(rng.randint(2, 6)))
        b = {"max_tokens": 2 + i % 3, "stream": stream}
        b.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
        b.update(temperature=0) if i % 2 else b.update(temperature=0.8, top_k=20, seed=77 + i)
        out.append(b)
    return out


async def _text_of(s, url, body):
    """(status, generated text, finish_reason) of a request, streamed or not."""
    async with s.post(url, json=body) as r:
        if not body["stream"]:
            j = await r.json()
            if r.status != 200:
                return r.status, j, None
            c = j["choices"][0]
            return 200, c["message"]["content"] if "message" in c else c["text"], c["finish_reason"]
        events = await stream_events(r)
    assert events[-1] == "[DONE]", events
    chunks = [e["choices"][0] for e in events[:-1] if e.get("choices")]
    text = "".join((c.get("delta") or {}).get("content", "") if "delta" in c else c["text"] for c in chunks)
    return r.status, text, chunks[-1]["finish_reason"]


@pytest.mark.parametrize("chat,stream", [(False, True), (True, False), (True, True)])
def test_concurrent_streaming_and_chat_requests_match_each_alone(server, chat, stream):
    bodies = _variant_bodies(chat, stream)
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")

    async def main():
        async with session() as s:
            alone = [await _text_of(s, url, b) for b in bodies]
            order = list(range(24))
            random.Random(2).shuffle(order)
            together = await asyncio.gather(*(_text_of(s, url, bodies[i % 8]) for i in order))
        return alone, order, together

    alone, order, together = run(main())
    assert all(a[0] == 200 for a in alone), alone
    for i, got in zip(order, together):
        assert got == alone[i % 8], (bodies[i % 8], got, alone[i % 8])


def test_max_waiting_503_and_recovery(model, monkeypatch):
    slow_steps(monkeypatch, 0.05)  # the 40-token request holds the slot >= 2 s on any device
    srv = Server(model, slots=1, max_ctx=64, model_id="tiny-qwen", coalesce_us=0, max_waiting=0)
    srv.start_in_thread()
    try:
        async def main():
            async with session() as s:
                long = asyncio.ensure_future(post(s, srv.url + "/v1/completions",
                                                  {"prompt": [1, 2], "max_tokens": 40, "temperature": 0}))
                for _ in range(600):
                    async with s.get(srv.url + "/health") as r:
                        if (await r.json())["busy"]:
                            break
                    await asyncio.sleep(0.05)
                refused = await post(s, srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
                first = await long
                after = await post(s, srv.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})
                return refused, first, after

        refused, first, after = run(main())
    finally:
        srv.stop_thread()
    assert refused[0] == 503 and refused[1]["error"]["code"] == "overloaded" and "max-waiting 0" in refused[1]["error"]["message"]
    assert first[0] == 200 and after[0] == 200


def test_idle_connections_are_closed_and_slow_bodies_get_408(model):
    srv = Server(model, slots=1, max_ctx=64, coalesce_us=0, idle_timeout=1.0, body_timeout=1.0)
    srv.start_in_thread()
    try:
        async def main():
            # half-open: headers never finish
            r, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            await w.drain()
            t0 = asyncio.get_running_loop().time()
            closed = await asyncio.wait_for(r.read(), 20)
            idle_s = asyncio.get_running_loop().time() - t0
            w.close()
            # headers complete, body trickles and stops
            r, w = await asyncio.open_connection("127.0.0.1", srv.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\":")
            await w.drain()
            answer = await asyncio.wait_for(r.read(), 20)
            w.close()
            return closed, idle_s, answer

        closed, idle_s, answer = run(main())
    finally:
        srv.stop_thread()
    assert closed == b"" and idle_s < 10
    assert answer.startswith(b"HTTP/1.1 408") and b'did not arrive within' in answer


def test_restore_from_disk_under_load_matches_each_alone(model, tmp_path):
    firsts = [[40 + 3 * i, 41 + 3 * i, 42 + 3 * i] for i in range(6)]
    ref1 = [greedy_ref(model, c, 2)[0] for c in firsts]
    conts = [c + r + [7] for c, r in zip(firsts, ref1)]
    others = [[200 + i, 100 + i] for i in range(6)]
    second = conts + others
    ref2 = [greedy_ref(model, c, 2)[0] for c in second]
    srv = Server(model, slots=2, max_ctx=64, coalesce_us=0, kv_cache_dir=str(tmp_path))
    srv.start_in_thread()
    try:
        async def main():
            async with session() as s:
                def req(p):
                    return post(s, srv.url + "/v1/completions",
                                {"prompt": p, "max_tokens": 2, "temperature": 0, "return_token_ids": True})
                one = await asyncio.gather(*(req(p) for p in firsts))  # 2 slots: evictions go to disk
                order = list(range(len(second)))
                random.Random(5).shuffle(order)
                two = await asyncio.gather(*(req(second[i]) for i in order))
                async with s.get(srv.url + "/metrics") as r:
                    return one, order, two, await r.text()

        one, order, two, text = run(main())
    finally:
        srv.stop_thread()
    assert [j["choices"][0]["token_ids"] for _, j in one] == ref1
    for i, (st, j) in zip(order, two):
        assert st == 200 and j["choices"][0]["token_ids"] == ref2[i], second[i]
    assert metric(text, "ds4t_serve_kv_restores_total") >= 2 and metric(text, "ds4t_serve_kv_corrupt_total") == 0
