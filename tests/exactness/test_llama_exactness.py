"""The dense llama family's native path is bit-exact against the ordered fallback (every row native,
sessions joining through prompt chunks inside decode batches), and the negative control is caught."""
import pytest

import ds4t
from ds4t.exactness import harness
from ds4t.exactness.harness import Plan, Scenario


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-llama")


def test_native_path_is_bit_exact(model):
    sc = Scenario([Plan([3, 1, 4, 1, 5, 9, 2, 6]), Plan([7]), Plan([2, 7, 1, 8, 2, 8], leave=3),
                   Plan([5, 3, 5, 8, 9], join=1, chunked_join=True), Plan([11, 13], join=2)],
                  steps=5, seed=3, max_ctx=64)
    rep = harness.run_scenario(model, sc, mode="native")
    assert rep.ok, rep.first_mismatch
    assert set(rep.paths) == {"native"} and rep.native_missing == 0


@pytest.mark.parametrize("kind", ["ulp", "batch-dependent"])
def test_negative_control_is_caught(model, kind):
    sc = Scenario([Plan([1, 2, 3]), Plan([4, 5, 6, 7, 8]), Plan([9])], steps=2, seed=1, max_ctx=32)
    with harness.plant(kind):
        rep = harness.run_scenario(model, sc, mode="native")
    assert not rep.ok and rep.mismatches > 0


def test_support_lists_the_dense_families(capsys):
    from ds4t.cli import main

    assert main(["support"]) == 0
    out = capsys.readouterr().out
    assert "llama " in out and "qwen3 " in out
