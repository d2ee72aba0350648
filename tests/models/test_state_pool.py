"""The state pool's sizes: a session asking for more context than the pool holds re-sizes it to the slots
in use plus its own, so closing a large batch and opening fewer, longer sessions needs only their memory
(before, every free slot grew to the new context as well: a benchmark that stepped 64 sessions at 8k and
then asked for 16 at 32k ran out of memory on the H200). Sessions that stay open keep their slots and their
state bitwise."""
import gc

import torch

import ds4t


def _ctx_tensors(model):
    return {n: t.shape for n, t in model.pool.tensors.items()}


def test_a_longer_session_after_a_closed_batch_takes_one_slot():
    model = ds4t.load("tiny-llama")
    sessions = [model.new_session(max_ctx=16) for _ in range(8)]
    assert model.pool.slots == 8
    del sessions
    gc.collect()
    s = model.new_session(max_ctx=64)
    assert (model.pool.slots, model.pool.ctx) == (1, 64) and s.slot == 0
    assert all(shape[0] == 1 for shape in _ctx_tensors(model).values())
    more = [model.new_session(max_ctx=64) for _ in range(3)]   # then the pool doubles as before
    assert model.pool.slots == 4 and sorted(x.slot for x in [s, *more]) == [0, 1, 2, 3]


def test_open_sessions_keep_slots_and_state_through_a_resize():
    prompt = [3, 17, 5, 42, 9, 11]
    model = ds4t.load("tiny-llama")
    ref = model.new_session(max_ctx=16)
    want = ref.prefill(prompt)
    want_next = ds4t.eval_batch([ds4t.DecodeItem(ref, 7)]).logits[0]
    del ref
    gc.collect()

    sessions = [model.new_session(max_ctx=16) for _ in range(8)]
    keep = sessions[5]
    assert torch.equal(keep.prefill(prompt), want)
    for i in (0, 1, 2, 3, 4, 6, 7):
        sessions[i] = None
    gc.collect()
    longer = model.new_session(max_ctx=64)   # slots 0..4 are free below slot 5: no slot past 5 is kept
    assert model.pool.slots == 6 and keep.slot == 5 and longer.slot == 0 and model.pool.ctx == 64
    got = ds4t.eval_batch([ds4t.DecodeItem(keep, 7)]).logits[0]
    assert torch.equal(got, want_next)


def test_growing_with_every_slot_in_use_adds_one():
    model = ds4t.load("tiny-llama")
    a = [model.new_session(max_ctx=16) for _ in range(4)]
    b = model.new_session(max_ctx=32)
    assert model.pool.slots == 5 and b.slot == 4 and len(a) == 4


def test_state_dict_on_another_device_copies_there():
    """``Session.state_dict(device)``: the copies are made on that device directly (the decode benchmark keeps
    its long-context snapshots in host memory); values as the pool's own copy, loadable back."""
    model = ds4t.load("tiny-qwen")
    s = model.new_session(max_ctx=32)
    s.prefill([5, 6, 7, 8])
    here, meta = s.state_dict(), s.state_dict("meta")
    assert here.keys() == meta.keys() and all(v.device.type == "meta" for v in meta.values())
    assert all(meta[k].shape == here[k].shape and meta[k].dtype == here[k].dtype for k in here)
    host = s.state_dict("cpu")
    assert all(torch.equal(host[k], here[k].cpu()) for k in here)
    s.load_state_dict(host, 4, [5, 6, 7, 8])
    assert all(torch.equal(v, here[k]) for k, v in s.state_dict().items())


def test_state_spec_order_lays_a_slot_out_and_keeps_the_logical_shape():
    """StateSpec.order: the per-slot dims from outermost to innermost in memory; tensors keep the logical
    shape (a strided view). Qwen3-Next's recurrent state is Dk-contiguous (the recurrence's fast layout,
    ds4t.kernels.gdn), through resizes, and its state round-trips through Session.state / load."""
    from ds4t.models.base import StateSpec

    spec = StateSpec((3, 4, 5), torch.float32, order=(0, 2, 1))
    t = spec.allocate(2, 0, "cpu")
    assert t.shape == (2, 3, 4, 5) and t.stride() == (60, 20, 1, 4) and not t.any()
    assert StateSpec((3, 4, 5), torch.float32).allocate(2, 0, "cpu").is_contiguous()
    try:
        StateSpec((3, 4), torch.float32, order=(0, 0))
        raise AssertionError("a bad order was accepted")
    except ValueError as e:
        assert "permutation" in str(e)

    model = ds4t.load("tiny-qwen")
    s = model.new_session(max_ctx=16)
    s.prefill([3, 17, 5, 42])
    rec = [n for n in model.pool.tensors if n.endswith(".recurrent")]
    assert rec and all(model.pool.tensors[n].stride(2) == 1 for n in rec)
    saved = s.state_dict()
    others = [model.new_session(max_ctx=16) for _ in range(4)]   # the pool doubles: a resize
    assert model.pool.slots > 1 and all(model.pool.tensors[n].stride(2) == 1 for n in rec)
    assert all(torch.equal(saved[k], v) for k, v in s.state_dict().items())
    # into another session and back out: same values, the pool's layout kept
    others[0].load_state_dict(saved, pos=4)
    assert all(torch.equal(saved[k], v) for k, v in others[0].state_dict().items())
    assert all(model.pool.tensors[n].stride(2) == 1 for n in rec)
