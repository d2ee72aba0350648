"""ds4t.kernels.conv: depthwise causal conv1d with per-session state (decode and prefill)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.backend import INTERPRET
from ds4t.kernels import conv as CV
from ds4t.kernels.conv import (
    conv1d_prefill,
    conv1d_prefill_ref,
    conv1d_update,
    conv1d_update_ref,
)
from tests.kernels.invariance import launcher_path, poisoned

# Inputs of every dtype are upcast to fp32 exactly, in the kernel and in the reference alike, and
# all arithmetic is fp32: the only differences are exp() implementations (silu) -> tight for all.
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=1e-5, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=1e-5),
}
S = 7  # slots in the pool


def _params(C, W, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(C, W, generator=g) * 0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(C, generator=g) * 0.3).to(device=device, dtype=dtype)
    state0 = torch.randn(S, C, W - 1, generator=g).to(device)
    return g, w, bias, state0


@pytest.fixture(params=["rows", "one-row"])
def path(request):
    """Run a case with the interpreter's several-rows-per-program kernel (``rows``) and with the
    one-row-per-program kernel the GPU runs (``one-row``, in the interpreter too)."""
    if request.param == "rows" and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    with launcher_path(CV, request.param == "rows"):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("C,W", [(200, 4), (200, 3), (37, 2), (64, 6)])
@pytest.mark.parametrize("use_bias,silu", [(True, True), (False, False)])
def test_update_matches_reference(path, device, dtype, C, W, use_bias, silu):
    g, w, bias, state0 = _params(C, W, dtype, device)
    bias = bias if use_bias else None
    x = torch.randn(5, C, generator=g).to(device=device, dtype=dtype)
    slots = torch.tensor([4, 0, 6, 2, 3], dtype=torch.int32, device=device)
    st_k, st_r = state0.clone(), state0.clone()
    out = poisoned((5, C), device=device)
    res = conv1d_update(x, st_k, w, slots, bias=bias, silu=silu, out=out)
    assert res is out
    ref = conv1d_update_ref(x, st_r, w, slots, bias=bias, silu=silu)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    # State after the call: the named slots shifted with x appended, the others untouched, exactly.
    assert torch.equal(st_k, st_r)
    assert torch.equal(st_k[[1, 5]], state0[[1, 5]])
    assert torch.equal(st_k[slots.long(), :, -1], x.float())


def test_update_noncontiguous_inputs(path, device):
    # x as a column slice of a wider activation (as after a split), weight as a squeezed [C,1,W].
    C, W = 200, 4
    g, w, bias, state0 = _params(C, W, torch.float32, device)
    wide = torch.randn(3, C + 50, generator=g).to(device)
    x = wide[:, 50:]
    w3 = w.unsqueeze(1).contiguous()
    slots = torch.tensor([1, 4, 2], dtype=torch.int32, device=device)
    st_k, st_r = state0.clone(), state0.clone()
    out = conv1d_update(x, st_k, w3.squeeze(1), slots, bias=bias)
    ref = conv1d_update_ref(x.contiguous(), st_r, w, slots, bias=bias)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert torch.equal(st_k, st_r)


@pytest.mark.parametrize(
    "dtype,C,W,T,fresh",
    [(dt, 200, W, T, False) for dt in (torch.float32, torch.bfloat16) for W in (4, 3) for T in (1, 2, 9)]
    + [(torch.float32, 200, 4, 2, True), (torch.bfloat16, 200, 3, 9, True),
       (torch.float32, 200, 4, 70, False)],  # T=70 spans two token tiles in the interpreter
)
def test_prefill_matches_reference_and_decodes(path, device, dtype, C, W, T, fresh):
    g, w, bias, state0 = _params(C, W, dtype, device, seed=T)
    if fresh:
        state0[3] = 0.0  # a new session starts from zeros
    x = torch.randn(T, C, generator=g).to(device=device, dtype=dtype)
    st_k, st_r, st_d = state0.clone(), state0.clone(), state0.clone()
    out = poisoned((T, C), device=device)
    conv1d_prefill(x, st_k, w, 3, bias=bias, out=out)
    ref = conv1d_prefill_ref(x, st_r, w, 3, bias=bias)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert torch.equal(st_k, st_r)
    # history kept when T < W-1
    hist = torch.cat([state0[3], x.float().t()], dim=1)[:, -(W - 1):]
    assert torch.equal(st_k[3], hist)
    # T successive decode steps: bitwise in the interpreter (same expression, same order)
    one = torch.tensor([3], dtype=torch.int32, device=device)
    dec = torch.stack([conv1d_update(x[t : t + 1], st_d, w, one, bias=bias)[0] for t in range(T)])
    if INTERPRET:
        assert torch.equal(out, dec)
    else:
        torch.testing.assert_close(out, dec, atol=1e-6, rtol=1e-6)
    assert torch.equal(st_k, st_d)


def _hf():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    upd = getattr(m, "torch_causal_conv1d_update", None) or m.causal_conv1d_update
    fn = getattr(m, "torch_causal_conv1d_fn", None) or m.causal_conv1d_fn
    return upd, fn


@pytest.mark.parametrize("W", [4, 3])
def test_reference_matches_hf(W):
    hf_update, hf_fn = _hf()
    C, B, T = 200, 4, 6
    g, w, bias, state0 = _params(C, W, torch.float32, "cpu")
    x = torch.randn(B, C, generator=g)
    slots = torch.tensor([5, 1, 0, 3], dtype=torch.int32)
    st_r = state0.clone()
    ref = conv1d_update_ref(x, st_r, w, slots, bias=bias)
    hf_state = state0[slots.long()].clone()
    hf = hf_update(x[:, :, None], hf_state, w, bias, "silu")[:, :, 0]
    torch.testing.assert_close(ref, hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_r[slots.long()], hf_state, atol=0, rtol=0)
    # prefill of a fresh session == HF's full causal conv
    xs = torch.randn(T, C, generator=g)
    st_p = torch.zeros(1, C, W - 1)
    ref_p = conv1d_prefill_ref(xs, st_p, w, 0, bias=bias)
    hf_p = hf_fn(xs.t()[None], w, bias, activation="silu")[0].t()
    torch.testing.assert_close(ref_p, hf_p, atol=1e-5, rtol=1e-5)


POOL = 40


@settings(max_examples=15, deadline=None)
@given(
    perm=st.permutations(list(range(POOL))),
    n=st.integers(1, 33),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    W=st.sampled_from([3, 4]),
    rows_path=st.booleans(),
)
def test_rows_batch_invariant(perm, n, dtype, W, rows_path):
    """Each row's output and its slot's new state are bitwise the same in a batch and alone."""
    with launcher_path(CV, rows_path):
        _check_rows_batch_invariant(perm, n, dtype, W)


def _check_rows_batch_invariant(perm, n, dtype, W):
    device = "cpu" if INTERPRET else "cuda"
    C = 200
    g = torch.Generator().manual_seed(n * 7 + W)
    w = (torch.randn(C, W, generator=g) * 0.5).to(device=device, dtype=dtype)
    bias = (torch.randn(C, generator=g) * 0.3).to(device=device, dtype=dtype)
    state0 = torch.randn(POOL, C, W - 1, generator=g).to(device)
    xpool = torch.randn(POOL, C, generator=g).to(device=device, dtype=dtype)
    slots = torch.tensor(perm[:n], dtype=torch.int32, device=device)

    st_b = state0.clone()
    out_b = poisoned((n, C), device=device)
    conv1d_update(xpool[slots.long()], st_b, w, slots, bias=bias, out=out_b)
    untouched = sorted(set(range(POOL)) - set(perm[:n]))
    assert torch.equal(st_b[untouched], state0[untouched])
    for i in range(n):
        s = perm[i]
        st_a = state0.clone()
        out_a = poisoned((1, C), device=device)
        conv1d_update(xpool[s : s + 1], st_a, w, slots[i : i + 1], bias=bias, out=out_a)
        assert torch.equal(out_a[0], out_b[i]), f"row {i} (slot {s}) output differs in batch of {n}"
        assert torch.equal(st_a[s], st_b[s]), f"row {i} (slot {s}) state differs in batch of {n}"


@pytest.mark.skipif(not INTERPRET, reason="the rows path is the interpreter's")
@pytest.mark.parametrize("C,W,use_bias", [(200, 4, True), (192, 4, False), (37, 2, True), (64, 6, False)])
def test_rows_path_equals_one_row_kernel(C, W, use_bias):
    """The interpreter's rows kernel evaluates each output with the one-row kernel's expression in
    its order: the same bits, and the same new state."""
    g, w, bias, state0 = _params(C, W, torch.bfloat16, "cpu", seed=3)
    x = torch.randn(6, C, generator=g)
    slots = torch.tensor([5, 0, 6, 2, 3, 1], dtype=torch.int32)
    res = {}
    for rows in (True, False):
        st = state0.clone()
        with launcher_path(CV, rows):
            res[rows] = conv1d_update(x, st, w, slots, bias=bias if use_bias else None), st
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])


# ----------------------------------------------------------------------------- several sessions in one launch

# (first row, rows, slot, states row: the conv keeps none, so unread): a 2-row chunk (shorter than the W-1
# history), a 5-row and a 20-row one (more than one token tile), slots out of order; row 7 belongs to no
# segment and must be left alone.
SEGMENTS = [(0, 2, 4, -1), (2, 5, 0, 0), (8, 20, 6, -1)]


def _run_segments(x, w, bias, state0, device, segments=SEGMENTS):
    st = state0.clone()
    out = poisoned((x.shape[0], w.shape[0]), device=device)
    CV.conv1d_prefill_segments(x, st, w, torch.tensor(segments, dtype=torch.int64, device=device), bias=bias, out=out)
    return out, st


@pytest.mark.parametrize("C,W", [(200, 4), (64, 2)])
def test_segments_equal_each_session_alone(device, C, W):
    """One launch over three sessions' chunks: rows and each slot's new history are bitwise those of
    conv1d_prefill on that session alone; rows and slots outside the segments are not written."""
    g, w, bias, state0 = _params(C, W, torch.bfloat16, device, seed=21)
    x = torch.randn(28, C, generator=g).to(device=device, dtype=torch.bfloat16)
    out, st = _run_segments(x, w, bias, state0, device)
    alone = state0.clone()
    for r0, n, slot, _ in SEGMENTS:
        o = conv1d_prefill(x[r0:r0 + n], alone, w, slot, bias=bias)
        assert torch.equal(out[r0:r0 + n], o) and torch.equal(st[slot], alone[slot]), slot
    assert torch.isnan(out[7]).all()
    assert torch.equal(st[[1, 2, 3, 5]], state0[[1, 2, 3, 5]])
    ref_st = state0.clone()
    ref = CV.conv1d_prefill_segments_ref(x, ref_st, w, torch.tensor(SEGMENTS), bias=bias)
    rows = [r for r0, n, _, _ in SEGMENTS for r in range(r0, r0 + n)]
    torch.testing.assert_close(out[rows], ref[rows], **TOL[torch.bfloat16])
    torch.testing.assert_close(st, ref_st, **TOL[torch.bfloat16])


def test_segments_control_a_change_in_one_session_is_seen_there_only(device):
    """Negative control of the comparison above: one input changed in the middle session changes its
    rows and history, and nothing of the others."""
    g, w, bias, state0 = _params(200, 4, torch.float32, device, seed=22)
    x = torch.randn(28, 200, generator=g).to(device)
    out, st = _run_segments(x, w, bias, state0, device)
    x2 = x.clone()
    x2[4, 7] = torch.nextafter(x2[4, 7], torch.tensor(float("inf"), device=device))
    out2, st2 = _run_segments(x2, w, bias, state0, device)
    assert not torch.equal(out2[2:7], out[2:7]) and not torch.equal(st2[0], st[0])
    assert torch.equal(out2[:2], out[:2]) and torch.equal(out2[8:], out[8:]) and torch.equal(st2[[4, 6]], st[[4, 6]])


def test_segments_bad_table(device):
    g, w, bias, state0 = _params(64, 4, torch.float32, device)
    x = torch.randn(3, 64, generator=g).to(device)
    with pytest.raises(ValueError, match=r"\[M, 4\]"):
        CV.conv1d_prefill_segments(x, state0, w, torch.zeros(1, 3, dtype=torch.int64, device=device))


@pytest.mark.parametrize("block_t", [4, 8])
def test_token_tiles_change_no_bit(device, block_t):
    """Token tiles run in parallel programs (tile 0 alone reads and then writes the history): with tiles
    of 4 and 8 tokens (segments of 2, 5 and 20 rows span one to five tiles) rows and histories are
    bitwise those of the default tiles, and equal to successive decode steps."""
    g, w, bias, state0 = _params(200, 4, torch.bfloat16, device, seed=23)
    x = torch.randn(28, 200, generator=g).to(device=device, dtype=torch.bfloat16)
    base, base_st = _run_segments(x, w, bias, state0, device)
    with CV.CONV_CONFIGS.forced(lambda C: CV.ConvConfig(block_c=64, block_t=block_t)):
        out, st = _run_segments(x, w, bias, state0, device)
        bounded = state0.clone()
        out_b = poisoned((28, 200), device=device)
        CV.conv1d_prefill_segments(x, bounded, w, torch.tensor(SEGMENTS, dtype=torch.int64, device=device),
                                   bias=bias, out=out_b, max_rows=20)
    rows = [r for r0, n, _, _ in SEGMENTS for r in range(r0, r0 + n)]
    assert torch.equal(out[rows], base[rows]) and torch.equal(st, base_st)
    assert torch.equal(out_b[rows], base[rows]) and torch.equal(bounded, base_st)
    dec = state0.clone()
    r0, n, slot, _ = SEGMENTS[2]
    sl = torch.tensor([slot], dtype=torch.int32, device=device)
    steps = torch.cat([conv1d_update(x[r:r + 1], dec, w, sl, bias=bias) for r in range(r0, r0 + n)])
    assert torch.equal(steps, out[r0:r0 + n]) and torch.equal(dec[slot], st[slot])


def test_token_tiles_bad_arguments(device):
    g, w, bias, state0 = _params(64, 4, torch.float32, device)
    x = torch.randn(6, 64, generator=g).to(device)
    seg = torch.tensor([[0, 6, 1, -1]], dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="max_rows"):
        CV.conv1d_prefill_segments(x, state0, w, seg, max_rows=7)
    with CV.CONV_CONFIGS.forced(lambda C: CV.ConvConfig(block_c=64, block_t=2)):
        with pytest.raises(ValueError, match="token tile 2"):
            CV.conv1d_prefill_segments(x, state0, w, seg)
    long = torch.zeros(65536 * 4 + 1, 64, device=device)   # more token tiles of 4 than a grid axis holds
    with CV.CONV_CONFIGS.forced(lambda C: CV.ConvConfig(block_c=64, block_t=4)):
        with pytest.raises(ValueError, match="prefill in chunks"):
            CV.conv1d_prefill_segments(long, state0, w, seg)


def test_the_rows_path_refuses_a_config_that_splits_the_channels():
    # The interpreter's rows kernel holds every channel of its rows: a forced config with fewer channels per
    # program is refused rather than leaving the rest uncomputed.
    from ds4t.kernels.conv import CONV_CONFIGS, ConvConfig, conv1d_update
    from ds4t.kernels.registry import INTERP, use_variants

    C, W = 72, 4
    x, w = torch.randn(2, C), torch.randn(C, W)
    state = torch.zeros(3, C, W - 1)
    slots = torch.tensor([0, 2], dtype=torch.int32)
    with use_variants({"conv1d_update": INTERP}), CONV_CONFIGS.forced(lambda C: ConvConfig(block_c=32, block_t=16)):
        with pytest.raises(ValueError, match="needs all 72"):
            conv1d_update(x, state, w, slots)
