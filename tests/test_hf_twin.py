"""The HF twin of each tiny preset holds ds4t's weights: its prompt logits match ds4t's."""
import pytest
import torch

import ds4t
from ds4t.hf import hf_twin


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_hf_twin_matches_ds4t_logits(preset):
    model = ds4t.load(preset)   # the GPU when there is one (kernels need tensors on their device)
    twin = hf_twin(preset, device=model.device)
    prompt = [3, 17, 42, 5, 99, 1, 64, 7]
    ours = model.new_session(32).prefill(prompt)
    with torch.no_grad():
        theirs = twin(input_ids=torch.tensor([prompt], device=model.device)).logits[0, -1].float()
    err = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    # On a GPU, HF runs Qwen3-Next's delta rule through fla's kernels (TF32 dots): looser there.
    assert err < (1e-4 if model.device.type == "cpu" else 3e-3), err


def test_hf_twin_rejects_unknown_preset():
    with pytest.raises(ds4t.CheckpointError, match="not a preset"):
        hf_twin("no-such-preset")
