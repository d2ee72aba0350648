"""ds4t.kernels.gdn: gated delta rule recurrence (decode and prefill) with per-session state."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4t.backend import (
    INTERPRET,
    default_device,  # noqa: F401
)
from ds4t.kernels import gdn as GD
from ds4t.kernels.gdn import gdn_decode, gdn_decode_ref, gdn_prefill, gdn_prefill_ref
from ds4t.kernels.norm import gated_rms_norm
from tests.kernels.devices import gen
from tests.kernels.invariance import launcher_path, poisoned

pytestmark = pytest.mark.usefixtures("on_kernel_device")

# Inputs of every dtype are upcast to fp32 exactly (kernel and reference alike) and the state is
# fp32, so the tolerance is fp32 summation-order noise for every input dtype.
TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-5, rtol=1e-5),
    torch.float16: dict(atol=2e-5, rtol=1e-5),
}
SHAPES = [(2, 4, 16, 24), (3, 3, 32, 32)]  # (Hk, Hv, Dk, Dv)
S = 7  # slots in the pool


def _params(Hv, Dk, Dv, device, seed=0, pool=S):
    g = gen(seed)
    A_log = (torch.rand(Hv, generator=g) * 3 - 1.5).to(device)     # A in (0.22, 4.5)
    dt_bias = (torch.randn(Hv, generator=g) * 0.5).to(device)
    state0 = (torch.randn(pool, Hv, Dk, Dv, generator=g) * 0.3).to(device)
    return g, A_log, dt_bias, state0


def _inputs(g, R, Hk, Hv, Dk, Dv, dtype, device):
    q = torch.randn(R, Hk, Dk, generator=g)
    k = torch.randn(R, Hk, Dk, generator=g)
    v = torch.randn(R, Hv, Dv, generator=g)
    a = torch.randn(R, Hv, generator=g) * 2
    b = torch.randn(R, Hv, generator=g) * 2
    return [t.to(device=device, dtype=dtype) for t in (q, k, v, a, b)]


@pytest.fixture(params=["rows", "one-row"])
def path(request):
    """Run a case with the interpreter's several-rows-per-program decode kernel (``rows``) and with
    the one-row-per-program kernel the GPU runs (``one-row``, in the interpreter too)."""
    if request.param == "rows" and not INTERPRET:
        pytest.skip("the rows path is the interpreter's")
    with launcher_path(GD, request.param == "rows"):
        yield request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES)
def test_decode_matches_reference(path, device, dtype, Hk, Hv, Dk, Dv):
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device)
    B = 5
    q, k, v, a, b = _inputs(g, B, Hk, Hv, Dk, Dv, dtype, device)
    slots = torch.tensor([4, 0, 6, 2, 3], dtype=torch.int32, device=device)
    st_k, st_r = state0.clone(), state0.clone()
    out = poisoned((B, Hv, Dv), device=device)
    res = gdn_decode(q, k, v, a, b, A_log, dt_bias, st_k, slots, out=out)
    assert res is out
    ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, st_r, slots)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(st_k, st_r, **TOL[dtype])
    assert torch.equal(st_k[[1, 5]], state0[[1, 5]])  # other slots untouched


def test_decode_strided_inputs(path, device):
    # q, k, v as views into one [B, 2*Hk*Dk + Hv*Dv] activation (what the conv produces).
    Hk, Hv, Dk, Dv = 2, 4, 16, 24
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device)
    B = 3
    mixed = torch.randn(B, 2 * Hk * Dk + Hv * Dv, generator=g).to(device)
    q, k, v = torch.split(mixed, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q, k, v = q.view(B, Hk, Dk), k.view(B, Hk, Dk), v.view(B, Hv, Dv)
    ab = torch.randn(B, 2 * Hv, generator=g).to(device)
    b, a = ab[:, :Hv], ab[:, Hv:]
    slots = torch.tensor([6, 1, 3], dtype=torch.int32, device=device)
    st_k, st_r = state0.clone(), state0.clone()
    out = gdn_decode(q, k, v, a, b, A_log, dt_bias, st_k, slots)
    ref = gdn_decode_ref(q.contiguous(), k.contiguous(), v.contiguous(), a.contiguous(), b.contiguous(),
                         A_log, dt_bias, st_r, slots)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(st_k, st_r, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES)
@pytest.mark.parametrize("T", [1, 6])
def test_prefill_matches_reference_and_decodes(path, device, dtype, Hk, Hv, Dk, Dv, T):
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=T)
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, dtype, device)
    st_k, st_r, st_d = state0.clone(), state0.clone(), state0.clone()
    out = poisoned((T, Hv, Dv), device=device)
    gdn_prefill(q, k, v, a, b, A_log, dt_bias, st_k, 2, out=out)
    ref = gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, st_r, 2)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    torch.testing.assert_close(st_k, st_r, **TOL[dtype])
    assert torch.equal(st_k[[0, 1, 3, 4, 5, 6]], state0[[0, 1, 3, 4, 5, 6]])
    # T successive decode steps of the same session: bitwise in the interpreter (same step
    # function, same tiles); within fp32 tolerance is the contract elsewhere.
    one = torch.tensor([2], dtype=torch.int32, device=device)
    dec = torch.cat([gdn_decode(q[t : t + 1], k[t : t + 1], v[t : t + 1], a[t : t + 1], b[t : t + 1],
                                A_log, dt_bias, st_d, one) for t in range(T)])
    if INTERPRET:
        assert torch.equal(out, dec)
        assert torch.equal(st_k, st_d)
    else:
        torch.testing.assert_close(out, dec, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(st_k, st_d, atol=1e-6, rtol=1e-6)


def test_prefill_fresh_session_long(device):
    # A new session (zero state) over more tokens; decays near 0 and near 1 both occur.
    Hk, Hv, Dk, Dv = 2, 4, 16, 24
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=11)
    state0[5] = 0.0
    T = 24
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, torch.float32, device)
    st_k, st_r = state0.clone(), state0.clone()
    out = gdn_prefill(q, k, v, a, b, A_log, dt_bias, st_k, 5)
    ref = gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, st_r, 5)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    torch.testing.assert_close(st_k, st_r, **TOL[torch.float32])


def _hf_inputs(q, k, v, a, b, A_log, dt_bias):
    """HF layout [1 or B, T, H, D] and its g/beta, computed as Qwen3NextGatedDeltaNet.forward does
    (q/k heads repeated to the v heads there, before the rule is called)."""
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    r = v.shape[2] // q.shape[2]
    return q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2), v, g, b.sigmoid()


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES)
def test_reference_matches_hf(Hk, Hv, Dk, Dv):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    # the reference against HF's torch forms: both plain torch, compared on the CPU (on the H200
    # HF's chunked form, with its in-chunk triangular solve, was 5e-4 off: not what is tested here)
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, "cpu")
    # decode: B rows, one token each (HF batch B, T=1)
    B = 4
    q, k, v, a, b = _inputs(g, B, Hk, Hv, Dk, Dv, torch.float32, "cpu")
    slots = torch.tensor([3, 6, 0, 1], dtype=torch.int32, device="cpu")
    st_r = state0.clone()
    ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, st_r, slots)
    hq, hk, hv, hg, hb = _hf_inputs(q[:, None], k[:, None], v[:, None], a[:, None], b[:, None], A_log, dt_bias)
    o_hf, s_hf = torch_recurrent_gated_delta_rule(hq, hk, hv, g=hg, beta=hb, initial_state=state0[slots.long()].clone(),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref, o_hf[:, 0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_r[slots.long()], s_hf, atol=1e-5, rtol=1e-5)

    # prefill: T tokens of one session, against HF's recurrent and chunked forms
    T = 9
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, torch.float32, "cpu")
    st_r = state0.clone()
    ref = gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, st_r, 4)
    hq, hk, hv, hg, hb = _hf_inputs(q[None], k[None], v[None], a[None], b[None], A_log, dt_bias)
    o_hf, s_hf = torch_recurrent_gated_delta_rule(hq, hk, hv, g=hg, beta=hb, initial_state=state0[4:5].clone(),
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref, o_hf[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st_r[4], s_hf[0], atol=1e-5, rtol=1e-5)
    o_c, s_c = torch_chunk_gated_delta_rule(hq, hk, hv, g=hg, beta=hb, chunk_size=4, initial_state=state0[4:5].clone(),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ref, o_c[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(st_r[4], s_c[0], atol=1e-4, rtol=1e-4)


POOL = 40


@settings(max_examples=12, deadline=None)
@given(
    perm=st.permutations(list(range(POOL))),
    n=st.integers(1, 33),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    shape=st.sampled_from(SHAPES),
    rows_path=st.booleans(),
)
def test_rows_batch_invariant(perm, n, dtype, shape, rows_path):
    """Each row's output and its slot's new state are bitwise the same in a batch and alone."""
    with launcher_path(GD, rows_path):
        _check_rows_batch_invariant(perm, n, dtype, shape)


def _check_rows_batch_invariant(perm, n, dtype, shape):
    device = "cpu" if INTERPRET else "cuda"
    Hk, Hv, Dk, Dv = shape
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=n, pool=POOL)
    q, k, v, a, b = _inputs(g, POOL, Hk, Hv, Dk, Dv, dtype, device)  # one input row per slot
    slots = torch.tensor(perm[:n], dtype=torch.int32, device=device)
    idx = slots.long()

    st_b = state0.clone()
    out_b = poisoned((n, Hv, Dv), device=device)
    gdn_decode(q[idx], k[idx], v[idx], a[idx], b[idx], A_log, dt_bias, st_b, slots, out=out_b)
    untouched = sorted(set(range(POOL)) - set(perm[:n]))
    assert torch.equal(st_b[untouched], state0[untouched])
    for i in range(n):
        s = perm[i]
        st_a = state0.clone()
        out_a = poisoned((1, Hv, Dv), device=device)
        sl = slice(s, s + 1)
        gdn_decode(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, st_a, slots[i : i + 1], out=out_a)
        assert torch.equal(out_a[0], out_b[i]), f"row {i} (slot {s}) output differs in batch of {n}"
        assert torch.equal(st_a[s], st_b[s]), f"row {i} (slot {s}) state differs in batch of {n}"


def _norm_in_decode():
    """The table's rules, with every whole-heads entry fusing the gated norm at any row count (the GPU table
    leaves it off: GDNConfig.norm_rows)."""
    rule = GD.GDN_CONFIGS.interp_rule if INTERPRET else GD.GDN_CONFIGS.gpu_rule

    def forced(*key):
        cfg = rule(*key)
        return dataclasses.replace(cfg, norm_rows=1 << 16) if len(key) == 5 and key[4] else cfg
    return GD.GDN_CONFIGS.forced(forced)


@pytest.mark.parametrize("layout", ["dv", "dk"])
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES + [(2, 4, 16, 16), (1, 2, 20, 12)])
def test_decode_with_gated_norm_is_gated_rms_norm(path, device, Hk, Hv, Dk, Dv, layout):
    """gdn_decode(..., z=, norm_w=) == gated_rms_norm(gdn_decode(...), z, norm_w), bitwise, with
    the same new state (z a strided view of a projection, as in Qwen3-Next). With the state Dk-contiguous
    the one-row kernel computes the norm itself (whole heads a program) -- the norm kernel's bits because
    both sum the squares as norm.rstd_of's fixed tree (tests/test_backend.py: pair_sum, with its control)."""
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=5)
    if layout == "dk":
        state0 = _dk_major(state0)
        assert GD.state_layout(state0) == "dk"
    B = 5
    q, k, v, a, b = _inputs(g, B, Hk, Hv, Dk, Dv, torch.float32, device)
    proj = torch.randn(B, Hv * Dv + 7, generator=g).to(device)
    z = proj[:, 3:3 + Hv * Dv].unflatten(1, (Hv, Dv))
    w = (1 + 0.1 * torch.randn(Dv, generator=g)).to(device)
    slots = torch.tensor([4, 0, 6, 2, 3], dtype=torch.int32, device=device)
    st1, st2 = state0.clone(), state0.clone()
    o = gdn_decode(q, k, v, a, b, A_log, dt_bias, st1, slots)
    sep = gated_rms_norm(o.reshape(B * Hv, Dv), z.reshape(B * Hv, Dv), w, 1e-6).view(B, Hv, Dv)
    with _norm_in_decode():
        fused = gdn_decode(q, k, v, a, b, A_log, dt_bias, st2, slots, z=z, norm_w=w, norm_eps=1e-6)
    assert torch.equal(fused, sep) and torch.equal(st1, st2)
    # out_dtype: the same y rounded to nearest even (what a bf16 out_proj rounds it to), the same state
    st3 = state0.clone()
    with _norm_in_decode():
        narrow = gdn_decode(q, k, v, a, b, A_log, dt_bias, st3, slots, z=z, norm_w=w, norm_eps=1e-6,
                            out_dtype=torch.bfloat16)
    assert narrow.dtype == torch.bfloat16 and torch.equal(narrow, sep.to(torch.bfloat16)) and torch.equal(st3, st1)
    with pytest.raises(ValueError, match="out_dtype"):   # o itself (no norm) stays fp32
        gdn_decode(q, k, v, a, b, A_log, dt_bias, state0.clone(), slots, out_dtype=torch.bfloat16)


@pytest.mark.skipif(not INTERPRET, reason="the rows path is the interpreter's")
@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES + [(1, 2, 20, 12)])
def test_rows_path_equals_one_row_kernel(Hk, Hv, Dk, Dv):
    """The interpreter's rows kernel runs _gdn_step's operations with a leading row axis: the same
    bits and the same new state as the one-row kernel (and so as gdn_prefill)."""
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, "cpu", seed=6)
    q, k, v, a, b = _inputs(g, 6, Hk, Hv, Dk, Dv, torch.bfloat16, "cpu")
    slots = torch.tensor([5, 0, 6, 2, 3, 1], dtype=torch.int32)
    res = {}
    for rows in (True, False):
        st = state0.clone()
        with launcher_path(GD, rows):
            res[rows] = gdn_decode(q, k, v, a, b, A_log, dt_bias, st, slots), st
    assert torch.equal(res[True][0], res[False][0]) and torch.equal(res[True][1], res[False][1])


@pytest.mark.parametrize("Hk,Hv,Dk,Dv", SHAPES)
def test_prefill_keeps_every_token_state(device, Hk, Hv, Dk, Dv):
    """``states_out[t]`` is bitwise the state a prefill of the first t + 1 tokens leaves (what a
    speculative rollback restores), and keeping them changes neither the output nor the final state."""
    T = 5
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=3)
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, torch.float32, device)
    st, st_plain = state0.clone(), state0.clone()
    kept = poisoned((T, Hv, Dk, Dv), device=device)
    out = gdn_prefill(q, k, v, a, b, A_log, dt_bias, st, 4, states_out=kept)
    assert torch.equal(out, gdn_prefill(q, k, v, a, b, A_log, dt_bias, st_plain, 4))
    assert torch.equal(st, st_plain) and torch.equal(kept[-1], st[4])
    for t in range(T):
        prefix = state0.clone()
        gdn_prefill(q[:t + 1], k[:t + 1], v[:t + 1], a[:t + 1], b[:t + 1], A_log, dt_bias, prefix, 4)
        assert torch.equal(kept[t], prefix[4]), t
    ref_kept = torch.empty_like(kept)
    gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, state0.clone(), 4, states_out=ref_kept)
    torch.testing.assert_close(kept, ref_kept, **TOL[torch.float32])
    with pytest.raises(ValueError, match="states_out"):
        gdn_prefill(q, k, v, a, b, A_log, dt_bias, st, 4, states_out=kept[:2])


# ----------------------------------------------------------------------------- several sessions in one launch

# (first row, rows, slot, states row or -1): three chunks in slot order 5, 0, 3, the first and last keeping
# their states (rows 0-3 and 4-9 of the kept-states buffer); row 4 belongs to no segment (a decode row of a
# mixed step, run by gdn_decode) and must be left alone.
SEGMENTS = [(0, 4, 5, 0), (5, 3, 0, -1), (8, 6, 3, 4)]
KEPT_ROWS = 10


def _segments_case(device, Hk=2, Hv=4, Dk=16, Dv=24, seed=11):
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=seed)
    q, k, v, a, b = _inputs(g, 14, Hk, Hv, Dk, Dv, torch.bfloat16, device)
    return (q, k, v, a, b, A_log, dt_bias), state0


def _run_segments(args, state0, device, segments=SEGMENTS):
    st = state0.clone()
    R, Hv, Dv = args[2].shape
    Dk = args[0].shape[2]
    out = poisoned((R, Hv, Dv), device=device)
    kept = poisoned((KEPT_ROWS, Hv, Dk, Dv), device=device)
    table = torch.tensor(segments, dtype=torch.int64, device=device)
    GD.gdn_prefill_segments(*args, st, table, out=out, states_out=kept)
    return out, st, kept


def test_segments_equal_each_session_alone(device):
    """One launch over three sessions' chunks: every row's output, every kept state and each slot's final
    state are bitwise those of gdn_prefill on that session alone; rows and slots outside the segments are
    not written, and the kept-states buffer holds the keeping segments' rows, every one written."""
    args, state0 = _segments_case(device)
    out, st, kept = _run_segments(args, state0, device)
    alone_state = state0.clone()
    for r0, n, slot, s0 in SEGMENTS:
        rows = slice(r0, r0 + n)
        keep_t = poisoned((n,) + tuple(kept.shape[1:]), device=device) if s0 >= 0 else None
        o = gdn_prefill(*(t[rows] for t in args[:5]), *args[5:], alone_state, slot, states_out=keep_t)
        assert torch.equal(out[rows], o), (r0, slot)
        assert torch.equal(st[slot], alone_state[slot]), slot
        if s0 >= 0:
            assert torch.equal(kept[s0:s0 + n], keep_t)
    assert torch.isnan(out[4]).all() and not torch.isnan(kept).any()
    untouched = [s for s in range(S) if s not in (5, 0, 3)]
    assert torch.equal(st[untouched], state0[untouched])


def test_segments_match_reference(device):
    args, state0 = _segments_case(device, seed=12)
    out, st, kept = _run_segments(args, state0, device)
    st_r = state0.clone()
    kept_r = torch.full_like(kept, float("nan"))
    ref = GD.gdn_prefill_segments_ref(*args, st_r, torch.tensor(SEGMENTS), states_out=kept_r)
    rows = [r for r0, n, _, _ in SEGMENTS for r in range(r0, r0 + n)]
    torch.testing.assert_close(out[rows], ref[rows], **TOL[torch.float32])
    torch.testing.assert_close(st, st_r, **TOL[torch.float32])
    torch.testing.assert_close(kept, kept_r, equal_nan=True, **TOL[torch.float32])


def test_segments_control_one_ulp_in_one_session_is_seen_there_only(device):
    """Negative control of the comparison above: a one-ulp change to one input of the middle session
    changes that session's rows and slot, and nothing of the other two (segments do not leak)."""
    args, state0 = _segments_case(device, seed=13)
    out, st, _ = _run_segments(args, state0, device)
    a2 = args[3].clone()
    a2.view(torch.int16)[6, 1] += 1   # the next bf16 value
    out2, st2, _ = _run_segments((*args[:3], a2, *args[4:]), state0, device)
    assert not torch.equal(out2[6:8], out[6:8]) and not torch.equal(st2[0], st[0])
    assert torch.equal(out2[:4], out[:4]) and torch.equal(out2[8:], out[8:])
    assert torch.equal(st2[5], st[5]) and torch.equal(st2[3], st[3])


def test_segments_bad_table(device):
    args, state0 = _segments_case(device)
    with pytest.raises(ValueError, match=r"\[M, 4\]"):
        GD.gdn_prefill_segments(*args, state0.clone(), torch.zeros(2, 3, dtype=torch.int64, device=device))
    out = GD.gdn_prefill_segments(*args, state0.clone(), torch.zeros(0, 4, dtype=torch.int64, device=device),
                                  out=poisoned(tuple(args[2].shape), device=device))
    assert torch.isnan(out).all()


# ----------------------------------------------------------------------------- how far prefill loads run ahead

@pytest.mark.parametrize("prefetch", [False, True])
def test_prefill_lookahead_keeps_decode_bits(device, prefetch):
    """Prefill with or without the next token's loads issued before this token's step
    (``GDNConfig.prefetch``) gives every segment's outputs, kept states and final state bitwise equal to
    decode steps, for chunks of 1, 2, 3 and 7 tokens (the lookahead's edges), the state Dk-contiguous as
    the models keep it. Control: one ulp in a chunk's last token (the one loaded ahead) changes
    its last output."""
    Hk, Hv, Dk, Dv = 2, 4, 16, 24
    base = GD.GDN_CONFIGS(Hv, Dk, Dv, "dk")
    cfg = GD.GDNConfig(block_h=base.block_h, block_k=base.block_k, block_v=base.block_v,
                       num_warps=base.num_warps, prefetch=prefetch)
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=21)
    state0 = _dk_major(state0)
    segments = [(0, 1, 1, -1), (1, 2, 2, 0), (3, 3, 4, 2), (6, 7, 6, -1)]   # (first row, T, slot, states row)
    q, k, v, a, b = _inputs(g, 13, Hk, Hv, Dk, Dv, torch.bfloat16, device)
    table = torch.tensor(segments, dtype=torch.int64, device=device)
    with GD.GDN_CONFIGS.forced(lambda *key: cfg):
        st = state0.clone()
        kept = _dk_major(poisoned((5, Hv, Dk, Dv), device=device))
        out = GD.gdn_prefill_segments(q, k, v, a, b, A_log, dt_bias, st, table, states_out=kept)
        st_d = state0.clone()
        for r0, T, slot, s0 in segments:
            one = torch.tensor([slot], dtype=torch.int32, device=device)
            for t in range(r0, r0 + T):
                o = gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias, st_d, one)
                assert torch.equal(out[t:t + 1], o), (prefetch, t)
                if s0 >= 0:
                    assert torch.equal(kept[s0 + t - r0], st_d[slot]), (prefetch, t)
        assert torch.equal(st, st_d)
        # control: the 7-token chunk's last token, one ulp off in its gate input
        b2 = b.clone()
        b2.view(torch.int16)[12] += 1
        out2 = GD.gdn_prefill_segments(q, k, v, a, b2, A_log, dt_bias, state0.clone(), table)
    assert torch.equal(out2[:12], out[:12]) and not torch.equal(out2[12], out[12])


# ----------------------------------------------------------------------------- the state's layout and the tile

def _dk_major(state):
    """The same values stored with Dk contiguous (the models' pools: StateSpec order (0, 2, 1))."""
    return state.transpose(2, 3).contiguous().transpose(2, 3)


def test_state_layout_names_the_contiguous_dim():
    s = torch.zeros(2, 3, 16, 8)
    assert GD.state_layout(s) == "dv" and GD.state_layout(_dk_major(s)) == "dk"
    assert GD.state_layout(torch.zeros(2, 3, 1, 8)) == "dv"   # Dk = 1: no layout to tell, the row-major tile


@pytest.mark.parametrize("layout", ["dv", "dk"])
def test_both_layouts_give_the_reference(device, layout):
    """A Dk-contiguous state (a strided view) is read and written in place like a contiguous one; the
    result is the reference's within fp32 noise, the state keeps its strides."""
    Hk, Hv, Dk, Dv, T = 2, 4, 16, 24, 5
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=31)
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, torch.bfloat16, device)
    st = _dk_major(state0) if layout == "dk" else state0.clone()
    strides = st.stride()
    out = gdn_prefill(q, k, v, a, b, A_log, dt_bias, st, 3)
    ref_state = state0.clone()
    ref = gdn_prefill_ref(q, k, v, a, b, A_log, dt_bias, ref_state, 3)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])
    torch.testing.assert_close(st, ref_state, **TOL[torch.bfloat16])
    assert st.stride() == strides and GD.state_layout(st) == layout


def test_dk_major_state_gives_one_set_of_bits_for_every_tile(device):
    """With Dk contiguous every Dk reduction of a token runs in one warp's lanes on S's layout (the norms
    too: q, k are broadcast to S's shape), so the Dv tile and warp count change no bit: prefill under
    one tile equals decode steps under another (the decode and prefill tiles may differ). Control (GPU,
    Qwen3-Next's Dk = Dv = 128): the Dv-contiguous layout spreads Dk over warps and two of its tiles give
    other bits -- the comparison can fail. In the interpreter every tile reduces alike; there the control
    is a one-ulp input change."""
    Hk, Hv, Dk, Dv, T = 1, 2, (16 if INTERPRET else 128), (24 if INTERPRET else 128), 12
    g, A_log, dt_bias, state0 = _params(Hv, Dk, Dv, device, seed=41)
    q, k, v, a, b = _inputs(g, T, Hk, Hv, Dk, Dv, torch.bfloat16, device)
    BK = triton.next_power_of_2(Dk)
    tiles = [GD.GDNConfig(block_h=1, block_k=BK, block_v=bv, num_warps=w) for bv, w in [(8, 1), (16, 2), (32, 4)]]

    def prefill(cfg, state):
        with GD.GDN_CONFIGS.forced(lambda *key: cfg):
            return gdn_prefill(q, k, v, a, b, A_log, dt_bias, state, 1), state

    def decode(cfg, state):
        one = torch.tensor([1], dtype=torch.int32, device=device)
        with GD.GDN_CONFIGS.forced(lambda *key: cfg):
            o = torch.cat([gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log, dt_bias,
                                      state, one) for t in range(T)])
        return o, state

    first_o, first_s = prefill(tiles[0], _dk_major(state0))
    for pre_cfg, dec_cfg in [(tiles[1], tiles[0]), (tiles[2], tiles[1]), (tiles[0], tiles[2])]:
        po, ps = prefill(pre_cfg, _dk_major(state0))
        do, ds = decode(dec_cfg, _dk_major(state0))
        assert torch.equal(po, first_o) and torch.equal(ps, first_s), pre_cfg
        assert torch.equal(do, first_o) and torch.equal(ds, first_s), dec_cfg
    if INTERPRET:
        b2 = b.clone()
        b2.view(torch.int16)[T - 1, 0] += 1
        with GD.GDN_CONFIGS.forced(lambda *key: tiles[0]):
            o2 = gdn_prefill(q, k, v, a, b2, A_log, dt_bias, _dk_major(state0), 1)
        assert torch.equal(o2[:T - 1], first_o[:T - 1]) and not torch.equal(o2[T - 1], first_o[T - 1])
    else:
        o8, s8 = prefill(tiles[0], state0.clone())
        o32, s32 = prefill(tiles[2], state0.clone())
        assert not (torch.equal(o8, o32) and torch.equal(s8, s32)), "Dv-contiguous tiles agreed: control lost"
