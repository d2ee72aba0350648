"""ds4t.kernels.linear_norm: the linear + residual add + RMSNorm op gives the bits of the two ops it replaces
(the split-K partials added inside the norm kernel), rows stay invariant, overrides of its parts still run."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4t
from ds4t import backend
from ds4t.backend import INTERPRET
from ds4t.kernels import linear as L
from ds4t.kernels import norm as NM
from ds4t.kernels import qlinear as QL
from ds4t.kernels.linear_norm import linear_add_rms_norm, linear_add_rms_norm_ref
from ds4t.kernels.quant_blocks import quantize as gguf_quantize
from ds4t.kernels.registry import ops, override
from ds4t.kernels.weights import quantize as fp8_quantize
from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.split_parts import decode_step, split_linears, split_sum_reversed

EPS = 1e-6


def _data(B, K, N, wdt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(wdt).to(device)
    b = (0.1 * torch.randn(N, generator=g)).to(device)
    r = torch.randn(B, N, generator=g).to(device)
    nw = (1 + 0.2 * torch.randn(N, generator=g)).to(device)
    return x, w, b, r, nw


def _two_ops(x, w, r, nw, bias=None, **kw):
    return NM.add_rms_norm(L.linear(x, w, bias), r, nw, EPS, **kw)


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16], ids=str)
def test_same_bits_as_linear_then_add_rms_norm(device, split, with_bias, wdt):
    x, w, b, r, nw = _data(5, 256, 96, wdt, device)
    bias = b if with_bias else None
    with split_linears(split):
        assert L.linear_parts(x, w, bias).splits == split
        want = _two_ops(x, w, r, nw, bias)
        got = linear_add_rms_norm(x, w, r, nw, EPS, bias=bias)
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)
    ref = linear_add_rms_norm_ref(x, w, r, nw, EPS, bias=bias)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_same_bits_with_narrow_store_zero_centered_and_chunked_rows(device, out_dtype, zero_centered):
    # D = 300 over 128-column chunks: the norm re-sums the partials in its second pass, and the last chunk
    # is ragged (masked loads of the partials and the bias).
    x, w, b, r, nw = _data(4, 128, 300, torch.bfloat16, device, seed=1)
    chunks = NM.NORM_CONFIGS.forced(lambda D: NM._norm_config(D, rows=1, max_block_d=128))
    with split_linears(2), chunks:
        want = _two_ops(x, w, r, nw, b, zero_centered=zero_centered, out_dtype=out_dtype)
        got = linear_add_rms_norm(x, w, r, nw, EPS, bias=b, zero_centered=zero_centered, out_dtype=out_dtype)
    assert got[0].dtype == out_dtype
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)


def test_fp8_and_gguf_weights(device):
    x, w, b, r, nw = _data(3, 256, 64, torch.float32, device, seed=2)
    fp8 = fp8_quantize(w, (128, 128))
    with split_linears(2, block_k=64):
        assert L.linear_parts(x, fp8).splits == 2
        for g, wt in zip(linear_add_rms_norm(x, fp8, r, nw, EPS, bias=b), _two_ops(x, fp8, r, nw, b)):
            assert torch.equal(g, wt)
    q8 = gguf_quantize(w.cpu(), "Q8_0").to(device)
    cfg = QL.QLinearConfig(block_n=16, split=2, group=2)
    with QL.QLINEAR_CONFIGS.forced(lambda *key: cfg):
        assert L.linear_parts(x, q8).splits == 2
        for g, wt in zip(linear_add_rms_norm(x, q8, r, nw, EPS), _two_ops(x, q8, r, nw)):
            assert torch.equal(g, wt)


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which a compiled kernel has inlined already")
def test_negative_control_another_summation_order_is_caught(device, monkeypatch):
    # The bitwise test above can fail: the norm kernel adding the same partials last-to-first gives other bits.
    x, w, b, r, nw = _data(6, 512, 64, torch.float32, device, seed=3)
    x = x * torch.logspace(0, 3, 512)          # partials of very different sizes: the order shows
    with split_linears(4):
        want = _two_ops(x, w, r, nw, b)
        monkeypatch.setattr(backend, "split_sum", split_sum_reversed)
        got = linear_add_rms_norm(x, w, r, nw, EPS, bias=b)
    assert not torch.equal(got[1], want[1])
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)   # the same sums up to rounding


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True), i=st.integers(0, 19))
def test_rows_invariant(device, batch, i):
    x, w, b, r, nw = _data(20, 192, 48, torch.bfloat16, device, seed=4)
    i = i % len(batch)

    def run(rows):
        idx = torch.tensor(rows, device=device)
        y, s = linear_add_rms_norm(x[idx], w, r[idx], nw, EPS, bias=b)
        return torch.cat([y, s], 1)

    with split_linears(3):
        assert_rows_invariant(run, batch, i)


def test_overridden_parts_still_run(device):
    # A researcher's linear sees the o_proj-style calls too: the op runs its parts through the registry then.
    x, w, b, r, nw = _data(2, 64, 32, torch.float32, device, seed=5)
    seen = []

    def my_linear(x, weight, bias=None, **kw):
        seen.append(tuple(weight.shape))
        return L.linear_ref(x, weight, bias)

    with override("linear", my_linear):
        got = ops.linear_add_rms_norm(x, w, r, nw, EPS, bias=b)
    assert seen == [(32, 64)]
    want = NM.add_rms_norm(L.linear_ref(x, w, b), r, nw, EPS)
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)


def test_rejects_a_residual_of_the_wrong_shape(device):
    x, w, b, r, nw = _data(3, 64, 32, torch.float32, device)
    with pytest.raises(ValueError, match="residual must be"):
        linear_add_rms_norm(x, w, r[:, :16], nw, EPS)


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_a_decode_step_has_the_bits_of_the_unfused_ops(device, preset):
    # The decoder hands each mixer's / dense MLP's last projection to linear_add_rms_norm; the same step with
    # the op run as its two parts (linear, then add_rms_norm) gives the same logits, split K or not.
    model = ds4t.load(preset, device=device)

    def unfused(x, weight, residual, norm_weight, eps, *, bias=None, **kw):
        return ops.add_rms_norm(ops.linear(x, weight, bias), residual, norm_weight, eps, **kw)

    with split_linears(2):
        fused, n = decode_step(model, "linear_add_rms_norm")
        with override("linear_add_rms_norm", unfused):
            parts, _ = decode_step(model, "linear_add_rms_norm")
    assert n >= 2 * model.num_layers - 1
    assert torch.equal(fused, parts)
