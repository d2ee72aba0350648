"""ds4t.kernels.norm: rms_norm / add_rms_norm / gated_rms_norm against references, invariance."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ds4t.backend import INTERPRET
from ds4t.kernels import norm as NM
from ds4t.kernels.norm import (
    add_rms_norm,
    add_rms_norm_ref,
    gated_rms_norm,
    gated_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from tests.kernels.invariance import assert_rows_invariant, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Inputs are upcast exactly, then everything is fp32 on both sides: only the order of the
# sum of squares differs (and, on the GPU, exp inside silu/sigmoid).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=1e-5),
}
SHAPES = [(1, 7), (5, 333), (3, 128), (9, 1000)]
EPS = 1e-6


def _data(B, D, dt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.randn(B, D, generator=g) * 2 + 0.3).to(dt).to(device)
    r = torch.randn(B, D, generator=g).to(dt).to(device)
    z = (torch.randn(B, D, generator=g) * 2).to(dt).to(device)
    w = (1 + 0.5 * torch.randn(D, generator=g)).to(device)  # away from the default ones
    return x, r, z, w


def _gpu_tiles(max_block_d):
    """The GPU's tiles (1 row/program), D chunked at ``max_block_d``."""
    return NM.NORM_CONFIGS.forced(lambda D: NM._norm_config(D, rows=1, max_block_d=max_block_d))


@pytest.fixture(params=["gpu-tiles", "interp-tiles"])
def tiles(request):
    """Run each case with the interpreter's tiles and with the GPU's (1 row/program, chunked D)."""
    if request.param == "gpu-tiles":
        with _gpu_tiles(256):
            yield request.param
    else:
        yield request.param


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("B,D", SHAPES)
@pytest.mark.parametrize("zero_centered", [False, True])
def test_rms_norm(device, tiles, dt, B, D, zero_centered):
    x, _, _, w = _data(B, D, dt, device)
    w = w.to(dt)
    out = poisoned((B, D), device=device)
    y = rms_norm(x, w, EPS, zero_centered=zero_centered, out=out)
    assert y is out
    torch.testing.assert_close(y, rms_norm_ref(x, w, EPS, zero_centered=zero_centered), **TOL[dt])


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("B,D", SHAPES)
def test_add_rms_norm(device, tiles, dt, B, D):
    x, r, _, w = _data(B, D, dt, device, seed=1)
    y, s = add_rms_norm(x, r, w, EPS, zero_centered=True)
    yr, sr = add_rms_norm_ref(x, r, w, EPS, zero_centered=True)
    assert y.dtype == s.dtype == torch.float32
    assert torch.equal(s, sr)  # one fp32 add: exact
    torch.testing.assert_close(y, yr, **TOL[dt])


@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("B,D", SHAPES)
def test_gated_rms_norm(device, tiles, dt, B, D):
    x, _, z, w = _data(B, D, dt, device, seed=2)
    out = poisoned((B, D), device=device)
    gated_rms_norm(x, z, w, EPS, out=out)
    torch.testing.assert_close(out, gated_rms_norm_ref(x, z, w, EPS), **TOL[dt])


def test_per_head_views_and_strided_rows(device):
    # [B, H*D] -> [B*H, D] per-head norm, and a column slice of a wider buffer (row stride != D).
    B, H, D = 3, 4, 16
    x, _, z, w = _data(B, H * D, torch.float32, device, seed=3)
    y = gated_rms_norm(x.view(B * H, D), z.view(B * H, D), w[:D], EPS)
    torch.testing.assert_close(y, gated_rms_norm_ref(x.view(B * H, D), z.view(B * H, D), w[:D], EPS),
                               **TOL[torch.float32])
    wide = torch.randn(5, 300, device=device)
    torch.testing.assert_close(rms_norm(wide[:, 100:164], w, EPS), rms_norm_ref(wide[:, 100:164], w, EPS),
                               **TOL[torch.float32])


def test_per_head_gates_read_in_place(device):
    # z as [B, H, D] heads sliced out of wider rows (a projection's z columns): no [B*H, D] view of them
    # exists; the kernel reads them in place and gives bitwise the copied rows' result
    B, H, D = 5, 4, 16
    x, _, _, w = _data(B, H * D, torch.float32, device, seed=4)
    proj = torch.randn(B, 7 + H * D + 3, device=device).bfloat16()
    z = proj[:, 7:7 + H * D].unflatten(1, (H, D))
    assert z.stride(0) == proj.shape[1]
    xh = x.view(B * H, D)
    y = gated_rms_norm(xh, z, w[:D], EPS)
    assert torch.equal(y, gated_rms_norm(xh, z.reshape(B * H, D), w[:D], EPS))
    torch.testing.assert_close(y, gated_rms_norm_ref(xh, z, w[:D], EPS), **TOL[torch.float32])
    # the control: the heads read with a wrong head stride differ
    wrong = proj[:, 7:7 + H * D].as_strided((B, H, D), (proj.shape[1], 0, 1))
    assert not torch.equal(gated_rms_norm(xh, wrong, w[:D], EPS), y)
    with pytest.raises(ValueError):
        gated_rms_norm(xh, z[:, :2], w[:D], EPS)


def test_rejects_bad_shapes(device):
    x, r, z, w = _data(2, 8, torch.float32, device)
    with pytest.raises(ValueError):
        rms_norm(x, w[:4], EPS)
    with pytest.raises(ValueError):
        add_rms_norm(x, r[:, :4], w, EPS)
    with pytest.raises(ValueError):
        gated_rms_norm(x, z[:1], w, EPS)


# ---------------------------------------------------------------------------------------------
POOL, D_INV = 40, 333


@st.composite
def batches(draw):
    B = draw(st.integers(1, 33))
    rows = draw(st.permutations(range(POOL)))[:B]
    return rows, draw(st.integers(0, B - 1))


@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=batches(), op=st.sampled_from(["rms", "rms_zc", "add", "gated"]),
       dt=st.sampled_from(DTYPES), gpu_tiles=st.booleans())
def test_rows_invariant(batch, op, dt, gpu_tiles):
    device = torch.device("cpu") if INTERPRET else torch.device("cuda")
    x, r, z, w = _data(POOL, D_INV, dt, device, seed=4)
    fns = {
        "rms": lambda i: rms_norm(x[i], w, EPS),
        "rms_zc": lambda i: rms_norm(x[i], w, EPS, zero_centered=True),
        "add": lambda i: torch.cat(add_rms_norm(x[i], r[i], w, EPS), 1),
        "gated": lambda i: gated_rms_norm(x[i], z[i], w, EPS),
    }
    if gpu_tiles:
        with _gpu_tiles(128):
            assert_rows_invariant(fns[op], *batch)
    else:
        assert_rows_invariant(fns[op], *batch)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("B,D", [(5, 333), (3, 2048)])
def test_out_dtype_is_the_fp32_output_rounded(device, out_dtype, B, D):
    """A norm stored as bf16 / fp16 holds its fp32 output rounded to nearest even (what a consumer that
    rounds on load computes), for every variant; the residual sum stays fp32. Bit for bit, compiled too:
    the sum of squares is norm.rstd_of's fixed tree in every output-dtype variant (with tl.sum, an fp16
    variant at D = 2048 rounded rstd differently on an H200)."""
    x, r, z, w = _data(B, D, torch.float32, device, seed=B)
    x = x * 1e3   # wide values: ties and rounding carries show

    def same(a, b):
        assert a.dtype == b.dtype == out_dtype
        assert torch.equal(a, b)

    same(rms_norm(x, w, EPS, out_dtype=out_dtype), rms_norm(x, w, EPS).to(out_dtype))
    yn, s = add_rms_norm(x, r, w, EPS, zero_centered=True, out_dtype=out_dtype)
    yw, sw = add_rms_norm(x, r, w, EPS, zero_centered=True)
    assert s.dtype == torch.float32 and torch.equal(s, sw)
    same(yn, yw.to(out_dtype))
    same(gated_rms_norm(x, z, w, EPS, out_dtype=out_dtype), gated_rms_norm(x, z, w, EPS).to(out_dtype))
    with pytest.raises(TypeError, match="out_dtype"):
        rms_norm(x, w, EPS, out_dtype=torch.int32)
