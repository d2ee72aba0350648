"""Dense llama / Qwen3 logits against HF transformers on tiny random checkpoints built here, and
prefill-chunk invariance of the dense family."""
import pytest
import torch

import ds4t
from ds4t.testing import assert_prefill_chunk_invariant
from tests.models.hf_oracle import check_against_hf, save_tiny

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_config(**over):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                initializer_range=0.1, tie_word_embeddings=False, rope_parameters=dict(LLAMA3_ROPE))
    base.update(over)
    return transformers.LlamaConfig(**base)


# name -> (HF classes, config, decode steps). One config runs the 32-step decode, the rest 4 steps.
CONFIGS = {
    "llama3-rope-gqa": (lambda: (transformers.LlamaForCausalLM, llama_config()), 32),
    "tied-bias-mha-linear-rope": (lambda: (transformers.LlamaForCausalLM, llama_config(
        tie_word_embeddings=True, attention_bias=True, num_key_value_heads=4, head_dim=None,
        rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0})), 4),
    "qwen3-dense": (lambda: (transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
        attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0})), 4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_matches_hf(tmp_path, name):
    make, steps = CONFIGS[name]
    cls, cfg = make()
    hf = save_tiny(cls, cfg, tmp_path, seed=1)
    model = ds4t.load(str(tmp_path), dtype="fp32")
    assert model.family == cfg.model_type
    prompt = [int(t) for t in torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(2))]
    check_against_hf(model, hf, prompt, steps, 1e-4)


def test_config_errors_are_clear():
    from ds4t.models.llama import LlamaConfig

    c = llama_config().to_dict()
    c["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0}
    with pytest.raises(ds4t.CheckpointError, match=r"rope_type 'yarn' is not supported .*'llama3'"):
        LlamaConfig.from_dict(c)
    c = llama_config(mlp_bias=True).to_dict()
    with pytest.raises(ds4t.CheckpointError, match="mlp_bias"):
        LlamaConfig.from_dict(c)
    c = llama_config(hidden_act="gelu").to_dict()
    with pytest.raises(ds4t.CheckpointError, match="hidden_act 'gelu'"):
        LlamaConfig.from_dict(c)


def test_prefill_chunks_are_bitwise_equal_and_equal_token_by_token():
    """A prompt's logits and KV are bitwise the same for prefill chunks of 1, 17 and 64 tokens, and
    for the prompt fed one token per step inside a batch beside another decoding session."""
    prompt = [int(t) for t in torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(5))]
    assert_prefill_chunk_invariant(ds4t.load("tiny-llama"), prompt)
