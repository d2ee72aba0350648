"""ds4t.kernels.linear_conv: the projection + conv decode step op gives the bits of the two ops it replaces (the
split-K partials added inside the conv kernel, the finished columns stored for their other readers), rows stay
invariant, overrides of its parts still run, and a Qwen3-Next decode step keeps its logits."""
from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4t
from ds4t.backend import INTERPRET
from ds4t.kernels import conv as CV
from ds4t.kernels import qlinear as QL
from ds4t.kernels.linear_conv import linear_conv1d_update, linear_conv1d_update_ref
from ds4t.kernels.quant_blocks import quantize as gguf_quantize
from ds4t.kernels.registry import GPU, INTERP, ops, override, use_variants
from ds4t.kernels.weights import quantize as fp8_quantize
from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.split_parts import decode_step, split_linears, split_sum_reversed

S, W = 8, 4


def _data(B, K, C, N, wdt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(device)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(wdt).to(device)
    b = (0.1 * torch.randn(N, generator=g)).to(device)
    cw = (0.5 * torch.randn(C, W, generator=g)).to(device)
    cb = (0.1 * torch.randn(C, generator=g)).to(device)
    state = torch.randn(S, C, W - 1, generator=g).to(device)
    slots = torch.randperm(S, generator=g)[:B].to(device, torch.int32)
    return x, w, b, cw, cb, state, slots


def _two_ops(x, w, state, cw, slots, bias=None, conv_bias=None):
    """linear, then conv1d_update on its first C columns: two registry calls (the ds4t kernels unless overridden)."""
    y = ops.linear(x, w, bias)
    return ops.conv1d_update(y[:, :cw.shape[0]], state, cw, slots, bias=conv_bias), y


def _same(x, w, state, cw, slots, **kw):
    """The op and the two calls from copies of one conv state: outputs and new states bitwise equal."""
    s1, s2 = state.clone(), state.clone()
    got = linear_conv1d_update(x, w, s1, cw, slots, **kw)
    want = _two_ops(x, w, s2, cw, slots, **kw)
    for g, wt in zip(got, want):
        assert g.shape == wt.shape and torch.equal(g, wt)
    assert torch.equal(s1, s2)
    return got, s1


@pytest.mark.parametrize("variant", [GPU, INTERP])
@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
def test_same_bits_as_linear_then_conv1d_update(device, variant, split, with_bias):
    if variant == INTERP and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    # C = 72 over 32-channel conv blocks (a ragged last one), N - C = 40 more columns (two blocks, ragged); the
    # interpreter's rows path takes every channel in one program, whatever the config
    x, w, b, cw, cb, state, slots = _data(5, 128, 72, 112, torch.float32, device)
    kw = dict(bias=b, conv_bias=cb) if with_bias else {}
    blocks = CV.CONV_CONFIGS.forced(lambda C: CV.ConvConfig(block_c=32, block_t=16)) if variant == GPU \
        else contextlib.nullcontext()
    with split_linears(split), blocks, use_variants({"conv1d_update": variant}):
        got, st = _same(x, w, state, cw, slots, **kw)
    ref_state = state.clone()
    ref = linear_conv1d_update_ref(x, w, ref_state, cw, slots, **kw)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, ref_state, atol=1e-5, rtol=1e-5)


def test_fp8_and_gguf_weights(device):
    x, w, b, cw, cb, state, slots = _data(3, 256, 64, 96, torch.float32, device, seed=2)
    with use_variants({"conv1d_update": GPU}):
        with split_linears(2, block_k=64):
            _same(x, fp8_quantize(w, (128, 128)), state, cw, slots, bias=b)
        cfg = QL.QLinearConfig(block_n=16, split=2, group=2)
        with QL.QLINEAR_CONFIGS.forced(lambda *key: cfg):
            _same(x, gguf_quantize(w.cpu(), "Q8_0").to(device), state, cw, slots)


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which a compiled kernel has inlined already")
def test_negative_control_another_summation_order_is_caught(device, monkeypatch):
    # The bitwise test above can fail: the conv kernel adding the same partials last-to-first gives other bits.
    from ds4t import backend

    x, w, b, cw, cb, state, slots = _data(6, 512, 48, 64, torch.float32, device, seed=3)
    x = x * torch.logspace(0, 2, 512)          # partials of very different sizes: the order shows
    with split_linears(4), use_variants({"conv1d_update": GPU}):
        want = _two_ops(x, w, state.clone(), cw, slots, bias=b)
        monkeypatch.setattr(backend, "split_sum", split_sum_reversed)
        got = linear_conv1d_update(x, w, state.clone(), cw, slots, bias=b)
    assert not torch.equal(got[1], want[1])
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)   # the same sums up to rounding


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.integers(0, 7), min_size=1, max_size=8, unique=True), i=st.integers(0, 7))
def test_rows_invariant(device, batch, i):
    x, w, b, cw, cb, state, slots = _data(8, 96, 40, 56, torch.bfloat16, device, seed=4)
    i = i % len(batch)

    def run(rows):
        idx = torch.tensor(rows, device=device)
        st = state.clone()
        conv, y = linear_conv1d_update(x[idx], w, st, cw, slots[idx], bias=b)
        return torch.cat([conv, y, st[slots[idx].long()].flatten(1)], 1)

    with split_linears(3), use_variants({"conv1d_update": GPU}):
        assert_rows_invariant(run, batch, i)


def test_overridden_parts_still_run(device):
    # A researcher's conv sees the Gated DeltaNet calls too: the op runs its parts through the registry then.
    x, w, b, cw, cb, state, slots = _data(2, 64, 24, 40, torch.float32, device, seed=5)
    seen = []

    def my_conv(x, conv_state, weight, slots, **kw):
        seen.append(tuple(x.shape))
        return CV.conv1d_update_ref(x, conv_state, weight, slots, **kw)

    with override("conv1d_update", my_conv):
        got = ops.linear_conv1d_update(x, w, state, cw, slots)
    assert seen == [(2, 24)] and got[1].shape == (2, 40)


def test_bad_arguments(device):
    x, w, b, cw, cb, state, slots = _data(2, 64, 24, 40, torch.float32, device)
    with pytest.raises(ValueError, match="output columns"):
        linear_conv1d_update(x, w[:16], state, cw, slots)


def test_a_decode_step_has_the_bits_of_the_unfused_ops(device):
    # Qwen3-Next's Gated DeltaNet layers call linear_conv1d_update; the same step with the op run as its two parts
    # (linear, then conv1d_update) gives the same logits, split K or not.
    model = ds4t.load("tiny-qwen", device=device)

    def unfused(x, weight, conv_state, conv_weight, slots, *, bias=None, conv_bias=None, silu=True):
        return _two_ops(x, weight, conv_state, conv_weight, slots, bias=bias, conv_bias=conv_bias)

    with split_linears(2), use_variants({"conv1d_update": GPU}):
        fused, n = decode_step(model, "linear_conv1d_update")
        with override("linear_conv1d_update", unfused):
            parts, _ = decode_step(model, "linear_conv1d_update")
    assert n >= 1 and torch.equal(fused, parts)
