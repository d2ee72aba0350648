"""The HTTP API (aiohttp): OpenAI-compatible completions and chat completions (JSON or SSE
streaming), ``/v1/models``, ``/health``, ``/metrics`` (Prometheus text).

Extensions to the OpenAI request: ``top_k`` (0: off), ``stop_token_ids``, ``ignore_eos``,
``return_token_ids`` (adds ``token_ids`` and ``prompt_token_ids`` to the choice); a completion
``prompt`` may be a list of token ids. Errors are OpenAI-shaped: ``{"error": {"message", "type",
"param", "code"}}`` with a 4xx status for anything the client can fix. Every error answer -- also
404/405/413/408 from the HTTP layer and a 500 from a bug -- is such a JSON body and is counted in
``http_errors_total{status}`` (one middleware does both).

Timeouts: a connection that has not sent a complete request within ``idle_timeout`` s (at the start,
or between keep-alive requests) is closed; a body not received within ``body_timeout`` s gets a 408.
Shutdown (:meth:`Server.close`): new requests get 503 while held ones finish for up to
``drain_timeout`` s; streams still open then end with an error event and ``data: [DONE]``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import threading
import time
import uuid
from typing import List, Optional, Tuple

from aiohttp import web

from ds4t.serve.metrics import Metrics
from ds4t.serve.persistence import KVStore, model_fingerprint
from ds4t.serve.pool import SlotPool
from ds4t.text import TextCodec, TokenizeError
from ds4t.serve.worker import DecodeWorker, GenParams, Overloaded, Request

log = logging.getLogger("ds4t.serve")

DEFAULT_MAX_TOKENS = 16
METRICS = web.AppKey("metrics", Metrics)
STARTED = web.AppKey("started", set)  # ids of connections whose first request reached the app
MAX_JSON_DEPTH = 64   # the API's bodies nest 4 deep; json.loads recurses per level (RecursionError past ~1000)


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def response(self) -> web.Response:
        return web.json_response({"error": {"message": self.message, "type": self.type, "param": self.param,
                                            "code": self.code}}, status=self.status)


@web.middleware
async def json_errors(request: web.Request, handler):
    """Every error answer as an OpenAI-shaped JSON body, counted by status; a bug is a 500, not a crash."""
    metrics = request.app[METRICS]
    request.app[STARTED].add(id(request.protocol))
    try:
        resp = await handler(request)
    except ApiError as e:
        resp = e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        text = e.text or ""
        msg = text if text and not text.startswith(f"{e.status}:") else f"{e.reason}: {request.method} {request.path}"
        resp = ApiError(e.status, msg, type_="server_error" if e.status >= 500 else "invalid_request_error").response()
        if "Allow" in e.headers:  # a 405 says which methods exist
            resp.headers["Allow"] = e.headers["Allow"]
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:  # noqa: BLE001
        log.exception("unhandled error in %s %s", request.method, request.path)
        resp = ApiError(500, f"internal error: {type(e).__name__}", type_="server_error").response()
    if resp.status >= 400:
        metrics.inc("http_errors_total", status=str(resp.status))
    return resp


class _HeaderDeadline:
    """aiohttp's protocol factory, wrapped: a connection whose first request has not reached the app
    within ``timeout`` s is closed (half-open clients, headers trickled in). aiohttp's own
    keepalive_timeout closes connections idle between requests; only some versions also arm it when
    a connection opens, so this does not rely on it."""

    def __init__(self, inner, timeout: float, started: set):
        self.inner, self.timeout, self.started = inner, timeout, started

    def __call__(self):
        handler = self.inner()
        if self.timeout > 0:
            asyncio.get_event_loop().call_later(self.timeout, self._check, handler)
        return handler

    def _check(self, handler) -> None:
        if id(handler) in self.started:
            self.started.discard(id(handler))
        elif handler.transport is not None:
            handler.force_close()


class _Runner(web.AppRunner):
    """An AppRunner whose sites accept connections through :class:`_HeaderDeadline`."""

    def __init__(self, app: web.Application, header_timeout: float, **kw):
        super().__init__(app, **kw)
        self._header_timeout = header_timeout
        self._guarded = None

    @property
    def server(self):
        inner = super().server
        if inner is None:
            return None
        if self._guarded is None or self._guarded.inner is not inner:
            self._guarded = _HeaderDeadline(inner, self._header_timeout, self.app[STARTED])
        return self._guarded


def _json_depth(raw: bytes) -> int:
    """Deepest nesting of [ and { outside strings, counted without parsing (bounded work per byte)."""
    depth = best = 0
    in_str = esc = False
    for c in raw:
        if in_str:
            if esc:
                esc = False
            elif c == 0x5C:  # backslash
                esc = True
            elif c == 0x22:
                in_str = False
        elif c == 0x22:
            in_str = True
        elif c in (0x5B, 0x7B):
            depth += 1
            best = max(best, depth)
        elif c in (0x5D, 0x7D):
            depth -= 1
    return best


def _chat_features(body: dict) -> None:
    """Refuse what a chat request asks for that this server would otherwise silently drop: tool calling (no
    tool-call parser: the model's reply would come back as plain text), constrained output formats (no
    constrained decoding) and the legacy ``functions``. ``tool_choice: "none"`` and ``response_format``
    ``{"type": "text"}`` ask for nothing and pass."""
    none = body.get("tool_choice") == "none"
    for name in ("tools", "functions"):
        if body.get(name) and not none:
            raise ApiError(400, f"'{name}' is not supported by this server: it has no tool-call parser, so a call "
                                "would come back as plain text (send tool_choice 'none' to ignore them)", name)
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none", "auto"):
            raise ApiError(400, f"'{name}' {body.get(name)!r} is not supported by this server (no tool calling)", name)
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        kind = fmt.get("type") if isinstance(fmt, dict) else fmt
        raise ApiError(400, f"'response_format' {kind!r} is not supported by this server (no constrained decoding; "
                            "only {\"type\": \"text\"})", "response_format")


def _int(body: dict, name: str, default=None, lo=None, hi=None, what="an integer"):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise ApiError(400, f"'{name}' must be {what}, got {v!r}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise ApiError(400, f"'{name}' must be {what}, got {v}", name)
    return v


def _float(body: dict, name: str, default: float, lo: float, hi: float, lo_open=False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"'{name}' must be a number, got {v!r}", name)
    v = float(v)
    if not (lo < v if lo_open else lo <= v) or v > hi or v != v:
        raise ApiError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", name)
    return v


class Server:
    """Everything ``ds4t serve`` runs: slot pool, decode worker, optional state store, HTTP app."""

    def __init__(self, model, *, slots: int, max_ctx: int, model_id: Optional[str] = None,
                 coalesce_us: int = 2000, prefill_chunk: int = 128, prefill_chunk_idle: int = 512,
                 kv_cache_dir: Optional[str] = None, kv_cache_max_entries: int = 256, max_waiting: int = 1024,
                 batch_log: bool = False, mode: str = "auto", drain_timeout: float = 30.0,
                 idle_timeout: float = 30.0, body_timeout: float = 30.0, mtp: int = 0):
        self.model = model
        self.model_id = model_id or os.path.basename(str(model.name).rstrip("/")) or str(model.name)
        self.aliases = {self.model_id, str(model.name)}
        self.max_ctx = max_ctx
        self.codec = TextCodec.for_model(model)
        self.metrics = Metrics()
        self.pool = SlotPool(model, slots, max_ctx)
        self.store = None
        if kv_cache_dir:
            def on_event(kind, msg):
                if kind in ("corrupt", "missing", "skipped"):
                    self.metrics.inc(f"kv_{kind}_total")
            self.store = KVStore(kv_cache_dir, model_fingerprint(model, self.pool.zero_state),
                                 max_entries=kv_cache_max_entries, on_event=on_event)
        self.worker = DecodeWorker(self.pool, metrics=self.metrics, store=self.store, coalesce_us=coalesce_us,
                                   prefill_chunk=prefill_chunk, prefill_chunk_idle=prefill_chunk_idle,
                                   max_waiting=max_waiting, batch_log_enabled=batch_log, mode=mode,
                                   on_fatal=self._on_fatal, mtp=mtp)
        self.drain_timeout = float(drain_timeout)
        self.idle_timeout = float(idle_timeout)
        self.body_timeout = float(body_timeout)
        self.exit_code = 0  # 70 (EX_SOFTWARE) when the decode worker died: a supervisor should restart us
        self.created = int(time.time())
        self._runner: Optional[web.AppRunner] = None
        self._thread: Optional[threading.Thread] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._stopped: Optional[asyncio.Event] = None
        self.port: Optional[int] = None

    # -- app -----------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=16 << 20, middlewares=[json_errors])
        app[METRICS] = self.metrics
        app[STARTED] = set()
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_text)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        self.worker.start()
        # idle_timeout: a connection is closed when its first request has not arrived by then
        # (_HeaderDeadline) or when it sits idle between keep-alive requests (keepalive_timeout).
        # shutdown_timeout: the worker has already failed what it held when the runner is cleaned up
        # (close()), so handlers only have their last events to write.
        self._runner = _Runner(self.app(), self.idle_timeout, handler_cancellation=True, access_log=None,
                               keepalive_timeout=self.idle_timeout, shutdown_timeout=5.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        """Drain (503 to new requests, held ones finish for up to ``drain_timeout`` s), then stop the
        worker -- it fails what is left, so open streams get an error event and [DONE] -- then close
        the connections."""
        loop = asyncio.get_running_loop()
        drained = await loop.run_in_executor(None, self.worker.drain, self.drain_timeout)
        if not drained:
            log.warning("drain timeout (%.0f s) reached: failing the requests still held", self.drain_timeout)
        await loop.run_in_executor(None, self.worker.stop)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.store is not None:
            self.store.close()
        if not self.worker.thread.is_alive():
            self.pool.close()

    async def serve_forever(self, host: str, port: int, ready=None) -> None:
        self._stopped = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        port = await self.start(host, port)
        if ready is not None:
            ready(port)
        try:
            await self._stopped.wait()
        finally:
            await self.close()

    def _on_fatal(self, why: str) -> None:  # worker thread
        self.exit_code = 70
        self.request_stop()

    def request_stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            self._loop.call_soon_threadsafe(self._stopped.set)

    # -- in a thread (tests, benchmarks) ---------------------------------------------------------
    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0, timeout: float = 60) -> int:
        ready = threading.Event()
        err: List[BaseException] = []

        def main():
            try:
                asyncio.run(self.serve_forever(host, port, ready=lambda p: ready.set()))
            except BaseException as e:  # noqa: BLE001
                err.append(e)
                ready.set()

        self._thread = threading.Thread(target=main, name="ds4t-http", daemon=True)
        self._thread.start()
        if not ready.wait(timeout) or err:
            raise RuntimeError(f"server did not start: {err[0] if err else 'timeout'}")
        return self.port

    def stop_thread(self, timeout: float = 120) -> None:
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- parsing -------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> dict:
        try:
            raw = await asyncio.wait_for(request.read(), self.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.body_timeout:.0f} s") from None
        if _json_depth(raw) > MAX_JSON_DEPTH:
            raise ApiError(400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            body = json.loads(raw)
            # a lone UTF-16 surrogate ("\ud800") parses but is no text: no tokenizer can encode it
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "invalid JSON body: a string contains a lone UTF-16 surrogate (not valid Unicode)") from None
        except (ValueError, RecursionError) as e:
            raise ApiError(400, f"invalid JSON body: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, f"the JSON body must be an object, got {type(body).__name__}")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, f"'model' must be a string, got {type(model).__name__}", "model")
        if model is not None and model not in self.aliases:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_id!r}",
                           "model", "model_not_found")
        return body

    def _prompt_ids(self, prompt, chat: bool = False) -> List[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            ids = self.codec.encode(prompt, add_special_tokens=not chat)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise ApiError(400, "batched prompts are not supported: send one prompt per request", "prompt")
        else:
            raise ApiError(400, "'prompt' must be a string or a list of token ids", "prompt")
        if not ids:
            raise ApiError(400, "the prompt is empty", "prompt")
        V = self.model.vocab_size
        bad = [t for t in ids if not 0 <= t < V]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary [0, {V})", "prompt")
        return ids

    def _params(self, body: dict, n_prompt: int) -> Tuple[GenParams, dict]:
        _int(body, "n", 1, 1, 1, "1 (one choice per request)")
        for name, ok in (("logprobs", lambda v: v in (None, False, 0)), ("echo", lambda v: v in (None, False)),
                         ("best_of", lambda v: v in (None, 1)), ("suffix", lambda v: v is None),
                         ("top_logprobs", lambda v: v in (None, 0)),
                         ("presence_penalty", lambda v: v in (None, 0)), ("frequency_penalty", lambda v: v in (None, 0)),
                         ("logit_bias", lambda v: not v)):
            if not ok(body.get(name)):
                raise ApiError(400, f"'{name}' is not supported by this server", name)
        room = self.max_ctx - n_prompt + 1  # the last generated token is never fed back
        if n_prompt > self.max_ctx:
            raise ApiError(400, f"the prompt is {n_prompt} tokens; this server's context (--max-ctx) is "
                                f"{self.max_ctx} tokens", "prompt", "context_length_exceeded")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _int(body, name, None, 1, None, "a positive integer")
        if max_tokens is None:
            max_tokens = min(DEFAULT_MAX_TOKENS, room)
        elif max_tokens > room:
            raise ApiError(400, f"the prompt ({n_prompt} tokens) plus {name} ({max_tokens}) exceeds this server's "
                                f"context of {self.max_ctx} tokens by {max_tokens - room}", name,
                           "context_length_exceeded")
        temperature = _float(body, "temperature", 1.0, 0.0, 100.0)
        top_p = _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
        V = self.model.vocab_size
        top_k = _int(body, "top_k", 0, -1, V, f"an integer in [-1, {V}] (0 or -1: off; {V}: the vocabulary)")
        seed = _int(body, "seed", None, -(1 << 63), (1 << 64) - 1, "a 64-bit integer")
        if seed is None:
            seed = secrets.randbits(63)
        stop = body.get("stop")
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 16:
            raise ApiError(400, "'stop' must be a non-empty string or a list of up to 16 of them", "stop")
        stop_ids = body.get("stop_token_ids") or []
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise ApiError(400, "'stop_token_ids' must be a list of token ids", "stop_token_ids")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, "'ignore_eos' must be a boolean", "ignore_eos")
        eos = [] if ignore_eos else self.codec.eos_ids
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, "'stream' must be a boolean", "stream")
        so = body.get("stream_options") or {}
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", "stream_options")
        # temperatures below ds4t.sampling.MIN_TEMPERATURE decode greedily (documented in the README)
        try:
            params = GenParams(max_tokens=max_tokens, temperature=temperature, top_k=max(0, top_k), top_p=top_p,
                               seed=seed, stop=tuple(stop), stop_token_ids=tuple(set(stop_ids) | set(eos)))
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        extra = {"stream": stream, "include_usage": bool(so.get("include_usage")),
                 "return_token_ids": bool(body.get("return_token_ids", False))}
        return params, extra

    # -- handlers ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        if "prompt" not in body:
            raise ApiError(400, "'prompt' is required", "prompt")
        ids = self._prompt_ids(body["prompt"])
        params, extra = self._params(body, len(ids))
        return await self._generate(request, ids, params, extra, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        _chat_features(body)
        try:
            text = self.codec.chat_prompt(body.get("messages"))
        except TokenizeError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = self._prompt_ids(text, chat=True)
        params, extra = self._params(body, len(ids))
        return await self._generate(request, ids, params, extra, chat=True)

    async def _generate(self, request: web.Request, ids: List[int], params: GenParams, extra: dict,
                        chat: bool) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def sink(ev):
            try:
                loop.call_soon_threadsafe(q.put_nowait, ev)
            except RuntimeError:
                pass  # the loop is closed: the client is long gone

        req = Request(ids, params, sink, self.codec.detokenizer())
        try:
            self.worker.submit(req)
        except ValueError as e:
            raise ApiError(400, str(e)) from None
        except Overloaded as e:
            raise ApiError(503, str(e), type_="server_error", code="overloaded") from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"
        base = {"id": rid, "object": obj + (".chunk" if chat and extra["stream"] else ""),
                "created": int(time.time()), "model": self.model_id}
        done = False
        try:
            if not extra["stream"]:
                while True:
                    ev = await q.get()
                    if ev["type"] == "error":
                        done = True
                        return ApiError(ev["status"], ev["message"],
                                        type_="server_error" if ev["status"] >= 500 else "invalid_request_error").response()
                    if ev["type"] == "done":
                        done = True
                        choice = {"index": 0, "finish_reason": ev["finish_reason"]}
                        if chat:
                            choice["message"] = {"role": "assistant", "content": ev["text"]}
                        else:
                            choice.update(text=ev["text"], logprobs=None)
                        if extra["return_token_ids"]:
                            choice["token_ids"] = ev["token_ids"]
                            choice["prompt_token_ids"] = ids
                        return web.json_response(dict(base, choices=[choice], usage=self._usage(ev)))
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Accel-Buffering": "no"})
            await resp.prepare(request)

            async def send(obj_):
                await resp.write(b"data: " + json.dumps(obj_).encode() + b"\n\n")

            if chat:
                await send(dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                "finish_reason": None}]))
            while True:
                ev = await q.get()
                if ev["type"] == "token":
                    if not ev["text"] and not extra["return_token_ids"]:
                        continue
                    delta = {"content": ev["text"]} if chat else None
                    c = {"index": 0, "finish_reason": None}
                    c.update(delta=delta) if chat else c.update(text=ev["text"], logprobs=None)
                    if extra["return_token_ids"]:
                        c["token_ids"] = [ev["token"]]
                    await send(dict(base, choices=[c]))
                elif ev["type"] == "error":
                    done = True
                    await send({"error": {"message": ev["message"], "type": "server_error" if ev["status"] >= 500
                                          else "invalid_request_error", "param": None, "code": ev["status"]}})
                    break
                else:
                    done = True
                    c = {"index": 0, "finish_reason": ev["finish_reason"]}
                    c.update(delta={}) if chat else c.update(text="", logprobs=None)
                    await send(dict(base, choices=[c]))
                    if extra["include_usage"]:
                        await send(dict(base, choices=[], usage=self._usage(ev)))
                    break
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            if not done:
                self.worker.cancel(req)  # the client went away: free its slot

    @staticmethod
    def _usage(ev: dict) -> dict:
        return dict(ev["usage"], prompt_tokens_details={"cached_tokens": ev["reused_tokens"]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{
            "id": self.model_id, "object": "model", "created": self.created, "owned_by": "ds4t",
            "max_model_len": self.max_ctx, "vocab_size": self.model.vocab_size, "family": self.model.family}]})

    async def health(self, request: web.Request) -> web.Response:
        st = self.worker.status()
        w = self.worker
        status = "error" if not w.thread.is_alive() else "draining" if st["draining"] else "ok"
        body = {"status": status, "model": self.model_id,
                "max_ctx": self.max_ctx, **st}
        if self.store is not None:
            body["kv_cache"] = {"dir": self.store.dir, "entries": len(self.store.entries), **self.store.stats}
        if w.fatal:
            body["error"] = w.fatal
        return web.json_response(body, status=200 if status == "ok" else 503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        st = self.worker.status()
        gauges = {"queue_length": (st["waiting"], "requests waiting for a slot"),
                  "active_requests": (st["active"], "requests holding a slot"),
                  "slots": (st["slots"], "resident sessions (--batched-session)"),
                  "slots_busy": (st["busy"], "slots holding a request")}
        if self.store is not None:
            gauges["kv_cache_entries"] = (len(self.store.entries), "states saved in --kv-cache-dir")
        return web.Response(body=self.metrics.render(gauges).encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})
