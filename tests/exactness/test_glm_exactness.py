"""GLM-4.5 MoE native path is bit-exact against the ordered fallback, including batches where some
rows are past the native window and run ordered inside the same eval_batch call."""
import pytest
import torch

import ds4t
from ds4t.exactness import harness
from ds4t.exactness.harness import Plan, Scenario
from ds4t.models.glm import DEFAULT_NATIVE_WINDOW


@pytest.fixture
def model():
    m = ds4t.load("tiny-glm")
    assert m.native_window is DEFAULT_NATIVE_WINDOW is None
    return m


def test_native_path_is_bit_exact(model):
    sc = Scenario([Plan([3, 1, 4, 1, 5, 9, 2, 6]), Plan([7]), Plan([2, 7, 1, 8, 2, 8], leave=3),
                   Plan([5, 3, 5, 8, 9], join=1, chunked_join=True), Plan([11, 13], join=2)],
                  steps=5, seed=3, max_ctx=64)
    rep = harness.run_scenario(model, sc, mode="native")
    assert rep.ok, rep.first_mismatch
    assert set(rep.paths) == {"native"} and rep.native_missing == 0


def test_mixed_eligibility_batch_is_bit_exact(model):
    """native_window=20: rows whose visible window (pos + new tokens) passes 20 run ordered in the
    same call, the others natively; every row and every state equals the all-ordered twin."""
    model.native_window = 20
    assert model.native_rules[0].condition == "visible window (pos + new tokens) <= 20"
    prompts = [[1, 2, 3], [4] * 17, [5] * 12, [6] * 30]
    a = [model.new_session(64) for _ in prompts]
    b = [model.new_session(64) for _ in prompts]
    for sa, sb, p in zip(a, b, prompts):
        assert torch.equal(sa.prefill(p), sb.prefill(p))
    chunk = [9, 8, 7, 6, 5, 4]   # a session joining through a prompt chunk (window 6, then 7, ...)
    a.append(model.new_session(64))
    b.append(model.new_session(64))
    seen = set()
    for step in range(4):
        order = [(step + k) % len(a) for k in range(len(a))]   # rows permuted between steps
        work = [chunk if (i == 4 and step == 0) else (3 + step + i) % 256 for i in order]
        ra = ds4t.eval_batch([ds4t.DecodeItem(a[i], w) for i, w in zip(order, work)], mode="ordered")
        before = [b[i].pos for i in order]
        rb = ds4t.eval_batch([ds4t.DecodeItem(b[i], w) for i, w in zip(order, work)], mode="auto")
        for k, i in enumerate(order):
            n = len(work[k]) if isinstance(work[k], list) else 1
            window = before[k] + n
            if window <= 20:
                assert rb.paths[k] == "native" and rb.reasons[k] is None
            else:
                assert rb.paths[k] == "ordered"
                assert rb.reasons[k] == f"visible window {window} > native capacity 20"
            seen.add(rb.paths[k])
            assert torch.equal(ra.logits[k], rb.logits[k]), f"step {step} session {i}"
            sa, sb = a[i].state_dict(), b[i].state_dict()
            assert sa.keys() == sb.keys() and all(torch.equal(sa[x], sb[x]) for x in sa)
        if step == 1:   # session 3 (prompt of 30) is past the window: mode "native" refuses it, changing nothing
            with pytest.raises(ds4t.NotNativeError, match="visible window .* > native capacity 20"):
                ds4t.eval_batch([ds4t.DecodeItem(b[3], 1)], mode="native")
    assert seen == {"native", "ordered"}
    for s in a + b:
        s.close()


def test_mixed_eligibility_scenario(model):
    """The harness in mode "auto": rows with no reason must have run natively."""
    model.native_window = 20
    sc = Scenario([Plan([1] * 18), Plan([2, 3]), Plan([4] * 25), Plan([5, 6, 7], join=1, chunked_join=True)],
                  steps=4, seed=5, max_ctx=64)
    rep = harness.run_scenario(model, sc, mode="auto")
    assert rep.ok, rep.first_mismatch
    assert rep.paths.get("native", 0) > 0 and rep.paths.get("ordered", 0) > 0


@pytest.mark.parametrize("kind", ["ulp", "batch-dependent"])
def test_negative_control_is_caught(model, kind):
    sc = Scenario([Plan([1, 2, 3]), Plan([4, 5, 6, 7, 8]), Plan([9])], steps=2, seed=1, max_ctx=32)
    with harness.plant(kind):
        rep = harness.run_scenario(model, sc, mode="native")
    assert not rep.ok and rep.mismatches > 0


def test_window_option():
    m = ds4t.load("tiny-glm", native_window=7)
    assert m.row_reasons([(6, 1), (7, 1), (0, 9)]) == [
        None, "visible window 8 > native capacity 7", "visible window 9 > native capacity 7"]
    with pytest.raises(ValueError, match="positive int"):
        m.native_window = 0
