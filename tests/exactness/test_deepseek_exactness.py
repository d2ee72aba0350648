"""DeepSeek-V3 native paths ("full" and "ds4") are bit-exact against the ordered fallback."""
import pytest
import torch

import ds4t
from ds4t.exactness import harness
from ds4t.exactness.harness import Plan, Scenario
from ds4t.kernels import mla


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-deepseek")


def mixed_scenario(seed=0):
    """Sessions at different positions; one joins through a prompt chunk inside a decode batch
    (mixed prefill + decode), one joins later by prefill, one leaves; rows permuted every step."""
    return Scenario([Plan([3, 1, 4, 1, 5, 9, 2, 6]), Plan([7]), Plan([2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4], leave=4),
                     Plan([5, 3, 5, 8, 9], join=1, chunked_join=True), Plan([11, 13, 17], join=3)],
                    steps=6, seed=seed, max_ctx=64)


def small_scenario(seed=1):
    return Scenario([Plan([1, 2, 3]), Plan([4, 5, 6, 7, 8]), Plan([9])], steps=2, seed=seed, max_ctx=32)


@pytest.mark.parametrize("path", ["full", "ds4"])
def test_native_path_is_bit_exact(model, path, monkeypatch):
    model.native_path = path
    rep = harness.run_scenario(model, mixed_scenario(), mode="native")
    assert rep.ok, rep.first_mismatch
    assert rep.mismatches == 0 and rep.native_missing == 0
    assert set(rep.paths) == {"native"} and rep.paths["native"] == rep.rows - 4   # 4 prefills compared
    # What the native call runs: MLA over all rows in one launch per layer ("full"), or per session ("ds4").
    sessions = [model.new_session(16) for _ in range(3)]
    for i, s in enumerate(sessions):
        s.prefill([i + 1] * (i + 1))
    launches = []
    monkeypatch.setattr(model, "cuda_graphs", False, raising=False)   # count an eager step's launches (a replay has none)
    orig = mla.mla_decode
    with ds4t.kernels.override("mla_decode", lambda q, *a, **k: launches.append(q.shape[0]) or orig(q, *a, **k)):
        res = ds4t.eval_batch([ds4t.DecodeItem(s, 7) for s in sessions], mode="native")
    assert res.paths == ["native"] * 3
    layers = model.num_layers
    assert launches == ([3] * layers if path == "full" else [1] * (3 * layers))
    for s in sessions:
        s.close()


@pytest.mark.parametrize("path", ["full", "ds4"])
@pytest.mark.parametrize("kind", ["ulp", "batch-dependent"])
def test_negative_control_is_caught(model, path, kind):
    model.native_path = path
    with harness.plant(kind):
        rep = harness.run_scenario(model, small_scenario(), mode="native")
    assert not rep.ok and rep.mismatches > 0, f"planted {kind!r} deviation not caught on the {path} path"


def test_path_selection():
    m = ds4t.load("tiny-deepseek", native_path="ds4")
    assert m.native_path == "ds4"
    assert "native_path='ds4'" in m.native_rules[0].condition
    m.native_path = "full"
    assert "native_path='full'" in m.native_rules[0].condition
    with pytest.raises(ValueError, match="native_path must be one of"):
        m.native_path = "fast"
    with pytest.raises(TypeError, match="no option 'native_window'"):
        ds4t.load("tiny-deepseek", native_window=3)
    assert m.row_reasons([(5, 1), (4000, 1)]) == [None, None]


def test_paths_agree_bitwise(model):
    """Switching native_path between steps is safe: "full" and "ds4" give the same bits."""
    twins = {p: [model.new_session(32) for _ in range(3)] for p in ("full", "ds4")}
    for p, sessions in twins.items():
        for i, s in enumerate(sessions):
            s.prefill([i + 2] * (2 * i + 1))
    for step in range(2):
        out = {}
        for p, sessions in twins.items():
            model.native_path = p
            items = [ds4t.DecodeItem(s, 10 + step) for s in sessions]
            items[0] = ds4t.DecodeItem(sessions[0], [1, 2, 3])   # a chunk in the batch too
            out[p] = ds4t.eval_batch(items, mode="native").logits
        assert torch.equal(out["full"], out["ds4"]), f"step {step}"
    for sessions in twins.values():
        for s in sessions:
            s.close()
