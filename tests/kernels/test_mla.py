"""Tests for ds4t.kernels.mla: latent-cache writes and absorbed MLA decode (split-KV, MQA)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4t  # noqa: F401
from ds4t.backend import INTERPRET
from ds4t.kernels.mla import (
    MLA_CONFIGS,
    TOLERANCE,
    MLAConfig,
    _check,
    default_split_schedule,
    mla_decode,
    mla_decode_ref,
    norm_rope_write_latent,
    norm_rope_write_latent_ref,
    write_latent,
    write_latent_ref,
)
from ds4t.kernels import mla as MLA
from ds4t.kernels import norm, rope
from ds4t.kernels.splits import SplitSchedule
from tests.kernels.invariance import Launches, assert_rows_invariant, poison_empty, poisoned

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SHAPES = [(4, 16, 8), (6, 48, 16)]  # (H, R, Dr): the tiny config, and odd non-power-of-two dims


def _name(dtype):
    return str(dtype).replace("torch.", "")


def _make(H, R, Dr, S, L, dtype, slots, lengths, seed=0, device="cpu"):
    """q, q_pe, cache (rows past every reader's length and unused slots poisoned with NaN)."""
    g = torch.Generator().manual_seed(seed)
    B = len(slots)
    cache = torch.randn(S, L, R + Dr, generator=g).to(dtype)
    used = torch.zeros(S, dtype=torch.long)
    for s, n in zip(slots, lengths):
        used[s] = max(int(used[s]), int(n))
    for s in range(S):
        cache[s, int(used[s]):] = float("nan")
    q = torch.randn(B, H, R, generator=g)
    qp = torch.randn(B, H, Dr, generator=g)
    return (q.to(device), qp.to(device), cache.to(device),
            torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(lengths, dtype=torch.int32, device=device))


def _assert_close(got, ref, dtype):
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------- write_latent

@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_write_latent_matches_ref(dtype, device):
    R, Dr, S, L, B = 48, 16, 3, 9, 7
    g = torch.Generator().manual_seed(1)
    c_kv = torch.randn(B, R, generator=g)
    k_pe = torch.randn(B, Dr, generator=g)
    # bf16 ties (round-half-to-even) in some elements
    bits = c_kv.view(torch.int32)
    c_kv[:, ::3] = ((bits[:, ::3] & ~0xFFFF) | 0x8000).view(torch.float32)
    slots = torch.tensor([2, 0, 1, 2, 0, 1, 2], dtype=torch.int32)
    pos = torch.tensor([0, 8, 4, 5, 3, 8, 7], dtype=torch.int32)
    cache = poisoned((S, L, R + Dr), dtype, device=device)
    ref = poisoned((S, L, R + Dr), dtype)
    write_latent(c_kv.to(device), k_pe.to(device), cache, slots.to(device), pos.to(device))
    write_latent_ref(c_kv, k_pe, ref, slots, pos)
    torch.testing.assert_close(cache.cpu(), ref, atol=0, rtol=0, equal_nan=True)
    assert torch.isnan(cache[1, 0]).all()  # untouched rows stay as they were


# ------------------------------------------------------------------------ norm_rope_write_latent

def _prologue(B, H, R, Dr, S, L, dtype, device, seed):
    """The down-projection's views (latent, k_pe) and a strided q_pe, norm weight, slots, positions,
    inverse frequencies and a NaN-poisoned cache, as DeepSeek-V3's MLA hands them over."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(B, R + Dr, generator=g).to(device)
    q = torch.randn(B, H * (8 + Dr), generator=g).to(device)
    w = (1 + 0.3 * torch.randn(R, generator=g)).to(device)
    slots = (torch.arange(B, dtype=torch.int32) // L) % S   # distinct (slot, position) pairs while B <= S * L
    pos = torch.arange(B, dtype=torch.int32) % L
    inv = rope.default_inv_freq(Dr, 10000.0, device=device)
    return (a[:, :R], a[:, R:], q[:, H * 8:].view(B, H, Dr), w, slots.to(device), pos.to(device), inv,
            poisoned((S, L, R + Dr), dtype, device=device))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H%d_R%d_Dr%d" % s)
def test_norm_rope_write_latent_is_norm_then_rope_then_write(shape, dtype, interleaved, device):
    """One launch == rms_norm, rope (over q_pe and k_pe) and write_latent in turn, as DeepSeek-V3 ran
    them, bitwise (the rotation is one helper, the norm's sum of squares norm.rstd_of's fixed tree in every
    kernel), and == the references."""
    H, R, Dr = shape
    c_kv, k_pe, q_pe, w, slots, pos, inv, cache = _prologue(7, H, R, Dr, 2, 5, dtype, device, seed=3)
    pos[0] = cache.shape[1]   # out of the pool: row 0 writes nothing (its q_pe is still rotated)
    c1, c2 = cache.clone(), cache.clone()
    out = poisoned((7, H, Dr), device=device)
    got = norm_rope_write_latent(c_kv, w, 1e-6, q_pe, k_pe, pos, inv, c1, slots, interleaved=interleaved,
                                 scale=1.1, out=out)
    assert got is out
    pe = torch.empty(7, H + 1, Dr, device=device)
    pe[:, :H] = q_pe
    pe[:, H] = k_pe
    rope.rope(pe, pos, inv, interleaved=interleaved, scale=1.1, out=pe)
    keep = pos < cache.shape[1]   # write_latent has no bounds check: give it the rows in range only
    write_latent(norm.rms_norm(c_kv, w, 1e-6)[keep], pe[keep, H], c2, slots[keep], pos[keep])
    assert torch.equal(got, pe[:, :H])
    torch.testing.assert_close(c1, c2, atol=0, rtol=0, equal_nan=True)
    ref_cache = cache.cpu().clone()
    k = keep.cpu()
    ref = norm_rope_write_latent_ref(c_kv.cpu()[k], w.cpu(), 1e-6, q_pe.cpu()[k], k_pe.cpu()[k], pos.cpu()[k],
                                     inv.cpu(), ref_cache, slots.cpu()[k], interleaved=interleaved, scale=1.1)
    torch.testing.assert_close(got.cpu()[k], ref, atol=1e-5, rtol=1e-5)
    # fp32 values rounded to the cache dtype: the reference's fp32 rstd may sit an ulp away
    tol = 1e-5 if dtype == torch.float32 else 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(c1.cpu().float(), ref_cache.float(), atol=tol * 8, rtol=tol, equal_nan=True)
    written = ~torch.isnan(c1.float()).all(-1)
    assert int(written.sum()) == int(keep.sum())   # row 0 (position L) wrote nothing; no other entry moved


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_norm_rope_write_latent_rows_invariant(data):
    """Row i among B rows == row i alone (its q_pe and the cache entry it writes), bitwise."""
    device = ds4t.backend.default_device()
    c_kv, k_pe, q_pe, w, slots, pos, inv, cache = _prologue(33, 4, 48, 16, 3, 11, torch.bfloat16, device, seed=4)
    B = data.draw(st.integers(1, 33), label="B")
    rows = data.draw(st.permutations(range(33)), label="order")[:B]
    i = data.draw(st.integers(0, B - 1), label="i")

    def run(r):
        idx = torch.tensor(r, dtype=torch.long, device=device)
        c1 = cache.clone()
        qo = norm_rope_write_latent(c_kv[idx], w, 1e-6, q_pe[idx], k_pe[idx], pos[idx], inv, c1, slots[idx],
                                    interleaved=True)
        return torch.cat([qo.flatten(1), c1[slots[idx].long(), pos[idx].long()].float()], 1)

    assert_rows_invariant(run, rows, i)


def test_norm_rope_write_latent_shape_errors(device):
    c_kv, k_pe, q_pe, w, slots, pos, inv, cache = _prologue(3, 4, 48, 16, 2, 5, torch.float32, device, seed=5)
    with pytest.raises(ValueError, match="kv_norm"):
        norm_rope_write_latent(c_kv, w[:-1], 1e-6, q_pe, k_pe, pos, inv, cache, slots)
    with pytest.raises(ValueError, match="shapes"):
        norm_rope_write_latent(c_kv, w, 1e-6, q_pe, k_pe[:, :-2], pos, inv, cache, slots)
    with pytest.raises(ValueError, match="slots and positions"):
        norm_rope_write_latent(c_kv, w, 1e-6, q_pe, k_pe, pos[:2], inv, cache, slots)


# ---------------------------------------------------------------------------------- mla_decode

@pytest.mark.parametrize("split", [16, 24, 64])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H%d_R%d_Dr%d" % s)
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_mla_decode_matches_ref(dtype, shape, split, device):
    H, R, Dr = shape
    S, L = 6, 70  # capacity not a multiple of any split size
    # length 1, == capacity, == split, split +- 1, not multiples of the split size
    slots = [3, 0, 5, 1, 2, 4, 3]
    lengths = [1, L, split, split + 1, split - 1, 2 * split + 5, 37]
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, dtype, slots, lengths, seed=split + H, device=device)
    scale = 1.0 / math.sqrt(R // 2 + Dr)
    out = poisoned((len(slots), H, R), device=device)
    got = mla_decode(q, qp, cache, sl, ln, scale, kv_lora_rank=R, split_size=split, out=out)
    assert got is out
    ref = mla_decode_ref(q, qp, cache, sl, ln, scale, kv_lora_rank=R)
    assert torch.isfinite(got).all()
    _assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
def test_split_sizes_agree(dtype, device):
    H, R, Dr, S, L = 6, 48, 16, 4, 97
    slots, lengths = [0, 1, 2, 3, 1], [97, 1, 50, 64, 33]
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, dtype, slots, lengths, seed=7, device=device)
    scale = 0.3
    outs = {sp: mla_decode(q, qp, cache, sl, ln, scale, kv_lora_rank=R, split_size=sp,
                           out=poisoned((5, H, R), device=device))
            for sp in (16, 32, 40, SplitSchedule(16, 32, 2), None)}
    base = outs.pop(None)  # default: one split at this capacity
    atol, rtol = TOLERANCE[dtype]
    for sp, o in outs.items():
        torch.testing.assert_close(o, base, atol=atol, rtol=rtol, msg=f"split {sp}")
    if dtype == torch.float32:
        for o in outs.values():
            torch.testing.assert_close(o, base, atol=2e-6, rtol=2e-6)


def test_sharp_softmax_and_large_scale(device):
    # peaked scores exercise the max-rescaling across tiles and splits
    H, R, Dr, S, L = 4, 16, 8, 2, 80
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, torch.float32, [0, 1], [80, 45], seed=3, device=device)
    for scale in (5.0, 1e-3):
        got = mla_decode(q * 3, qp, cache, sl, ln, scale, kv_lora_rank=R, split_size=16,
                         out=poisoned((2, H, R), device=device))
        ref = mla_decode_ref(q * 3, qp, cache, sl, ln, scale, kv_lora_rank=R)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_strided_inputs_and_out(device):
    H, R, Dr, S, L, B = 4, 16, 8, 3, 40, 3
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, torch.bfloat16, [2, 0, 1], [40, 17, 1], seed=4, device=device)
    qbig = torch.randn(B, H + 3, R + 5, device=device)
    qbig[:, 1:H + 1, 2:R + 2] = q
    qpbig = torch.randn(B, H, 2 * Dr, device=device)
    qpbig[..., :Dr] = qp
    big = poisoned((B, H + 2, R), device=device)
    out = big[:, 1:H + 1]
    # q rows padded on the last dim are not last-dim contiguous -> copied by the launcher
    mla_decode(qbig[:, 1:H + 1, 2:R + 2], qpbig[..., :Dr], cache, sl, ln, 0.2, kv_lora_rank=R,
               split_size=16, out=out)
    ref = mla_decode_ref(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R)
    _assert_close(out, ref, torch.bfloat16)
    assert torch.isnan(big[:, 0]).all() and torch.isnan(big[:, H + 1]).all()


def test_empty_row_gives_zeros_and_capacity_clamp(device):
    H, R, Dr, S, L = 4, 16, 8, 2, 40
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, torch.float32, [0, 1, 1], [0, 40, 40], seed=5, device=device)
    for split in (16, 64):
        got = mla_decode(q, qp, cache, sl, ln, 0.25, kv_lora_rank=R, split_size=split,
                         out=poisoned((3, H, R), device=device))
        assert torch.equal(got[0], torch.zeros_like(got[0]))
        ref = mla_decode_ref(q, qp, cache, sl, ln, 0.25, kv_lora_rank=R)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_prefill_rows_equal_single_decodes(device):
    # T rows of one slot with lengths start+1..start+T: each equals that step decoded alone.
    H, R, Dr, S, L, T, start = 6, 48, 16, 3, 60, 9, 27
    q, qp, cache, _, _ = _make(H, R, Dr, S, L, torch.bfloat16, [1] * T, [start + T] * T, seed=6, device=device)
    sl = torch.full((T,), 1, dtype=torch.int32, device=device)
    ln = torch.arange(start + 1, start + T + 1, dtype=torch.int32, device=device)
    full = mla_decode(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R, split_size=16)
    for t in (0, 4, T - 1):
        alone = mla_decode(q[t:t + 1], qp[t:t + 1], cache, sl[t:t + 1], ln[t:t + 1], 0.2,
                           kv_lora_rank=R, split_size=16)
        assert torch.equal(full[t], alone[0])


# The GPU's candidate tiles: 32 heads (mma.sync, q in registers) and 64 heads over 8 warps (wgmma on
# Hopper, q taken from shared memory when it comes in the cache dtype). The interpreter runs both.
_TILES = [MLAConfig(block_h=32, block_n=64, merge_heads=8, num_warps=4, num_stages=2),
          MLAConfig(block_h=64, block_n=32, merge_heads=8, num_warps=8, num_stages=3)]


@pytest.mark.parametrize("tile", _TILES, ids=lambda c: f"h{c.block_h}_w{c.num_warps}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=_name)
def test_query_in_cache_dtype_gives_the_same_bits(dtype, tile, device):
    """q_latent / q_pe handed over already rounded to the cache dtype (DeepSeek's model stores q_latent so)
    give the bits of fp32 queries the kernel rounds itself, for every row length and split. Negative
    control: the same queries one ulp off (another rounding) change the output."""
    H, R, Dr, S, L = 70, 64, 16, 3, 90
    slots, lengths = [0, 1, 2, 1, 0], [90, 1, 33, 64, 17]
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, dtype, slots, lengths, seed=21, device=device)

    def run(ql, qpe):
        with MLA_CONFIGS.forced(lambda *k: tile):
            return mla_decode(ql, qpe, cache, sl, ln, 0.2, kv_lora_rank=R, split_size=SplitSchedule(16, 64, 4),
                              out=poisoned((len(slots), H, R), device=device))

    wide = run(q, qp)
    assert torch.isfinite(wide).all()
    _assert_close(wide, mla_decode_ref(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R), dtype)
    assert torch.equal(run(q.to(dtype), qp.to(dtype)), wide)
    assert torch.equal(run(q.to(dtype), qp), wide)
    off = (q.to(dtype).view(torch.int16) ^ 1).view(dtype)   # every element one ulp away
    assert not torch.equal(run(off, qp.to(dtype)), wide)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_merge_stages_change_no_bit(dtype, device):
    """``MLAConfig.merge_stages`` (how many splits' partials the merge loads ahead) changes no bit, for rows
    of one to 19 splits. Control: another split schedule changes the rows of several splits."""
    import dataclasses

    H, R, Dr, S, L = 6, 48, 16, 3, 300
    slots, lengths = [0, 1, 2, 1], [300, 1, 33, 150]
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, dtype, slots, lengths, seed=23, device=device)
    rule = MLA._interp_config if INTERPRET else MLA._gpu_config
    got = {}
    for stages in (1, 4):
        with MLA_CONFIGS.forced(lambda *k: dataclasses.replace(rule(*k), merge_stages=stages)):
            got[stages] = mla_decode(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R, split_size=16,
                                     out=poisoned((4, H, R), device=device))
    assert torch.isfinite(got[4]).all() and torch.equal(got[4], got[1])
    other = mla_decode(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R, split_size=32)
    assert not torch.equal(other[[0, 3]], got[4][[0, 3]])


@pytest.mark.parametrize("heads", [None, 16])
def test_few_row_tiles_change_no_bit(device, monkeypatch, heads):
    """``MLAConfig.few_rows`` / ``few_stages`` / ``few_heads``: a launch of at most ``few_rows`` rows runs the split
    kernel with ``few_stages`` pipeline stages (and ``few_heads`` heads a program), a larger one with the entry's
    own -- and a row's bits are the same either way (each row alone, the few-rows launch, against the same rows
    inside a larger launch), for rows of one and of several splits. Control: another split schedule changes the
    rows of several splits."""
    import dataclasses

    H, R, Dr, S, L = 40, 64, 16, 3, 200
    slots, lengths = [0, 1, 2, 1, 0], [200, 1, 70, 129, 33]
    q, qp, cache, sl, ln = _make(H, R, Dr, S, L, torch.bfloat16, slots, lengths, seed=29, device=device)
    rule = MLA._interp_config if INTERPRET else MLA._gpu_config
    few = lambda *k: dataclasses.replace(rule(*k), block_h=32, num_stages=2, few_rows=2, few_stages=3,  # noqa: E731
                                         few_heads=heads)
    spy = Launches(MLA._mla_split_kernel)
    monkeypatch.setattr(MLA, "_mla_split_kernel", spy)

    def run(idx, split=SplitSchedule(16, 64, 4)):
        with MLA_CONFIGS.forced(few):
            return mla_decode(q[idx], qp[idx], cache, sl[idx], ln[idx], 0.2, kv_lora_rank=R,
                              split_size=split, out=poisoned((len(idx), H, R), device=device))

    full = run(list(range(5)))
    assert spy.kwargs[-1]["num_stages"] == 2 and torch.isfinite(full).all()
    for i in range(5):
        alone = run([i])
        assert spy.kwargs[-1]["num_stages"] == 3
        assert torch.equal(alone[0], full[i]), i
    pair = run([0, 3])
    assert spy.kwargs[-1]["num_stages"] == 3 and torch.equal(pair, full[[0, 3]])
    assert MLAConfig(32, 64, 8, 4, num_stages=2, few_rows=0, few_stages=3, few_heads=16).split_tile(1) == (32, 2)
    assert MLAConfig(32, 64, 8, 4, num_stages=2, few_rows=1, few_heads=16).split_tile(1) == (16, 2)
    other = run(list(range(5)), 32)
    assert not torch.equal(other[[0, 3]], full[[0, 3]])


def test_default_split_schedule():
    assert default_split_schedule(512, 64, torch.bfloat16) == SplitSchedule(128, 1024, 16)
    assert default_split_schedule(512, 64, torch.float16) == SplitSchedule(128, 1024, 16)
    assert default_split_schedule(512, 64, torch.float32) == SplitSchedule(64, 512, 16)
    for R, Dr in ((16, 8), (48, 16), (512, 64), (4096, 64)):
        for dt in DTYPES:
            sp = default_split_schedule(R, Dr, dt).max_split
            assert 64 <= sp <= 1024 and sp & (sp - 1) == 0


def test_shape_errors(device):
    q = torch.randn(2, 4, 16, device=device)
    qp = torch.randn(2, 4, 8, device=device)
    cache = torch.randn(2, 8, 24, device=device)
    sl = torch.zeros(2, dtype=torch.int32, device=device)
    with pytest.raises(ValueError):
        mla_decode(q, qp, cache, sl, sl, 1.0, kv_lora_rank=12)
    with pytest.raises(ValueError):
        mla_decode(q, qp[..., :4], cache, sl, sl, 1.0, kv_lora_rank=16)
    with pytest.raises(TypeError):
        mla_decode(q, qp, cache, sl.float(), sl, 1.0, kv_lora_rank=16)


# ---------------------------------------------------------------------------- batch invariance

_POOL = {}


def _pool(dtype, device):
    """33 prepared rows over 5 slots (shared slots allowed), lengths 1..capacity."""
    key = (dtype, str(device))
    if key not in _POOL:
        H, R, Dr, S, L = 4, 16, 8, 5, 50
        g = torch.Generator().manual_seed(11)
        slots = torch.randint(0, S, (33,), generator=g).tolist()
        lengths = torch.randint(1, L + 1, (33,), generator=g).tolist()
        lengths[:3] = [1, L, 16]
        _POOL[key] = (_make(H, R, Dr, S, L, dtype, slots, lengths, seed=12, device=device), R)
    return _POOL[key]


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_rows_batch_invariant(data):
    device = ds4t.backend.default_device()
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    B = data.draw(st.integers(1, 33), label="B")
    rows = data.draw(st.permutations(range(33)), label="order")[:B]
    i = data.draw(st.integers(0, B - 1), label="i")
    split = data.draw(st.sampled_from([16, SplitSchedule(16, 64, 2)]), label="split")
    (q, qp, cache, sl, ln), R = _pool(dtype, device)

    def run(sel):
        idx = torch.tensor(sel, dtype=torch.long, device=device)
        out = poisoned((len(sel), q.shape[1], R), device=device)
        return mla_decode(q[idx], qp[idx], cache, sl[idx], ln[idx], 0.25, kv_lora_rank=R,
                          split_size=split, out=out)

    assert_rows_invariant(run, rows, i)


# ------------------------------------------------------------------------ absorbed == unabsorbed

def _kv_b(H, nope, v, R, g):
    return torch.randn(H * (nope + v), R, generator=g, dtype=torch.float64).float() / math.sqrt(R)


def test_absorbed_equals_unabsorbed_plain(device):
    """Standard MLA (k_nope = W_UK c, v = W_UV c, per-head attention) == absorbed mla_decode."""
    H, R, Dr, nope, vdim, S, L = 4, 16, 8, 16, 12, 3, 40
    g = torch.Generator().manual_seed(21)
    slots, lengths = [2, 0, 2], [40, 23, 1]
    _, _, cache, sl, ln = _make(H, R, Dr, S, L, torch.float32, slots, lengths, seed=22, device=device)
    B = len(slots)
    q_nope = torch.randn(B, H, nope, generator=g).to(device)
    q_pe = torch.randn(B, H, Dr, generator=g).to(device)
    W = _kv_b(H, nope, vdim, R, g).to(device).view(H, nope + vdim, R)
    W_UK, W_UV = W[:, :nope], W[:, nope:]
    scale = (nope + Dr) ** -0.5

    # unabsorbed, HF-style: expand keys and values per head, standard attention
    outs = []
    for b in range(B):
        n = lengths[b]
        c = cache[slots[b], :n, :R]
        kpe = cache[slots[b], :n, R:]
        k_nope = torch.einsum("hnr,tr->htn", W_UK, c)
        v = torch.einsum("hvr,tr->htv", W_UV, c)
        k = torch.cat([k_nope, kpe[None].expand(H, -1, -1)], dim=-1)
        qb = torch.cat([q_nope[b], q_pe[b]], dim=-1)
        p = torch.softmax(torch.einsum("hd,htd->ht", qb, k) * scale, dim=-1)
        outs.append(torch.einsum("ht,htv->hv", p, v))
    want = torch.stack(outs)

    q_latent = torch.einsum("bhn,hnr->bhr", q_nope, W_UK)
    lat = mla_decode(q_latent, q_pe, cache, sl, ln, scale, kv_lora_rank=R, split_size=16,
                     out=poisoned((B, H, R), device=device))
    got = torch.einsum("bhr,hvr->bhv", lat, W_UV)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_absorbed_matches_hf_deepseek_v3_attention(device):
    """Prefill (5 tokens) + 4 decodes through write_latent/mla_decode == HF DeepseekV3Attention."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=256, rope_interleave=True, q_lora_rank=32, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, initializer_range=0.1,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(31)
    attn = hf.DeepseekV3Attention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        attn.q_a_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(cfg.q_lora_rank))
        attn.kv_a_layernorm.weight.copy_(1.0 + 0.3 * torch.randn(cfg.kv_lora_rank))
    rope = hf.DeepseekV3RotaryEmbedding(cfg)
    T, P = 9, 5
    H, R, Dr = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, vdim = cfg.qk_nope_head_dim, cfg.v_head_dim
    x = torch.randn(1, T, cfg.hidden_size)
    pos_ids = torch.arange(T)[None]
    cos, sin = rope(x, pos_ids)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want, _ = attn(x, (cos, sin), mask)
        want = want[0]

        # absorbed path, built from the module's weights
        qs = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x))).view(1, T, H, nope + Dr).transpose(1, 2)
        q_nope, q_rot = qs.split([nope, Dr], dim=-1)
        kv_nope, k_rot = attn.kv_a_proj_with_mqa(x).split([R, Dr], dim=-1)
        kv_nope = attn.kv_a_layernorm(kv_nope)
        q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot.view(1, 1, T, Dr), cos, sin)
        W = attn.kv_b_proj.weight.view(H, nope + vdim, R)
        q_latent = torch.einsum("htn,hnr->thr", q_nope[0], W[:, :nope]).contiguous()
        q_pe = q_rot[0].transpose(0, 1).contiguous()  # [T, H, Dr]

        S, L, slot = 3, 24, 2
        cache = poisoned((S, L, R + Dr)).to(device)
        dev = lambda t: t.to(device)  # noqa: E731
        i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        lat = []
        # prefill: P rows of one slot
        write_latent(dev(kv_nope[0, :P]), dev(k_rot[0, 0, :P]), cache, i32([slot] * P), i32(list(range(P))))
        lat.append(mla_decode(dev(q_latent[:P]), dev(q_pe[:P]), cache, i32([slot] * P),
                              i32(list(range(1, P + 1))), attn.scaling, kv_lora_rank=R, split_size=4))
        # decode steps
        for t in range(P, T):
            write_latent(dev(kv_nope[0, t:t + 1]), dev(k_rot[0, 0, t:t + 1]), cache, i32([slot]), i32([t]))
            lat.append(mla_decode(dev(q_latent[t:t + 1]), dev(q_pe[t:t + 1]), cache, i32([slot]),
                                  i32([t + 1]), attn.scaling, kv_lora_rank=R, split_size=4))
        lat = torch.cat(lat).cpu()
        o = torch.einsum("thr,hvr->thv", lat, W[:, nope:]).reshape(T, H * vdim)
        got = attn.o_proj(o)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------- self-check

def test_self_check(device):
    results = _check(device)
    assert results and all(r.ok for r in results), results


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=_name)
def test_fused_runs_keep_every_rows_bits(dtype, device, monkeypatch):
    """``same_slot_runs`` (a :class:`SameSlotRuns` table) with ``MLAConfig.fuse_rows`` = 8: a row of several
    splits in a run of >= 8 rows is folded and merged by its split-0 programs, with the merge kernel's step --
    its partials are never written and the merge leaves it alone -- while rows of one split, the rows of a
    short run (a verify chunk), decode rows and a row of length 0 keep a program a split. Runs: a chunk of 20
    rows, one of exactly 8, one from length 1 (its first rows one split, its last ones two), a verify run of
    3; the launch cut into grid chunks of 7 rows (runs cross them: the table holds batch rows). Every row
    keeps the unfused launch's bits (which a row decoded alone has: test_prefill_rows_equal_single_decodes).
    Controls: without the table (an int hint) every row of several splits writes its partials; another
    split schedule changes the bits."""
    import dataclasses

    from ds4t.kernels.splits import SameSlotRuns

    H, R, Dr, L = 6, 48, 16, 200
    # (slot, rows, first length): chunk, verify, decode, empty decode, chunk from the start, chunk of 8
    runs = [(0, 20, 40), (1, 3, 100), (2, 1, 150), (3, 1, 0), (4, 20, 1), (5, 8, 60)]
    slots = [sl for sl, n, _ in runs for _ in range(n)]
    lengths = [l0 + t for _, n, l0 in runs for t in range(n)]
    q, qp, cache, sl, ln = _make(H, R, Dr, len(runs), L, dtype, slots, lengths, seed=24, device=device)
    firsts = [sum(n for _, n, _ in runs[:i]) for i in range(len(runs))]
    table = torch.tensor([[f, n, s_, -1] for f, (s_, n, _) in zip(firsts, runs) if n > 1], dtype=torch.int64,
                         device=device)
    hint = SameSlotRuns(table, 3, 20)
    sched = SplitSchedule(16, 64, 4)
    B = len(slots)
    run_rows = [n for _, n, _ in runs for _ in range(n)]
    several = [length > sched.split_of(length) for length in lengths]
    fused_rows = [m and n >= 8 for m, n in zip(several, run_rows)]
    assert sum(fused_rows) == 20 + 8 + 4 and sum(several) > sum(fused_rows)
    rule = MLA._interp_config if INTERPRET else MLA._gpu_config
    monkeypatch.setattr(MLA, "_MAX_GRID_Y", 7)

    def run(fuse_rows, runs_hint, split=sched):
        cfg = lambda *k: dataclasses.replace(rule(*k), fuse_rows=fuse_rows)   # noqa: E731
        with MLA_CONFIGS.forced(cfg):
            return mla_decode(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R, split_size=split, same_slot_runs=runs_hint,
                              out=poisoned((B, H, R), device=device))

    plain = run(None, None)
    kept = poison_empty(monkeypatch, lambda shape: len(shape) == 4 and shape[0] == B and shape[2:] == (H, R))
    fused = run(8, hint)
    unfused = run(8, 3)
    monkeypatch.undo()
    assert torch.isfinite(plain).all() and torch.equal(fused, plain) and torch.equal(unfused, plain)
    written = [t[:, 0].isfinite().all(-1).all(-1).tolist() for t in kept]   # split 0's partials, per row
    assert written[0] == [m and not f for m, f in zip(several, fused_rows)]
    assert written[1] == several   # control: an int hint fuses nothing
    _assert_close(fused, mla_decode_ref(q, qp, cache, sl, ln, 0.2, kv_lora_rank=R), dtype)
    assert not torch.equal(run(8, hint, split=32), fused)


def test_same_slot_runs_refuses_a_bad_table(device):
    """The runs hint's table is what the kernels read as (first row, rows) pairs: int64, unit column stride,
    on the rows' device; its lengths are those of runs (>= 2 rows)."""
    from ds4t.kernels.splits import SameSlotRuns

    good = torch.tensor([[0, 4, 0, -1]], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="int64"):
        SameSlotRuns(good.int(), 4, 4)
    with pytest.raises(ValueError, match="unit column stride"):
        SameSlotRuns(good[:, ::2], 4, 4)
    with pytest.raises(ValueError, match="shortest"):
        SameSlotRuns(good, 1, 4)
    hint = SameSlotRuns(good, 4, 4)
    assert hint.check_device(good.device, "op") is hint
    with pytest.raises(ValueError, match="op: same_slot_runs' table is on"):
        hint.check_device(torch.device("meta"), "op")
