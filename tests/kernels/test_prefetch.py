"""Weight prefetch (ds4t.kernels.prefetch): the option, the byte ranges, the schedule a decoder builds, and on
the GPU a step with prefetches on has the bits of one without (eager and graph replay)."""
import pytest
import torch

import ds4t
from ds4t.kernels.prefetch import CHUNK, WeightPrefetch, byte_ranges, parse_option
from ds4t.models.blocks import MoEWeights
from ds4t.models.decoder import named_tensors

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("value, want", [
    ("off", None), (None, None), (False, None),
    ("l2", {"cap_bytes": 24 << 20, "evict_last": False}),
    ("l2:cap=8", {"cap_bytes": 8 << 20, "evict_last": False}),
    ("l2:last:cap=40", {"cap_bytes": 40 << 20, "evict_last": True}),
])
def test_option_parses(value, want):
    assert parse_option(value) == want


@pytest.mark.parametrize("value", ["on", "l3", "l2:cap=0", "l2:cap=x", "l2:first", 1, "l2:"])
def test_bad_option_raises_naming_it(value):
    with pytest.raises(ValueError, match="weight_prefetch"):
        parse_option(value)


def test_byte_ranges_stay_inside_each_tensor_on_16_bytes_and_stop_at_the_cap():
    t = torch.zeros(1000)   # 4000 bytes
    base = t.data_ptr()
    assert base % 16 == 0
    assert byte_ranges([t], 1 << 20) == [(base, 4000 // 16 * 16)]
    # a view starting 40 bytes in: rounded up to 48, its end (80) down to 80
    assert byte_ranges([t[10:20]], 1 << 20) == [(base + 48, 32)]
    # a strided view spans first to last element
    assert byte_ranges([t[::2]], 1 << 20) == [(base, (999 // 2 * 2 + 1) * 4 // 16 * 16)]
    # the cap cuts the total, across tensors
    r = byte_ranges([t, t], 4000 + 1000)
    assert [n for _, n in r] == [4000, 992] and sum(n for _, n in r) <= 5000
    # negative control: with no cap to speak of the second tensor is whole
    assert [n for _, n in byte_ranges([t, t], 1 << 20)] == [4000, 4000]


def test_schedule_names_what_each_point_reads_next():
    m = ds4t.load("tiny-qwen")
    m.prefetch_min_bytes = 0
    sched = m.prefetch_schedule()
    L = m.num_layers
    assert len(sched) == 2 * L
    for i in range(L):
        ffn = m.layers[i].ffn
        ids = {id(t) for t in sched[2 * i]}
        if isinstance(ffn, MoEWeights):
            assert id(ffn.router) in ids
            # a routed expert's slot is never asked for, whole or sliced
            assert all(t.data_ptr() != ffn.w_gate.data_ptr() or ffn.shared_index == 0 for t in sched[2 * i])
        if i + 1 < L:   # the next mixer's tensors, all of them
            want = [t for _, t in named_tensors(m.layers[i + 1].mixer, "")]
            assert [id(t) for t in sched[2 * i + 1]] == [id(t) for t in want]
    assert sched[-1][0] is m.lm_head
    m.prefetch_min_bytes = 1 << 40   # negative control: nothing is that big
    assert all(not e for e in m.prefetch_schedule())


def test_fused_shared_expert_is_its_stack_slot():
    m = ds4t.load("tiny-qwen")
    ffn = next(l.ffn for l in m.layers if isinstance(l.ffn, MoEWeights))
    reads = ffn.whole_reads()
    assert reads[0] is ffn.router
    if ffn.shared_index is not None:
        e = ffn.shared_index
        assert torch.equal(reads[1], ffn.w_gate[e]) and reads[1].data_ptr() == ffn.w_gate[e].data_ptr()
        assert reads[1].data_ptr() != ffn.w_gate[0].data_ptr()


def test_inert_off_the_gpu_and_in_the_interpreter():
    pf = WeightPrefetch(torch.device("cpu"))
    assert not pf.active and pf.plan([torch.zeros(4096)], 1 << 20) is None
    pf.issue(None)
    pf.join()


def _steps(model, prefetch, steps=6):
    model.weight_prefetch = prefetch
    sessions = [model.new_session(64) for _ in range(3)]
    for j, s in enumerate(sessions):
        s.prefill([1 + j, 5, 9, 2 * j + 3])
    out = []
    toks = [3, 4, 5]
    for _ in range(steps):
        r = ds4t.eval_batch([ds4t.DecodeItem(s, t) for s, t in zip(sessions, toks)], mode="native")
        toks = [int(v) for v in r.logits.argmax(-1)]
        out.append(r.logits)
    states = [s.state_dict() for s in sessions]
    for s in sessions:
        s.close()
    return out, states


@gpu
@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-glm", "tiny-deepseek"])
@pytest.mark.parametrize("prefetch", ["l2:cap=1", "l2:last"])
def test_prefetch_keeps_every_bit_on_the_gpu(preset, prefetch):
    m = ds4t.load(preset, device="cuda")
    m.prefetch_min_bytes = 0   # tiny weights: prefetch all of them
    assert m._prefetcher() is None   # off by default
    base = _steps(m, "off")
    m.weight_prefetch = prefetch
    pf, plans = m._prefetcher()
    assert pf.active and sum(p.chunks for p in plans if p is not None) > 0
    assert all(int(s.max()) <= CHUNK for p in plans if p is not None for s in [p.sizes])
    got = _steps(m, prefetch)   # steps 2.. replay CUDA graphs captured with the side branch
    assert all(torch.equal(a, b) for a, b in zip(base[0], got[0]))
    assert all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(base[1], got[1]))
