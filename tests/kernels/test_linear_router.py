"""ds4t.kernels.linear_router: the router linear + top-k op gives the bits of the two ops it replaces (the
split-K partials added inside the router kernel, the finished logits stored for their other readers), rows
stay invariant, overrides of its parts still run."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4t
from ds4t import backend
from ds4t.backend import INTERPRET
from ds4t.kernels import linear as L
from ds4t.kernels import qlinear as QL
from ds4t.kernels import router as RT
from ds4t.kernels.linear_router import ROUTER_OPS, linear_router, linear_router_ref, router_args
from ds4t.kernels.quant_blocks import quantize as gguf_quantize
from ds4t.kernels.registry import ops, override
from ds4t.kernels.weights import quantize as fp8_quantize
from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.split_parts import decode_step, split_linears, split_sum_reversed

# (kind, router keywords): Qwen3-Next's softmax router with its shared-expert gate row (N = E + 1), and
# DeepSeek-V3 / GLM-4.5's grouped sigmoid router (N = E)
SOFTMAX = ("softmax", dict(top_k=4, renormalize=True), 1)
GROUPED = ("sigmoid_grouped", dict(top_k=3, renormalize=True, n_group=4, topk_group=2, scaling=2.5), 0)


def _data(B, K, E, extra, wdt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(device)
    w = (torch.randn(E + extra, K, generator=g) * 2 * K ** -0.5).to(wdt).to(device)
    b = (0.1 * torch.randn(E + extra, generator=g)).to(device)
    cb = (0.3 * torch.randn(E, generator=g)).to(device)
    return x, w, b, cb


def _kw(kind, kw, cb):
    return dict(kw, correction_bias=cb) if kind == "sigmoid_grouped" else dict(kw)


def _two_ops(x, w, E, kind, kw, cb, bias=None):
    """linear, then the router op on its first E columns: two registry calls (the ds4t kernels unless overridden)."""
    logits = ops.linear(x, w, bias)
    wt, ids = getattr(ops, ROUTER_OPS[kind])(logits[:, :E], *router_args(kind, **_kw(kind, kw, cb)))
    return wt, ids, logits


def _equal(got, want):
    assert len(got) == len(want) == 3
    for g, wt in zip(got, want):
        assert g.dtype == wt.dtype and torch.equal(g, wt)


@pytest.mark.parametrize("split", [1, 2, 3])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("router", [SOFTMAX, GROUPED], ids=lambda r: r[0])
def test_same_bits_as_linear_then_router(device, split, with_bias, router):
    kind, kw, extra = router
    E = 16
    x, w, b, cb = _data(5, 256, E, extra, torch.float32, device)
    bias = b if with_bias else None
    with split_linears(split):
        assert L.linear_parts(x, w, bias).splits == split
        want = _two_ops(x, w, E, kind, kw, cb, bias)
        got = linear_router(x, w, E, kind, bias=bias, **_kw(kind, kw, cb))
    _equal(got, want)
    ref = linear_router_ref(x, w, E, kind, bias=bias, **_kw(kind, kw, cb))
    assert torch.equal(got[1], ref[1].to(torch.int32))
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2], ref[2], atol=1e-4, rtol=1e-4)


def test_many_columns_past_the_experts_and_16_bit_weights(device):
    # 40 experts (not a power of two: padded selection lanes) and 9 logit columns past them (a tail of 16
    # lanes, 7 masked), bf16 weights, rows of a 16-row interpreter program past B
    x, w, b, cb = _data(3, 192, 40, 9, torch.bfloat16, device, seed=1)
    kind, kw, _ = SOFTMAX
    with split_linears(3):
        _equal(linear_router(x, w, 40, kind, bias=b, **kw), _two_ops(x, w, 40, kind, kw, cb, b))


def test_fp8_and_gguf_weights(device):
    x, w, b, cb = _data(3, 256, 32, 1, torch.float32, device, seed=2)
    kind, kw, _ = SOFTMAX
    fp8 = fp8_quantize(w, (128, 128))
    with split_linears(2, block_k=64):
        assert L.linear_parts(x, fp8).splits == 2
        _equal(linear_router(x, fp8, 32, kind, bias=b, **kw), _two_ops(x, fp8, 32, kind, kw, cb, b))
    q8 = gguf_quantize(w.cpu(), "Q8_0").to(device)
    cfg = QL.QLinearConfig(block_n=16, split=2, group=2)
    with QL.QLINEAR_CONFIGS.forced(lambda *key: cfg):
        assert L.linear_parts(x, q8).splits == 2
        _equal(linear_router(x, q8, 32, kind, **kw), _two_ops(x, q8, 32, kind, kw, cb))


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which a compiled kernel has inlined already")
def test_negative_control_another_summation_order_is_caught(device, monkeypatch):
    # The bitwise test above can fail: the router kernel adding the same partials last-to-first gives other bits.
    x, w, b, cb = _data(6, 512, 16, 1, torch.float32, device, seed=3)
    x = x * torch.logspace(0, 3, 512)          # partials of very different sizes: the order shows
    kind, kw, _ = SOFTMAX
    with split_linears(4):
        want = _two_ops(x, w, 16, kind, kw, cb, b)
        monkeypatch.setattr(backend, "split_sum", split_sum_reversed)
        got = linear_router(x, w, 16, kind, bias=b, **kw)
    assert not torch.equal(got[2], want[2])
    torch.testing.assert_close(got[2], want[2], atol=1e-3, rtol=1e-4)   # the same sums up to rounding


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.integers(0, 19), min_size=1, max_size=20, unique=True), i=st.integers(0, 19),
       grouped=st.booleans())
def test_rows_invariant(device, batch, i, grouped):
    kind, kw, extra = GROUPED if grouped else SOFTMAX
    x, w, b, cb = _data(20, 192, 16, extra, torch.float32, device, seed=4)
    i = i % len(batch)

    def run(rows):
        idx = torch.tensor(rows, device=device)
        wt, ids, logits = linear_router(x[idx], w, 16, kind, bias=b, **_kw(kind, kw, cb))
        return torch.cat([wt, ids.float(), logits], 1)

    with split_linears(3):
        assert_rows_invariant(run, batch, i)


def test_overridden_parts_still_run(device):
    # A researcher's router (or linear) sees the router calls too: the op runs its parts through the registry.
    x, w, b, cb = _data(2, 64, 8, 1, torch.float32, device, seed=5)
    seen = []

    def my_router(logits, top_k, renormalize, **kw):
        seen.append(tuple(logits.shape))
        return RT.router_softmax_topk_ref(logits, top_k, renormalize)

    with split_linears(2):
        with override("router_softmax_topk", my_router):
            got = ops.linear_router(x, w, 8, "softmax", 2, True)
        want = RT.router_softmax_topk_ref(L.linear(x, w)[:, :8], 2, True)
    assert seen == [(2, 8)]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_bad_arguments(device):
    x, w, b, cb = _data(2, 64, 8, 0, torch.float32, device)
    with pytest.raises(ValueError, match="unknown router kind"):
        linear_router(x, w, 8, "argmax", 2, True)
    with pytest.raises(ValueError, match="correction_bias"):
        linear_router(x, w, 8, "sigmoid_grouped", 2, True, n_group=2, topk_group=1)
    with split_linears(2), pytest.raises(ValueError, match="fp32 partials"):
        linear_router(x, w, 9, "softmax", 2, True)           # more experts than logit columns


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_a_decode_step_has_the_bits_of_the_unfused_ops(device, preset):
    # Every MoE layer routes through linear_router; the same step with the op run as its two parts gives the
    # same logits, split K or not (tiny-qwen: the shared-expert gate is read from the stored logits).
    model = ds4t.load(preset, device=device)

    def unfused(x, weight, num_experts, kind, top_k, renormalize, *, bias=None, correction_bias=None, **groups):
        return _two_ops(x, weight, num_experts, kind, dict(groups, top_k=top_k, renormalize=renormalize),
                        correction_bias, bias)

    with split_linears(2):
        fused, n = decode_step(model, "linear_router")
        with override("linear_router", unfused):
            parts, _ = decode_step(model, "linear_router")
    assert n >= 1
    assert torch.equal(fused, parts)
