"""A decode step never waits for the GPU (so it can be captured in a CUDA graph). GPU only."""
import pytest
import torch

import ds4t
from ds4t.step import StepBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_decode_step_does_not_synchronize(preset):
    model = ds4t.load(preset)
    sessions = [model.new_session(64) for _ in range(5)]
    for i, s in enumerate(sessions):
        s.prefill([i + 1, 2, 3])
    for _ in range(2):  # compile every kernel first (compilation may synchronise)
        ds4t.eval_batch([ds4t.DecodeItem(s, 7) for s in sessions], mode="native")
    batch = StepBatch.build([(s.slot, [9], s.pos) for s in sessions], model.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        logits = model.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert logits.shape == (5, model.vocab_size)
