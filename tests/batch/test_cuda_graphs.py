"""CUDA-graph replay of decode steps gives the eager step's bits (GPU only), and graphs stay
out of the way on the CPU."""
import random

import pytest
import torch

import ds4t
from ds4t.batch import graphs

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(model, prompts, steps, sizes):
    """Prefill each prompt, then decode greedily in batches of the given sizes (cycled).
    Returns every step's logits and the final state of every session."""
    sessions = [model.new_session(128) for _ in prompts]
    for s, p in zip(sessions, prompts):
        s.prefill(p)
    toks = [7] * len(sessions)
    out = []
    for step in range(steps):
        k = sizes[step % len(sizes)]
        group = list(range(len(sessions)))[:k] if step % 2 == 0 else list(range(len(sessions)))[-k:]
        res = ds4t.eval_batch([ds4t.DecodeItem(sessions[i], toks[i]) for i in group], mode="native")
        for j, i in enumerate(group):
            toks[i] = int(res.logits[j].argmax())
        out.append(res.logits)
    states = [s.state_dict() for s in sessions]
    for s in sessions:
        s.close()
    return out, states


@gpu
@pytest.mark.parametrize("preset,options", [("tiny-qwen", {}), ("tiny-glm", {}), ("tiny-deepseek", {}),
                                            ("tiny-deepseek", {"native_path": "ds4"})])
def test_graph_replay_equals_eager(preset, options):
    rng = random.Random(0)
    prompts = [[rng.randrange(200) for _ in range(rng.randint(1, 40))] for _ in range(6)]
    eager = ds4t.load(preset, device="cuda", **options)
    eager.cuda_graphs = False
    graphed = ds4t.load(preset, device="cuda", **options)
    a_logits, a_states = _run(eager, prompts, 12, [6, 3, 1])
    b_logits, b_states = _run(graphed, prompts, 12, [6, 3, 1])
    stats = graphs.graphs_for(graphed).stats
    assert stats.captures == 3 and stats.replays >= 8 and stats.failures == 0, stats
    assert graphs.graphs_for(eager) is None
    for x, y in zip(a_logits, b_logits):
        assert torch.equal(x, y)
    for sa, sb in zip(a_states, b_states):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k


@gpu
def test_graphs_are_recaptured_when_the_state_pool_grows():
    model = ds4t.load("tiny-qwen", device="cuda")
    first = [model.new_session(32) for _ in range(2)]
    for s in first:
        s.prefill([1, 2, 3])
    for _ in range(3):
        ds4t.eval_batch([ds4t.DecodeItem(s, 5) for s in first], mode="native")
    runner = graphs.graphs_for(model)
    assert runner.stats.replays >= 1
    more = [model.new_session(256) for _ in range(4)]   # pool grows: tensors move
    twin = ds4t.load("tiny-qwen", device="cuda")
    twin.cuda_graphs = False
    t_first = [twin.new_session(32) for _ in range(2)]
    for s in t_first:
        s.prefill([1, 2, 3])
    for _ in range(3):
        ds4t.eval_batch([ds4t.DecodeItem(s, 5) for s in t_first], mode="native")
    for _ in range(3):
        a = ds4t.eval_batch([ds4t.DecodeItem(s, 5) for s in first], mode="native").logits
        b = ds4t.eval_batch([ds4t.DecodeItem(s, 5) for s in t_first], mode="native").logits
        assert torch.equal(a, b)
    assert runner.stats.captures == 2
    for s in more:
        s.close()


def test_no_graphs_on_cpu():
    model = ds4t.load("tiny-qwen", device="cpu")
    assert graphs.graphs_for(model) is None


def test_suspended_turns_graphs_off(monkeypatch):
    class FakeModel:
        device = torch.device("cuda")

    assert graphs.enabled_for(FakeModel())
    with graphs.suspended():
        assert not graphs.enabled_for(FakeModel())
    monkeypatch.setenv("DS4T_CUDA_GRAPHS", "0")
    assert not graphs.enabled_for(FakeModel())


def test_overrides_are_captured_only_inside_the_explicit_opt_in():
    """An override turns graphs off; capture_overrides() turns them back on, keyed by the overrides
    (a graph captured with one set of functions never replays for another or for the ds4t kernels)."""
    from ds4t.kernels import override, registry

    class FakeModel:
        device = torch.device("cuda")

        def graph_key(self, rows):
            return ("decode", rows)

    m = FakeModel()

    def my_linear(x, weight, bias=None, *, out=None, config=None, act_dtype=None):
        return registry.op("linear").fn(x, weight, bias)

    assert graphs.graph_key(m, 3) == ("decode", 3)
    with graphs.capture_overrides():
        assert graphs.enabled_for(m) and graphs.graph_key(m, 3) == ("decode", 3)   # nothing overridden
    with override("linear", my_linear):
        assert not graphs.enabled_for(m)
        with graphs.capture_overrides():
            assert graphs.enabled_for(m)
            key = graphs.graph_key(m, 3)
            assert key[0] == ("decode", 3) and key != ("decode", 3)
            with override("linear", lambda *a, **k: None):   # another function: another key
                assert graphs.graph_key(m, 3) != key
            with registry.recording():                       # recordings still turn graphs off
                assert not graphs.enabled_for(m)
        assert not graphs.enabled_for(m)
    assert graphs.enabled_for(m) and graphs.graph_key(m, 3) == ("decode", 3)


def _sessions(model, prompts):
    out = []
    for p in prompts:
        s = model.new_session(64)
        s.prefill(p)
        out.append(s)
    return out


def _alone(model, sessions, tok=5):
    """Each session's decode step alone (one N = 1 graph for all), queued without reading logits."""
    from ds4t.batch.engine import run_segments
    return [run_segments(model, [(s, [tok])]) for s in sessions]


@gpu
@pytest.mark.parametrize("control", [False, True])
def test_back_to_back_replays_read_their_own_metadata(control):
    """The graph's first node copies the metadata from a pinned host buffer when the GPU reaches it;
    replays queued behind slow work must each see their own step's metadata. Control: without the
    wait for the copy's event, the queued replays read the last one's."""
    prompts = [[1 + i] * (3 + 5 * i) for i in range(5)]
    model = ds4t.load("tiny-glm", device="cuda")
    twin = ds4t.load("tiny-glm", device="cuda")
    twin.cuda_graphs = False
    warm, ref = _sessions(model, prompts), _sessions(twin, prompts)
    _alone(model, warm)
    expect = _alone(twin, ref) + _alone(twin, ref)
    cap = graphs.graphs_for(model).graphs[model.graph_key(1)]
    if control:
        cap.copied = type("NoWait", (), {"synchronize": lambda self: None})()
    torch.cuda._sleep(200_000_000)   # ~0.1 s of GPU work ahead of the replays: they queue
    got = _alone(model, warm)
    same = all(torch.equal(a, b) for a, b in zip(got, expect[len(prompts):]))
    assert same != control
    for s in warm + ref:
        s.close()


@gpu
@pytest.mark.parametrize("control", [False, True])
def test_static_metadata_outlives_other_allocations(control):
    """The device buffer the graph's copy node writes must stay allocated: if only the graph pointed
    at it, the caching allocator would hand its memory to the next small tensor, which every replay
    would then overwrite with metadata. Control: drop the capture's reference; a new tensor lands
    there and loses its values."""
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    model = ds4t.load("tiny-glm", device="cuda")
    twin = ds4t.load("tiny-glm", device="cuda")
    twin.cuda_graphs = False
    warm, ref = _sessions(model, prompts), _sessions(twin, prompts)
    _alone(model, warm)
    _alone(twin, ref)
    cap = graphs.graphs_for(model).graphs[model.graph_key(1)]
    ptr = cap.meta.data_ptr()
    if control:
        cap.meta = None
        torch.cuda.synchronize()
    junk = []
    for _ in range(20000):
        junk.append(torch.zeros(64, dtype=torch.int64, device="cuda"))
        if junk[-1].data_ptr() <= ptr < junk[-1].data_ptr() + junk[-1].nbytes:
            break
    got, expect = _alone(model, warm), _alone(twin, ref)
    assert all(torch.equal(a, b) for a, b in zip(got, expect))   # the graph reads what it just wrote
    intact = not any(bool(j.any()) for j in junk)
    assert intact != control
    for s in warm + ref:
        s.close()
