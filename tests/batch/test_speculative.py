"""Exact speculative decoding (ds4t.batch.speculative): tokens, logits and state equal plain decoding."""
import pytest
import torch

import ds4t
from ds4t import BatchError, DecodeItem
from ds4t.batch import speculative as spec
from ds4t.exactness.speculative import has_recurrent_rollback, plant, run_speculative
from ds4t.step import SegmentSpec, StepBatch

FAMILIES = ["tiny-qwen", "tiny-deepseek", "tiny-glm", "tiny-llama"]   # llama: no MTP head, replayed drafts


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return ds4t.load(request.param)


def test_speculative_equals_plain_decoding(model):
    """Random mixes: MTP and replayed drafts (every acceptance length), k = 0 rows, greedy and seeded
    sampling, sessions joining by a prompt chunk inside a verify call."""
    r = run_speculative(model, k=3, sessions=4, new_tokens=8, seed=1)
    assert r.ok, r.first_mismatch
    assert r.calls > 0 and r.drafted > 0 and 0 < r.accepted < r.drafted
    assert r.emitted > r.calls   # some calls advanced a session by more than one token


@pytest.mark.parametrize("kind", ["accept-one-more", "skip-rollback"])
def test_negative_controls(model, kind):
    """The comparison catches an off-by-one in acceptance and a rollback that keeps stale recurrent
    state (the latter only where the model has recurrent state to roll back)."""
    if kind == "skip-rollback" and not has_recurrent_rollback(model):
        pytest.skip("position-addressed state only: nothing to roll back")
    with plant(kind, model):
        r = run_speculative(model, k=3, sessions=3, new_tokens=6, seed=1)
    assert r.mismatches > 0


def test_mtp_head_is_chunk_invariant():
    """The MTP head over a chunk of rows equals it row by row (drafts never depend on how a
    session's history reached the head), and its cache lives in the session's slot."""
    m = ds4t.load("tiny-deepseek")
    a, b = m.new_session(32), m.new_session(32)
    h = torch.randn(5, m.cfg.hidden_size, generator=torch.Generator().manual_seed(0)).to(m.device)
    toks = [3, 1, 4, 1, 5]
    whole = StepBatch.build([SegmentSpec(a.slot, toks, 0, all_logits=True)], m.device)
    lw = m.mtp_forward(whole, h)
    rows = []
    for j, t in enumerate(toks):
        one = StepBatch.build([SegmentSpec(b.slot, [t], j)], m.device)
        rows.append(m.mtp_forward(one, h[j:j + 1])[0])
    assert torch.equal(lw, torch.stack(rows))
    st_a, st_b = a.state_dict(), b.state_dict()   # (cut at pos 0: compare the slots' caches directly)
    L = m.mtp_state_prefix + "latent"
    assert torch.equal(m.pool.tensors[L][a.slot, :5], m.pool.tensors[L][b.slot, :5])
    assert set(st_a) == set(st_b)


def test_bad_input_changes_nothing():
    m = ds4t.load("tiny-qwen")
    s = m.new_session(16)
    spec.prefill([DecodeItem(s, [1, 2, 3])])
    pos, toks = s.pos, list(s.tokens)
    cases = [
        ([spec.SpecItem(s, 5, k=-1)], "k must be"),
        ([spec.SpecItem(s, 5, k=3, drafts=[1])], "drafts given"),
        ([spec.SpecItem(s, 999, k=1)], "outside the vocabulary"),
        ([spec.SpecItem(s, 5, k=1, drafts=[999])], "outside the vocabulary"),
        ([spec.SpecItem(s, 5), spec.SpecItem(s, 6)], "already in the batch"),
        ([spec.SpecItem(s, 5, temperature=-1.0)], "temperature"),
        ([], "empty"),
    ]
    for items, msg in cases:
        with pytest.raises(BatchError, match=msg):
            spec.spec_step(items)
        assert (s.pos, s.tokens) == (pos, toks)
    llama = ds4t.load("tiny-llama")
    t = llama.new_session(16)
    t.prefill([1, 2])
    with pytest.raises(BatchError, match="no MTP head"):
        spec.spec_step([spec.SpecItem(t, 3, k=2)])


def test_k_is_clamped_to_the_session_room():
    m = ds4t.load("tiny-llama")
    s = m.new_session(6)
    s.prefill([1, 2, 3, 4])
    (r,), _ = spec.spec_step([spec.SpecItem(s, 7, k=5, drafts=[1, 2, 3, 4, 5])])
    assert r.drafted == 1 and s.pos <= 6


def test_extra_items_report_their_own_paths():
    """A prompt chunk riding along a verify call reports the path it really ran (GLM with a 6-token
    window: the 8-token chunk runs ordered, the decode row natively)."""
    m = ds4t.load("tiny-glm", native_window=6)
    a, b = m.new_session(32), m.new_session(32)
    lg = spec.prefill([DecodeItem(a, [1, 2, 3])])
    paths: list = []
    res, _ = spec.spec_step([spec.SpecItem(a, int(lg[0].argmax()), k=1)], extra=[DecodeItem(b, list(range(8)))],
                            extra_paths=paths)
    assert res[0].path == "native" and paths == ["ordered"]
    more: list = []
    spec.prefill([DecodeItem(b, [4])], paths=more)
    assert more == ["ordered"]



def test_kept_states_hold_only_the_verify_rows():
    """A long prompt chunk riding along a Qwen3-Next verify chunk: each Gated DeltaNet layer keeps the
    verify chunk's per-token states (for a rollback) in a buffer of the verify rows only, not of every
    row of the step (a prefill chunk of hundreds of rows would multiply that memory per layer)."""
    m = ds4t.load("tiny-qwen")
    a, b = m.new_session(64), m.new_session(64)
    a.prefill([1, 2, 3])
    batch = StepBatch.build([(b.slot, list(range(40)), 0),
                             SegmentSpec(a.slot, [7, 4, 5, 6], a.pos, all_logits=True, keep=True)], m.device)
    assert [s.states_row for s in batch.segments] == [-1, 0]
    m.forward(batch)
    kept = [v for key, v in m._kept.items() if key[1] == a.slot]
    assert kept, "the verify chunk kept nothing"
    for _, inputs, states in kept:
        assert states.shape[0] == inputs.shape[0] == 4
        assert states.untyped_storage().nbytes() == 4 * states[0].numel() * 4   # 4 verify rows, not 44
    m.rollback(a.slot, 4)


def test_a_nan_in_the_mtp_head_ends_the_draft_and_changes_no_token(monkeypatch):
    """The MTP head's logits holding a NaN (its draft has no token) shorten that draft: the step emits the
    tokens plain decoding emits (before: the sampler's 2**31 - 1 was fed back as a draft). Control: without
    the NaN the same step drafts k tokens."""
    m = ds4t.load("tiny-qwen")
    prompt = [5, 6, 7, 8]

    def step(nan_at):
        s = m.new_session(32)
        lg = spec.prefill([DecodeItem(s, prompt)])
        calls = []
        real = type(m).mtp_forward

        def head(self, batch, h):
            out = real(self, batch, h)
            calls.append(1)
            if len(calls) == nan_at:
                out = out.clone()
                out[0] = float("nan")
            return out

        monkeypatch.setattr(type(m), "mtp_forward", head)
        (r,), _ = spec.spec_step([spec.SpecItem(s, int(lg[0].argmax()), k=3)])
        monkeypatch.setattr(type(m), "mtp_forward", real)
        s.close()
        return r

    plain = m.new_session(32)
    lg = plain.prefill(prompt)
    want = []
    for _ in range(4):
        want.append(int(lg.argmax()))
        lg = ds4t.eval_batch([DecodeItem(plain, want[-1])]).logits[0]
    plain.close()
    assert step(nan_at=0).drafted == 3
    for nan_at, drafted in [(1, 0), (2, 1)]:
        r = step(nan_at)
        assert r.drafted == drafted and r.tokens == want[1:len(r.tokens) + 1]
