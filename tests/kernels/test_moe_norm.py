"""ds4t.kernels.moe_norm: the routed experts + residual add + RMSNorm op gives the bits of the two ops it
replaces (the rank-ordered combine inside the norm kernel), rows stay invariant, overrides of its parts
still run, and a decode step of each MoE family keeps its logits."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ds4t
from ds4t.backend import INTERPRET, split_sum
from ds4t.kernels import moe as M
from ds4t.kernels import norm as NM
from ds4t.kernels import moe_norm as MN
from ds4t.kernels.moe_norm import moe_add_rms_norm, moe_add_rms_norm_ref
from ds4t.kernels.quant_blocks import quantize as gguf_quantize
from ds4t.kernels.registry import GPU, HOST_LIST, INTERP, ops, override, use_variants
from ds4t.kernels.weights import quantize as fp8_quantize
from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.split_parts import decode_step

EPS = 1e-6
E, K_TOP = 7, 2          # expert E - 1 is the shared one


@pytest.fixture(autouse=True)
def fuse_every_launch(monkeypatch):
    """The cases below are small: fuse at every row count (the default leaves launches of a few rows to the
    two kernels, test_the_row_threshold_keeps_the_bits)."""
    monkeypatch.setattr(MN, "FUSE_MIN_ROWS", 1)


def _case(B, D, I, wdt, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    wg, wu = ((torch.randn(E, I, D, generator=g) * D ** -0.5) for _ in range(2))
    wd = torch.randn(E, D, I, generator=g) * I ** -0.5
    if wdt == "fp8":
        wg, wu, wd = (fp8_quantize(w, (128, 128)) for w in (wg, wu, wd))
    elif wdt == "q8_0":
        wg, wu, wd = (gguf_quantize(w, "Q8_0") for w in (wg, wu, wd))
    else:
        wg, wu, wd = (w.to(wdt) for w in (wg, wu, wd))
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K_TOP] for _ in range(B)]).to(torch.int32)
    ids[1, 0] = -1                                    # a skipped pair (another rank's expert): adds 0
    wts = torch.rand(B, K_TOP, generator=g) + 0.1
    gate = torch.randn(B, generator=g)
    h, r = torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)
    nw = 1 + 0.2 * torch.randn(D, generator=g)
    moe = [w.to(device) for w in (h, ids, wts, wg, wu, wd)]
    return moe, r.to(device), nw.to(device), gate.to(device)


def _two_ops(moe, r, nw, shared, **kw):
    y = M.moe_experts(*moe, **shared)
    return NM.add_rms_norm(y, r, nw, EPS, **kw)


def _down_split(split):
    """The down kernel's K in ``split`` parts (its fp32 partials are what the combine adds first)."""
    cfg = M.MoEConfig(tile_n=32, tile_k=16, split=split)
    return M.MOE_CONFIGS.forced(lambda kernel, *f: cfg if kernel == "down" else dataclasses.replace(cfg, split=1))


def _shared_kw(kind, gate):
    return {"none": {}, "plain": dict(shared_expert=E - 1),
            "gated": dict(shared_expert=E - 1, shared_gate=gate)}[kind]


@pytest.mark.parametrize("variant,shared,split", [
    *[(GPU, shared, split) for shared in ("none", "plain", "gated") for split in (1, 2)],
    (HOST_LIST, "gated", 2), (INTERP, "gated", 1), (INTERP, "none", 2),
])
def test_same_bits_as_moe_experts_then_add_rms_norm(device, variant, shared, split):
    if variant == INTERP and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    moe, r, nw, gate = _case(5, 72, 64, torch.float32, device)
    kw = _shared_kw(shared, gate)
    with use_variants({"moe_experts": variant}), _down_split(split):
        want = _two_ops(moe, r, nw, kw)
        got = moe_add_rms_norm(*moe, r, nw, EPS, **kw)
        if variant != INTERP:      # the interpreter's rows path finishes the rows itself
            parts = M.moe_partials(*moe, **kw)
            assert parts.splits == split and parts.ranks == K_TOP + (shared != "none")
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)
    ref = moe_add_rms_norm_ref(*moe, r, nw, EPS, **kw)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], ref[1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("wdt", [torch.bfloat16, "fp8", "q8_0"], ids=str)
def test_same_bits_for_every_weight_format_narrow_store_zero_centered_and_chunked_rows(device, wdt):
    # D = 320 over 128-column chunks: the norm combines the pairs again in its second pass, and the last
    # chunk is ragged (masked loads of the pair outputs).
    moe, r, nw, gate = _case(4, 320, 96, wdt, device, seed=1)
    kw = _shared_kw("gated", gate)
    chunks = NM.NORM_CONFIGS.forced(lambda D: NM._norm_config(D, rows=1, max_block_d=128))
    norm_kw = dict(zero_centered=True, out_dtype=torch.bfloat16)
    with use_variants({"moe_experts": GPU}), chunks:
        want = _two_ops(moe, r, nw, kw, **norm_kw)
        got = moe_add_rms_norm(*moe, r, nw, EPS, **kw, **norm_kw)
    assert got[0].dtype == torch.bfloat16
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)


@triton.jit
def _combine_reversed(y_ptr, sy_p, r64, rm, cc, m, w_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED,
                      KTOP: tl.constexpr, KT: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, sy_s):
    """combine_rows with the ranks added last to first: a norm that combines in another order."""
    acc = tl.zeros([r64.shape[0], cc.shape[1]], dtype=tl.float32)
    for j in tl.static_range(KT - 1, -1, -1):
        wj = M._pair_weight(w_ptr, sw_b, gate_ptr, sg_b, r64, j, rm, KTOP, GATED)
        ok = M._pair_expert(ids_ptr, si_b, r64, j, rm, KTOP, SHARED) >= 0
        yj = split_sum(y_ptr + (r64 * KT + j)[:, None] * sy_p + cc, m & ok[:, None], sy_s, SPLIT)
        acc = acc + tl.where(ok, wj, 0.0)[:, None] * yj
    return acc


@pytest.mark.skipif(not INTERPRET, reason="swaps a jit helper, which a compiled kernel has inlined already")
def test_negative_control_another_rank_order_is_caught(device, monkeypatch):
    # The bitwise tests above can fail: the norm kernel combining the same pairs last rank first gives other bits.
    moe, r, nw, gate = _case(6, 64, 32, torch.float32, device, seed=3)
    moe[2] = moe[2] * torch.tensor([1.0, 1e3], device=device)    # terms of very different sizes: the order shows
    kw = _shared_kw("gated", gate)
    with use_variants({"moe_experts": GPU}):
        want = _two_ops(moe, r, nw, kw)
        monkeypatch.setattr(NM, "combine_rows", _combine_reversed)
        got = moe_add_rms_norm(*moe, r, nw, EPS, **kw)
    assert not torch.equal(got[1], want[1])
    torch.testing.assert_close(got[1], want[1], atol=1e-3, rtol=1e-4)   # the same sums up to rounding


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batch=st.lists(st.integers(0, 15), min_size=1, max_size=16, unique=True), i=st.integers(0, 15))
def test_rows_invariant(device, batch, i):
    moe, r, nw, gate = _case(16, 64, 64, torch.bfloat16, device, seed=4)
    i = i % len(batch)

    def run(rows):
        idx = torch.tensor(rows, device=device)
        h, ids, wts = (t[idx] for t in moe[:3])
        y, s = moe_add_rms_norm(h, ids, wts, *moe[3:], r[idx], nw, EPS, shared_expert=E - 1, shared_gate=gate[idx])
        return torch.cat([y, s], 1)

    with use_variants({"moe_experts": GPU}), _down_split(2):
        assert_rows_invariant(run, batch, i)


def test_overridden_parts_still_run(device):
    # A researcher's moe_experts sees the MoE layers' calls too: the op runs its parts through the registry then.
    moe, r, nw, gate = _case(3, 48, 32, torch.float32, device, seed=5)
    seen = []

    def my_moe(h, ids, weights, w_gate, w_up, w_down, **kw):
        seen.append(tuple(ids.shape))
        return M.moe_experts_ref(h, ids, weights, w_gate, w_up, w_down, **kw)

    with override("moe_experts", my_moe):
        got = ops.moe_add_rms_norm(*moe, r, nw, EPS, shared_expert=E - 1)
    assert seen == [(3, K_TOP)]
    want = NM.add_rms_norm(M.moe_experts_ref(*moe, shared_expert=E - 1), r, nw, EPS)
    for g, wt in zip(got, want):
        assert torch.equal(g, wt)


def test_the_row_threshold_keeps_the_bits(device, monkeypatch):
    # Below FUSE_MIN_ROWS rows the op runs the combine kernel then the norm; at and above it the norm combines:
    # either way the bits of the two ops, and a row's bits do not depend on which side of the threshold its
    # launch falls.
    monkeypatch.setattr(MN, "FUSE_MIN_ROWS", 4)
    moe, r, nw, gate = _case(6, 64, 32, torch.float32, device, seed=6)
    kw = _shared_kw("gated", gate)
    with use_variants({"moe_experts": GPU}):
        for rows in (slice(0, 3), slice(0, 6)):
            part = [t[rows] for t in moe[:3]] + moe[3:]
            want = _two_ops(part, r[rows], nw, dict(kw, shared_gate=gate[rows]))
            got = moe_add_rms_norm(*part, r[rows], nw, EPS, **dict(kw, shared_gate=gate[rows]))
            for g, wt in zip(got, want):
                assert torch.equal(g, wt)
        assert torch.equal(moe_add_rms_norm(*part, r[rows], nw, EPS, **dict(kw, shared_gate=gate[rows]))[0][:3],
                           moe_add_rms_norm(*[t[:3] for t in moe[:3]], *moe[3:], r[:3], nw, EPS,
                                            **dict(kw, shared_gate=gate[:3]))[0])


def test_rejects_a_residual_of_the_wrong_shape(device):
    moe, r, nw, _ = _case(3, 48, 32, torch.float32, device)
    with use_variants({"moe_experts": GPU}), pytest.raises(ValueError, match="residual must be"):
        moe_add_rms_norm(*moe, r[:, :16], nw, EPS)


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_a_decode_step_has_the_bits_of_the_unfused_ops(device, preset):
    # The decoder hands each MoE layer's routed experts to moe_add_rms_norm; the same step with the op run as
    # its two parts (moe_experts, then add_rms_norm) gives the same logits.
    model = ds4t.load(preset, device=device)

    def unfused(h, ids, weights, w_gate, w_up, w_down, residual, norm_weight, eps, *, shared_expert=None,
                shared_gate=None, **kw):
        y = ops.moe_experts(h, ids, weights, w_gate, w_up, w_down, shared_expert=shared_expert,
                            shared_gate=shared_gate)
        return ops.add_rms_norm(y, residual, norm_weight, eps, **kw)

    with use_variants({"moe_experts": GPU}), _down_split(2):
        fused, n = decode_step(model, "moe_add_rms_norm")
        with override("moe_add_rms_norm", unfused):
            parts, _ = decode_step(model, "moe_add_rms_norm")
    assert n >= 2 and torch.equal(fused, parts)


@pytest.mark.skipif(INTERPRET, reason="warps exist on the GPU only (the interpreter ignores num_warps)")
def test_combine_warps_change_no_bit(device):
    """``NormConfig.moe_warps`` only schedules: 4 / 8 / 16 warps give the combine norm the same bits at a D whose
    block_d is 8192 (where 4 warps spill); the control -- block_d 1024, the squares' tree over another width --
    gives other bits, so the comparison can fail."""
    moe, r, nw, gate = _case(16, 5120, 64, torch.bfloat16, device, seed=5)
    kw = _shared_kw("gated", gate)

    def run(max_block_d, warps):
        cfg = lambda D: dataclasses.replace(NM._norm_config(D, rows=1, max_block_d=max_block_d),  # noqa: E731
                                            moe_warps=warps)
        with NM.NORM_CONFIGS.forced(cfg), use_variants({"moe_experts": GPU}):
            return moe_add_rms_norm(*moe, r, nw, EPS, **kw)

    base = run(8192, 16)
    for warps in (4, 8):
        assert all(torch.equal(a, b) for a, b in zip(run(8192, warps), base))
    assert not torch.equal(run(1024, 16)[0], base[0])
