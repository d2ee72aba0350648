"""ds4t.kernels.linear: against the reference, batch invariance, and a negative control."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

import pytest
import torch
import triton
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ds4t.backend import FP8_LAYOUT_BARRIER, INTERPRET
from ds4t.kernels import linear as L
from ds4t.kernels import weights
from ds4t.kernels.linear import LinearConfig, linear, linear_config, linear_ref
from ds4t.kernels.registry import GPU, use_variants
from tests.kernels.invariance import assert_rows_invariant, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Both sides sum exact fp32 products (bf16/fp16 x bf16/fp16 is exact in fp32), in different orders.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.bfloat16: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=1e-4, rtol=1e-4),
}
SHAPES = [(5, 200, 333), (1, 96, 17), (33, 64, 130), (17, 1000, 48)]  # (B, K, N): odd, not tile multiples

# Configs that exercise the GPU code paths (split-K with a ragged last split, swapped operands,
# small tiles, several N tiles) at sizes the interpreter runs quickly.
PATH_CONFIGS = [
    LinearConfig(block_n=64, block_k=32, split=3, swap=True),
    LinearConfig(block_n=128, block_k=64, split=2, swap=False),
    LinearConfig(block_n=16, block_k=128, split=1, swap=True),
    LinearConfig(block_n=256, block_k=16, split=1, num_stages=2, swap=False),
    LinearConfig(block_n=64, block_k=64, split=2, swap=True, m_sub=2),   # 2 row sub-tiles a program
    LinearConfig(block_n=128, block_k=32, split=1, swap=False, m_sub=4, evict=0),  # 4 row sub-tiles a program
    LinearConfig(block_n=32, block_k=64, split=2, swap=True, evict=2),
]


def _data(B, K, N, wdt, xdt=torch.float32, device="cpu", seed=0, bias=True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(xdt).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(wdt).to(device)
    b = (torch.randn(N, generator=g) * 0.5 + 0.1).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("wdt", DTYPES, ids=str)
@pytest.mark.parametrize("B,K,N", SHAPES)
def test_matches_reference(device, wdt, B, K, N):
    x, w, b = _data(B, K, N, wdt, device=device)
    out = poisoned((B, N), device=device)
    y = linear(x, w, b, out=out)
    assert y is out
    torch.testing.assert_close(y, linear_ref(x, w, b), **TOL[wdt])


@pytest.mark.parametrize("xdt", DTYPES, ids=str)
@pytest.mark.parametrize("wdt", DTYPES, ids=str)
def test_activation_dtypes_no_bias(device, xdt, wdt):
    x, w, _ = _data(7, 200, 333, wdt, xdt, device=device, seed=1, bias=False)
    y = linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (7, 333)
    torch.testing.assert_close(y, linear_ref(x, w), **TOL[wdt])


def test_activation_is_rounded_to_weight_dtype(device):
    # x values that bf16 cannot hold: the kernel must round x to bf16 (nearest even) first.
    x, w, _ = _data(3, 64, 40, torch.bfloat16, device=device, seed=2, bias=False)
    x = x + 1e-3 * torch.rand_like(x)
    y = linear(x, w)
    exact_fp32 = x @ w.float().t()
    torch.testing.assert_close(y, linear_ref(x, w), **TOL[torch.bfloat16])
    assert (y - exact_fp32).abs().max() > 1e-4  # the rounding is visible at these magnitudes


@pytest.mark.parametrize("cfg", PATH_CONFIGS, ids=str)
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_paths_match_reference(device, cfg, wdt):
    x, w, b = _data(19, 200, 333, wdt, device=device, seed=3)
    out = poisoned((19, 333), device=device)
    with use_variants({"linear": GPU}):   # the GPU's masked row loads
        linear(x, w, b, out=out, config=cfg)
    torch.testing.assert_close(out, linear_ref(x, w, b), **TOL[wdt])


def test_strided_x_and_bf16_bias(device):
    x, w, b = _data(6, 200, 333, torch.bfloat16, device=device, seed=4)
    xs = torch.randn(6, 400, device=device)[:, ::2]  # unit stride broken: the launcher copies
    xs.copy_(x)
    b = b.bfloat16()
    torch.testing.assert_close(linear(xs, w, b), linear_ref(x, w, b), **TOL[torch.bfloat16])


def test_rejects_bad_shapes(device):
    x, w, b = _data(2, 64, 40, torch.float32, device=device)
    with pytest.raises(ValueError):
        linear(x[:, :32], w)
    with pytest.raises(ValueError):
        linear(x, w, b[:10])
    with pytest.raises(ValueError):
        linear(x, w, out=torch.empty(2, 40, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError):
        linear(x, w, config=LinearConfig(block_n=32, block_k=32, split=1, m_sub=3))


def test_config_never_sees_the_batch():
    assert list(inspect.signature(linear_config).parameters) == ["K", "N", "w_dtype", "x_dtype", "w_block_k"]
    for (K, N, w_dtype, *fp8_key), cfg in L._GPU_TABLE.items():
        assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_n >= 16
        assert cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_k >= 16
        assert cfg.split >= 1 and cfg.m_sub in (1, 2, 4) and cfg.evict in (0, 1, 2)
        if w_dtype == torch.float8_e4m3fn:   # (K, N, fp8, scale block, activation dtype)
            scale_bk, adt = fp8_key
            assert scale_bk % cfg.block_k == 0 and cfg.fp8_route in ("direct", "f32", "tf32", "fold")
            assert L._fp8_route(cfg, adt) >= 0
    for K, N in [(4096, 14336), (14336, 4096), (2048, 12288), (2048, 151936), (200, 333), (7, 5)]:
        cfg = L._gpu_heuristic(K, N, 2)
        assert cfg.block_k >= 16 and cfg.block_n >= 16 and cfg.split >= 1
        cfg = L._gpu_fp8_heuristic(K, N, 128)
        assert cfg.block_k >= 16 and cfg.block_n >= 16 and cfg.split >= 1 and 128 % cfg.block_k == 0
        assert cfg.k_per_split(K, 128) % min(128, cfg.k_step(K, 128)) == 0


@pytest.mark.parametrize("K,N,wbytes", [(5120, 160, 4), (7168, 256, 4), (2048, 513, 2), (2048, 513, 4)])
def test_latency_bound_weights_get_programs(K, N, wbytes):
    # router-sized weights are latency-bound: the routers of GLM-4.5 / DeepSeek-V3 (fp32 [E, D]) and
    # Qwen3-Next (bf16) need ~one program per SM or a step waits on a few long K chains (49 us for
    # GLM-4.5's on 20 programs)
    cfg = L._gpu_heuristic(K, N, wbytes)
    assert L._latency_bound(K, N, wbytes)
    assert cfg.programs_per_m_tile(K, N) >= 128
    assert cfg.k_per_split(K) >= 4 * cfg.block_k


@pytest.mark.parametrize("K,N", [(5120, 160), (7168, 256), (2048, 513), (1100, 100), (4000, 130)])
def test_fp32_routers_take_narrow_k_tiles_without_moving_a_split(K, N):
    # the FMA chains of an fp32 router sum each split's K in order whatever the K tile: a narrower tile keeps
    # the bits only while every split keeps its columns, so the tile narrows only then
    cfg = L._gpu_heuristic(K, N, 4)
    assert L._latency_bound(K, N, 4)
    wide = dataclasses.replace(cfg, block_k=64)
    assert cfg.block_k in (16, 64) and cfg.k_per_split(K) == wide.k_per_split(K)
    if cfg.block_k == 64:   # the control: a 16-column tile would have moved a split boundary here
        assert dataclasses.replace(cfg, block_k=16).k_per_split(K) != cfg.k_per_split(K)
    assert L._gpu_heuristic(K, N, 2).block_k == 128   # 16-bit weights (tensor cores) keep 256-byte rows


@pytest.mark.parametrize("K,N,wbytes", [(7168, 2112, 2), (4096, 2048, 2), (5120, 14336, 4), (14336, 4096, 4),
                                        (512, 128, 4), (128, 512, 2)])
def test_bandwidth_bound_weights_keep_long_splits(K, N, wbytes):
    # weights above 8 MiB and per-head ones (MLA's W_UK / W_UV: K 128 / 512, which linear_heads runs
    # in one launch only without a K split) keep the sweep's >= 16 K blocks a split and >= 32-row tiles
    cfg = L._gpu_heuristic(K, N, wbytes)
    assert not L._latency_bound(K, N, wbytes)
    assert (cfg.split == 1 or cfg.k_per_split(K) >= 16 * cfg.block_k) and cfg.block_n >= min(32, N)


# ---------------------------------------------------------------------------------------------
# Row batch invariance (hypothesis): row i among B rows (random subset and order) == row i alone
# ---------------------------------------------------------------------------------------------
POOL = 40
INV_SHAPES = [(200, 333), (64, 128)]  # (K, N); at (64, 128) np.matmul's rows would differ (see backend.mma)


@st.composite
def batches(draw):
    B = draw(st.integers(1, 33))
    rows = draw(st.permutations(range(POOL)))[:B]
    i = draw(st.integers(0, B - 1))
    return rows, i


def _pool(wdt, device, seed, K=200, N=333):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(POOL, K, generator=g).to(device)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(wdt).to(device)
    b = torch.randn(N, generator=g).to(device)
    return x, w, b


def check_rows_invariant(launch, wdt, device, batch, seed=5, shape=(200, 333)):
    """The property: ``launch(x_rows, w, b)`` gives row i the same bits alone and in the batch."""
    x, w, b = _pool(wdt, device, seed, *shape)
    rows, i = batch

    def run(idx):
        return launch(x[idx].contiguous(), w, b)

    assert_rows_invariant(run, rows, i)


# No shrinking: an interpreted launch is slow, and the failing row and B are in the message.
PROPERTY = settings(max_examples=12, deadline=None, phases=(Phase.explicit, Phase.reuse, Phase.generate),
                    suppress_health_check=list(HealthCheck))


@PROPERTY
@given(batch=batches(), wdt=st.sampled_from(DTYPES), shape=st.sampled_from(INV_SHAPES))
def test_rows_invariant(batch, wdt, shape):
    check_rows_invariant(lambda x, w, b: linear(x, w, b), wdt, default_device(), batch, shape=shape)


@settings(PROPERTY, max_examples=10)
@given(batch=batches(), cfg=st.sampled_from(PATH_CONFIGS), shape=st.sampled_from(INV_SHAPES))
def test_rows_invariant_gpu_paths(batch, cfg, shape):
    with use_variants({"linear": GPU}):   # the GPU's masked row loads
        check_rows_invariant(lambda x, w, b: linear(x, w, b, config=cfg), torch.bfloat16, default_device(), batch,
                             shape=shape)


# ---------------------------------------------------------------------------------------------
# Negative controls: launchers whose reduction order depends on B. The same property check must
# catch them, or it proves nothing.
# ---------------------------------------------------------------------------------------------
def _split_from_batch(x, w, b):
    B = x.shape[0]
    return linear(x, w, b, config=LinearConfig(block_n=128, block_k=32, split=1 if B == 1 else 2, num_stages=2))


def _block_k_from_batch(x, w, b):
    B = x.shape[0]
    return linear(x, w, b, config=LinearConfig(block_n=128, block_k=64 if B < 8 else 16, split=1, num_stages=2))


def _one_ulp_in_batch(x, w, b):
    """Correct kernel, then column 0 of every row moved by one ulp whenever B > 1."""
    y = linear(x, w, b)
    if x.shape[0] > 1:
        y[:, 0] = torch.nextafter(y[:, 0], torch.full_like(y[:, 0], float("inf")))
    return y


NEGATIVE = settings(max_examples=25, deadline=None, database=None, phases=(Phase.generate,),
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("bad", [
    _split_from_batch,
    _one_ulp_in_batch,
    # On the GPU, tl.dot accumulates into the same accumulator in K order whatever BLOCK_K is
    # (seen on an H200: identical bits for BLOCK_K 16 and 64), so only the interpreter, which sums
    # each K block before adding it, changes bits with BLOCK_K.
    pytest.param(_block_k_from_batch, marks=pytest.mark.skipif(
        not INTERPRET, reason="BLOCK_K does not change the K order of tl.dot on the GPU")),
], ids=lambda f: getattr(f, "__name__", str(f)))
def test_negative_control_is_caught(bad):
    @NEGATIVE
    @given(batch=batches())
    def prop(batch):
        check_rows_invariant(bad, torch.float32, default_device(), batch)

    with pytest.raises(AssertionError, match="differs between batch"):
        prop()


def default_device():
    return torch.device("cpu" if INTERPRET else "cuda")


@pytest.mark.parametrize("cfg", PATH_CONFIGS, ids=str)
def test_out_may_be_a_column_slice(device, cfg):
    """``out`` with a row stride wider than N (a column slice of a buffer): same bits as a fresh
    output, nothing written outside the slice (split-K's final sum included)."""
    x, w, b = _data(5, 200, 70, torch.bfloat16, device=device)
    buf = poisoned((5, 70 + 9), device=device)
    got = linear(x, w, b, out=buf[:, 3:73], config=cfg)
    assert got.data_ptr() == buf[:, 3:73].data_ptr()
    assert torch.equal(got, linear(x, w, b, config=cfg))
    assert torch.isnan(buf[:, :3]).all() and torch.isnan(buf[:, 73:]).all()


# ----------------------------------------------------------------------------- linear_heads

HEAD_SHAPES = [(5, 4, 64, 96), (1, 3, 48, 17), (19, 2, 128, 40)]   # (B, G, K, N)


@pytest.mark.parametrize("B,G,K,N", HEAD_SHAPES)
@pytest.mark.parametrize("wdt", [torch.float32, torch.bfloat16])
def test_linear_heads_is_the_per_head_loop_bitwise(device, B, G, K, N, wdt):
    g = torch.Generator(device="cpu").manual_seed(B + G + K)
    # x as a strided view of a wider projection (as MLA's q_nope part); out a view of a buffer
    wide = torch.randn(B, G * K + 7, generator=g).to(device)
    x = wide[:, : G * K].view(B, G, K)
    w = (torch.randn(G, N, K, generator=g) / K ** 0.5).to(wdt).to(device)
    buf = poisoned((B, G, N + 5), device=device)
    got = L.linear_heads(x, w, out=buf[:, :, :N])
    assert got.data_ptr() == buf.data_ptr()
    assert not torch.isnan(got).any()
    assert torch.isnan(buf[:, :, N:]).all()            # nothing written past N
    loop = torch.stack([linear(x[:, h], w[h]) for h in range(G)], dim=1)
    assert torch.equal(got, loop)
    torch.testing.assert_close(got, L.linear_heads_ref(x, w), **TOL[wdt])


def test_linear_heads_with_split_k_runs_the_per_head_loop(device, monkeypatch):
    """A config with split-K (big K on the GPU) takes the loop; still the per-head linear bits."""
    split = LinearConfig(block_n=32, block_k=16, split=2, swap=True)
    monkeypatch.setattr(L, "linear_config", lambda *a, **k: split)
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(5, 3, 64, generator=g).to(device)
    w = torch.randn(3, 40, 64, generator=g).to(torch.bfloat16).to(device)
    loop = torch.stack([linear(x[:, h], w[h], config=split) for h in range(3)], dim=1)
    assert torch.equal(L.linear_heads(x, w), loop)


_HX = torch.randn(33, 3, 40, generator=torch.Generator().manual_seed(5))
_HW = (torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(6)) / 40 ** 0.5).to(torch.bfloat16)


@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.permutations(range(33)).flatmap(
    lambda p: st.integers(1, 33).flatmap(lambda n: st.tuples(st.just(p[:n]), st.integers(0, n - 1)))))
def test_linear_heads_rows_invariant(case):
    rows, i = case
    dev = torch.device(_device())
    x, w = _HX.to(dev), _HW.to(dev)
    assert_rows_invariant(lambda rs: L.linear_heads(x[list(rs)], w), rows, i)


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@pytest.mark.parametrize("out_dt", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("split", [False, True])
def test_linear_heads_out_dtype_is_the_fp32_result_rounded(device, monkeypatch, fmt, out_dt, split):
    """``out_dtype`` 16-bit stores the fp32 result rounded to nearest even (MLA's W_UV output for o_proj),
    into a poisoned buffer of that dtype, in the one-launch path and in the per-head loop a split config
    takes; every row as alone."""
    g = torch.Generator(device="cpu").manual_seed(9)
    B, G, K, N = 7, 3, 256, 40
    x = torch.randn(B, G, K, generator=g).to(device)
    w = (torch.randn(G, N, K, generator=g) / K ** 0.5)
    if fmt == "fp8":
        from ds4t.kernels.weights import quantize

        w = quantize(w).with_act_dtype(torch.bfloat16).to(device)
    else:
        w = w.to(torch.bfloat16).to(device)
    if split:
        cfg = LinearConfig(block_n=32, block_k=64, split=2, swap=True, fp8_route="f32" if fmt == "fp8" else "direct")
        monkeypatch.setattr(L, "linear_config", lambda *a, **k: cfg)
    want = L.linear_heads(x, w).to(out_dt)
    out = torch.full((B, G, N), float("nan"), dtype=out_dt, device=device)
    got = L.linear_heads(x, w, out=out, out_dtype=out_dt)
    assert got is out and torch.equal(got, want)
    assert torch.equal(L.linear_heads(x[3:4], w, out_dtype=out_dt), want[3:4])
    assert torch.equal(L.linear_heads_ref(x, w, out_dtype=out_dt), L.linear_heads_ref(x, w).to(out_dt))


def test_linear_heads_bad_args():
    with pytest.raises(ValueError, match="linear_heads"):
        L.linear_heads(torch.randn(2, 3, 8), torch.randn(4, 5, 8))
    with pytest.raises(ValueError, match="out must be"):
        L.linear_heads(torch.randn(2, 3, 8), torch.randn(3, 5, 8), out=torch.empty(2, 3, 4))
    with pytest.raises(ValueError, match="out must be"):   # an fp32 buffer for a bf16 store
        L.linear_heads(torch.randn(2, 3, 8), torch.randn(3, 5, 8), out=torch.empty(2, 3, 5),
                       out_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="out_dtype"):
        L.linear_heads(torch.randn(2, 3, 8), torch.randn(3, 5, 8), out_dtype=torch.int8)


def _device():
    from ds4t.backend import default_device

    return default_device()


# ----------------------------------------------------------------------------- FP8 weights (W8A16)

FP8_TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-4, torch.float16: 1e-4}
"""Max |kernel - ref| / max |ref| by activation dtype: the kernel sums scale * (x . fp8) per K block,
the reference x . (fp8 * scale); both round in fp32 (fp32 x times fp8 is not exact), in other orders."""
FP8_SHAPES = [(5, 200, 576), (1, 300, 333), (17, 96, 48)]   # (B, K, N): K, N not multiples of 128


def _fp8_data(B, K, N, xdt=torch.float32, device="cpu", seed=0, block=(128, 128), bias=True):
    from ds4t.kernels.weights import quantize

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, K, generator=g).to(xdt).to(device)
    # rows of different magnitudes: the per-row block scales differ
    w = torch.randn(N, K, generator=g) / K ** 0.5 * (1 + torch.rand(N, 1, generator=g) * 4)
    b = (torch.randn(N, generator=g) * 0.5 + 0.1).to(device) if bias else None
    return x, quantize(w, block).to(device), b


def _rel_err(y, ref):
    return ((y - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("adt", DTYPES, ids=str)
@pytest.mark.parametrize("B,K,N", FP8_SHAPES)
def test_fp8_matches_reference(device, adt, B, K, N):
    x, w, b = _fp8_data(B, K, N, adt, device=device, seed=B + K)
    out = poisoned((B, N), device=device)
    y = linear(x, w, b, out=out)          # activation dtype = x's own dtype
    assert y is out and not torch.isnan(y).any()
    assert _rel_err(y, linear_ref(x, w, b)) <= FP8_TOL[adt]


def test_fp8_fp32_activations_are_not_rounded(device):
    """fp32 x stays fp32 (never rounded to bf16 or fp8): the result is the dequantized product to
    fp32 accuracy; ``act_dtype=bf16`` rounds x first and the difference shows."""
    x, w, _ = _fp8_data(4, 200, 70, device=device, seed=7, bias=False)
    exact = (x.double() @ w.dequantize().double().t())
    y = linear(x, w)
    assert ((y.double() - exact).abs().max() / exact.abs().max()).item() < 2e-6
    yb = linear(x, w, act_dtype=torch.bfloat16)
    assert _rel_err(yb, linear_ref(x, w, act_dtype=torch.bfloat16)) <= FP8_TOL[torch.bfloat16]
    assert torch.equal(yb, linear(x.bfloat16(), w))   # rounding inside == a bf16 x
    assert ((yb.double() - exact).abs().max() / exact.abs().max()).item() > 1e-4


@pytest.mark.parametrize("cfg", PATH_CONFIGS, ids=str)
@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_gpu_paths_match_reference(device, cfg, adt):
    """The GPU's code paths with FP8 weights: split-K on scale-block boundaries (K = 300: three
    blocks, the last ragged; split 2 runs a block past K), swapped operands, 2 and 4 row sub-tiles,
    BLOCK_K of 16..128 inside 128-column scale blocks (and 64-column blocks where BLOCK_K allows)."""
    x, w, b = _fp8_data(19, 300, 333, adt, device=device, seed=3)
    out = poisoned((19, 333), device=device)
    with use_variants({"linear": GPU}):
        linear(x, w, b, out=out, config=cfg)
    assert _rel_err(out, linear_ref(x, w, b)) <= FP8_TOL[adt]
    if cfg.block_k <= 64:
        x, w, b = _fp8_data(19, 300, 333, adt, device=device, seed=4, block=(128, 64))
        with use_variants({"linear": GPU}):
            y = linear(x, w, b, config=cfg)
        assert _rel_err(y, linear_ref(x, w, b)) <= FP8_TOL[adt]



@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("K, split, blocks", [(1024, 2, 2), (1024, 1, 4), (640, 1, 2), (640, 2, 3)],
                         ids=["even", "one-split", "ragged", "past-K"])
def test_fp8_scale_blocks_a_step_keep_the_one_block_bits(device, adt, K, split, blocks):
    """LinearConfig.scale_blocks: a K-loop step of several 128-column scale blocks runs the one-block step's
    operations on each in turn -- the bits of one block a step over the same splits (640 = 5 blocks: the
    last step of a split may lie partly or wholly past K; linear_heads too). Control: another split differs."""
    x, w, b = _fp8_data(5, K, 96, adt, device=device, seed=7)
    one = LinearConfig(block_n=32, block_k=64, split=split, num_warps=2, num_stages=3, swap=True)
    many = dataclasses.replace(one, scale_blocks=blocks)
    if one.k_per_split(K, 128) != many.k_per_split(K, 128):
        one = dataclasses.replace(one, split=triton.cdiv(K, many.k_per_split(K, 128)))   # the same splits
    with use_variants({"linear": GPU, "linear_heads": GPU}):
        base = linear(x, w, b, config=one, act_dtype=adt)
        assert torch.equal(linear(x, w, b, config=many, act_dtype=adt), base)
        assert not torch.equal(linear(x, w, b, config=dataclasses.replace(one, split=4), act_dtype=adt), base)
        wh = weights.stack([w[:48], w[48:]])
        xh = x[:, None].expand(5, 2, K).contiguous()
        with L.LINEAR_CONFIGS.forced(lambda *key: many):
            heads = L.linear_heads(xh, wh, act_dtype=adt)
        with L.LINEAR_CONFIGS.forced(lambda *key: one):
            assert torch.equal(heads, L.linear_heads(xh, wh, act_dtype=adt))
    with pytest.raises(ValueError, match="scale_blocks"):
        linear(x, w, config=dataclasses.replace(one, scale_blocks=0))

@pytest.mark.parametrize("B, N, K, split, blocks", [(1, 96, 1024, 2, 1), (5, 100, 640, 1, 2), (17, 96, 640, 2, 1)],
                         ids=["one-row", "ragged-N-K", "two-sub-tiles"])
def test_fp8_weight_tiles_through_a_descriptor_keep_the_bits(device, B, N, K, split, blocks):
    """LinearConfig.tma: the fp8 weight tiles through a tensor descriptor (rows past N zero instead of row N - 1,
    columns past K zero as the masked loads give) -- the bits of pointer loads. Control: another split differs."""
    x, w, b = _fp8_data(B, K, N, torch.bfloat16, device=device, seed=11)
    ptr = LinearConfig(block_n=32, block_k=64, split=split, num_warps=2, num_stages=3, swap=True, scale_blocks=blocks,
                       m_sub=2)
    with use_variants({"linear": GPU}):
        base = linear(x, w, b, config=ptr, act_dtype=torch.bfloat16)
        assert torch.equal(linear(x, w, b, config=dataclasses.replace(ptr, tma=True), act_dtype=torch.bfloat16), base)
        assert not torch.equal(linear(x, w, b, config=dataclasses.replace(ptr, split=split + 2),
                                      act_dtype=torch.bfloat16), base)


@pytest.mark.parametrize("swap, m_sub", [(False, 2), (True, 1), (False, 1)], ids=["sub-tiles", "swap", "one-tile"])
def test_16_bit_decode_config_with_tma_keeps_the_bits(device, swap, m_sub):
    """A 16-bit decode config asking for descriptors takes them only where the descriptor path computes the
    launch's tile (one sub-tile, no swap); elsewhere the pointer loads -- the bits of ``tma=False`` either way."""
    x, w, b = _data(20, 256, 96, torch.bfloat16, torch.bfloat16, device=device, seed=5)
    cfg = LinearConfig(block_n=32, block_k=64, split=2, num_warps=4, num_stages=2, swap=swap, m_sub=m_sub)
    with use_variants({"linear": GPU}):
        base = linear(x, w, b, config=cfg)
        assert not torch.isnan(base).any()
        assert torch.equal(linear(x, w, b, config=dataclasses.replace(cfg, tma=True)), base)


def test_fp8_block_k_must_divide_the_scale_block(device):
    x, w, _ = _fp8_data(2, 200, 40, device=device, block=(128, 64), bias=False)
    with pytest.raises(ValueError, match="must divide"):
        linear(x, w, config=LinearConfig(block_n=32, block_k=128, split=1))
    y = linear(x, w)   # its own config picks a BLOCK_K that divides 64
    assert linear_config(200, 40, w.dtype, x.dtype, 64).block_k <= 64
    assert _rel_err(y, linear_ref(x, w)) <= FP8_TOL[torch.float32]


def test_fp8_bad_act_dtype(device):
    x, w, _ = _data(2, 64, 40, torch.bfloat16, device=device, bias=False)
    with pytest.raises(ValueError, match="act_dtype"):
        linear(x, w, act_dtype=torch.float32)
    assert torch.equal(linear(x, w, act_dtype=torch.bfloat16), linear(x, w))


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("variant_cfg", [None, PATH_CONFIGS[0], PATH_CONFIGS[4]],
                         ids=["own-config", "split3-swap", "split2-msub2"])
def test_fp8_launch_size_changes_no_bit(device, adt, variant_cfg):
    """The prefill property: 64 rows computed in launches of 64, 17 (+13) and 1 rows are bitwise equal."""
    x, w, b = _fp8_data(64, 300, 200, device=device, seed=11)
    ctx = use_variants({"linear": GPU}) if variant_cfg is not None else contextlib.nullcontext()
    with ctx:
        def run(rows):
            return linear(rows, w, b, config=variant_cfg, act_dtype=adt)

        whole = run(x)
        by17 = torch.cat([run(x[i:i + 17]) for i in range(0, 64, 17)])
        alone = range(64) if variant_cfg is None else [0, 15, 16, 17, 40, 63]   # the GPU variant: fewer (slow here)
        by1 = {i: run(x[i:i + 1]) for i in alone}
    assert torch.equal(whole, by17)
    assert all(torch.equal(whole[i:i + 1], y) for i, y in by1.items())


_FP8_POOL = {}


def _fp8_pool(shape, block):
    key = (shape, block)
    if key not in _FP8_POOL:
        from ds4t.kernels.weights import quantize

        K, N = shape
        g = torch.Generator(device="cpu").manual_seed(sum(shape))
        x = torch.randn(POOL, K, generator=g).to(default_device())
        w = quantize(torch.randn(N, K, generator=g) / K ** 0.5, block).to(default_device())
        b = torch.randn(N, generator=g).to(default_device())
        _FP8_POOL[key] = (x, w, b)
    return _FP8_POOL[key]


@settings(PROPERTY, max_examples=12)
@given(batch=batches(), adt=st.sampled_from([torch.float32, torch.bfloat16]),
       shape=st.sampled_from([(200, 333), (300, 64)]), block=st.sampled_from([(128, 128), (128, 64)]),
       cfg=st.sampled_from([None, PATH_CONFIGS[0], PATH_CONFIGS[4], PATH_CONFIGS[5]]))
def test_fp8_rows_invariant(batch, adt, shape, block, cfg):
    x, w, b = _fp8_pool(shape, block)
    if cfg is not None and block[1] % cfg.block_k:
        cfg = None
    rows, i = batch
    with use_variants({"linear": GPU}) if cfg is not None else contextlib.nullcontext():
        assert_rows_invariant(lambda idx: linear(x[idx].contiguous(), w, b, config=cfg, act_dtype=adt), rows, i)


@pytest.mark.parametrize("B,G,K,N", [(5, 4, 200, 96), (1, 3, 48, 17)])
@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_linear_heads_is_the_per_head_loop_bitwise(device, B, G, K, N, adt):
    from ds4t.kernels.weights import quantize

    g = torch.Generator(device="cpu").manual_seed(B + G + K)
    wide = torch.randn(B, G * K + 7, generator=g).to(device)
    x = wide[:, : G * K].view(B, G, K)
    w = quantize(torch.randn(G, N, K, generator=g) / K ** 0.5).to(device)
    assert w.scale.shape == (G, N, (K + 127) // 128)
    buf = poisoned((B, G, N + 5), device=device)
    got = L.linear_heads(x, w, out=buf[:, :, :N], act_dtype=adt)
    assert not torch.isnan(got).any() and torch.isnan(buf[:, :, N:]).all()
    loop = torch.stack([linear(x[:, h], w[h], act_dtype=adt) for h in range(G)], dim=1)
    assert torch.equal(got, loop)
    assert _rel_err(got, L.linear_heads_ref(x, w, act_dtype=adt)) <= FP8_TOL[adt]


def test_fp8_linear_heads_split_k_loop(device, monkeypatch):
    from ds4t.kernels.weights import quantize

    split = LinearConfig(block_n=32, block_k=32, split=2, swap=True)
    monkeypatch.setattr(L, "linear_config", lambda *a, **k: split)
    g = torch.Generator(device="cpu").manual_seed(3)
    x = torch.randn(5, 3, 300, generator=g).to(device)
    w = quantize(torch.randn(3, 40, 300, generator=g) / 300 ** 0.5).to(device)
    loop = torch.stack([linear(x[:, h], w[h], config=split) for h in range(3)], dim=1)
    got = L.linear_heads(x, w)
    assert torch.equal(got, loop)
    assert _rel_err(got, L.linear_heads_ref(x, w)) <= FP8_TOL[torch.float32]


_HW8 = None


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.permutations(range(33)).flatmap(
    lambda p: st.integers(1, 33).flatmap(lambda n: st.tuples(st.just(p[:n]), st.integers(0, n - 1)))))
def test_fp8_linear_heads_rows_invariant(case):
    from ds4t.kernels.weights import quantize

    global _HW8
    if _HW8 is None:
        _HW8 = quantize(torch.randn(3, 24, 40, generator=torch.Generator().manual_seed(6)) / 40 ** 0.5)
    rows, i = case
    dev = torch.device(_device())
    x, w = _HX.to(dev), _HW8.to(dev)
    assert_rows_invariant(lambda rs: L.linear_heads(x[list(rs)], w), rows, i)


@pytest.mark.parametrize("adt", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_routes(device, adt):
    """fp8 -> fp32 -> A (route "f32") gives the bits of fp8 -> A ("direct"): both exact conversions, the
    same MMA. Route "tf32" (bf16 activations only) is another MMA instruction: on the GPU its sums may
    differ in the last bit (in the interpreter too: numpy sums the same products in an order that
    follows the operands' memory layout), so it must match the reference and stay batch-invariant.
    Route "fold" rounds each weight once to the activation dtype: it must equal that computation and
    stay batch-invariant. Routes "x2" (fp8 pieces of x, fp8 MMA) and "f16" (x rows scaled into fp16, fp16
    weight tiles) must match the reference and stay batch-invariant. fp32 activations refuse all four."""
    import dataclasses

    x, w, b = _fp8_data(20, 300, 200, device=device, seed=5)
    base = LinearConfig(block_n=64, block_k=64, split=2, num_warps=4, num_stages=1, swap=True)
    with use_variants({"linear": GPU}):
        def run(route, rows=x):
            return linear(rows, w, b, config=dataclasses.replace(base, fp8_route=route), act_dtype=adt,
                          out=poisoned((rows.shape[0], 200), device=device))

        y0, y1 = run("direct"), run("f32")
        assert not torch.isnan(y1).any() and torch.equal(y0, y1)
        if adt == torch.float32:
            for route in ("tf32", "fold", "x2", "f16"):
                with pytest.raises(ValueError, match=route):
                    run(route)
            return
        y2, y3, y4, y5 = run("tf32"), run("fold"), run("x2"), run("f16")
        for route, y in (("tf32", y2), ("fold", y3), ("x2", y4), ("f16", y5)):
            assert all(torch.equal(y[i:i + 1], run(route, x[i:i + 1])) for i in (0, 7, 19)), route
        # "f16" with K steps of one scale block: the bits of "f32" in the interpreter (backend.FP8_ROUTES;
        # unswapped: with swapped tiles numpy's sum order follows the transposed operand's layout)
        one_block = dataclasses.replace(base, block_k=128, swap=False)
        y16, y32 = (linear(x, w, b, config=dataclasses.replace(one_block, fp8_route=r), act_dtype=adt)
                    for r in ("f16", "f32"))
        if device.type == "cpu":
            assert torch.equal(y16, y32)
    ref = linear_ref(x, w, b, act_dtype=adt)
    assert ((y2 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((y5 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert ((y16 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    # "x2": x in two fp8 pieces (exact here but for elements far below their row's largest); on the GPU the
    # fp8 MMA adds its products with fewer bits than fp32 -- still far inside the bf16 bound
    assert ((y4 - ref).abs().max() / ref.abs().max()).item() < (1e-5 if device.type == "cpu" else 1e-3)
    # "fold": the weight fp8 * scale rounded once to the activation dtype, then an fp32-accumulated
    # product: equal to that computation up to summation order, and within the bf16 bound of the exact one
    folded = x.to(adt).float() @ w.dequantize(torch.float32).to(adt).float().t() + b.float()
    assert ((y3 - folded).abs().max() / folded.abs().max()).item() < 1e-5
    assert ((y3 - ref).abs().max() / ref.abs().max()).item() < 1e-2
    assert not torch.equal(y3, y1)   # the rounding of the weight shows: fold is not the exact route


# ----------------------------------------------------------------------------- row tiles (prefill chunks)

def _row_tile_case(fmt, device, B=70, K=300, N=200):
    if fmt == "fp8":
        x, w, b = _fp8_data(B, K, N, torch.bfloat16, device, seed=41)
        return x, w, b, dict(act_dtype=torch.bfloat16)
    if fmt == "bf16x":   # x already in the weight dtype, as the models' norms store it: what tensor descriptors take
        # (rows of a multiple of 16 bytes; 304 columns are still no multiple of a 32-column step)
        x, w, b = _data(B, K + 4, N, torch.bfloat16, torch.bfloat16, device=device, seed=41)
        return x, w, b, {}
    x, w, b = _data(B, K, N, torch.float32 if fmt == "fp32" else torch.bfloat16, device=device, seed=41)
    return x, w, b, {}


def _rows_vs_alone(monkeypatch, fmt, device, split, tile, scale_blocks=1):
    """(the B-row launch, each row launched alone, the tiles the B-row launch used); ``scale_blocks``: the
    decode config's FP8 scale blocks a loop step."""
    x, w, b, kw = _row_tile_case(fmt, device)
    dec = LinearConfig(block_n=64, block_k=64, split=split, swap=True, scale_blocks=scale_blocks)
    monkeypatch.setattr(L, "linear_config", lambda *a, **k: dec)
    monkeypatch.setattr(L, "linear_row_tiles", lambda *a, **k: (tile,))
    used = []
    real = L._row_launch
    monkeypatch.setattr(L, "_row_launch", lambda *a: used.append(real(*a)) or used[-1])
    full = linear(x, w, b, out=poisoned((x.shape[0], w.shape[0]), device=device), **kw)
    alone = torch.cat([linear(x[i:i + 1], w, b, **kw) for i in range(x.shape[0])])
    return full, alone, used


@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("fmt", ["bf16", pytest.param("fp32", marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter's fp32 MMA is numpy's broadcast sum, whose order follows the tile's shape "
                      "(it has no fp32 row tiles); the GPU's IEEE fp32 dot is an FMA chain in K order")),
                                 pytest.param("fp8", marks=pytest.mark.skipif(
    not (INTERPRET or FP8_LAYOUT_BARRIER), reason="on an H200 an FP8 row's bits change with the tile (bench/mma_shapes.py): the GPU has "
                          "no FP8 row tiles"))])
def test_row_tile_keeps_every_rows_bits(device, monkeypatch, fmt, split):
    """A launch of >= min_rows rows runs the row tile (32 x 128 here, the decode config 16 x 64 swapped);
    every row equals that row launched alone (the decode tile), bit for bit, with and without split-K.
    On the GPU the tile also changes BLOCK_K (64 -> 32) and the MMA instruction."""
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2)
    full, alone, used = _rows_vs_alone(monkeypatch, fmt, device, split, tile)
    assert (used[0].block_m, used[0].block_n, used[0].swap) == (32, 128, False)
    assert all(u.block_m == L.BLOCK_M for u in used[1:])
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


@pytest.mark.skipif(not (INTERPRET or FP8_LAYOUT_BARRIER), reason="the GPU has FP8 row tiles only under "
                    "DS4T_FP8_BARRIER=1 (see test_row_tile_keeps_every_rows_bits)")
def test_fp8_row_tile_steps_one_scale_block(device, monkeypatch):
    """A row tile steps one FP8 scale block at a time whatever the decode config's ``scale_blocks`` (two blocks a
    step of the 128 x 128 FP8 row tile need 344 KB of sm_90 shared memory, over the H100's 227 KB: DeepSeek-V3's
    o_proj and dense down_proj failed to launch under the barrier on an H100); every row keeps the bits of that
    row alone, which the decode config steps two blocks at a time (K = 300: the second step's block ragged)."""
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2)
    full, alone, used = _rows_vs_alone(monkeypatch, "fp8", device, 1, tile, scale_blocks=2)
    assert used[0].block_m == 32 and used[0].scale_blocks == 1
    assert all(u.block_m == L.BLOCK_M and u.scale_blocks == 2 for u in used[1:])
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


@pytest.mark.parametrize("fmt", ["bf16", pytest.param("fp32", marks=pytest.mark.skipif(
    INTERPRET, reason="the interpreter has no fp32 row tiles (see test_row_tile_keeps_every_rows_bits)"))])
def test_row_tile_folded_splits_keep_every_rows_bits(device, monkeypatch, fmt):
    """A row tile that folds its splits (``fold_splits``: the 3 splits of a tile in one program, added in split
    order there, no partials) gives every row the bits of that row alone (3 split programs and the split-K sum),
    and ``linear_parts`` hands the finished product over as one partial."""
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2, fold_splits=True)
    full, alone, used = _rows_vs_alone(monkeypatch, fmt, device, 3, tile)
    assert used[0].fold and (used[0].block_m, used[0].block_n) == (32, 128)
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)
    x, w, b, kw = _row_tile_case(fmt, device)
    parts = L.linear_parts(x, w, b, **kw)
    assert parts.splits == 1 and parts.bias is None and torch.equal(parts.part[0], full)


@pytest.mark.parametrize("tma", [False, pytest.param(True, marks=pytest.mark.skipif(
    not L.TMA, reason="tensor descriptors need a Hopper GPU (or the interpreter)"))], ids=["pointers", "tma"])
def test_row_tile_fold_control_other_splits_are_caught(device, monkeypatch, tma):
    """Negative control of the folded splits (and of the descriptor loads' test): the same fold over 2 splits of
    the columns, against rows alone over 3, differs -- the comparisons above see how a row's K is grouped."""
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2, fold_splits=True,
                     tma=tma)
    fmt = "bf16x" if tma else "bf16"
    x, w, b, kw = _row_tile_case(fmt, device)
    two = LinearConfig(block_n=64, block_k=64, split=2, swap=True)
    full = L._launch(x, w, b, poisoned((x.shape[0], w.shape[0]), device=device), two, None, (tile,))
    _, alone, _ = _rows_vs_alone(monkeypatch, fmt, device, 3, tile)
    assert not torch.isnan(full).any()
    assert not torch.equal(full, alone)


@pytest.mark.skipif(not L.TMA, reason="tensor descriptors need a Hopper GPU (or the interpreter)")
@pytest.mark.parametrize("fold,split", [(False, 1), (False, 3), (True, 3)], ids=["unsplit", "split", "folded"])
def test_row_tile_tma_keeps_every_rows_bits(device, monkeypatch, fold, split):
    """A row tile that loads through tensor descriptors (``tma``; x in bf16 like the weight) gives every row the
    bits of that row alone (pointer loads, decode tiles): unsplit, split-K, and folded. K = 304 is no multiple of
    the 32-column step, so the zeros past K come from the descriptor, as the pointer path's masks give them."""
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2, fold_splits=fold,
                     tma=True)
    took = []
    real = L._tma_descriptors
    monkeypatch.setattr(L, "_tma_descriptors", lambda *a: took.append(real(*a)) or took[-1])
    full, alone, used = _rows_vs_alone(monkeypatch, "bf16x", device, split, tile)
    assert used[0].tma and used[0].fold == fold and took[0].get("USE_TMA")
    assert not any(d for d in took[1:])   # the lone rows: decode tiles, pointer loads
    assert not torch.isnan(full).any()
    assert torch.equal(full, alone)


def test_tma_needs_x_in_the_weight_dtype_and_16_byte_rows():
    """Where a launch cannot take descriptors it takes the pointer path: fp32 x (rounded in registers), a row
    stride that is no multiple of 16 bytes."""
    t = L._Tiles(32, 128, 32, 1, False, False, 4, 2, tma=True)
    w = torch.randn(64, 64).to(torch.bfloat16)
    assert not L._tma_descriptors(torch.randn(40, 64), w, t)
    assert not L._tma_descriptors(torch.randn(40, 68).to(torch.bfloat16)[:, :60], w[:, :60], t)
    assert not L._tma_descriptors(torch.randn(40, 64).to(torch.bfloat16), w, dataclasses.replace(t, tma=False))
    assert L._tma_descriptors(torch.randn(40, 64).to(torch.bfloat16), w, t).get("USE_TMA") is L.TMA


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's MMA sums per K tile; on the GPU BLOCK_K changes no bit")
def test_row_tile_control_a_changed_k_tile_is_caught(monkeypatch):
    """Negative control: were a row tile allowed its own BLOCK_K in the interpreter (where a K tile's
    products are summed before being added), the rows would differ and the test above would fail."""
    monkeypatch.setattr(L, "INTERPRET", False)
    tile = L.RowTile(min_rows=32, block_m=32, block_n=128, block_k=32, num_warps=4, num_stages=2)
    full, alone, used = _rows_vs_alone(monkeypatch, "bf16", "cpu", 1, tile)
    assert used[0].block_k == 32
    assert not torch.equal(full, alone)


@pytest.mark.skipif(INTERPRET, reason="the GPU tables' row tiles (the interpreter has none)")
@pytest.mark.parametrize("K,N", [(2048, 12288)] + sorted({k[:2] for k in L._GPU_ROW_TILES if k[2] == torch.bfloat16}),
                         ids=lambda v: str(v))
@pytest.mark.parametrize("xdt", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_table_row_tiles_keep_every_rows_bits(device, K, N, xdt):
    """The GPU's own row tiles -- the rule's at a decode shape (2048 x 12288) and every per-shape entry (folded
    splits among them), x in fp32 and in bf16 (what descriptor loads take): 300 rows in one launch (the row tile)
    equal each row alone (the decode config), bit for bit. FP8 weights have no row tiles."""
    B = 300
    x, w, b = _data(B, K, N, torch.bfloat16, xdt, device=device, seed=43)
    tiles = L.linear_row_tiles(K, N, torch.bfloat16, xdt)
    assert tiles and B >= tiles[0].min_rows
    assert L.linear_row_tiles(K, N, torch.float8_e4m3fn, torch.bfloat16, 128) == ()
    full = linear(x, w, b)
    for i in (0, 1, 127, 128, 299):
        assert torch.equal(full[i:i + 1], linear(x[i:i + 1], w, b)), i


@pytest.mark.skipif(INTERPRET, reason="the GPU tables' row tiles (the interpreter has none)")
@pytest.mark.parametrize("K,N", [(7168, 256), (5120, 160)], ids=["deepseek-router", "glm-router"])
def test_table_fp32_row_tiles_keep_every_rows_bits(device, K, N):
    """fp32 weights (the MoE routers, an IEEE fp32 dot) at their real shapes: 300 rows in one launch (the
    fp32 row tile) equal each row alone (the decode config, split-K), bit for bit, and as linear_parts
    (the router's partials, summed by its top-k kernel) too."""
    B = 300
    x, w, _ = _data(B, K, N, torch.float32, device=device, seed=44)
    tiles = L.linear_row_tiles(K, N, torch.float32)
    assert tiles and B >= tiles[0].min_rows
    full = linear(x, w)
    parts = L.linear_parts(x, w)
    for i in (0, 1, 127, 128, 299):
        assert torch.equal(full[i:i + 1], linear(x[i:i + 1], w)), i
        assert torch.equal(parts.part[:, i:i + 1], L.linear_parts(x[i:i + 1], w).part), i


# ----------------------------------------------------------------------------- fused split-K sum


@pytest.mark.parametrize("fmt,cfg", [
    ("bf16", LinearConfig(block_n=64, block_k=32, split=3, swap=True)),
    ("fp32", LinearConfig(block_n=32, block_k=64, split=2, swap=False, m_sub=2)),
    ("fp8", LinearConfig(block_n=32, block_k=64, split=2, swap=True, fp8_route="f32")),
    ("fp8", LinearConfig(block_n=64, block_k=128, split=3, swap=True, m_sub=4, fp8_route="f32")),
], ids=str)
def test_fused_split_sum_is_the_two_kernel_sum_bitwise(device, monkeypatch, fmt, cfg):
    """LinearConfig.fused_sum (the tile's last split adds the partials in split order, then the bias): the
    bits of the separate sum kernel, with a bias, ragged K splits and N tiles, twice in a row (the counters
    are left at 0), and the two-kernel fallback when the launch has more tiles than counters."""
    import dataclasses

    B, K, N = 37, 300, 200
    if fmt == "fp8":
        x, w, b = _fp8_data(B, K, N, torch.bfloat16, device=device, seed=7)
    else:
        x, w, b = _data(B, K, N, torch.bfloat16 if fmt == "bf16" else torch.float32, device=device, seed=7)
    fused = dataclasses.replace(cfg, fused_sum=True)
    two = linear(x, w, b, config=cfg, out=poisoned((B, N), device=device))
    for _ in range(2):
        one = linear(x, w, b, config=fused, out=poisoned((B, N), device=device))
        assert not torch.isnan(one).any() and torch.equal(one, two)
    assert L._COUNTERS and all(int(c.abs().sum()) == 0 for c in L._COUNTERS.values())
    monkeypatch.setattr(L, "TILE_COUNTERS", 2)
    assert torch.equal(linear(x, w, b, config=fused, out=poisoned((B, N), device=device)), two)
    assert torch.equal(linear(x[:1], w, b, config=fused)[0], two[0])


# ----------------------------------------------------------------------------- row sub-tiles a launch takes


def test_launch_m_sub_follows_the_rows_up_to_the_config():
    assert [L.launch_m_sub(4, b) for b in (1, 16, 17, 32, 33, 64, 300)] == [1, 1, 2, 2, 4, 4, 4]
    assert [L.launch_m_sub(2, b) for b in (1, 16, 17, 64)] == [1, 1, 2, 2]
    assert all(L.launch_m_sub(1, b) == 1 for b in (1, 17, 300))


@pytest.mark.parametrize("fmt", ["bf16", "fp32", "fp8"])
def test_sub_tiles_a_launch_takes_do_not_change_a_rows_bits(device, fmt):
    """A config with m_sub = 4 runs 1, 2 or 4 16-row sub-tiles a program as B fills them: every row equals
    the m_sub = 1 launch and the row alone, bit for bit (ragged N and K, a bias, split-K). Control: a split
    count that changes the K order is caught by the same comparison."""
    import dataclasses

    B, K, N = 70, 300, 200
    if fmt == "fp8":
        x, w, b = _fp8_data(B, K, N, torch.bfloat16, device=device, seed=11)
        cfg = LinearConfig(block_n=32, block_k=64, split=2, swap=True, m_sub=4, fp8_route="f32")
    else:
        x, w, b = _data(B, K, N, torch.bfloat16 if fmt == "bf16" else torch.float32, device=device, seed=11)
        cfg = LinearConfig(block_n=32, block_k=32, split=2, swap=True, m_sub=4)
    one = dataclasses.replace(cfg, m_sub=1)
    want = linear(x, w, b, config=one, out=poisoned((B, N), device=device))
    for rows in (B, 33, 17):
        got = linear(x[:rows], w, b, config=cfg, out=poisoned((rows, N), device=device))
        assert torch.equal(got, want[:rows]), rows
    for i in (0, 16, 40, 69):
        assert torch.equal(linear(x[i:i + 1], w, b, config=cfg), want[i:i + 1]), i
    other_k_order = dataclasses.replace(one, split=3)
    assert not torch.equal(linear(x, w, b, config=other_k_order), want)
