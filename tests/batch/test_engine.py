"""eval_batch / Session API contract (docs/design.md, "API contract"): validation, paths, no change on error."""
import pytest
import torch

import ds4t
from ds4t import BatchError, DecodeItem, NotNativeError, eval_batch


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


def snapshot(sessions):
    return [(s.pos, list(s.tokens), {k: v.clone() for k, v in s.state_dict().items()}) for s in sessions]


def assert_unchanged(before, sessions):
    for (pos, toks, state), s in zip(before, sessions):
        assert s.pos == pos and s.tokens == toks
        now = s.state_dict()
        assert all(torch.equal(state[k], now[k]) for k in state)


def test_single_item_is_one_decode_step(model):
    a, b = model.new_session(32), model.new_session(32)
    a.prefill([1, 2, 3])
    b.prefill([1, 2, 3])
    ra = eval_batch([DecodeItem(a, 9)])
    lb = b.prefill([9])
    assert ra.logits.shape == (1, model.vocab_size) and ra.logits.dtype == torch.float32
    assert torch.equal(ra.logits[0], lb)
    assert a.pos == b.pos == 4


def test_paths_and_reasons(model):
    s = [model.new_session(32) for _ in range(3)]
    for i, x in enumerate(s):
        x.prefill([i + 1, 7])
    res = eval_batch([DecodeItem(x, 5) for x in s], mode="native")
    assert res.paths == ["native"] * 3 and res.reasons == [None] * 3
    res = eval_batch([DecodeItem(x, 5) for x in s], mode="ordered")
    assert res.paths == ["ordered"] * 3 and all(r for r in res.reasons)


@pytest.mark.parametrize("case", ["empty", "twice", "vocab", "negative", "ctx", "models", "mode", "closed", "float"])
def test_invalid_batches_change_nothing(model, case):
    s = [model.new_session(8) for _ in range(3)]
    for x in s:
        x.prefill([3, 4, 5])
    before = snapshot(s)
    items = [DecodeItem(x, 1) for x in s]
    if case == "empty":
        items, match = [], "empty"
    elif case == "twice":
        items.append(DecodeItem(s[1], 2))
        match = "item 3: session already in the batch as item 1"
    elif case == "vocab":
        items[2] = DecodeItem(s[2], model.vocab_size)
        match = "item 2: token 256 outside the vocabulary"
    elif case == "negative":
        items[1] = DecodeItem(s[1], -1)
        match = "item 1"
    elif case == "ctx":
        s[2].prefill([1] * 5)  # now at max_ctx 8
        before = snapshot(s)
        match = "item 2: session at position 8"
    elif case == "models":
        other = ds4t.load("tiny-qwen").new_session(8)
        items[1] = DecodeItem(other, 1)
        match = "item 1: session belongs to model"
    elif case == "mode":
        match = "mode must be one of"
    elif case == "closed":
        s[0].close()
        match = "item 0: session is closed"
        before, s = before[1:], s[1:]
    elif case == "float":
        items[0] = DecodeItem(s[0], 1.5)
        match = "item 0: token 1.5 is not an int"
    with pytest.raises(BatchError, match=match) as err:
        eval_batch(items, mode="bogus" if case == "mode" else "auto")
    expected_item = {"empty": None, "mode": None, "twice": 3, "vocab": 2, "negative": 1, "ctx": 2, "models": 1,
                     "closed": 0, "float": 0}[case]
    assert err.value.item == expected_item
    assert_unchanged(before, s)


def test_native_mode_names_the_reason(model, monkeypatch):
    s = [model.new_session(16) for _ in range(2)]
    for x in s:
        x.prefill([1, 2])
    monkeypatch.setattr(model, "row_reasons", lambda rows: [None, "window too long"])
    before = snapshot(s)
    with pytest.raises(NotNativeError, match="item 1: native path not available: window too long"):
        eval_batch([DecodeItem(x, 1) for x in s], mode="native")
    assert_unchanged(before, s)
    res = eval_batch([DecodeItem(x, 1) for x in s], mode="auto")
    assert res.paths == ["native", "ordered"] and res.reasons == [None, "window too long"]


def test_prefill_chunks_and_all_logits(model):
    a, b = model.new_session(64), model.new_session(64)
    prompt = list(range(20, 45))
    la = a.prefill(prompt, all_logits=True)
    lb = b.prefill(torch.tensor(prompt), chunk=7)
    assert la.shape == (25, model.vocab_size)
    torch.testing.assert_close(la[-1], lb, rtol=1e-5, atol=1e-5)
    assert a.pos == b.pos == 25 and a.tokens == prompt


def test_slots_are_reused_and_state_is_fresh(model):
    a = model.new_session(16)
    a.prefill([1, 2, 3])
    slot = a.slot
    a.close()
    b = model.new_session(16)
    assert b.slot == slot and b.pos == 0
    assert all(v.numel() == 0 or not v.any() for v in b.state_dict().values())
