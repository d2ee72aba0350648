"""The decode worker without HTTP: chunked prefill interleaved with decoders in mixed batches, FIFO
admission, prefix reuse, restore from --kv-cache-dir, and one bad item failing only its request."""
import threading

import pytest

from ds4t.serve.persistence import KVStore, model_fingerprint
from ds4t.serve.pool import SlotPool
from ds4t.serve.worker import DecodeWorker, GenParams, Request

from .conftest import greedy_ref, slow_steps


class Sink:
    def __init__(self, order=None):
        self.events, self.done, self.order = [], threading.Event(), order

    def __call__(self, ev):
        self.events.append(ev)
        if ev["type"] in ("done", "error"):
            if self.order is not None:
                self.order.append(self)
            self.done.set()

    @property
    def final(self):
        return self.events[-1]

    @property
    def tokens(self):
        return [e["token"] for e in self.events if e["type"] == "token"]


def submit(w, prompt, max_tokens, order=None):
    sink = Sink(order)
    req = Request(prompt, GenParams(max_tokens=max_tokens), sink)
    w.submit(req)
    return req, sink


def wait_all(sinks, timeout=300):
    for s in sinks:
        assert s.done.wait(timeout), "request did not finish"


@pytest.fixture
def worker(model):
    made = []

    def make(n, store=None, start=True, **kw):
        pool = SlotPool(model, n, 64)
        w = DecodeWorker(pool, store=store, coalesce_us=kw.pop("coalesce_us", 0), **kw)
        made.append(w)
        if start:
            w.start()
        return w

    yield make
    for w in made:
        if w.thread.is_alive():
            w.stop()
        w.pool.close()


def test_long_prefill_is_chunked_between_decode_steps(model, worker):
    short = [[7, 8, 9], [40, 41, 42]]
    long_prompt = list(range(60, 70))  # 10 tokens: chunks of 4, 4, 2
    refs = [greedy_ref(model, p, 10)[0] for p in short] + [greedy_ref(model, long_prompt, 2)[0]]
    w = worker(3, prefill_chunk=4, prefill_chunk_idle=64, start=False)
    s3 = Sink()
    r3 = Request(long_prompt, GenParams(max_tokens=2), s3)
    (r1, s1), (r2, s2) = submit(w, short[0], 10), submit(w, short[1], 10)
    sink1 = s1.__call__

    def arrive_while_decoding(ev):  # runs in the worker: r3 arrives right after r1's 2nd token
        sink1(ev)
        if len(s1.tokens) == 2:
            w.submit(r3)

    r1.sink = arrive_while_decoding
    w.start()
    wait_all([s1, s2, s3])
    assert [s1.tokens, s2.tokens, s3.tokens] == refs
    steps = list(w.step_log)
    chunks = [st for st in steps if r3.id in st["requests"] and st["prefill_tokens"]]
    assert len(chunks) == 3 and sum(st["prefill_tokens"] for st in chunks) == len(long_prompt)
    for st in chunks:
        assert st["prefill_tokens"] <= 4  # never more than one chunk per step
        assert {r1.id, r2.id} <= set(st["requests"]) and st["decode"] == 2  # mixed with the decoders
        assert st["paths"] == {"native": 3}  # one call: the native path took the mixed batch
    for r in (r1, r2):  # a decoder advances in every step from its first to its last
        idx = [i for i, st in enumerate(steps) if r.id in st["requests"]]
        assert idx == list(range(idx[0], idx[-1] + 1))


def test_fifo_admission_and_prefix_reuse(model, worker):
    prompts = [[1, 2, 3], [4, 5, 6], [7, 8]]
    refs = [greedy_ref(model, p, 1)[0] for p in prompts]
    cont = prompts[2] + [100, 101]
    ref_cont = greedy_ref(model, cont, 2)[0]
    order = []
    w = worker(1, start=False)
    subs = [submit(w, p, 1, order) for p in prompts]
    w.start()
    wait_all([s for _, s in subs])
    assert order == [s for _, s in subs]  # first come, first served
    assert [s.tokens for _, s in subs] == refs
    assert [st["requests"] for st in w.step_log] == [[r.id] for r, _ in subs]
    r4, s4 = submit(w, cont, 2)  # the slot's history [7, 8] is a prefix: only 2 tokens to prefill
    wait_all([s4])
    assert s4.final["reused_tokens"] == len(prompts[2]) and s4.tokens == ref_cont
    assert w.step_log[-2]["prefill_tokens"] == 2


def test_bad_item_fails_only_its_request(model, worker):
    good = [[10, 11, 12], [20, 21]]
    refs = [greedy_ref(model, p, 2)[0] for p in good]
    w = worker(3, start=False)
    (_, sa), (_, sb), (_, sc) = submit(w, good[0], 2), submit(w, [5, 300, 6], 2), submit(w, good[1], 2)
    w.start()  # all three are in the first batch; the engine rejects item 1
    wait_all([sa, sb, sc])
    assert sb.final["type"] == "error" and sb.final["status"] == 400 and "vocabulary" in sb.final["message"]
    assert [sa.tokens, sc.tokens] == refs and sa.final["type"] == sc.final["type"] == "done"
    assert w.step_log[0]["items"] == 2 and w.status()["busy"] == 0


def test_conversation_restored_from_disk_after_eviction(model, worker, tmp_path):
    a, b = [30, 31, 32, 33], [50, 51, 52]
    ref_a = greedy_ref(model, a, 2)[0]
    cont = a + ref_a + [9]
    ref_cont = greedy_ref(model, cont, 2)[0]
    pool_probe = SlotPool(model, 1, 64)
    fp = model_fingerprint(model, pool_probe.zero_state)
    pool_probe.close()
    store = KVStore(tmp_path, fp)
    w = worker(1, store=store)
    _, sa = submit(w, a, 2)
    wait_all([sa])
    _, sb = submit(w, b, 1)  # takes the only slot: a's state goes to disk first
    wait_all([sb])
    _, sc = submit(w, cont, 2)  # a returns: restored (b's state is saved in turn)
    wait_all([sc])
    assert sa.tokens == ref_a
    assert sc.final["restored_from_disk"] and sc.final["reused_tokens"] == len(a) + 1
    assert sc.tokens == ref_cont
    w.stop()
    store.close()
    assert store.stats["saved"] == 3 and store.stats["restored"] == 1  # a, b, and cont at shutdown


# -- failures: a step that raises fails its own requests, the worker goes on or exits loudly ----------

def test_failing_sampler_fails_only_that_step(model, worker):
    w = worker(2, start=False)
    real, calls = w._sample, []

    def flaky(logits, reqs):
        calls.append(len(reqs))
        if len(calls) == 1:
            raise RuntimeError("planted sampler fault")
        return real(logits, reqs)

    w._sample = flaky
    (_, sa), (_, sb) = submit(w, [1, 2, 3], 2), submit(w, [4, 5], 2)
    w.start()
    wait_all([sa, sb])
    assert sa.final["status"] == sb.final["status"] == 500 and "planted sampler fault" in sa.final["message"]
    _, sc = submit(w, [7, 8, 9], 2)  # the worker kept serving, from reset slots
    wait_all([sc])
    assert sc.tokens == greedy_ref(model, [7, 8, 9], 2)[0] and w.thread.is_alive() and w.fatal is None


def test_model_fault_fails_its_batch_and_serving_continues(model, worker, monkeypatch):
    import ds4t.serve.worker as wmod

    real, n = wmod.eval_batch, []

    def faulty(items, mode="auto"):
        n.append(len(items))
        if len(n) == 1:
            raise RuntimeError("planted kernel fault")
        return real(items, mode=mode)

    monkeypatch.setattr(wmod, "eval_batch", faulty)
    w = worker(2)
    _, sa = submit(w, [11, 12], 2)
    wait_all([sa])
    assert sa.final["status"] == 500 and "planted kernel fault" in sa.final["message"]
    _, sb = submit(w, [11, 12], 2)
    wait_all([sb])
    assert sb.tokens == greedy_ref(model, [11, 12], 2)[0] and w.fatal is None


def test_nan_logits_fail_only_their_request(model, worker, monkeypatch):
    """A request whose logits hold a NaN fails alone (500 naming it); the request beside it in the same
    step gets its tokens, and serving continues."""
    import ds4t.serve.worker as wmod

    real, poisoned = wmod.eval_batch, []

    def nan_for_one(items, mode="auto"):
        r = real(items, mode=mode)
        for j, it in enumerate(items):
            if it.session.tokens[:2] == [21, 22] and not poisoned:
                r.logits[j] = float("nan")
                poisoned.append(j)
        return r

    monkeypatch.setattr(wmod, "eval_batch", nan_for_one)
    w = worker(2, start=False)
    (_, sa), (_, sb) = submit(w, [21, 22], 3), submit(w, [23, 24], 3)
    w.start()
    wait_all([sa, sb])
    assert poisoned and sa.final["status"] == 500 and "NaN" in sa.final["message"]
    assert sb.final["type"] == "done" and sb.tokens == greedy_ref(model, [23, 24], 3)[0]
    _, sc = submit(w, [21, 22], 2)
    wait_all([sc])
    assert sc.tokens == greedy_ref(model, [21, 22], 2)[0] and w.fatal is None


def test_worker_that_cannot_go_on_fails_everything_and_reports_fatal(model, worker, monkeypatch):
    import ds4t.serve.worker as wmod

    def broken(items, mode="auto"):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(wmod, "eval_batch", broken)
    fatal = []
    w = worker(1, start=False, on_fatal=fatal.append)
    sinks = [submit(w, [i + 1, i + 2], 2)[1] for i in range(5)]
    w.start()
    wait_all(sinks)
    w.thread.join(30)
    assert not w.thread.is_alive() and w.fatal and fatal == [w.fatal] and "3 steps in a row" in w.fatal
    assert [s.final["status"] for s in sinks] == [500, 500, 500, 503, 503]
    assert all("decode worker failed" in s.final["message"] for s in sinks[3:])
    with pytest.raises(Exception):
        submit(w, [1], 1)  # stopped: refused, not queued forever


def test_sampling_parameters_are_bounded(model, worker):
    w = worker(1, start=False)
    for bad in (dict(top_k=-1), dict(top_k=1 << 31), dict(temperature=float("nan")), dict(temperature=-1e-3),
                dict(top_p=0.0), dict(top_p=1.5), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            GenParams(**dict(dict(max_tokens=2), **bad))
    with pytest.raises(ValueError, match="vocabulary size"):
        w.submit(Request([1], GenParams(max_tokens=1, top_k=model.vocab_size + 1), Sink()))


def test_seeded_sampling_at_a_tiny_temperature_is_greedy(model, worker):
    w = worker(1)
    sink = Sink()
    w.submit(Request([3, 4, 5], GenParams(max_tokens=3, temperature=1e-40, top_k=2, seed=1), sink))
    wait_all([sink])
    assert sink.tokens == greedy_ref(model, [3, 4, 5], 3)[0]


# -- admission: --max-waiting, cancel while queued, drain -----------------------------------------------

def test_max_waiting_zero_takes_idle_slots_and_queues_nothing(model, worker):
    from ds4t.serve.worker import Overloaded

    w = worker(2, max_waiting=0)
    _, sa = submit(w, [1, 2], 40)
    _, sb = submit(w, [3, 4], 40)  # both slots were idle: accepted
    with pytest.raises(Overloaded, match="max-waiting 0"):
        submit(w, [5, 6], 1)
    wait_all([sa, sb])
    _, sc = submit(w, [5, 6], 1)  # idle again
    wait_all([sc])
    assert sc.final["type"] == "done"


def test_max_waiting_counts_only_requests_beyond_the_slots(model, worker):
    from ds4t.serve.worker import Overloaded

    w = worker(1, start=False, max_waiting=2)
    subs = [submit(w, [i + 1], 1) for i in range(3)]  # 1 takes the idle slot, 2 wait
    with pytest.raises(Overloaded):
        submit(w, [9], 1)
    w.start()
    wait_all([s for _, s in subs])


def test_cancel_while_queued_never_runs(model, worker):
    w = worker(1, start=False)
    ra, sa = submit(w, [1, 2, 3], 3)
    rb, sb = submit(w, [4, 5, 6], 3)  # waits behind a
    w.cancel(rb)
    w.start()
    wait_all([sa, sb])
    assert sb.final["finish_reason"] == "cancelled" and sb.tokens == []
    assert all(rb.id not in st["requests"] for st in w.step_log)
    assert sa.tokens == greedy_ref(model, [1, 2, 3], 3)[0]


def test_drain_refuses_new_work_and_lets_held_work_finish(model, worker):
    from ds4t.serve.worker import Overloaded

    w = worker(1)
    _, sa = submit(w, [1, 2, 3], 3)
    assert w.drain(timeout=300) and sa.final["type"] == "done"
    with pytest.raises(Overloaded, match="shutting down"):
        submit(w, [1], 1)


def test_drain_timeout_then_stop_fails_what_is_left(model, worker, monkeypatch):
    slow_steps(monkeypatch, 0.05)  # 60 tokens take >= 3 s on any device
    w = worker(1)
    _, sa = submit(w, [1, 2, 3], 60)
    assert not w.drain(timeout=0.2)
    w.stop()
    wait_all([sa])
    assert sa.final["type"] == "error" and sa.final["status"] == 503 and len(sa.tokens) < 60


def test_drain_returns_only_after_the_last_event_is_delivered(model, worker):
    """A slow client callback on the final event: drain() must not report the request finished before
    its client has that event (the order once seen on the H200, where steps take ~1 ms)."""
    import time

    class SlowDone(Sink):
        def __call__(self, ev):
            if ev["type"] in ("done", "error"):
                time.sleep(0.5)
            super().__call__(ev)

    w = worker(1)
    sink = SlowDone()
    w.submit(Request([1, 2, 3], GenParams(max_tokens=2), sink))
    assert w.drain(timeout=300)
    assert sink.done.is_set() and sink.final["type"] == "done"


def test_speculative_worker_serves_the_plain_tokens(model, worker):
    """--mtp: every step is one spec_step (drafts from the MTP head, replayed through the one verify
    call with the prompt chunks of arriving requests); each request gets exactly the tokens plain
    decoding gives, greedy and seeded, with a stop token; drafts are counted."""
    prompts = [[7, 8, 9], [40, 41, 42, 43, 44, 45], [3]]
    w = worker(2, prefill_chunk=4, prefill_chunk_idle=8, mtp=3)   # 3 requests on 2 slots: one waits
    refs = [greedy_ref(model, p, 9)[0] for p in prompts]
    sinks = [submit(w, p, 9)[1] for p in prompts]
    wait_all(sinks)
    assert [s.tokens for s in sinks] == refs
    assert all(s.final["finish_reason"] == "length" for s in sinks)
    assert w.drafted > 0 and any(r.get("speculative") for r in w.step_log)
    stop = refs[0][4]
    sink = Sink()
    w.submit(Request(prompts[0], GenParams(max_tokens=9, stop_token_ids=(stop,)), sink))
    wait_all([sink])
    assert sink.tokens == refs[0][:refs[0].index(stop) + 1] and sink.final["finish_reason"] == "stop"
    plain = worker(1)
    seeded = dict(max_tokens=7, temperature=0.9, seed=11)
    got = []
    for ww in (plain, w):
        s = Sink()
        ww.submit(Request(prompts[1], GenParams(**seeded), s))
        wait_all([s])
        got.append(s.tokens)
    assert got[0] == got[1]
    with pytest.raises(ValueError, match="no MTP head"):
        DecodeWorker(SlotPool(__import__("ds4t").load("tiny-llama"), 1, 16), mtp=2)
