"""Token selection: argmax, seeded sampling (exact token vs the reference, batch invariance,
determinism per (seed, stream, position), statistics, HF top-k / top-p semantics)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ds4t.kernels.sampling as S
from ds4t.backend import default_device
from ds4t.kernels.sampling import (
    argmax,
    argmax_ref,
    candidates_ref,
    gumbel_noise,
    sample,
    sample_ref,
)
from tests.kernels.devices import gen
from tests.kernels.invariance import assert_rows_invariant

pytestmark = pytest.mark.usefixtures("on_kernel_device")


def _out(B):
    return torch.full((B,), -7, dtype=torch.int64)  # "poisoned": -7 is never a token


def _settings(B, g, greedy_rows=True):
    temp = torch.rand(B, generator=g) * 1.5 + 0.2
    if greedy_rows:
        temp[::7] = 0.0
    tk = torch.randint(0, 30, (B,), generator=g).to(torch.int32)
    tk[::3] = 0
    tp = torch.rand(B, generator=g) * 0.6 + 0.4
    tp[1::4] = 1.0
    return temp, tk, tp


def _ids(B, g):
    seeds = torch.randint(-2 ** 62, 2 ** 62, (B,), generator=g)
    streams = torch.randint(0, 2 ** 40, (B,), generator=g)
    pos = torch.randint(0, 100000, (B,), generator=g)
    return seeds, streams, pos


# ----------------------------------------------------------------------------- argmax


@pytest.mark.parametrize("B,V", [(1, 1), (5, 37), (9, 1000)])
def test_argmax_vs_torch(B, V):
    g = gen(V)
    x = torch.randn(B, V, generator=g)
    out = _out(B)
    assert argmax(x, out=out) is out
    assert torch.equal(out, argmax_ref(x))


@pytest.mark.parametrize("V", [37, 1000])
def test_a_row_holding_a_nan_has_no_token_and_its_neighbours_keep_theirs(V):
    """A NaN anywhere in a row (or the whole row NaN) gives NO_TOKEN in argmax and in every sampling mode,
    in the kernels and the references; the other rows of the call get the tokens they get without it.
    (Before: an all-NaN row returned 2147483647, past any vocabulary; a partly-NaN row ignored the NaN.)"""
    g = gen(V + 1)
    B = 6
    x = torch.randn(B, V, generator=g)
    clean = x.clone()
    x[1] = float("nan")
    x[4, V // 2] = float("nan")
    temp, tk, tp = _settings(B, g)
    temp[1] = temp[4] = 0.9
    ids = _ids(B, g)
    ok = torch.tensor([i not in (1, 4) for i in range(B)], device="cpu")
    for got, ref, want in [(argmax(x, out=_out(B)), argmax_ref(x), argmax(clean)),
                           (sample(x, *ids, temp, tk, tp, out=_out(B)), sample_ref(x, *ids, temp, tk, tp),
                            sample(clean, *ids, temp, tk, tp))]:
        got = got.cpu()
        assert got[1] == got[4] == S.NO_TOKEN and torch.equal(got, ref.cpu())
        want = want.cpu()
        assert torch.equal(got[ok], want[ok]) and (want >= 0).all()
    greedy = torch.zeros(B)
    assert torch.equal(sample(x, *ids, greedy, tk, tp).cpu(), argmax(x).cpu())


def _chunked(V, block_v):
    """16 rows per program and vocab chunks of ``block_v``; the backend's warps."""
    warps = S.SAMPLING_CONFIGS(V).num_warps
    return S.SAMPLING_CONFIGS.forced(lambda V: S.SamplingConfig(rows=16, block_v=block_v, num_warps=warps))


def test_argmax_first_index_of_ties_and_chunks():
    x = torch.randn(4, 300)
    x[0, 7] = x[0, 250] = 100.0          # tie across chunks
    x[1, :] = -1.0                        # all equal
    x[2, 299] = 50.0                      # last index
    x[3, 64] = x[3, 65] = float("inf")    # inf ties
    want = torch.tensor([7, 0, 299, 64])
    assert torch.equal(argmax(x), want)
    with _chunked(300, 64):                # chunked path: 5 chunks
        assert torch.equal(argmax(x), want)
    x16 = x.bfloat16()
    assert torch.equal(argmax(x16), argmax_ref(x16))


# ----------------------------------------------------------------------------- sample vs reference


@pytest.mark.parametrize("B,V", [(40, 257), (7, 1000)])
def test_sample_vs_ref(B, V):
    g = gen(B + V)
    x = torch.randn(B, V, generator=g) * 3
    temp, tk, tp = _settings(B, g)
    seeds, streams, pos = _ids(B, g)
    out = _out(B)
    res = sample(x, seeds, streams, pos, temp, tk, tp, out=out)
    assert res is out
    assert torch.equal(res, sample_ref(x, seeds, streams, pos, temp, tk, tp))
    assert bool(candidates_ref(x, temp, tk, tp).gather(1, res[:, None]).all())


def test_sample_vs_ref_chunked():
    """The multi-chunk path (large vocabularies) picks the same tokens as the reference."""
    g = gen(5)
    B, V = 4, 300  # 3 chunks, the last one partial
    x = torch.randn(B, V, generator=g) * 2
    temp = torch.tensor([0.0, 1.0, 0.8, 1.2])
    tk = torch.tensor([0, 0, 12, 40], dtype=torch.int32)
    tp = torch.tensor([1.0, 0.7, 1.0, 0.9])
    seeds, streams, pos = _ids(B, g)
    with _chunked(V, 128):
        got = sample(x, seeds, streams, pos, temp, tk, tp)
    assert torch.equal(got, sample_ref(x, seeds, streams, pos, temp, tk, tp))


def test_sample_is_gumbel_max_with_the_public_noise():
    g = gen(8)
    B, V = 20, 50
    x = torch.randn(B, V, generator=g)
    seeds, streams, pos = _ids(B, g)
    ones = torch.ones(B)
    res = sample(x, seeds, streams, pos, ones, torch.zeros(B, dtype=torch.int32), ones)
    assert torch.equal(res, torch.argmax(x + gumbel_noise(seeds, streams, pos, V), dim=-1))


def test_temperature_zero_and_top_k_one_are_argmax():
    g = gen(9)
    B, V = 24, 200
    x = torch.randn(B, V, generator=g) * 4
    seeds, streams, pos = _ids(B, g)
    want = torch.argmax(x, dim=-1)
    z = torch.zeros(B)
    tk = torch.randint(0, 5, (B,), generator=g).to(torch.int32)
    tp = torch.rand(B, generator=g)
    assert torch.equal(sample(x, seeds, streams, pos, z, tk, tp), want)  # T = 0 ignores top-k / top-p
    t = torch.rand(B, generator=g) * 3 + 0.1
    one = torch.ones(B, dtype=torch.int32)
    assert torch.equal(sample(x, seeds, streams, pos, t, one, torch.ones(B)), want)
    assert torch.equal(sample(x, seeds, streams, pos, t, one, torch.full((B,), 0.5)), want)
    # top_p -> 0 keeps only the max as well
    assert torch.equal(sample(x, seeds, streams, pos, t, torch.zeros(B, dtype=torch.int32),
                              torch.full((B,), 1e-6)), want)


# ----------------------------------------------------------------------------- determinism / invariance

POOL = 33
with torch.device(default_device()):
    _g = gen(33)
    _X = torch.randn(POOL, 100, generator=_g) * 2
    _TEMP, _TK, _TP = _settings(POOL, _g)
    _SEEDS, _STREAMS, _POS = _ids(POOL, _g)


def _run(rows):
    return sample(_X[rows], _SEEDS[rows], _STREAMS[rows], _POS[rows], _TEMP[rows], _TK[rows], _TP[rows])


@settings(max_examples=10, deadline=None)
@given(st.tuples(st.permutations(range(POOL)), st.integers(1, POOL)).map(lambda t: t[0][: t[1]]).flatmap(
    lambda rows: st.tuples(st.just(rows), st.integers(0, len(rows) - 1))))
def test_sample_rows_invariant(case):
    rows, i = case
    assert_rows_invariant(_run, rows, i)


def test_same_seed_stream_position_same_token_anywhere():
    # one row repeated at every position of a batch, among other rows: always the same token
    rows = list(range(POOL))
    full = _run(rows)
    for r in (0, 5, 17, 32):
        mixed = [x for x in rows if x != r]
        mixed.insert(r % 7, r)
        res = _run(mixed)
        assert res[mixed.index(r)] == full[r]
        assert _run([r])[0] == full[r]
    # noise depends on each of seed, stream, position (not on the row)
    n = gumbel_noise(torch.tensor([1, 1, 1, 2]), torch.tensor([5, 5, 6, 5]), torch.tensor([9, 10, 9, 9]), 64)
    for a in range(4):
        for b in range(a + 1, 4):
            assert not torch.equal(n[a], n[b])
    assert torch.equal(gumbel_noise(torch.tensor([1]), torch.tensor([5]), torch.tensor([9]), 64)[0], n[0])


# ----------------------------------------------------------------------------- statistics


def _freq(draws, V):
    return torch.bincount(draws, minlength=V).double() / draws.numel()


def test_sample_frequencies_match_softmax():
    """Over many positions of one session (fixed seed and stream) the draws follow softmax(z / T),
    restricted and renormalised by top-k / top-p."""
    V, N = 6, 2000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, 0.3])
    x = logits.expand(N, V).contiguous()
    seeds = torch.full((N,), 42, dtype=torch.int64)
    streams = torch.full((N,), 3, dtype=torch.int64)
    pos = torch.arange(N, dtype=torch.int64)
    for T, k, p in ((1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8)):
        temp = torch.full((N,), T)
        tk = torch.full((N,), k, dtype=torch.int32)
        tp = torch.full((N,), p)
        draws = sample(x, seeds, streams, pos, temp, tk, tp)
        keep = candidates_ref(x[:1], temp[:1], tk[:1], tp[:1])[0]
        probs = torch.where(keep, torch.softmax(logits.double() / T, -1), torch.zeros(V, dtype=torch.float64))
        probs = probs / probs.sum()
        f = _freq(draws, V)
        sigma = (probs * (1 - probs) / N).sqrt()
        assert bool((f[~keep] == 0).all()), (T, k, p, f)
        assert bool(((f - probs).abs() <= 4.5 * sigma + 1e-12).all()), (T, k, p, f, probs)
    # different seeds (one position) give the same distribution
    temp = torch.ones(N)
    draws = sample(x, torch.arange(N, dtype=torch.int64), streams, torch.zeros(N, dtype=torch.int64), temp,
                   torch.zeros(N, dtype=torch.int32), torch.ones(N))
    probs = torch.softmax(logits.double(), -1)
    assert bool(((_freq(draws, V) - probs).abs() <= 4.5 * (probs * (1 - probs) / N).sqrt()).all())


def test_noise_is_uniform_enough():
    u = torch.exp(-torch.exp(-gumbel_noise(torch.tensor([7]), torch.tensor([1]), torch.tensor([0]), 1 << 16)[0]))
    hist = torch.histc(u, bins=16, min=0, max=1)
    exp = u.numel() / 16
    chi2 = ((hist - exp) ** 2 / exp).sum().item()
    assert chi2 < 40.0  # 15 dof: p ~ 5e-4


# ----------------------------------------------------------------------------- HF semantics


def test_candidates_match_hf_warpers():
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    g = gen(12)
    V = 300
    for _ in range(12):
        x = torch.randn(1, V, generator=g) * 3
        T = float(torch.rand(1, generator=g)) * 1.5 + 0.3
        k = int(torch.randint(0, 60, (1,), generator=g))
        p = float(torch.rand(1, generator=g)) * 0.9 + 0.05
        s = TemperatureLogitsWarper(T)(None, x.clone())
        if k > 0:
            s = TopKLogitsWarper(k)(None, s)
        s = TopPLogitsWarper(p)(None, s)
        hf_keep = s[0] > float("-inf")
        mine = candidates_ref(x, torch.tensor([T]), torch.tensor([k]), torch.tensor([p]))[0]
        assert torch.equal(mine, hf_keep), (T, k, p)
        # and the kernel only ever picks from that set
        tok = sample(x.expand(64, V).contiguous(), torch.arange(64), torch.zeros(64, dtype=torch.int64),
                     torch.zeros(64, dtype=torch.int64), torch.full((64,), T),
                     torch.full((64,), k, dtype=torch.int32), torch.full((64,), p))
        assert bool(hf_keep[tok].all())


def test_bad_args_and_empty():
    with pytest.raises(ValueError):
        sample(torch.randn(2, 5), torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
               torch.zeros(2, dtype=torch.int64), torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    z = torch.zeros(0, dtype=torch.int64)
    assert sample(torch.randn(0, 5), z, z, z, torch.ones(0), torch.zeros(0, dtype=torch.int32),
                  torch.ones(0)).shape == (0,)
    assert argmax(torch.randn(0, 5)).shape == (0,)
