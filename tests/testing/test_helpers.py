"""ds4t.testing's helpers and fixtures, each with the failure it must report."""
import contextlib

import pytest
import torch

import ds4t
from ds4t.exactness import controls, harness
from ds4t.exactness.harness import Plan, Scenario
from ds4t.testing import assert_native_exact, assert_rows_invariant, kernel_ops, poisoned
from ds4t.testing.plugin import _model_param

POOL = torch.randn(9, 50, generator=torch.Generator().manual_seed(0))


def test_poisoned_is_nan_everywhere():
    t = poisoned((3, 4), dtype=torch.bfloat16)
    assert t.dtype == torch.bfloat16 and t.shape == (3, 4) and t.isnan().all()


def test_rows_invariant_accepts_a_row_wise_op_and_rejects_a_batch_dependent_one():
    def rowwise(rows):
        return POOL[list(rows)].sum(1)

    def batch_dependent(rows):   # sums in two halves when there is more than one row
        x = POOL[list(rows)]
        return x.sum(1) if len(rows) == 1 else x[:, :25].sum(1) + x[:, 25:].sum(1)

    assert_rows_invariant(rowwise, [4, 1, 7], 1)
    caught = 0
    for rows in ([0, 1, 2, 3, 4, 5, 6, 7, 8], [8, 3], [2, 5, 6]):
        for i in range(len(rows)):
            try:
                assert_rows_invariant(batch_dependent, rows, i)
            except AssertionError as e:
                assert "differs between batch of" in str(e)
                caught += 1
    assert caught > 0


def test_rows_invariant_bad_arguments():
    with pytest.raises(IndexError, match="outside batch_rows"):
        assert_rows_invariant(lambda rows: POOL[list(rows)], [1, 2], 2)
    with pytest.raises(ValueError, match="one leading entry per row"):
        assert_rows_invariant(lambda rows: POOL[:1], [1, 2], 0)


def test_hypothesis_profile_is_loaded():
    from hypothesis import settings

    assert settings.default.deadline is None


def test_kernel_devices(ds4t_device, on_kernel_device):
    assert on_kernel_device == ds4t_device
    assert torch.empty(1).device.type == ds4t_device.type


def test_ds4t_model_default(ds4t_model):
    assert ds4t_model.family == "qwen3_next"


@pytest.mark.parametrize("ds4t_model", ["tiny-deepseek", ("tiny-glm", {"native_window": 7})], indirect=True)
def test_ds4t_model_parametrised(ds4t_model):
    assert ds4t_model.family in ("deepseek_v3", "glm4_moe")
    if ds4t_model.family == "glm4_moe":
        assert ds4t_model.native_window == 7


def test_ds4t_model_bad_param():
    with pytest.raises(TypeError, match="preset name or"):
        _model_param(("tiny-glm", "native_window=7"))


def test_kernel_ops_names_each_launcher_with_a_reference():
    ops = kernel_ops()
    assert ops["linear"] == ["linear", "linear_heads"] and "rms_norm" in ops["norm"]
    assert all(not o.endswith("_ref") for v in ops.values() for o in v)


SCENARIO = Scenario([Plan([1, 2, 3]), Plan([4, 5, 6, 7]), Plan([9], join=1)], steps=2, seed=1, max_ctx=16)


def test_assert_native_exact_passes_and_reports(ds4t_model):
    rep = assert_native_exact(ds4t_model, SCENARIO)
    assert rep.ok and rep.native_batches == 2 and set(rep.paths) == {"native"}


def test_assert_native_exact_fails_on_a_batch_dependent_kernel(ds4t_model):
    with harness.plant("batch-dependent"), pytest.raises(AssertionError, match="is not exact"):
        assert_native_exact(ds4t_model, SCENARIO, negative_control=False)


def test_assert_native_exact_fails_when_the_control_cannot_fail(ds4t_model, monkeypatch):
    """Controls that plant nothing are not caught: assert_native_exact must say so."""
    monkeypatch.setattr(controls, "plant", lambda kind: contextlib.nullcontext())
    with pytest.raises(AssertionError, match="negative control 'ulp' NOT CAUGHT"):
        assert_native_exact(ds4t_model, SCENARIO)


@pytest.mark.parametrize("ds4t_model", [("tiny-glm", {"native_window": 1})], indirect=True)
def test_assert_native_exact_refuses_a_scenario_without_native_batches(ds4t_model):
    """Every row past the window: mode auto is exact, but the batch-dependent control has nothing
    to show in, so the scenario proves nothing about batching."""
    with pytest.raises(AssertionError, match="not applicable"):
        assert_native_exact(ds4t_model, SCENARIO, mode="auto")


def test_assert_native_exact_needs_a_batch():
    with pytest.raises(ValueError, match="sessions >= 2"):
        assert_native_exact(ds4t.load("tiny-qwen"), sessions=1)


def test_assert_prefill_chunk_invariant_holds_and_can_fail():
    """Holds for a preset; fails (negative control) when the linear kernel's sum order depends on
    how many rows a launch has -- as a chunk size chosen split-K would."""
    import ds4t
    from ds4t.exactness.harness import plant
    from ds4t.testing import assert_prefill_chunk_invariant

    model = ds4t.load("tiny-qwen")
    prompt = [5, 17, 99, 3, 250, 8, 41, 7, 66, 12]
    assert_prefill_chunk_invariant(model, prompt, chunks=(1, 4))
    with plant("batch-dependent"), pytest.raises(AssertionError, match="logits differ from the whole prompt"):
        assert_prefill_chunk_invariant(model, prompt, chunks=(1, 4))
