"""Tests of a researcher's own repository, using ds4t's pytest plugin.

With ds4t installed the plugin loads by itself (entry point ``pytest11``); from a checkout of ds4t:
``pytest -p ds4t.testing.plugin``. The plugin brings the fixtures used here and a hypothesis
profile without deadline (kernels in the Triton interpreter take far longer than 200 ms).
"""
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import ds4t
from ds4t.exactness.harness import run_scenario
from ds4t.exactness.strategies import scenarios
from ds4t.testing import assert_native_exact, assert_rows_invariant, poisoned
from my_kernels import rms_norm, rms_norm_ref

POOL, D = 12, 200   # D not a multiple of the 64-wide chunk


def _rows(device):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(POOL, D, generator=g, device="cpu"), 1 + 0.1 * torch.randn(D, generator=g, device="cpu")
    return x.to(device), w.to(device)


def test_matches_reference(ds4t_device):
    x, w = _rows(ds4t_device)
    y = rms_norm(x, w, out=poisoned((POOL, D), device=ds4t_device))
    torch.testing.assert_close(y, rms_norm_ref(x, w), atol=1e-5, rtol=1e-5)


@settings(max_examples=10)
@example(rows=list(range(POOL)))  # the whole pool, every time: a batch-dependent kernel cannot hide
@given(rows=st.permutations(range(POOL)).flatmap(lambda p: st.integers(1, POOL).map(lambda n: p[:n])))
def test_rows_invariant(on_kernel_device, rows):
    """Every row of the subset: computed among the others == computed alone, bitwise. (Many rows of
    an RMS norm agree even under another summation order: the rsqrt rounds the difference away.)"""
    x, w = _rows(on_kernel_device)
    for i in range(len(rows)):
        assert_rows_invariant(lambda rs: rms_norm(x[list(rs)], w), rows, i)


@pytest.mark.parametrize("ds4t_model", ["tiny-glm"], indirect=True)
def test_native_path_exact(ds4t_model):
    """ds4t's own native path, with the negative control that shows the check can fail."""
    rep = assert_native_exact(ds4t_model, sessions=3, steps=2)
    assert rep.paths.get("native", 0) > 0


MODEL = ds4t.load("tiny-qwen")


@settings(max_examples=2)
@given(scenarios(MODEL.vocab_size, max_sessions=3, max_prompt=6, max_steps=2, max_ctx=16))
def test_session_mixes_exact(sc):
    rep = run_scenario(MODEL, sc, mode="native")
    assert rep.ok, rep.first_mismatch
