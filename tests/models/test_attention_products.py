"""The GQA families' ``attention_products`` load option ("split": fp32-accurate hi + lo products, the default;
"cache": products in the cache dtype, FlashAttention's numerics): it reaches every attention launch, and the
model keeps its promises under it -- native == ordered bitwise, prefill chunk sizes and token-by-token decoding
bitwise equal (each with its control) -- while its logits move by bf16-sized amounts."""
import pytest
import torch

import ds4t
from ds4t.exactness import harness
from ds4t.exactness.chunks import run_chunk_check
from ds4t.exactness.harness import Plan, Scenario, plant

PROMPT = [5, 17, 99, 3, 250, 8, 41, 7, 66, 12, 1, 2]
PRESETS = ["tiny-qwen", "tiny-glm", "tiny-llama"]


@pytest.mark.parametrize("preset", PRESETS)
def test_cache_products_keep_the_promises(preset):
    m = ds4t.load(preset, dtype="bf16", attention_products="cache")
    assert m.attention_products == "cache" and "attention_products='cache'" in repr(m)
    sc = Scenario([Plan([3, 1, 4, 1, 5, 9, 2, 6]), Plan([7]), Plan([2, 7, 1, 8, 2, 8], leave=3),
                   Plan([5, 3, 5, 8, 9], join=1, chunked_join=True)], steps=4, seed=5, max_ctx=64)
    rep = harness.run_scenario(m, sc, mode="native")
    assert rep.ok, rep.first_mismatch
    with plant("ulp"):
        assert not harness.run_scenario(m, sc, mode="native").ok
    chunks = run_chunk_check(m, PROMPT, chunks=(1, 5, len(PROMPT)))
    assert chunks.ok, chunks.first_mismatch
    with plant("batch-dependent"):
        assert run_chunk_check(m, PROMPT, chunks=(1, 5), in_batch=False).mismatches > 0


@pytest.mark.parametrize("preset", PRESETS)
def test_cache_products_move_logits_by_bf16_amounts(preset):
    """The option changes a bf16 model's logits (the launches got it), by less than bf16 attention would
    (the same model with a float32 cache is the yardstick), and not an fp32 model's at all."""
    split = ds4t.load(preset, dtype="bf16")
    cache = ds4t.load(preset, dtype="bf16", attention_products="cache")
    a = split.new_session(32).prefill(PROMPT, all_logits=True)
    b = cache.new_session(32).prefill(PROMPT, all_logits=True)
    assert not torch.equal(a, b)
    assert float((a - b).abs().max() / a.abs().max()) < 5e-2
    f32 = ds4t.load(preset, attention_products="cache")
    assert torch.equal(f32.new_session(32).prefill(PROMPT, all_logits=True),
                       ds4t.load(preset).new_session(32).prefill(PROMPT, all_logits=True))


def test_bad_option_values_are_refused():
    with pytest.raises(ValueError, match="attention_products must be one of"):
        ds4t.load("tiny-glm", attention_products="bf16")
    with pytest.raises(TypeError, match="no option 'attention_products'"):
        ds4t.load("tiny-deepseek", attention_products="cache")   # MLA multiplies in the cache dtype already
    m = ds4t.load("tiny-qwen", attention_products="cache")
    with pytest.raises(ValueError, match="attention_products must be one of"):
        m.attention_products = "fp8"
    assert m.attention_products == "cache"
    m.attention_products = "split"
    assert m.attention_products == "split"
