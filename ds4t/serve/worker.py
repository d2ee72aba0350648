"""The decode worker: one thread that owns the slots and runs every step of every request.

Each step is ONE ``ds4t.eval_batch`` call holding:

* a decode row (the last sampled token) for every slot that is generating, and
* prompt chunks of slots that are prefilling, at most ``prefill_chunk`` tokens in all while anything
  decodes (``prefill_chunk_idle`` otherwise), so a long prompt delays running decoders by at most
  one chunk per step (a mixed batch: the model's native path takes it where it allows).

Then one sampling launch picks the next token of every row that needs one (greedy argmax, or
``sampling.sample`` seeded by (seed, stream, position) with stream derived from the request's seed:
the draw does not depend on the slot or the batch).

Speculative decoding (``mtp`` k > 0, ``ds4t serve --mtp K``): the step is ONE
:func:`ds4t.batch.speculative.spec_step` instead: every decoding slot drafts k tokens with the MTP head
and verifies them in the call that also carries the prompt chunks; a slot then emits one to k + 1
tokens, exactly those plain decoding would have produced (greedy or seeded). A slot without MTP history
(a restored state) takes a plain step until it has some.

Coalescing: the decode steps of running slots are ready the moment the previous step ends (the
worker samples their tokens itself), so what a window can gather is arrivals. When a step is
about to start requests that arrived since the last one, and slots are still free, the worker waits
up to ``coalesce_us`` from then for more arrivals, so a burst shares its prefill and decode steps
from the start. Steady decoding never waits.

Waiting requests are admitted in FIFO order to idle slots (:mod:`ds4t.serve.pool` routing, and
states saved in ``--kv-cache-dir`` via :mod:`ds4t.serve.persistence`). Active requests are never
evicted. An invalid item fails only its own request: the batch is run again without it.

Failures: a step that raises (inside the model, in sampling, in delivery) fails the requests of that
step only (their slots are reset: a half-written state is never continued) and the worker goes on.
When it cannot go on (``max_step_failures`` steps in a row failed, or its own bookkeeping raised),
every request still held is failed, ``fatal`` says why and ``on_fatal`` is called: the server then
exits non-zero so a supervisor restarts it, rather than staying up but dead.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ds4t.batch import speculative as spec
from ds4t.batch.engine import DecodeItem, eval_batch
from ds4t.batch.errors import BatchError
from ds4t import sampling
from ds4t.serve.metrics import Metrics
from ds4t.serve.persistence import KVStore
from ds4t.serve.pool import Slot, SlotPool

log = logging.getLogger("ds4t.serve")
batch_log = logging.getLogger("ds4t.serve.batch")

@dataclasses.dataclass
class GenParams:
    """What a request asks for. ``temperature`` 0 (or below :data:`ds4t.sampling.MIN_TEMPERATURE`, where
    fp32 ``logits / temperature`` would overflow): greedy; ``top_k`` 0: off, at most the vocabulary
    (checked by :meth:`DecodeWorker.submit`); ``top_p`` in (0, 1]. Draws follow :func:`ds4t.sampling.sample`:
    seeded by (seed, stream_id(seed), position), never by the slot or the batch."""
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop: Tuple[str, ...] = ()
    stop_token_ids: Tuple[int, ...] = ()

    def __post_init__(self):
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:  # also rejects NaN
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (isinstance(self.top_k, int) and 0 <= self.top_k < 1 << 31):
            raise ValueError(f"top_k must be an integer >= 0 (0: off), got {self.top_k!r}")
        if not 0.0 < float(self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


class Overloaded(Exception):
    """The waiting queue is full, or the server is draining."""


class Request:
    """One generation. ``sink(event)`` is called from the worker thread with dicts:
    {"type": "token", "token", "text"}, {"type": "done", "finish_reason", ...},
    {"type": "error", "status", "message"}."""

    _ids = itertools.count(1)

    def __init__(self, prompt: Sequence[int], params: GenParams, sink: Callable[[dict], None], detok=None):
        self.id = next(Request._ids)
        self.prompt = list(prompt)
        self.params = params
        self.sink = sink
        self.detok = detok
        self.state = "waiting"  # waiting | restoring | prefill | decode | done
        self.slot: Optional[Slot] = None
        self.fed = 0            # prompt tokens already in the slot's state
        self.reused = 0         # of which taken from a resident history or a restored state
        self.restored_from_disk = False
        self.next_token: Optional[int] = None
        self.generated: List[int] = []
        self.text = ""
        self.emitted = 0
        self.cancelled = False
        self.finish_reason: Optional[str] = None
        self.t_submit = time.monotonic()
        self.t_last: Optional[float] = None

    # -- text and stop conditions -------------------------------------------------------------
    def on_token(self, tok: int) -> Tuple[str, Optional[str]]:
        """Account a sampled token: (text that may be shown now, finish reason or None)."""
        p = self.params
        self.generated.append(tok)
        if tok in p.stop_token_ids:
            return self._flush(), "stop"
        if self.detok is not None:
            self.text += self.detok.push(tok)
        if p.stop:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out, "stop"
        if len(self.generated) >= p.max_tokens:
            return self._flush(), "length"
        end = len(self.text) - self._holdback()
        out = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return out, None

    def _find_stop(self) -> Optional[int]:
        start = max(0, self.emitted - max(len(s) for s in self.params.stop))
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        return min(hits) if hits else None

    def _holdback(self) -> int:
        """Length of the longest end of the text that may still become a stop string."""
        best = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def _flush(self) -> str:
        if self.detok is not None:
            self.text += self.detok.flush()
        if self.params.stop:
            cut = self._find_stop()
            if cut is not None:
                self.text = self.text[:cut]
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out

    def emit(self, event: dict) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001  (a gone client must not stop the worker)
            log.debug("request %d: sink failed", self.id, exc_info=True)

    def usage(self) -> Dict[str, int]:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": len(self.generated),
                "total_tokens": len(self.prompt) + len(self.generated)}


class DecodeWorker:
    def __init__(self, pool: SlotPool, *, metrics: Optional[Metrics] = None, store: Optional[KVStore] = None,
                 coalesce_us: int = 2000, prefill_chunk: int = 128, prefill_chunk_idle: int = 512,
                 max_waiting: int = 1024, batch_log_enabled: bool = False, mode: str = "auto",
                 max_step_failures: int = 3, on_fatal: Optional[Callable[[str], None]] = None, mtp: int = 0):
        if prefill_chunk < 1 or prefill_chunk_idle < 1:
            raise ValueError("prefill chunks must be >= 1 token")
        if not isinstance(mtp, int) or mtp < 0:
            raise ValueError(f"mtp must be an int >= 0, got {mtp!r}")
        if mtp and getattr(pool.model, "mtp", None) is None:
            raise ValueError(f"mtp={mtp}: model {pool.model.name!r} has no MTP head (its checkpoint holds no MTP "
                             "weights)")
        self.mtp = int(mtp)
        self.drafted = self.accepted = 0   # speculative decoding totals (also in /metrics)
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0 (0: no queue), got {max_waiting}")
        self.pool = pool
        self.model = pool.model
        self.metrics = metrics or Metrics()
        self.store = store
        self.coalesce_s = max(0, int(coalesce_us)) / 1e6
        self.prefill_chunk = int(prefill_chunk)
        self.prefill_chunk_idle = max(int(prefill_chunk_idle), int(prefill_chunk))
        self.max_waiting = int(max_waiting)
        self.batch_log_enabled = batch_log_enabled
        self.mode = mode
        self.waiting: "collections.deque[Request]" = collections.deque()
        self.active: List[Request] = []
        self._restored: List[Tuple[Request, object]] = []
        self._cond = threading.Condition()
        self._stop = False
        self._draining = False
        self.max_step_failures = max(1, int(max_step_failures))
        self._failed_in_a_row = 0
        self.on_fatal = on_fatal
        self.fatal: Optional[str] = None  # why the worker stopped on its own, if it did
        self._steps = 0
        self._fresh = False  # a request was admitted since the last step (a burst may be arriving)
        self.step_log: "collections.deque[dict]" = collections.deque(maxlen=4096)  # for tests/bench
        self.thread = threading.Thread(target=self._run, name="ds4t-decode-worker", daemon=True)

    # -- API for the HTTP side (any thread) ---------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def submit(self, req: Request) -> None:
        """Queue ``req``. ValueError: parameters this model cannot honour. Overloaded: draining, stopped,
        or more than ``max_waiting`` requests would wait for a slot (0: only idle slots are taken)."""
        V = self.model.vocab_size
        if req.params.top_k > V:
            raise ValueError(f"top_k must be at most the vocabulary size {V}, got {req.params.top_k}")
        with self._cond:
            if self._stop or self._draining:
                raise Overloaded("server is shutting down")
            free = sum(s.idle for s in self.pool.slots)
            if len(self.waiting) - free >= self.max_waiting:
                raise Overloaded(f"all {len(self.pool)} slots are busy and {len(self.waiting)} requests are "
                                 f"already waiting (--max-waiting {self.max_waiting})")
            self.waiting.append(req)
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """The client is gone: drop the request (waiting) or free its slot after this step."""
        with self._cond:
            if req.state != "done":
                req.cancelled = True
                self._cond.notify_all()

    def set_coalesce_us(self, us: int) -> None:
        with self._cond:
            self.coalesce_s = max(0, int(us)) / 1e6

    def status(self) -> dict:
        with self._cond:
            return {"slots": len(self.pool), "busy": self.pool.busy(), "active": len(self.active),
                    "waiting": len(self.waiting), "steps": self._steps, "draining": self._draining,
                    "slot_positions": [s.session.pos for s in self.pool.slots]}

    def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to ``timeout`` s for the held ones to finish; True if they did.
        Call :meth:`stop` afterwards: it fails whatever is still held."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            self._draining = True
            self._cond.notify_all()
            while (self.waiting or self.active) and self.thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def stop(self, save: bool = True, timeout: float = 120.0) -> None:
        """Finish the current step, fail what is left (503), save idle states (with a store)."""
        with self._cond:
            self._stop = True
            self._save_on_stop = save
            self._cond.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)

    # -- the loop ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    if not self._wait_for_work():
                        break
                self._step()
                with self._cond:
                    self._cond.notify_all()  # drain() waits for active/waiting to empty
                if self._failed_in_a_row >= self.max_step_failures:
                    self._die(f"{self._failed_in_a_row} steps in a row failed; the model looks broken")
                    break
        except Exception as e:  # noqa: BLE001  (the worker's own bookkeeping: it cannot go on)
            log.exception("decode worker crashed")
            self._die(f"decode worker crashed: {type(e).__name__}: {e}")
        finally:
            self._shutdown()

    def _die(self, why: str) -> None:
        self.fatal = why
        log.critical("decode worker stopping: %s", why)
        if self.on_fatal is not None:
            try:
                self.on_fatal(why)
            except Exception:  # noqa: BLE001
                log.exception("on_fatal failed")

    def _wait_for_work(self) -> bool:
        """With the lock held: admit, wait until there is a step to run; coalesce. False: stop."""
        while True:
            if self._stop:
                return False
            self._housekeeping()
            if self._runnable():
                break
            self._cond.wait()
        if self.coalesce_s > 0 and self._fresh and self.pool.idle_slots() and not self.waiting:
            deadline = time.monotonic() + self.coalesce_s
            while not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
                self._housekeeping()
                if not self.pool.idle_slots():
                    break
        return not self._stop

    def _runnable(self) -> bool:
        return any(r.state in ("prefill", "decode") for r in self.active)

    def _housekeeping(self) -> None:
        self._apply_restores()
        self._drop_cancelled()
        self._admit()

    # -- admission and routing ----------------------------------------------------------------
    def _drop_cancelled(self) -> None:
        if any(r.cancelled for r in self.waiting):
            for r in [r for r in self.waiting if r.cancelled]:
                self._finish(r, "cancelled")
            self.waiting = collections.deque(r for r in self.waiting if not r.cancelled)
        for r in list(self.active):
            if r.cancelled and r.state in ("prefill", "decode"):
                self._finish(r, "cancelled")

    def _admit(self) -> None:
        while self.waiting and self.pool.idle_slots():
            r = self.waiting.popleft()
            if r.cancelled:
                self._finish(r, "cancelled")
                continue
            self._route(r)

    def _route(self, r: Request) -> None:
        slot, n = self.pool.best_prefix(r.prompt)
        disk = self.store.match(r.prompt) if self.store is not None else None
        if disk is not None and disk[1] > n:
            victim = self._take_victim(avoid=slot)
            self._attach(r, victim)
            r.state = "restoring"
            self.store.load_async(disk[0], lambda res, r=r: self._restore_done(r, res))
            return
        if slot is not None:
            self._attach(r, slot)
            r.fed = r.reused = n
            self.metrics.inc("prefix_reused_tokens_total", n)
        else:
            self._attach(r, self._take_victim())
        r.state = "prefill"

    def _take_victim(self, avoid: Optional[Slot] = None) -> Slot:
        saved = self.store.contains if self.store is not None else (lambda t: False)
        slot = self.pool.victim(saved=saved, avoid=avoid)
        s = slot.session
        if s.pos > 0:
            if self.store is not None and not self.store.contains(s.tokens):
                self.store.save_async(list(s.tokens), s.pos, s.state_dict())  # a snapshot: reset at once
                self.metrics.inc("kv_saves_total")
            self.metrics.inc("evictions_total")
            self.pool.reset(slot)
        return slot

    def _attach(self, r: Request, slot: Slot) -> None:
        self._fresh = True
        self.pool.assign(slot, r)
        r.slot = slot
        self.active.append(r)

    def _restore_done(self, r: Request, res) -> None:  # I/O thread
        with self._cond:
            self._restored.append((r, res))
            self._cond.notify_all()

    def _apply_restores(self) -> None:
        done, self._restored = self._restored, []
        for r, res in done:
            s = r.slot.session
            r.state = "prefill"
            if isinstance(res, Exception):
                log.warning("request %d: saved state not usable (%s); prefilling the whole prompt", r.id, res)
                self.metrics.inc("kv_restore_failures_total")
                continue  # the slot was reset when it was taken: prefill from 0
            tokens, pos, state = res
            if list(tokens) != r.prompt[:pos] or pos >= len(r.prompt):
                log.warning("request %d: restored history does not prefix the prompt; prefilling", r.id)
                continue
            try:
                s.load_state_dict(state, pos, list(tokens))
            except Exception as e:  # noqa: BLE001  (a state that does not fit: never use it)
                log.warning("request %d: could not load saved state (%s); prefilling", r.id, e)
                self.pool.reset(r.slot)
                continue
            r.fed = r.reused = pos
            r.restored_from_disk = True
            self.metrics.inc("kv_restores_total")
            self.metrics.inc("restored_tokens_total", pos)
        for r, _ in done:
            if r.cancelled:
                self._finish(r, "cancelled")

    # -- one step --------------------------------------------------------------------------------
    def _step(self) -> None:
        t0 = time.perf_counter()
        self._fresh = False
        decode = [r for r in self.active if r.state == "decode"]
        budget = self.prefill_chunk if decode else self.prefill_chunk_idle
        work: List[Tuple[Request, List[int]]] = [(r, [r.next_token]) for r in decode]
        for r in self.active:
            if r.state != "prefill" or budget <= 0:
                continue
            n = min(budget, len(r.prompt) - r.fed)
            work.append((r, r.prompt[r.fed:r.fed + n]))
            budget -= n
        if not work:
            return
        if self.mtp:
            self._spec(work, t0)
            return
        ran, logits, paths = self._eval(work)
        if not ran:
            return
        try:
            self._advance(ran, logits, paths, decode, t0)
            self._failed_in_a_row = 0
        except Exception as e:  # noqa: BLE001  (sampling or delivery: fail this step's requests only)
            self._fail_step(ran, e)

    def _advance(self, ran, logits, paths, decode, t0) -> None:
        """After the model ran ``ran``: count fed prompt tokens, sample, deliver, record the step."""
        t1 = time.perf_counter()
        need, rows = [], []
        for j, (r, toks) in enumerate(ran):
            if r.state == "prefill":
                r.fed += len(toks)
                if r.fed < len(r.prompt):
                    continue
            need.append(r)
            rows.append(j)
        tokens: List[int] = []
        if need:
            tokens = self._sample(logits[rows] if len(rows) != len(ran) else logits, need)
        now = time.monotonic()
        self.metrics.observe_tokens(len(need), now)
        for r, tok in zip(need, tokens):
            self._deliver(r, tok, now)
        t2 = time.perf_counter()
        self._steps += 1
        dec_ids = {id(r) for r in decode}
        n_rows = sum(len(t) for _, t in ran)
        n_dec = sum(id(r) in dec_ids for r, _ in ran)
        n_pre_tok = n_rows - n_dec
        native = sum(p == "native" for p in paths)
        self.metrics.observe_batch(len(ran), n_rows, t2 - t0, native, len(paths) - native, n_pre_tok, n_dec)
        rec = {"step": self._steps, "items": len(ran), "rows": n_rows, "decode": n_dec,
               "prefill_items": len(ran) - n_dec, "prefill_tokens": n_pre_tok,
               "paths": dict(collections.Counter(paths)), "eval_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3,
               "requests": [r.id for r, _ in ran]}
        self.step_log.append(rec)
        if self.batch_log_enabled:
            batch_log.info("batch %d: items=%d rows=%d decode=%d prefill=%d(%d tok) paths=%s elapsed=%.1fms "
                           "(eval %.1fms)", rec["step"], rec["items"], rec["rows"], rec["decode"],
                           rec["prefill_items"], rec["prefill_tokens"],
                           ",".join(f"{k}:{v}" for k, v in sorted(rec["paths"].items())) or "-",
                           rec["total_ms"], rec["eval_ms"])

    def _eval(self, work):
        """eval_batch over ``work``; an item that the engine rejects fails its request only and the
        rest runs again. Returns (work that ran, logits [len, vocab], paths)."""
        work = list(work)
        while work:
            items = [DecodeItem(r.slot.session, toks if len(toks) > 1 else toks[0]) for r, toks in work]
            try:
                res = eval_batch(items, mode=self.mode)
                return work, res.logits, res.paths
            except BatchError as e:
                if e.item is not None and e.item < len(work):
                    bad = work.pop(e.item)
                    self._fail(bad[0], 400, f"{e}".split(":", 1)[1].strip(), state_ok=True)
                    continue
                if len(work) == 1:
                    self._fail(work[0][0], 400, str(e), state_ok=True)
                    return [], None, []
                # not attributable to one item: each alone (no session was changed by the failure)
                ran, rows, paths = [], [], []
                for w in work:
                    sub, lg, p = self._eval([w])
                    ran += sub
                    paths += p
                    if sub:
                        rows.append(lg)
                return ran, (torch.cat(rows) if rows else None), paths
            except Exception as e:  # noqa: BLE001
                # A fault inside the model's forward: the rows' states may be half-written. Never
                # continue them: fail these requests and reset their slots; other slots are untouched.
                log.exception("step failed inside the model")
                self._failed_in_a_row += 1
                for r, _ in work:
                    self._fail(r, 500, f"internal error during the step: {type(e).__name__}: {e}", state_ok=False)
                return [], None, []
        return [], None, []

    # -- speculative steps (mtp > 0) ------------------------------------------------------------------
    def _spec(self, work, t0) -> None:
        """One speculative step over ``work`` (decode rows and prompt chunks): drafts,
        ONE verify call, the accepted tokens delivered in order. Failures as in ``_step``."""
        ran = self._spec_run(work)
        if ran is None:
            return
        work, results, plain_logits, paths = ran
        dec, pre = work[:len(results)], work[len(results):]   # _spec_run orders decode rows first
        try:
            now = time.monotonic()
            n_tok = 0
            for (r, _), res in zip(dec, results):
                self.drafted += res.drafted
                self.accepted += res.accepted
                self.metrics.observe_speculation(res.drafted, res.accepted)
                for tok in res.tokens:
                    if r.state == "done":
                        break
                    self._deliver(r, tok, now)
                    n_tok += 1
            done = []
            for j, (r, toks) in enumerate(pre):
                r.fed += len(toks)
                if r.fed == len(r.prompt):
                    done.append((j, r))
            if done:
                toks = self._sample(plain_logits[[j for j, _ in done]], [r for _, r in done])
                for (_, r), tok in zip(done, toks):
                    self._deliver(r, tok, now)
                    n_tok += 1
            self.metrics.observe_tokens(n_tok, now)
            t2 = time.perf_counter()
            self._steps += 1
            n_rows = sum(len(t) for _, t in work)
            native = sum(p == "native" for p in paths)
            self.metrics.observe_batch(len(work), n_rows, t2 - t0, native, len(paths) - native,
                                       sum(len(t) for _, t in pre), len(dec))
            self.step_log.append({"step": self._steps, "items": len(work), "rows": n_rows, "decode": len(dec),
                                  "speculative": True, "total_ms": (t2 - t0) * 1e3,
                                  "requests": [r.id for r, _ in work]})
            self._failed_in_a_row = 0
        except Exception as e:  # noqa: BLE001  (sampling or delivery: fail this step's requests only)
            self._fail_step(work, e)

    def _fail_step(self, work, e: Exception) -> None:
        """Sampling or delivery raised after the model ran: fail this step's unfinished requests (their
        slots are reset: a half-delivered state is never continued) and count the failed step."""
        log.exception("step failed after the model ran")
        self._failed_in_a_row += 1
        for r, _ in work:
            if r.state != "done":
                self._fail(r, 500, f"internal error during the step: {type(e).__name__}: {e}", state_ok=False)

    def _spec_run(self, work):
        """The model part of a speculative step: (results of the decode rows, logits of the prompt
        chunks' last tokens, paths) or None when nothing ran. A request the engine rejects fails alone
        and the step runs again without it."""
        work = list(work)
        while work:
            dec = [(r, t) for r, t in work if r.state == "decode"]
            pre = [(r, t) for r, t in work if r.state != "decode"]
            items = []
            for r, _ in dec:
                p = r.params
                items.append(spec.SpecItem(r.slot.session, r.next_token, k=self.mtp, temperature=p.temperature,
                                           top_k=p.top_k, top_p=p.top_p, seed=p.seed,
                                           stop=frozenset(p.stop_token_ids),
                                           max_tokens=max(1, p.max_tokens - len(r.generated))))
            extra = [DecodeItem(r.slot.session, t) for r, t in pre]
            try:
                extra_paths: list = []
                if items:
                    results, logits = spec.spec_step(items, extra=extra, mode=self.mode, extra_paths=extra_paths)
                else:
                    results, logits = [], spec.prefill(extra, mode=self.mode, paths=extra_paths)
                return dec + pre, results, logits, [res.path for res in results] + extra_paths
            except BatchError as e:
                i = e.item
                bad = (dec + pre)[i] if i is not None and i < len(dec + pre) else (work[0] if len(work) == 1 else None)
                if bad is None:   # not attributable: fail the step's requests (no session was changed)
                    for r, _ in work:
                        self._fail(r, 400, str(e), state_ok=True)
                    return None
                work.remove(bad)
                self._fail(bad[0], 400, str(e), state_ok=True)
            except Exception as e:  # noqa: BLE001
                log.exception("speculative step failed inside the model")
                self._failed_in_a_row += 1
                for r, _ in work:
                    self._fail(r, 500, f"internal error during the step: {type(e).__name__}: {e}", state_ok=False)
                return None
        return None

    def _sample(self, logits: torch.Tensor, reqs: List[Request]) -> List[int]:
        """One token per row: greedy or seeded, each row by its own request's parameters."""
        ps = [r.params for r in reqs]
        return sampling.sample(logits, temperature=[p.temperature for p in ps], top_k=[p.top_k for p in ps],
                               top_p=[p.top_p for p in ps], seed=[p.seed for p in ps],
                               position=[r.slot.session.pos for r in reqs]).tolist()

    def _deliver(self, r: Request, tok: int, now: float) -> None:
        if tok == sampling.NO_TOKEN:   # this request's logits held a NaN: it alone fails, its state not kept
            log.error("request %s: the model's logits hold a NaN; failing it", r.id)
            self._fail(r, 500, "internal error: the model's logits for this request hold a NaN (no token to "
                               "choose)", state_ok=False)
            return
        if r.t_last is None:
            self.metrics.observe_ttft(now - r.t_submit)
        else:
            self.metrics.observe_itl(now - r.t_last)
        r.t_last = now
        text, finish = r.on_token(tok)
        if finish is None and r.cancelled:
            finish = "cancelled"
        if finish is None and r.slot.session.pos >= r.slot.session.max_ctx:
            text += r._flush()
            finish = "length"
        r.emit({"type": "token", "token": tok, "text": text})
        if finish is not None:
            self._finish(r, finish)
        else:
            r.next_token = tok
            r.state = "decode"

    # -- ending requests ---------------------------------------------------------------------------
    def _release(self, r: Request, state_ok: bool = True) -> None:
        if r in self.active:
            self.active.remove(r)
        if r.slot is not None:
            if not state_ok:
                try:
                    self.pool.reset(r.slot)
                except Exception:  # noqa: BLE001
                    log.exception("could not reset slot %d", r.slot.index)
            self.pool.release(r.slot)
            r.slot = None

    # Ending a request (slot released, then its last event) happens under the lock as one step: drain()
    # reads ``active`` under it, so once a request has left ``active`` its client has its last event
    # (seen on the H200: drain returned between the two). The lock is re-entrant (housekeeping holds it).
    def _finish(self, r: Request, reason: str) -> None:
        with self._cond:
            self._release(r)
            r.state = "done"
            r.finish_reason = reason
            self.metrics.inc("requests_total", status="cancelled" if reason == "cancelled" else "ok")
            r.emit({"type": "done", "finish_reason": reason, "usage": r.usage(), "text": r.text,
                    "token_ids": list(r.generated), "reused_tokens": r.reused,
                    "restored_from_disk": r.restored_from_disk})

    def _fail(self, r: Request, status: int, message: str, state_ok: bool) -> None:
        with self._cond:
            self._release(r, state_ok=state_ok)
            r.state = "done"
            r.finish_reason = "error"
            self.metrics.inc("requests_total", status="error")
            r.emit({"type": "error", "status": status, "message": message})

    def _shutdown(self) -> None:
        with self._cond:
            self._stop = True
            why = f"the decode worker failed ({self.fatal})" if self.fatal else "server is shutting down"
            for r in list(self.waiting) + list(self.active):
                if r.state != "done":
                    self._fail(r, 503, why, state_ok=self.fatal is None)
            self.waiting.clear()
            if self.store is not None and getattr(self, "_save_on_stop", True):
                for slot in self.pool.slots:
                    s = slot.session
                    if s.pos > 0 and not self.store.contains(s.tokens):
                        self.store.save_async(list(s.tokens), s.pos, s.state_dict())
                        self.metrics.inc("kv_saves_total")
        if self.store is not None:
            self.store.flush()
