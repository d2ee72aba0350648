"""The exactness harness on tiny-qwen: native == ordered, bitwise, and the harness can fail."""
import random

import pytest
from hypothesis import HealthCheck, given, settings

import ds4t
from ds4t.exactness.harness import Plan, Scenario, plant, random_scenario, run_scenario
from ds4t.exactness.strategies import scenarios


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


# Small on the CPU (each step of each session runs in the Triton interpreter); the GPU benchmark
# runs the full ranges (16 sessions, prompts up to 200 tokens, 40 steps).
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                HealthCheck.too_slow, HealthCheck.data_too_large])
@given(sc=scenarios(vocab=256, max_sessions=4, max_prompt=12, max_steps=4, max_ctx=32))
def test_native_equals_ordered_on_random_mixes(model, sc):
    rep = run_scenario(model, sc, mode="native")
    assert rep.ok, rep
    assert rep.paths.get("native", 0) > 0


def test_many_rows_fill_a_whole_tile(model):
    """17 sessions: rows land in every row slot of a 16-row tile and spill into a second tile."""
    rng = random.Random(3)
    plans = [Plan([rng.randrange(256) for _ in range(rng.randint(1, 3))]) for _ in range(17)]
    rep = run_scenario(model, Scenario(plans, steps=1, seed=5, max_ctx=16), mode="native")
    assert rep.ok, rep
    assert rep.paths == {"native": 17}


def test_mixed_prefill_and_decode_batch(model):
    plans = [Plan([1, 2, 3]), Plan([4, 5], join=1, chunked_join=True), Plan([9] * 7, join=1, chunked_join=True),
             Plan([7], leave=2)]
    rep = run_scenario(model, Scenario(plans, steps=3, seed=1, max_ctx=32), mode="native")
    assert rep.ok, rep


@pytest.mark.parametrize("kind", ["ulp", "batch-dependent"])
def test_negative_control_is_caught(model, kind):
    sc = random_scenario(random.Random(11), 256, sessions=3, steps=2, max_prompt=5, max_ctx=16)
    with plant(kind):
        rep = run_scenario(model, sc, mode="native")
    assert rep.mismatches > 0, f"planted {kind} deviation was not caught"


def test_cli_exactness_exits_zero(capsys):
    from ds4t.cli import main

    assert main(["exactness", "--model", "tiny-qwen", "--sessions", "3", "--steps", "2", "--max-prompt", "6"]) == 0
    out = capsys.readouterr().out
    assert "exact: yes" in out and "caught" in out and "NOT CAUGHT" not in out
