"""The SwiGLU down projection's input stored in the activation dtype (``blocks.down_input_dtype``) changes
no bit.

``swiglu`` stores silu(g)·u as bf16 / fp16 where the down linear, its only reader, rounds its input to that
dtype anyway (16-bit weights, FP8 or GGUF blocks with a 16-bit activation dtype): the logits of every
family that runs SwiGLU outside the grouped MoE kernel -- dense layers and shared experts -- must be bitwise
those of an fp32 store. The elementwise kernel has no reduction, so this holds compiled too. Negative
control: storing in a dtype the linear does not round to (fp16 for a bf16 model) changes logits, so the
comparison sees a narrowing that is not free.
"""
import pytest
import torch

import ds4t
from ds4t.models import blocks

PROMPT = [3, 17, 5, 42, 9, 11, 2, 30, 7, 64]
CASES = [("tiny-deepseek", None), ("tiny-glm", None), ("tiny-llama", None), ("tiny-deepseek", "fp8"),
         ("tiny-glm", "q8_0")]


def _logits(model):
    return model.new_session(64).prefill(PROMPT, all_logits=True)


def _calls(monkeypatch):
    """Records the dtype of every swiglu store while the model runs."""
    seen = []
    real = blocks.down_input_dtype

    def spy(gu, w):
        seen.append(real(gu, w))
        return seen[-1]

    monkeypatch.setattr(blocks, "down_input_dtype", spy)
    return seen


@pytest.mark.parametrize("preset,quantize", CASES)
def test_narrow_down_inputs_change_no_bit(preset, quantize, monkeypatch):
    model = ds4t.load(preset, dtype=torch.bfloat16, quantize=quantize)
    seen = _calls(monkeypatch)
    narrow = _logits(model)
    assert seen and set(seen) == {torch.bfloat16}   # the model runs swiglu, narrowed (else this proves nothing)
    monkeypatch.setattr(blocks, "down_input_dtype", lambda gu, w: torch.float32)
    wide = _logits(model)
    assert not torch.isnan(narrow).any()
    assert torch.equal(narrow, wide)


def test_a_narrowing_the_linear_does_not_do_is_caught(monkeypatch):
    model = ds4t.load("tiny-deepseek", dtype=torch.bfloat16)
    wide = _logits(model)
    monkeypatch.setattr(blocks, "down_input_dtype", lambda gu, w: torch.float16)
    assert not torch.equal(_logits(model), wide)


def test_fp32_models_and_fp32_activations_store_fp32():
    gu = torch.randn(2, 8)
    assert blocks.down_input_dtype(gu, torch.randn(4, 4)) == torch.float32
    assert blocks.down_input_dtype(gu, torch.randn(4, 4).bfloat16()) == torch.bfloat16
    w8 = ds4t.kernels.weights.quantize(torch.randn(4, 128))
    assert blocks.down_input_dtype(gu, w8) == torch.float32                    # no activation dtype: x's own
    assert blocks.down_input_dtype(gu, w8.with_act_dtype(torch.bfloat16)) == torch.bfloat16
