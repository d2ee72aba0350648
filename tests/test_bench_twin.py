"""bench/twin.py, the non-invariant plain-torch twin of the kernels (the bench's price-of-invariance
baseline): every twin op computes what the ds4t kernel computes, checked op by op inside real decode
steps of the tiny presets, so a twin op with wrong semantics fails here rather than in a GPU run."""
import random

import pytest
import torch

import ds4t
from ds4t.kernels import registry
from ds4t.testing.markers import cpu_interpreter_only
from tests.bench_scripts import load

pytestmark = cpu_interpreter_only

twin = load("bench/twin.py", "bench_twin")

# The tiny presets are fp32: the twin differs from the kernels by summation order only.
TOL = 1e-4


def _sessions(model, n, seed):
    rng = random.Random(seed)
    sessions = [model.new_session(64) for _ in range(n)]
    for s in sessions:
        s.prefill([rng.randrange(model.vocab_size) for _ in range(rng.randint(3, 12))])
    return sessions, [rng.randrange(model.vocab_size) for _ in range(n)]


def _step(sessions, toks):
    return ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode="native").logits


def _assert_close(diffs, names):
    assert set(names) <= set(diffs), f"ops never called: {sorted(set(names) - set(diffs))}"
    bad = {n: d for n, d in diffs.items() if d.max_rel > TOL or d.int_mismatches}
    assert not bad, f"twin ops that differ from the ds4t kernels: {bad}"


# ops each family's decode step calls (what the shadow run must have compared)
STEP_OPS = {
    "tiny-qwen": ["embedding", "rms_norm", "add_rms_norm", "linear", "norm_rope_write_kv", "decode_attention",
                  "conv1d_update", "gdn_decode", "router_softmax_topk", "moe_experts"],
    "tiny-glm": ["embedding", "rms_norm", "add_rms_norm", "linear", "norm_rope_write_kv", "decode_attention",
                 "silu_mul", "router_sigmoid_grouped", "moe_experts"],
    "tiny-deepseek": ["embedding", "rms_norm", "add_rms_norm", "linear", "norm_rope_write_latent", "linear_heads",
                      "mla_decode", "silu_mul", "router_sigmoid_grouped", "moe_experts"],
}


@pytest.mark.parametrize("preset", sorted(STEP_OPS))
def test_twin_ops_match_the_kernels_in_a_decode_step(preset):
    model = ds4t.load(preset, device="cpu")
    sessions, toks = _sessions(model, 3, seed=1)
    ref_state = [s.state_dict() for s in sessions]
    with twin.shadowed("all") as diffs:      # each op both ways, the step runs on the kernels' results
        ref = _step(sessions, toks)
    _assert_close(diffs, STEP_OPS[preset])
    # The whole step on the twin (the gathered-slot path) from the same states: bf16-free, so close.
    for s, st in zip(sessions, ref_state):
        s.load_state_dict(st, s.pos - 1)
    with twin.applied("all") as rep:
        got = _step(sessions, toks)
    assert "moe_experts" in rep.swapped and "gdn_prefill" in rep.kept
    assert (got - ref).abs().max() <= TOL * ref.abs().max()


@pytest.mark.parametrize("preset", sorted(STEP_OPS))
def test_twin_shadows_a_bf16_step_with_narrowed_stores(preset):
    """In bf16 the models ask some ops for bf16 stores (``out_dtype``, registry.ADVISORY_KWARGS); the
    twin's ops take no such keyword and the shadow comparison must call them as an installed override
    is called (keyword dropped), not crash -- the GPU bench's bf16 presets run this path, the fp32 tests
    above do not. Outputs differ by the store's bf16 rounding at most (plus sum order)."""
    model = ds4t.load(preset, device="cpu", dtype="bfloat16")
    sessions, toks = _sessions(model, 2, seed=3)
    seen = []
    real = registry.call_override

    def spy(name, fn, *args, **kwargs):
        seen.append((name, "out_dtype" in kwargs))
        return real(name, fn, *args, **kwargs)

    twin.registry.call_override = spy
    try:
        with twin.shadowed("all") as diffs:
            _step(sessions, toks)
    finally:
        twin.registry.call_override = real
    assert any(narrow for _, narrow in seen), "no op was asked for a narrowed store: the case is not covered"
    assert set(STEP_OPS[preset]) <= set(diffs)
    bad = {n: d for n, d in diffs.items() if d.max_rel > 2e-2 or d.int_mismatches}
    assert not bad, bad


def test_twin_moe_both_implementations_and_the_slots_are_rows_views(monkeypatch):
    """grouped_mm and gathered-weights MoE; slot views instead of gathers when slots are 0..B-1 (and
    the promise is checked)."""
    model = ds4t.load("tiny-qwen", device="cpu")
    sessions, toks = _sessions(model, 3, seed=2)   # slots 0, 1, 2 in batch order
    assert [s.slot for s in sessions] == [0, 1, 2]
    for impl in ("grouped_mm", "gather"):
        monkeypatch.setattr(twin, "MOE_IMPL", impl)
        st = [s.state_dict() for s in sessions]
        with twin.shadowed(["moe_experts"]) as diffs:
            _step(sessions, toks)
        _assert_close(diffs, ["moe_experts"])
        for s, x in zip(sessions, st):
            s.load_state_dict(x, s.pos - 1)
    monkeypatch.setattr(twin, "MOE_IMPL", "auto")
    st = [s.state_dict() for s in sessions]
    ref = _step(sessions, toks)
    for s, x in zip(sessions, st):
        s.load_state_dict(x, s.pos - 1)
    with twin.applied("all", slots_are_rows=True):
        got = _step(sessions, toks)
        assert (got - ref).abs().max() <= TOL * ref.abs().max()
        with pytest.raises(ValueError, match="slots_are_rows"):
            _step(sessions[1:], toks[1:])     # slots 1, 2: not rows 0, 1
    assert not registry.overrides()


def test_twin_ops_outside_decode_steps():
    """The twin ops a pure decode step of the presets does not call: against the kernels directly."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    w = 1 + 0.1 * torch.randn(40, generator=g)
    for name, args in [("silu_mul", (a, b)), ("sigmoid_mul", (a, b)), ("add", (a, b)),
                       ("gated_rms_norm", (a, b, w, 1e-6))]:
        ref, got = registry.op(name).fn(*args), twin.TWIN[name](*args)
        assert (ref - got).abs().max() <= TOL * ref.abs().max(), name


def test_twin_selection_and_report():
    assert twin.resolve("priced") == list(twin.PRICED)
    assert twin.resolve("linear, moe_experts") == ["linear", "moe_experts"]
    with pytest.raises(ValueError, match="no twin"):
        twin.resolve("gdn_prefill")
    with twin.applied("priced") as rep:
        assert sorted(registry.overrides()) == sorted(twin.PRICED)
        assert rep.kept["gdn_decode"] == "not selected" and "prefill" in rep.kept["conv1d_prefill"]
        assert "swapped to plain torch: decode_attention" in rep.describe()
    assert not registry.overrides()
    # every op the registry knows is either twinned or kept with a reason
    assert set(registry.op_names()) == set(twin.TWIN) | set(twin.KEPT)
