"""Producers whose only reader is a linear store in the dtype that linear rounds to
(``blocks.linear_input_dtype`` / ``narrow_store``): no bit changes.

``swiglu`` stores silu(g)·u for its down projection, DeepSeek's MLA W_UV's output for o_proj (and its query
q_latent in the latent cache's dtype, which the attention kernel rounds it to), and Qwen3-Next
its gated attention output (o_proj) and Gated DeltaNet's gated-norm output (out_proj; the decode step's fused
norm and the prefill's separate one) as bf16 / fp16 where that linear rounds its input to that dtype anyway
(16-bit weights, FP8 or GGUF blocks with a 16-bit activation dtype). Rounded to nearest even at the store as the linear would round at its load, so
the logits of every family are bitwise those of fp32 stores. Neither store follows a reduction of its own
(elementwise; the end of an MMA chain), so this holds compiled too. Negative control: storing in a dtype the
linear does not round to (fp16 for a bf16 model) changes logits.
"""
import pytest
import torch

import ds4t
from ds4t.models import blocks
from ds4t.models import deepseek
from ds4t.models import qwen

PROMPT = [3, 17, 5, 42, 9, 11, 2, 30, 7, 64]
CASES = [("tiny-deepseek", None), ("tiny-glm", None), ("tiny-llama", None), ("tiny-qwen", None),
         ("tiny-deepseek", "fp8"), ("tiny-qwen", "fp8"), ("tiny-glm", "q8_0")]


def _logits(model):
    """The prompt's logits (prefill) and three decode steps' (the decode kernels: Gated DeltaNet's step with its
    fused norm, decode attention)."""
    s = model.new_session(64)
    out = [s.prefill(PROMPT, all_logits=True)]
    for t in (4, 8, 15):
        out.append(ds4t.eval_batch([ds4t.DecodeItem(s, t)]).logits)
    return torch.cat([o.reshape(-1, o.shape[-1]) for o in out])


def _spy(monkeypatch):
    """Records the dtype of every narrowed store while the model runs, how many were MLA's W_UV output, and the
    dtypes MLA's query (q_latent, which the attention kernel rounds to the cache dtype) was stored in."""
    seen, mla, query = [], [], []
    real, real_narrow, real_store = blocks.linear_input_dtype, deepseek.narrow_store, deepseek.store_kwargs

    def spy(x, w):
        seen.append(real(x, w))
        return seen[-1]

    def mla_spy(x, w):
        mla.append(1)
        return real_narrow(x, w)

    def query_spy(dt):
        query.append(dt)
        return real_store(dt)

    monkeypatch.setattr(blocks, "linear_input_dtype", spy)
    monkeypatch.setattr(deepseek, "narrow_store", mla_spy)
    monkeypatch.setattr(deepseek, "store_kwargs", query_spy)
    return seen, mla, query


@pytest.mark.parametrize("preset,quantize", CASES)
def test_narrow_stores_change_no_bit(preset, quantize, monkeypatch):
    model = ds4t.load(preset, dtype=torch.bfloat16, quantize=quantize)
    seen, mla, query = _spy(monkeypatch)
    narrow = _logits(model)
    assert seen and set(seen) == {torch.bfloat16}   # the model narrows (else this proves nothing)
    assert bool(mla) == preset.endswith("deepseek")  # MLA's W_UV output among them
    assert set(query) == ({torch.bfloat16} if preset.endswith("deepseek") else set())   # and its query
    monkeypatch.setattr(blocks, "linear_input_dtype", lambda x, w: torch.float32)
    monkeypatch.setattr(deepseek, "store_kwargs", lambda dt: {})
    wide = _logits(model)
    assert not torch.isnan(narrow).any()
    assert torch.equal(narrow, wide)


@pytest.mark.parametrize("where", ["swiglu", "mla", "mla_query", "qwen"])
def test_a_narrowing_the_linear_does_not_do_is_caught(where, monkeypatch):
    model = ds4t.load("tiny-qwen" if where == "qwen" else "tiny-deepseek", dtype=torch.bfloat16)
    wide = _logits(model)
    if where == "mla_query":   # only MLA's query in fp16 (then rounded again to the bf16 cache's dtype)
        monkeypatch.setattr(deepseek, "store_kwargs", lambda dt: {"out_dtype": torch.float16})
    elif where == "mla":   # only MLA's store in fp16
        monkeypatch.setattr(deepseek, "narrow_store", lambda x, w: {"out_dtype": torch.float16})
        monkeypatch.setattr(blocks, "linear_input_dtype", lambda x, w: torch.float32)
    elif where == "qwen":   # only Qwen3-Next's attention and Gated DeltaNet output stores in fp16
        monkeypatch.setattr(qwen, "narrow_store", lambda x, w: {"out_dtype": torch.float16})
        monkeypatch.setattr(blocks, "linear_input_dtype", lambda x, w: torch.float32)
    else:
        monkeypatch.setattr(blocks, "linear_input_dtype", lambda x, w: torch.float16)
        monkeypatch.setattr(deepseek, "narrow_store", lambda x, w: {})
    assert not torch.equal(_logits(model), wide)


def test_fp32_models_and_fp32_activations_store_fp32():
    x = torch.randn(2, 8)
    assert blocks.linear_input_dtype(x, torch.randn(4, 4)) == torch.float32
    assert blocks.linear_input_dtype(x, torch.randn(4, 4).bfloat16()) == torch.bfloat16
    assert blocks.narrow_store(x, torch.randn(4, 4)) == {}
    w8 = ds4t.kernels.weights.quantize(torch.randn(4, 128))
    assert blocks.linear_input_dtype(x, w8) == torch.float32                    # no activation dtype: x's own
    assert blocks.narrow_store(x, w8.with_act_dtype(torch.bfloat16)) == {"out_dtype": torch.bfloat16}
