"""write_kv and split-KV decode attention: reference, splits, NaN leaks, batch invariance."""
import dataclasses
import math

import pytest
import torch
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.backend import (
    INTERPRET,
    default_device,  # noqa: F401
)
from ds4t.kernels import activation, norm, rope
from ds4t.kernels import registry
from ds4t.kernels import attention as A
from ds4t.kernels.attention import (
    decode_attention,
    decode_attention_ref,
    default_split_schedule,
    norm_rope_write_kv,
    write_kv,
    write_kv_ref,
)
from ds4t.kernels.splits import SplitSchedule
from tests.kernels.devices import gen
from tests.kernels.invariance import Launches, assert_rows_invariant, launcher_path, poison_empty, poisoned

pytestmark = pytest.mark.usefixtures("on_kernel_device")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# (atol, rtol) of the kernel against the fp32 reference on the same (already rounded) cache:
# the math is fp32 in every case (16-bit caches via hi/lo-split dots), so only rounding order
# differs; outputs are O(1).
TOL = {
    torch.float32: (2e-6, 1e-5),
    torch.bfloat16: (2e-5, 1e-4),
    torch.float16: (1e-5, 1e-4),
}


def _gen(seed):
    return gen(seed)


def _cache(S, L, HKV, D, DV, dtype, device, g):
    kc = torch.randn(S, L, HKV, D, generator=g).to(dtype).to(device)
    vc = torch.randn(S, L, HKV, DV, generator=g).to(dtype).to(device)
    return kc, vc


def _run(q, kc, vc, slots, lengths, scale, **kw):
    B, HQ, _ = q.shape
    out = poisoned((B, HQ, vc.shape[3]), device=q.device)
    res = decode_attention(q, kc, vc, slots, lengths, scale, out=out, **kw)
    assert res is out
    return res


def _assert_close(got, ref, dtype):
    atol, rtol = TOL[dtype]
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol)


# (Hq, Hkv, D, Dv): GQA with non-power-of-two dims, MQA, MHA with D != Dv
SHAPES = [(6, 2, 48, 48), (4, 1, 80, 80), (3, 3, 16, 40)]


@pytest.fixture(params=["rows", "split-merge"])
def path(request):
    """Run a case with the interpreter's one-program-per-rows kernel (``rows``) and with the split
    and merge kernels the GPU runs (``split-merge``, in the interpreter too)."""
    if request.param == "rows" and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    with launcher_path(A, request.param == "rows"):
        yield request.param


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "Hq%d-Hkv%d-D%d-Dv%d" % s)
def test_matches_reference(path, device, dtype, shape):
    HQ, HKV, D, DV = shape
    g = _gen(1)
    S, L = 4, 70                        # capacity not a multiple of the split size
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    # lengths 1, capacity, split boundaries (32, 33), and odd ones
    slots = torch.tensor([2, 0, 3, 1, 2, 0], dtype=torch.int32, device=device)
    lengths = torch.tensor([1, 70, 33, 32, 5, 51], dtype=torch.int32, device=device)
    q = (torch.randn(6, HQ, D, generator=g) * 2).to(device)   # peaky softmax too
    scale = 1 / math.sqrt(D)
    got = _run(q, kc, vc, slots, lengths, scale, split_size=32)
    ref = decode_attention_ref(q, kc, vc, slots, lengths, scale)
    _assert_close(got, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_split_sizes_agree(path, device, dtype):
    HQ, HKV, D, DV = 6, 2, 48, 48
    g = _gen(2)
    S, L = 3, 100
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    slots = torch.tensor([1, 0, 2, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([100, 17, 64, 1], dtype=torch.int32, device=device)
    q = torch.randn(4, HQ, D, generator=g).to(device)
    scale = 0.2
    ref = decode_attention_ref(q, kc, vc, slots, lengths, scale)
    outs = {sp: _run(q, kc, vc, slots, lengths, scale, split_size=sp) for sp in (16, 64, 128, None, SplitSchedule(16, 64, 2))}
    for sp, o in outs.items():
        _assert_close(o, ref, dtype)
        _assert_close(o, outs[16], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_garbage_beyond_length_never_leaks(path, device, dtype):
    """NaN / Inf in cache positions >= lengths[b] (and in unused slots) change no output bit."""
    HQ, HKV, D, DV = 4, 2, 48, 80
    g = _gen(3)
    S, L = 4, 50
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([1, 50, 21], dtype=torch.int32, device=device)
    q = torch.randn(3, HQ, D, generator=g).to(device)
    clean = _run(q, kc, vc, slots, lengths, 0.15, split_size=16)
    kp, vp = kc.clone(), vc.clone()
    kp[2] = float("nan")
    vp[2] = float("inf")
    for s, n in zip(slots.tolist(), lengths.tolist()):
        kp[s, n:] = float("nan")
        vp[s, n:] = float("nan")
    dirty = _run(q, kp, vp, slots, lengths, 0.15, split_size=16)
    assert torch.equal(clean, dirty)
    _assert_close(dirty, decode_attention_ref(q, kc, vc, slots, lengths, 0.15), dtype)


def test_prefill_rows_are_causal_attention(path, device):
    """T rows of one slot with lengths start+1..start+T == causal attention over the slot."""
    HQ, HKV, D = 4, 2, 32
    g = _gen(4)
    S, L, start, T = 2, 40, 7, 25
    kc, vc = _cache(S, L, HKV, D, D, torch.float32, device, g)
    q = torch.randn(T, HQ, D, generator=g).to(device)
    slots = torch.full((T,), 1, dtype=torch.int32, device=device)
    lengths = torch.arange(start + 1, start + T + 1, dtype=torch.int32, device=device)
    got = _run(q, kc, vc, slots, lengths, D ** -0.5, split_size=16)
    k = kc[1, : start + T].permute(1, 0, 2).repeat_interleave(HQ // HKV, 0)   # [HQ, n, D]
    v = vc[1, : start + T].permute(1, 0, 2).repeat_interleave(HQ // HKV, 0)
    mask = torch.arange(start + T)[None, :] <= (start + torch.arange(T))[:, None]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 0, 2), k, v, attn_mask=mask.to(device), scale=D ** -0.5).permute(1, 0, 2)
    _assert_close(got, ref, torch.float32)


def test_length_zero_row_is_zero_and_tiny_head_dim(path, device):
    g = _gen(5)
    kc, vc = _cache(2, 20, 1, 8, 8, torch.float32, device, g)     # D = 8 < 16: padded dot operands
    q = torch.randn(2, 2, 8, generator=g).to(device)
    out = _run(q, kc, vc, torch.tensor([0, 1], dtype=torch.int32, device=device),
               torch.tensor([0, 20], dtype=torch.int32, device=device), 0.25, split_size=16)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    _assert_close(out[1:], decode_attention_ref(q[1:], kc, vc, torch.tensor([1]), torch.tensor([20]), 0.25),
                  torch.float32)


def test_bad_arguments(device):
    kc = torch.randn(2, 16, 2, 16)
    vc = torch.randn(2, 16, 2, 16)
    ok = dict(slots=torch.zeros(1, dtype=torch.int32), lengths=torch.ones(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        decode_attention(torch.randn(1, 3, 16), kc, vc, scale=1.0, **ok)
    with pytest.raises(ValueError, match="split_size"):
        decode_attention(torch.randn(1, 4, 16), kc, vc, scale=1.0, split_size=48, **ok)
    with pytest.raises(TypeError):
        decode_attention(torch.randn(1, 4, 16), kc, vc.bfloat16(), scale=1.0, **ok)


def test_default_split_schedule_depends_on_head_dims_only(device):
    for d in (128, 256):
        for dt in (torch.bfloat16, torch.float32):
            # the H200 entry for Qwen3-Next's heads (bench/results/2026-12-04-h200-gdn-attention-merge.md);
            # the interpreter has the rule alone
            long_rows = not INTERPRET and d == 256 and dt == torch.bfloat16
            assert default_split_schedule(d, d, dt) == SplitSchedule(64, 1024 if long_rows else 2048, 16)
    # the table is what decode_attention reads: forcing it is the same as passing the schedule
    g = _gen(34)
    kc, vc = _cache(2, 200, 2, 32, 32, torch.bfloat16, device, g)
    q = torch.randn(2, 4, 32, generator=g).to(device)
    slots = torch.tensor([0, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([200, 90], dtype=torch.int32, device=device)
    sched = SplitSchedule(16, 32, 2)
    with A.SPLIT_SCHEDULES.forced(lambda *key: sched):
        forced = _run(q, kc, vc, slots, lengths, 0.2)
    assert torch.equal(forced, _run(q, kc, vc, slots, lengths, 0.2, split_size=sched))
    assert not torch.equal(forced, _run(q, kc, vc, slots, lengths, 0.2))
    with pytest.raises(ValueError, match="split_size"):   # GQA splits are powers of two >= 16
        decode_attention(torch.randn(1, 4, 16), torch.randn(2, 16, 2, 16), torch.randn(2, 16, 2, 16),
                         torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0,
                         split_size=SplitSchedule(8, 32, 2))


# ----------------------------------------------------------------------------- write_kv


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_write_kv_round_trip(device, dtype):
    g = _gen(6)
    S, L, HKV, D, DV = 3, 9, 3, 20, 12
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    kc0, vc0 = kc.clone(), vc.clone()
    B = 5
    k = torch.randn(B, HKV, D, generator=g)
    # exact bf16 / fp16 rounding ties in k
    bits = k.view(torch.int32)
    k[0] = ((bits[0] & ~0xFFFF) | 0x8000).view(torch.float32)
    k[1] = ((bits[1] & ~0x1FFF) | 0x1000).view(torch.float32)
    v = torch.randn(B, HKV, DV, generator=g)
    slots = torch.tensor([0, 2, 2, 1, 0], dtype=torch.int32)
    pos = torch.tensor([0, 8, 3, 4, 8], dtype=torch.int64)
    write_kv(k.to(device), v.to(device), kc, vc, slots.to(device), pos.to(device))
    kr, vr = kc0.clone(), vc0.clone()
    write_kv_ref(k, v, kr, vr, slots, pos)
    assert torch.equal(kc.cpu(), kr.cpu()) and torch.equal(vc.cpu(), vr.cpu())
    assert torch.equal(kc[2, 8], k[1].to(dtype)) and torch.equal(vc[0, 0], v[0].to(dtype))


def test_write_kv_strided_input_and_out_of_range_rows(device):
    g = _gen(7)
    kc, vc = _cache(2, 4, 2, 8, 8, torch.bfloat16, device, g)
    before_k, before_v = kc.clone(), vc.clone()
    kv = torch.randn(3, 2, 16, generator=g).to(device)        # k, v as views of one projection
    k, v = kv[..., :8], kv[..., 8:]
    slots = torch.tensor([1, 5, 0], dtype=torch.int32)       # slot 5 does not exist: dropped
    pos = torch.tensor([3, 0, 4], dtype=torch.int32)         # position 4 == L: dropped
    write_kv(k, v, kc, vc, slots, pos)
    before_k[1, 3] = k[0].bfloat16()
    before_v[1, 3] = v[0].bfloat16()
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


def test_write_then_attend(path, device):
    """Decode loop: write the token's k/v, then attend over lengths = pos + 1."""
    g = _gen(8)
    HQ, HKV, D = 4, 2, 16
    kc = poisoned((2, 12, HKV, D), torch.bfloat16, device)
    vc = poisoned((2, 12, HKV, D), torch.bfloat16, device)
    ks = torch.randn(12, HKV, D, generator=g)
    vs = torch.randn(12, HKV, D, generator=g)
    slot = torch.tensor([1], dtype=torch.int32)
    for t in range(12):
        write_kv(ks[t:t + 1], vs[t:t + 1], kc, vc, slot, torch.tensor([t], dtype=torch.int32))
    q = torch.randn(1, HQ, D, generator=g)
    got = _run(q, kc, vc, slot, torch.tensor([12], dtype=torch.int32), 0.3, split_size=16)
    k = ks.bfloat16().float().repeat_interleave(2, 1)
    v = vs.bfloat16().float().repeat_interleave(2, 1)
    p = torch.softmax(torch.einsum("hd,nhd->hn", q[0], k) * 0.3, -1)
    _assert_close(got[0], torch.einsum("hn,nhd->hd", p, v), torch.bfloat16)


# ----------------------------------------------------------------------------- batch invariance

_POOL = 33
_S, _L = 5, 48
_SCHEDULE = SplitSchedule(16, 64, 2)


@pytest.fixture(scope="module")
def pool():
    """33 rows of q over one bf16 MQA cache (L = 48: two splits of 32, the second partial; under the
    schedule 16..64 (<= 2 per row) rows of 17..32 positions get two splits of 16, longer rows two of 32)."""
    g = _gen(9)
    HQ, HKV, D = 4, 1, 32
    with torch.device(default_device()):
        kc, vc = _cache(_S, _L, HKV, D, D, torch.bfloat16, default_device(), g)
        q = torch.randn(_POOL, HQ, D, generator=g)
    return kc, vc, q


@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_rows_batch_invariant(pool, data):
    """Row i among B rows (random slots, lengths 1..L, random order) == row i alone, bitwise."""
    kc, vc, q = pool
    with launcher_path(A, data.draw(st.booleans(), label="rows path")):
        _check_rows_batch_invariant(kc, vc, q, data)


def _check_rows_batch_invariant(kc, vc, q, data):
    slots = torch.tensor(data.draw(st.lists(st.integers(0, _S - 1), min_size=_POOL, max_size=_POOL), label="slots"),
                         dtype=torch.int32)
    lengths = torch.tensor(data.draw(st.lists(st.integers(1, _L), min_size=_POOL, max_size=_POOL), label="lengths"),
                           dtype=torch.int32)
    B = data.draw(st.integers(1, _POOL), label="B")
    rows = data.draw(st.permutations(range(_POOL)), label="order")[:B]
    i = data.draw(st.integers(0, B - 1), label="i")
    split = data.draw(st.sampled_from([32, _SCHEDULE]), label="split")

    def run(r):
        idx = torch.tensor(r, dtype=torch.long)
        return _run(q[idx], kc, vc, slots[idx], lengths[idx], 0.18, split_size=split)

    assert_rows_invariant(run, rows, i)


@pytest.mark.parametrize("split", [32, _SCHEDULE], ids=["fixed", "schedule"])
def test_full_batch_of_33_rows_invariant(path, pool, split):
    """The largest batch (hypothesis favours small ones): 33 rows, reversed, some sharing slots
    as prefill rows do; several rows checked alone."""
    kc, vc, q = pool
    g = _gen(10)
    slots = torch.randint(0, _S, (_POOL,), generator=g, dtype=torch.int32)
    lengths = torch.randint(1, _L + 1, (_POOL,), generator=g, dtype=torch.int32)
    slots[:8] = 4
    lengths[:8] = torch.arange(41, 49, dtype=torch.int32)          # a prefill chunk up to L
    lengths[8] = 1
    rows = list(reversed(range(_POOL)))

    def run(r):
        idx = torch.tensor(r, dtype=torch.long)
        return _run(q[idx], kc, vc, slots[idx], lengths[idx], 0.18, split_size=split)

    full = run(rows)
    for i in (0, 16, 24, 32):
        assert torch.equal(run([rows[i]])[0], full[i])
    ref = decode_attention_ref(q[rows], kc, vc, slots[rows], lengths[rows], 0.18)
    _assert_close(full, ref, torch.bfloat16)


def test_a_batch_dependent_split_is_caught(path, pool):
    """Negative control for the row-invariance tests: a split size chosen from the batch (here: from
    its size) changes a multi-split row's bits, and assert_rows_invariant says so."""
    kc, vc, q = pool
    slots = torch.tensor([1, 3, 0], dtype=torch.int32)
    lengths = torch.tensor([48, 40, 9], dtype=torch.int32)

    def run(r):
        idx = torch.tensor(r, dtype=torch.long)
        return _run(q[idx], kc, vc, slots[idx], lengths[idx], 0.18, split_size=16 if len(r) > 1 else 64)

    with pytest.raises(AssertionError):
        assert_rows_invariant(run, [0, 1, 2], 0)


# ----------------------------------------------------------------------------- same-slot runs


def _run_rows(runs, device):
    """(slots, lengths) int32 of prefill-like runs ``[(slot, rows, first length), ...]``: each run's rows at
    consecutive lengths of its slot."""
    slots = torch.tensor([sl for sl, n, _ in runs for _ in range(n)], dtype=torch.int32, device=device)
    lengths = torch.tensor([l0 + t for _, n, l0 in runs for t in range(n)], dtype=torch.int32, device=device)
    return slots, lengths


_SAME_SLOT_CASES = [(shape, dt) for shape in SHAPES for dt in (torch.float32, torch.bfloat16)]
if INTERPRET:   # each shape once, the dtypes alternating (3 of the 6 cases; 10-30 s each in the interpreter)
    _SAME_SLOT_CASES = [(shape, (torch.float32, torch.bfloat16)[i % 2]) for i, shape in enumerate(SHAPES)]


@pytest.mark.parametrize("shape,dtype", _SAME_SLOT_CASES,
                         ids=lambda v: str(v).replace("torch.", "") if isinstance(v, torch.dtype)
                         else "Hq%d-Hkv%d-D%d-Dv%d" % v)
def test_same_slot_runs_give_the_split_kernels_bits(device, dtype, shape, monkeypatch):
    """``same_slot_runs``: programs of 4 rows sharing K / V tiles give every row the split kernel's bits
    -- runs of one slot whose rows cross split-size thresholds (16 -> 32 at 64 positions, 32 -> 64 at
    128), decode rows of other slots inside the same programs, rows ending mid-tile, NaN past every
    slot's used length (never read). Control: the same runs under a fixed split size differ."""
    HQ, HKV, D, DV = shape
    g = _gen(31)
    S, L = 4, 160
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    runs = [(1, 21, 50), (0, 1, 150), (2, 9, 120), (3, 1, 7), (2, 1, 3), (3, 6, 61)]   # (slot, rows, first length)
    slots, lengths = _run_rows(runs, device)
    for sl in range(S):   # NaN past each slot's longest row
        used = int(lengths[slots == sl].max())
        kc[sl, used:] = float("nan")
        vc[sl, used:] = float("nan")
    q = torch.randn(slots.numel(), HQ, D, generator=g).to(device)
    sched = SplitSchedule(16, 64, 4)
    spy = Launches(A._attn_runs_kernel)
    monkeypatch.setattr(A, "_attn_runs_kernel", spy)
    with launcher_path(A, False):
        split = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched)
        assert spy.n == 0
        got = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched, same_slot_runs=True)
        assert spy.n == 1
        assert not torch.isnan(got).any() and torch.equal(got, split)
        # rows up to 160 positions, where TOL is set for <= 70: fp32's absolute bound doubled (the H200
        # measured 2.4e-6 on one element of 17600 at D = 80)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(got, decode_attention_ref(q, kc, vc, slots, lengths, 0.2),
                                   atol=2 * atol if dtype == torch.float32 else atol, rtol=rtol)
        fixed = _run(q, kc, vc, slots, lengths, 0.2, split_size=16, same_slot_runs=True)
    assert not torch.equal(fixed, got)


_PACKED_CASES = [("G3", (6, 2, 48, 48)), ("G12", (24, 2, 32, 32))]
_PACKED_CASES = [pytest.param(shape, rows, id=f"{g}-{rows}") for g, shape in _PACKED_CASES for rows in (2, 5)
                 if not INTERPRET or (g, rows) in (("G3", 5), ("G12", 2))]   # interpreter: each G and run size once


@pytest.mark.parametrize("shape,run_rows", _PACKED_CASES)
def test_packed_runs_of_any_length_give_the_split_kernels_bits(device, shape, run_rows, monkeypatch):
    """The runs kernel packs a run's (row, query head) pairs densely into run_tile(run_rows, G) tile rows
    (the GPU table: 5 rows of GLM-4.5's 12 heads in 64): runs of 2 or 5 rows at G = 3 or 12 (tiles of 16-64
    rows, padding after the last pair), slots changing inside a program, rows crossing a split-size
    threshold -- every row the split kernel's bits. Control: the same launch under another split schedule
    differs."""
    import dataclasses

    HQ, HKV, D, DV = shape
    g = _gen(33)
    kc, vc = _cache(3, 140, HKV, D, DV, torch.bfloat16, device, g)
    runs = [(0, 13, 58), (2, 1, 9), (1, 7, 120), (0, 2, 3)]   # (slot, rows, first length)
    slots, lengths = _run_rows(runs, device)
    q = torch.randn(slots.numel(), HQ, D, generator=g).to(device)
    sched = SplitSchedule(16, 64, 4)
    base = A.ATTENTION_CONFIGS(16, max(16, triton.next_power_of_2(D)), max(16, triton.next_power_of_2(DV)))
    cfg = dataclasses.replace(base, run_rows=run_rows, run_stages=2)
    assert A.run_tile(run_rows, HQ // HKV) == max(16, triton.next_power_of_2(run_rows * HQ // HKV))
    spy = Launches(A._attn_runs_kernel)
    monkeypatch.setattr(A, "_attn_runs_kernel", spy)
    with launcher_path(A, False), A.ATTENTION_CONFIGS.forced(lambda *k: cfg):
        split = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched)
        got = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched, same_slot_runs=True)
        assert spy.n == 1
        assert not torch.isnan(got).any() and torch.equal(got, split)
        assert not torch.equal(_run(q, kc, vc, slots, lengths, 0.2, split_size=32, same_slot_runs=True), got)


_TILE_PATHS = {"masked": (False, False), "interior": (True, False), "interior-peel": (True, True)}
"""run_interior / run_peel as the tables set them: GPU d 128, GPU d 256, the interpreter."""
_FUSED_CASES = [(dt, products, path) for dt in ("float32", "bfloat16") for products in ("split", "cache")
                for path in _TILE_PATHS]
if INTERPRET:
    # every pair of the three factors once (6 of the 12 cases; 20-50 s each in the interpreter); make test runs
    # three that hold each dtype, each products option and each tile path (make test-long the other three)
    _LONG = pytest.mark.long
    _FUSED_CASES = [("float32", "split", "masked"), pytest.param("bfloat16", "cache", "masked", marks=_LONG),
                    ("float32", "cache", "interior"), pytest.param("bfloat16", "split", "interior", marks=_LONG),
                    ("bfloat16", "cache", "interior-peel"),
                    pytest.param("float32", "split", "interior-peel", marks=_LONG)]


_SHORTEST = (True, 8) if not INTERPRET else (8,)
"""same_slot_runs hints: True (runs of unknown length: no run fuses, the runs kernel's split programs) and the
shortest run's 8 rows (the long runs fuse). In the interpreter the fused launches only: the unfused runs kernel's
bits are test_same_slot_runs_give_the_split_kernels_bits's (interior tiles, the interpreter's table) and
test_fused_runs_are_chosen_run_by_run_with_the_runs_table's control."""


@pytest.mark.parametrize("dtype_name,products,path", _FUSED_CASES)
def test_fused_runs_give_the_split_kernels_bits(device, dtype_name, products, path, monkeypatch):
    """``run_fuse_rows``: when the launch's shortest run (``same_slot_runs=n``) has at least that many rows, a
    full one-slot program's split-0 program folds every split and merges them with the merge kernel's step, no
    partials; programs of several slots, and a lone last row, keep the split programs and the merge. Every row
    keeps the split kernel's bits -- runs crossing split-size thresholds (16 -> 32 -> 64), up to 5 splits a
    row, rows of length 0 and rows of one split inside fused runs, decode rows of other slots beside them,
    gated too -- and the merge kernel leaves the fused rows alone (NaN outputs would show otherwise). A launch
    whose shortest run is below the threshold (``True``: 1) does not fuse (on a GPU; see ``_SHORTEST``).
    ``run_interior``: the tiles inside every row's range of a group folded without masks, the same bits;
    ``run_peel``: a fused program's split 0 run before its split loop, the same bits. Control: the same fused
    launch under another split schedule differs."""
    import dataclasses

    dtype = getattr(torch, dtype_name)
    interior, peel = _TILE_PATHS[path]
    HQ, HKV, D, DV = 6, 2, 48, 40
    g = _gen(37)
    S, L = 4, 320
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    runs = [(1, 12, 0), (0, 1, 150), (2, 9, 58), (3, 1, 7), (2, 8, 120), (3, 14, 300)]   # (slot, rows, first length)
    slots, lengths = _run_rows(runs, device)
    for sl in range(S):
        used = int(lengths[slots == sl].max())
        kc[sl, used:] = float("nan")
        vc[sl, used:] = float("nan")
    B = slots.numel()
    q = torch.randn(B, HQ, D, generator=g).to(device)
    gate = torch.randn(B, HQ * DV, generator=g).to(device)
    sched = SplitSchedule(16, 64, 4)
    base = A.ATTENTION_CONFIGS(16, 64, 64)
    spy = Launches(A._attn_runs_kernel)
    monkeypatch.setattr(A, "_attn_runs_kernel", spy)
    got = {}
    with launcher_path(A, False):
        split = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched, products=products)
        split_gated = decode_attention(q, kc, vc, slots, lengths, 0.2, split_size=sched, gate=gate, products=products)
        # the shortest run of more than one row has 8 rows; True: runs of unknown length
        cfg = dataclasses.replace(base, run_rows=4, run_fuse_rows=8, run_interior=interior, run_peel=peel)
        with A.ATTENTION_CONFIGS.forced(lambda *k: cfg):
            for shortest in _SHORTEST:
                kw = dict(split_size=sched, same_slot_runs=shortest, products=products)
                got[shortest] = (_run(q, kc, vc, slots, lengths, 0.2, **kw),
                                 decode_attention(q, kc, vc, slots, lengths, 0.2, gate=gate, **kw))
            other = _run(q, kc, vc, slots, lengths, 0.2, **{**kw, "split_size": 32})
    assert [(k["FUSE"], k["INTERIOR"], k["PEEL"]) for k in spy.kwargs] == \
        [(False, interior, False)] * 2 * (True in _SHORTEST) + [(True, interior, peel)] * 3
    for fuse in got:
        assert not torch.isnan(got[fuse][0]).any()
        assert torch.equal(got[fuse][0], split) and torch.equal(got[fuse][1], split_gated), fuse
    assert torch.equal(got[8][0][lengths == 0], torch.zeros_like(got[8][0][lengths == 0]))
    assert not torch.equal(other, got[8][0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_fused_runs_are_chosen_run_by_run_with_the_runs_table(device, dtype, monkeypatch):
    """``same_slot_runs`` as a :class:`SameSlotRuns` table: a launch holding a long run (a chunk of >=
    ``run_fuse_rows`` rows) and a short one (a verify chunk) fuses the long run's programs only -- their
    partials are never written, the merge leaves their rows alone -- while the short run keeps its split
    programs and the merge; every row keeps the split kernel's bits. Control: the shortest run as an int
    hint (below the threshold) fuses nothing, so the long run's partials are written."""
    import dataclasses

    from ds4t.kernels.splits import SameSlotRuns

    HQ, HKV, D, DV = 6, 2, 48, 40
    g = _gen(38)
    S, L = 4, 200
    kc, vc = _cache(S, L, HKV, D, DV, dtype, device, g)
    # (slot, rows, first length): chunk, verify, decode, a chunk of exactly the threshold (8 rows: 21-28, so
    # programs of 4 rows hold rows 20-23 (a decode row and three of it: not one slot), 24-27 (fused) and 28
    # (a lone last row: never fused)
    runs = [(0, 16, 60), (1, 4, 150), (2, 1, 90), (3, 8, 70)]
    slots, lengths = _run_rows(runs, device)
    B = slots.numel()
    q = torch.randn(B, HQ, D, generator=g).to(device)
    table = torch.tensor([[0, 16, 0, -1], [16, 4, 1, -1], [21, 8, 3, -1]], dtype=torch.int64, device=device)
    sched = SplitSchedule(16, 64, 4)   # every row of more than one split
    cfg = dataclasses.replace(A.ATTENTION_CONFIGS(16, 64, 64), run_rows=4, run_fuse_rows=8)
    with launcher_path(A, False):
        split = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched)
        kept = poison_empty(monkeypatch, lambda shape: len(shape) == 4 and shape[0] == B and shape[2:] == (HQ, DV))
        with A.ATTENTION_CONFIGS.forced(lambda *k: cfg):
            fused = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched, same_slot_runs=SameSlotRuns(table, 4, 16))
            unfused = _run(q, kc, vc, slots, lengths, 0.2, split_size=sched, same_slot_runs=4)
        monkeypatch.undo()
    assert torch.isfinite(fused).all() and torch.equal(fused, split) and torch.equal(unfused, split)
    written = [t[:, 0].isfinite().all(-1).all(-1).tolist() for t in kept]   # split 0's partials, per row
    assert written[0] == [False] * 16 + [True] * 8 + [False] * 4 + [True]
    assert written[1] == [True] * B


def test_fusion_decision_of_each_hint():
    """``_fusion`` (the launcher's choice): (fuse at all, FUSE_ROWS: 0 when every run is long, else the
    threshold each program's run is held to). No fusion without a threshold, without split partials, for a
    decode step (0 / None / False), or when no run reaches the threshold; an int hint is the shortest run,
    all or nothing. ``splits.table_args``: the table the kernels then read, or the unread dummy and zeros."""
    from ds4t.kernels.attention import _fusion
    from ds4t.kernels.splits import SameSlotRuns, table_args

    dummy = torch.zeros(5, dtype=torch.int32)
    table = torch.zeros(2, 4, dtype=torch.int64)
    pick = lambda hint, threshold=8, possible=True: _fusion(hint, threshold, possible)   # noqa: E731
    for hint in (0, None, False, True, 7):
        assert pick(hint) == (False, 0), hint
    assert pick(8) == (True, 0) and pick(9) == (True, 0)
    assert pick(SameSlotRuns(table, 2, 7)) == (False, 0)
    assert pick(SameSlotRuns(table, 2, 8)) == (True, 8)     # the long run only: each program asks the table
    assert pick(SameSlotRuns(table, 8, 20)) == (True, 0)    # every run long: no table to ask
    assert pick(SameSlotRuns(table, 8, 20), threshold=None) == (False, 0)
    assert pick(SameSlotRuns(table, 8, 20), possible=False) == (False, 0)
    ptr, stride, lines = table_args(SameSlotRuns(table, 2, 8), dummy)
    assert ptr is table and (stride, lines) == (4, 2)
    ptr, stride, lines = table_args(None, dummy)
    assert ptr is dummy and (stride, lines) == (0, 0)


# ----------------------------------------------------------------------------- products="cache"

# q and the probabilities rounded once to the cache dtype (FlashAttention's numerics): bf16-sized errors against
# the reference, which keeps exact probabilities (the MLA kernel's bounds, the same rounding)
CACHE_TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def _cache_case(i, shape, j, dtype):
    """A (shape, dtype) case; in the interpreter three of the six -- every shape and each dtype once -- run in make
    test, the other three in make test-long."""
    name = "Hq%d-Hkv%d-D%d-Dv%d-%s" % (*shape, str(dtype).replace("torch.", ""))
    return pytest.param(shape, dtype, id=name, marks=[pytest.mark.long] if INTERPRET and (i + j) % 2 == 0 else [])


_CACHE_CASES = [_cache_case(i, s, j, dt) for i, s in enumerate(SHAPES)
                for j, dt in enumerate((torch.bfloat16, torch.float16))]


@pytest.mark.parametrize("shape,dtype", _CACHE_CASES)
def test_cache_products_match_the_reference_and_keep_every_invariance(device, dtype, shape, monkeypatch):
    """products="cache": within bf16 / fp16 bounds of the reference (q rounded as the kernel rounds it), gated
    too; a row alone == the row in the batch; the runs kernel == the split kernel, bit for bit, across
    split-size thresholds and slots; NaN past every slot's used length never read. Control: "split" gives
    other bits (the option does something)."""
    HQ, HKV, D, DV = shape
    g = _gen(35)
    kc, vc = _cache(3, 140, HKV, D, DV, dtype, device, g)
    runs = [(0, 9, 58), (2, 1, 9), (1, 6, 120)]   # (slot, rows, first length)
    slots, lengths = _run_rows(runs, device)
    for sl in range(3):
        used = int(lengths[slots == sl].max())
        kc[sl, used:] = float("nan")
        vc[sl, used:] = float("nan")
    q = torch.randn(slots.numel(), HQ, D, generator=g).to(device)
    sched = SplitSchedule(16, 64, 4)
    kw = dict(split_size=sched, products="cache")
    spy = Launches(A._attn_runs_kernel)
    monkeypatch.setattr(A, "_attn_runs_kernel", spy)
    with launcher_path(A, False):
        split = _run(q, kc, vc, slots, lengths, 0.2, **kw)
        got = _run(q, kc, vc, slots, lengths, 0.2, same_slot_runs=True, **kw)
        assert spy.n == 1 and not torch.isnan(got).any() and torch.equal(got, split)
        for i in (0, 8, 10, 15):
            assert torch.equal(_run(q[i:i + 1], kc, vc, slots[i:i + 1], lengths[i:i + 1], 0.2, **kw)[0], got[i]), i
        atol, rtol = CACHE_TOL[dtype]
        torch.testing.assert_close(got, decode_attention_ref(q, kc, vc, slots, lengths, 0.2, products="cache"),
                                   atol=atol, rtol=rtol)
        gate = torch.randn(slots.numel(), HQ * DV, generator=g).to(device)
        gated = decode_attention(q, kc, vc, slots, lengths, 0.2, gate=gate, same_slot_runs=True, **kw)
        assert torch.equal(gated, activation.sigmoid_mul(got.reshape(slots.numel(), -1), gate).view_as(got))
        assert not torch.equal(_run(q, kc, vc, slots, lengths, 0.2, split_size=sched), got)


def test_cache_products_are_split_products_for_an_fp32_cache_and_refuse_unknown_names(device):
    g = _gen(36)
    kc, vc = _cache(2, 40, 2, 32, 32, torch.float32, device, g)
    slots = torch.tensor([0, 1, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([40, 7, 33], dtype=torch.int32, device=device)
    q = torch.randn(3, 4, 32, generator=g).to(device)
    with launcher_path(A, False):
        assert torch.equal(_run(q, kc, vc, slots, lengths, 0.2, split_size=16, products="cache"),
                           _run(q, kc, vc, slots, lengths, 0.2, split_size=16))
    with pytest.raises(ValueError, match="products"):
        decode_attention(q, kc, vc, slots, lengths, 0.2, products="bf16")


def test_same_slot_runs_one_split_and_empty_rows(device):
    """Every row one split (no merge) and rows of length 0 (zeros) through the runs kernel: the split
    kernel's bits."""
    g = _gen(32)
    kc, vc = _cache(2, 48, 2, 32, 32, torch.bfloat16, device, g)
    slots = torch.tensor([0] * 7 + [1, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([0, 1, 2, 3, 4, 5, 6, 0, 40], dtype=torch.int32, device=device)
    q = torch.randn(9, 4, 32, generator=g).to(device)
    with launcher_path(A, False):
        split = _run(q, kc, vc, slots, lengths, 0.2, split_size=64)
        got = _run(q, kc, vc, slots, lengths, 0.2, split_size=64, same_slot_runs=True)
    assert torch.equal(got, split) and torch.equal(got[lengths == 0], torch.zeros_like(got[lengths == 0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_merge_stages_change_no_bit(device, dtype):
    """``merge_stages`` (how many splits' partials the merge loads ahead) changes no bit: rows of one split
    (stored by the split kernel), a split boundary, mid-tile ends and 19 splits, gated too. Control: the same
    rows under another split schedule differ."""
    import dataclasses

    rule = A._interp_config if INTERPRET else A._gpu_config
    HQ, HKV, D, DV = 6, 2, 48, 40
    g = _gen(33)
    kc, vc = _cache(3, 300, HKV, D, DV, dtype, device, g)
    slots = torch.tensor([0, 1, 2, 1, 0, 2, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([1, 16, 17, 64, 150, 299, 300], dtype=torch.int32, device=device)
    q = torch.randn(7, HQ, D, generator=g).to(device)
    gate = torch.randn(7, HQ * DV, generator=g).to(device)
    got = {}
    with launcher_path(A, False):
        for stages in (1, 2, 4):
            with A.ATTENTION_CONFIGS.forced(lambda *key: dataclasses.replace(rule(*key), merge_stages=stages)):
                got[stages] = (_run(q, kc, vc, slots, lengths, 0.2, split_size=16),
                               decode_attention(q, kc, vc, slots, lengths, 0.2, split_size=16, gate=gate))
        other = _run(q, kc, vc, slots, lengths, 0.2, split_size=32)
    for stages in (2, 4):
        assert torch.equal(got[stages][0], got[1][0]) and torch.equal(got[stages][1], got[1][1])
    _assert_close(got[4][0], decode_attention_ref(q, kc, vc, slots, lengths, 0.2), dtype)
    assert not torch.equal(other[4:], got[4][0][4:])


# ----------------------------------------------------------------------------- one split, gate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d).replace("torch.", ""))
def test_one_split_needs_no_merge(path, device, dtype):
    """L <= split size: one split per row (the split kernel writes the output itself, no merge
    launch); a length-0 row is zeros, the others match the reference."""
    HQ, HKV, D = 4, 2, 24
    g = _gen(11)
    kc, vc = _cache(3, 20, HKV, D, D, dtype, device, g)
    q = torch.randn(4, HQ, D, generator=g).to(device)
    slots = torch.tensor([0, 2, 1, 2], dtype=torch.int32, device=device)
    lengths = torch.tensor([0, 20, 1, 13], dtype=torch.int32, device=device)
    got = _run(q, kc, vc, slots, lengths, 0.3, split_size=32)
    assert torch.equal(got[0], torch.zeros_like(got[0]))
    _assert_close(got[1:], decode_attention_ref(q[1:], kc, vc, slots[1:], lengths[1:], 0.3), dtype)
    alone = _run(q[3:], kc, vc, slots[3:], lengths[3:], 0.3, split_size=32)
    assert torch.equal(alone[0], got[3])


@pytest.mark.parametrize("runs", [False, True], ids=["rows", "same_slot_runs"])
@pytest.mark.parametrize("split", [16, 64])
def test_gate_is_sigmoid_mul(path, device, split, runs):
    """decode_attention(..., gate=g) == sigmoid_mul(decode_attention(...), g), bitwise (the gate a
    strided column slice, as in the Qwen3-Next projection), whichever kernel stores a row: the split
    kernel (one split), the merge, or the same-slot-runs kernel."""
    HQ, HKV, D = 6, 2, 16
    g = _gen(12)
    kc, vc = _cache(3, 48, HKV, D, D, torch.float32, device, g)
    B = 5
    q = torch.randn(B, HQ, D, generator=g).to(device)
    proj = torch.randn(B, 2 * HQ * D + 3, generator=g).to(device)
    gate = proj[:, 3:3 + HQ * D]
    slots = torch.tensor([0, 2, 1, 2, 0], dtype=torch.int32, device=device)
    lengths = torch.tensor([48, 20, 1, 33, 7], dtype=torch.int32, device=device)
    plain = _run(q, kc, vc, slots, lengths, 0.25, split_size=split)
    gated = decode_attention(q, kc, vc, slots, lengths, 0.25, split_size=split, gate=gate, same_slot_runs=runs)
    assert torch.equal(gated, activation.sigmoid_mul(plain.view(B, HQ * D), gate).view(B, HQ, D))
    # out_dtype: the same fp32 result rounded to nearest even (what a bf16 o_proj rounds it to); fp16 differs
    for dt in (torch.bfloat16, torch.float16):
        narrow = decode_attention(q, kc, vc, slots, lengths, 0.25, split_size=split, gate=gate, out_dtype=dt,
                                  same_slot_runs=runs)
        assert narrow.dtype == dt and torch.equal(narrow, gated.to(dt))
        plain16 = decode_attention(q, kc, vc, slots, lengths, 0.25, split_size=split, out_dtype=dt)
        assert torch.equal(plain16, plain.to(dt))
    with pytest.raises(ValueError, match="out_dtype"):
        decode_attention(q, kc, vc, slots, lengths, 0.25, out_dtype=torch.int8)


# ----------------------------------------------------------------------------- norm + rope + write_kv


def _prologue_case(R, H, KV, D, DV, dtype, device, seed):
    g = _gen(seed)
    S, L = 4, 32
    proj = torch.randn(R, (H + KV) * D + KV * DV + 5, generator=g).to(device)   # q | k | v views
    q = proj[:, :H * D].unflatten(1, (H, D))
    k = proj[:, H * D:(H + KV) * D].unflatten(1, (KV, D))
    v = proj[:, (H + KV) * D:(H + KV) * D + KV * DV].unflatten(1, (KV, DV))
    qw = (0.3 * torch.randn(D, generator=g)).to(device)
    kw = (0.3 * torch.randn(D, generator=g)).to(device)
    slots = (torch.arange(R, dtype=torch.int32) % S).to(device)
    pos = (torch.arange(R, dtype=torch.int32) // S * 3 + 1).to(device)      # distinct (slot, pos)
    kc, vc = _cache(S, L, KV, D, DV, dtype, device, g)
    return q, k, v, qw, kw, slots, pos, kc, vc


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("R,H,KV,D,DV,rot,zc", [
    (1, 4, 2, 16, 16, 4, True),       # the tiny-qwen attention layer, one decode row
    (9, 4, 2, 16, 16, 4, True),
    (5, 6, 2, 48, 48, 24, False),     # non-power-of-two head dim
    (3, 3, 3, 20, 12, 20, True),      # MHA, D != Dv, full rotary
])
def test_norm_rope_write_kv_is_norm_then_rope_then_write(path, device, dtype, R, H, KV, D, DV, rot, zc):
    """The prologue equals rms_norm + rope on q and k, then write_kv, bitwise (its sums of squares are the
    norm kernel's fixed tree, norm.rstd_of, in any layout), and the reference."""
    q, k, v, qw, kw, slots, pos, kc, vc = _prologue_case(R, H, KV, D, DV, dtype, device, seed=13)
    pos[0] = kc.shape[1]  # == L: this row's k / v are not written (its q is still computed)
    inv = rope.default_inv_freq(rot, 10000.0, device=device)
    kc1, vc1, kc2, vc2 = kc.clone(), vc.clone(), kc.clone(), vc.clone()
    out = poisoned((R, H, D), device=device)
    got = norm_rope_write_kv(q, k, v, qw, kw, 1e-6, pos, inv, kc1, vc1, slots, rotary_dim=rot,
                             zero_centered=zc, out=out)
    assert got is out
    qn = norm.rms_norm(q.reshape(R * H, D), qw, 1e-6, zero_centered=zc).view(R, H, D)
    kn = norm.rms_norm(k.reshape(R * KV, D), kw, 1e-6, zero_centered=zc).view(R, KV, D)
    qr, kr = rope.rope(qn, pos, inv, rotary_dim=rot), rope.rope(kn, pos, inv, rotary_dim=rot)
    write_kv(kr, v, kc2, vc2, slots, pos)
    assert torch.equal(got, qr) and torch.equal(kc1, kc2) and torch.equal(vc1, vc2)
    qref = rope.rope_ref(norm.rms_norm_ref(q, qw, 1e-6, zero_centered=zc), pos, inv, rotary_dim=rot)
    torch.testing.assert_close(got, qref, atol=1e-5, rtol=1e-5)
    if R == 1:
        assert torch.equal(kc1, kc) and torch.equal(vc1, vc)   # the one row was out of range


@settings(max_examples=8, deadline=None)
@given(data=st.data())
def test_norm_rope_write_kv_rows_invariant(data):
    """Row i among B rows == row i alone (q out and the cache entries it writes), bitwise."""
    device = torch.device("cpu" if INTERPRET else "cuda")
    q, k, v, qw, kw, slots, pos, kc, vc = _prologue_case(33, 4, 2, 16, 16, torch.bfloat16, device, seed=14)
    inv = rope.default_inv_freq(4, 10000.0, device=device)
    rows_path = INTERPRET and data.draw(st.booleans(), label="rows path")
    B = data.draw(st.integers(1, 33), label="B")
    rows = data.draw(st.permutations(range(33)), label="order")[:B]
    i = data.draw(st.integers(0, B - 1), label="i")

    def run(r):
        idx = torch.tensor(r, dtype=torch.long, device=device)
        kc1, vc1 = kc.clone(), vc.clone()
        qo = norm_rope_write_kv(q[idx], k[idx], v[idx], qw, kw, 1e-6, pos[idx], inv, kc1, vc1, slots[idx],
                                rotary_dim=4, zero_centered=True)
        s, p = slots[idx].long(), pos[idx].long()
        return torch.cat([qo.flatten(1), kc1[s, p].float().flatten(1), vc1[s, p].float().flatten(1)], 1)

    with launcher_path(A, rows_path):
        assert_rows_invariant(run, rows, i)


@pytest.mark.parametrize("parts,products,gated", [(2, "split", False), (4, "cache", True)], ids=str)
def test_value_column_parts_keep_every_rows_bits(device, parts, products, gated):
    """``AttentionConfig.dv_parts``: a launch of at most ``dv_rows`` rows runs each (row, kv head, split) as
    ``parts`` programs over a part of the value columns each (the same scores and softmax) -- bitwise the
    one-program launch, for rows of one split and of several (merged), gated or not. Control: another
    split schedule gives other bits (the comparison sees an order change)."""
    HQ, HKV, D, DV = 8, 2, 64, 64
    g = _gen(39)
    kc, vc = _cache(3, 140, HKV, D, DV, torch.bfloat16, device, g)
    slots = torch.tensor([0, 2, 1], dtype=torch.int32, device=device)
    lengths = torch.tensor([9, 120, 77], dtype=torch.int32, device=device)
    q = torch.randn(3, HQ, D, generator=g).to(device)
    gate = torch.randn(3, HQ * DV, generator=g).to(device) if gated else None
    sched = SplitSchedule(16, 64, 4)
    base = A.ATTENTION_CONFIGS(16, D, DV)
    split_cfg = dataclasses.replace(base, dv_parts=parts, dv_rows=3)
    assert A.dv_parts_of(split_cfg, 3, DV) == parts and A.dv_parts_of(split_cfg, 4, DV) == 1
    spy = Launches(A._attn_split_kernel)

    def run(cfg, sp=sched):
        with launcher_path(A, False), A.ATTENTION_CONFIGS.forced(lambda *k: cfg):
            if gated:
                return decode_attention(q, kc, vc, slots, lengths, 0.2, split_size=sp, gate=gate, products=products)
            return _run(q, kc, vc, slots, lengths, 0.2, split_size=sp, products=products)

    one = run(base)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(A, "_attn_split_kernel", spy)
        got = run(split_cfg)
    assert spy.n == 1 and spy.kwargs[-1]["DV_PARTS"] == parts
    assert not torch.isnan(got).any() and torch.equal(got, one)
    assert not torch.equal(run(split_cfg, 16), got)
    # one split a row (a 40-position cache, splits of 64: no partials, no merge kernel) and a row of length 0
    short_k, short_v = kc[:, :40].contiguous(), vc[:, :40].contiguous()
    lens = torch.tensor([9, 0, 40], dtype=torch.int32, device=device)

    def final(cfg):
        with launcher_path(A, False), A.ATTENTION_CONFIGS.forced(lambda *k: cfg):
            return _run(q, short_k, short_v, slots, lens, 0.2, split_size=64, products=products)

    alone = final(base)
    assert torch.equal(final(split_cfg), alone) and not torch.isnan(alone).any()
    assert A.dv_parts_of(dataclasses.replace(split_cfg, dv_parts=8), 1, 64) == 4     # >= 16 columns a part
    with pytest.raises(ValueError, match="dv_parts"):
        A.dv_parts_of(dataclasses.replace(split_cfg, dv_parts=3), 1, DV)


@pytest.mark.parametrize("heads", [2, 4, 8])
def test_norm_rope_heads_a_program_change_no_bit(device, heads):
    """``NormRopeConfig.heads``: the GPU prologue kernel with several heads a program (masked past H and KV)
    gives the one-head programs' q out and cache entries bit for bit; the control (one column's q-norm weight
    moved by 2^-10) shows the comparison sees a change."""
    R, H, KV, D, DV, rot = 7, 6, 3, 48, 40, 24   # H, KV not multiples of the heads a program
    q, k, v, qw, kw, slots, pos, kc, vc = _prologue_case(R, H, KV, D, DV, torch.bfloat16, device, seed=15)
    inv = rope.default_inv_freq(rot, 10000.0, device=device)

    def run(cfg, qn=qw):
        kc1, vc1 = kc.clone(), vc.clone()
        with A.NORM_ROPE_CONFIGS.forced(lambda D_: cfg), registry.use_variants({"norm_rope_write_kv": registry.GPU}):
            out = poisoned((R, H, D), device=device)
            norm_rope_write_kv(q, k, v, qn, kw, 1e-6, pos, inv, kc1, vc1, slots, rotary_dim=rot, zero_centered=True,
                               out=out)
        return out, kc1, vc1

    one = run(A.NormRopeConfig(heads=1, min_rows=1, num_warps=1))
    many = run(A.NormRopeConfig(heads=heads, min_rows=1, num_warps=4))
    assert all(torch.equal(a, b) for a, b in zip(one, many))
    assert not torch.isnan(many[0]).any()
    moved = qw.clone()
    moved[5] += 2.0 ** -10   # (zero-centred: 1 + w, so a move of one ulp of w would be absorbed)
    control = run(A.NormRopeConfig(heads=heads, min_rows=1, num_warps=4), qn=moved)
    assert not torch.equal(control[0], many[0])
