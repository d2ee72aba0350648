"""Norm outputs stored in the activation dtype (``Decoder.norm_dtype``) change no bit (interpreter).

A bf16 model's norms used to write fp32 that every linear, fused projection and MoE expert rounded to
bf16 as it loaded it; now the norm rounds (to nearest even, as those consumers do) and stores bf16 where
every consumer of the tensor rounds so. The logits of every family, in bf16 and with FP8 / GGUF weights,
must be bitwise those of fp32 norm outputs, compiled too (the norm's sum of squares is a fixed tree in every
output-dtype variant, ``ds4t.kernels.norm.rstd_of``). Negative control: narrowing an input that a consumer reads unrounded -- the FFN
input of DeepSeek-V3 / GLM-4.5, whose router is kept in fp32 -- does change logits, so the comparison can
see a narrowing that is not free, and ``norm_dtype`` must keep that one fp32.
"""
import pytest
import torch

import ds4t
from ds4t.models.decoder import DecoderModel as Decoder

PROMPT = [3, 17, 5, 42, 9, 11, 2, 30, 7, 64]


def _logits(model, monkeypatch=None, rule=None):
    if rule is not None:
        monkeypatch.setattr(Decoder, "norm_dtype", rule)
    return model.new_session(64).prefill(PROMPT, all_logits=True)


def _all_fp32(self, i, site):
    return torch.float32


def _all_narrow(self, i, site):
    return self.dtype


@pytest.mark.parametrize("preset,quantize", [("tiny-qwen", None), ("tiny-deepseek", None), ("tiny-glm", None),
                                             ("tiny-llama", None), ("tiny-qwen", "fp8"), ("tiny-deepseek", "q8_0")])
def test_narrow_norm_outputs_change_no_bit(preset, quantize, monkeypatch):
    model = ds4t.load(preset, dtype=torch.bfloat16, quantize=quantize)
    assert model.norm_dtype(0, "mixer") == torch.bfloat16   # the rule narrows (else this proves nothing)
    narrow = _logits(model)
    wide = _logits(model, monkeypatch, _all_fp32)
    assert not torch.isnan(narrow).any()
    assert torch.equal(narrow, wide)


@pytest.mark.parametrize("preset", ["tiny-deepseek", "tiny-glm"])
def test_narrowing_an_fp32_router_input_is_caught(preset, monkeypatch):
    model = ds4t.load(preset, dtype=torch.bfloat16)
    moe = [i for i, layer in enumerate(model.layers) if getattr(layer.ffn, "router", None) is not None]
    assert moe and all(model.norm_dtype(i, "ffn") == torch.float32 for i in moe)
    assert model.norm_dtype(0, "mixer") == torch.bfloat16
    wide = _logits(model, monkeypatch, _all_fp32)
    forced = _logits(model, monkeypatch, _all_narrow)
    assert not torch.equal(forced, wide)


def test_fp32_models_keep_fp32_norm_outputs():
    model = ds4t.load("tiny-qwen")
    assert model.dtype == torch.float32
    assert {model.norm_dtype(i, s) for i in range(model.num_layers) for s in ("mixer", "ffn")} == {torch.float32}
