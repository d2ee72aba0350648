"""ds4t.kernels.activation: silu_mul / sigmoid_mul / add against references, invariance."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4t.backend import INTERPRET
from ds4t.kernels import activation as A
from ds4t.kernels.activation import (
    add,
    add_ref,
    sigmoid_mul,
    sigmoid_mul_ref,
    silu_mul,
    silu_mul_ref,
)
from tests.kernels.invariance import assert_rows_invariant, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# fp32 math on exactly upcast inputs; exp/sigmoid may differ by an ulp or two (approximate on GPU).
TOL = {
    torch.float32: dict(atol=1e-6, rtol=1e-6),
    torch.bfloat16: dict(atol=1e-6, rtol=1e-6),
    torch.float16: dict(atol=1e-6, rtol=1e-6),
}
OPS = [(silu_mul, silu_mul_ref), (sigmoid_mul, sigmoid_mul_ref), (add, add_ref)]
SHAPES = [(1, 1), (5, 333), (33, 130), (2, 5000)]


def _pair(B, C, dt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = (torch.randn(B, C, generator=g) * 4).to(dt).to(device)
    b = (torch.randn(B, C, generator=g) * 2 + 0.5).to(dt).to(device)
    return a, b


@pytest.fixture(params=["gpu-tiles", "interp-tiles"])
def tiles(request):
    if request.param == "gpu-tiles":
        with A.ACTIVATION_CONFIGS.forced(lambda C: A._activation_config(C, block_r=1, max_block_c=1024)):
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize("op,ref", OPS, ids=lambda f: getattr(f, "__name__", ""))
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("B,C", SHAPES)
def test_matches_reference(device, tiles, op, ref, dt, B, C):
    a, b = _pair(B, C, dt, device)
    out = poisoned((B, C), device=device)
    y = op(a, b, out=out)
    assert y is out
    torch.testing.assert_close(y, ref(a, b), **TOL[dt])


@pytest.mark.parametrize("op,ref", OPS, ids=lambda f: getattr(f, "__name__", ""))
def test_strided_halves_of_fused_projection(device, op, ref):
    gu = torch.randn(6, 2 * 300, device=device).bfloat16()
    g, u = gu[:, :300], gu[:, 300:]
    torch.testing.assert_close(op(g, u), ref(g, u), **TOL[torch.bfloat16])
    nc = torch.randn(300, 6, device=device).t()  # column stride != 1: copied
    torch.testing.assert_close(op(nc, nc), ref(nc, nc), **TOL[torch.float32])


def test_extremes(device):
    a = torch.tensor([[-100.0, -20.0, 0.0, 20.0, 100.0, 3e38]], device=device)
    b = torch.full_like(a, 2.0)
    torch.testing.assert_close(silu_mul(a[:, :5], b[:, :5]), silu_mul_ref(a[:, :5], b[:, :5]))
    torch.testing.assert_close(sigmoid_mul(b, a), sigmoid_mul_ref(b, a))


def test_rejects_mismatch(device):
    a, b = _pair(2, 8, torch.float32, device)
    with pytest.raises(ValueError):
        add(a, b[:, :4])
    with pytest.raises(ValueError):
        silu_mul(a[0], b[0])


POOL, C_INV = 40, 333


@st.composite
def batches(draw):
    B = draw(st.integers(1, 33))
    rows = draw(st.permutations(range(POOL)))[:B]
    return rows, draw(st.integers(0, B - 1))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches(), k=st.integers(0, 2), dt=st.sampled_from(DTYPES))
def test_rows_invariant(batch, k, dt):
    device = torch.device("cpu") if INTERPRET else torch.device("cuda")
    a, b = _pair(POOL, C_INV, dt, device, seed=7)
    op = OPS[k][0]
    assert_rows_invariant(lambda i: op(a[i], b[i]), *batch)


@pytest.mark.parametrize("op", [silu_mul, sigmoid_mul], ids=lambda f: f.__name__)
@pytest.mark.parametrize("out_dt", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,C", [(1, 1), (5, 333), (33, 130)])
def test_out_dtype_is_the_fp32_result_rounded_to_nearest_even(device, tiles, op, out_dt, B, C):
    """A 16-bit out_dtype stores exactly the fp32 output rounded to nearest even (what a linear does to its
    input), every row as alone; into a poisoned buffer of that dtype."""
    a, b = _pair(B, C, torch.bfloat16, device, seed=5)
    want = op(a, b).to(out_dt)
    out = torch.full((B, C), float("nan"), dtype=out_dt, device=device)
    got = op(a, b, out=out, out_dtype=out_dt)
    assert got is out and got.dtype == out_dt
    assert torch.equal(got, want)
    assert torch.equal(op(a[B - 1:], b[B - 1:], out_dtype=out_dt), want[B - 1:])


def test_out_dtype_errors(device):
    a, b = _pair(2, 8, torch.float32, device)
    with pytest.raises(TypeError, match="out_dtype"):
        silu_mul(a, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="bfloat16"):   # an out buffer of another dtype
        sigmoid_mul(a, b, out=torch.empty(2, 8, device=device), out_dtype=torch.bfloat16)
