"""GLM-4.5 MoE logits against HF transformers on tiny random checkpoints built here."""
import warnings

import pytest
import torch

import ds4t
from tests.models.hf_oracle import bias_tweak, check_against_hf, check_mtp_loading, save_tiny

transformers = pytest.importorskip("transformers")


def glm_config(**over):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True,
                use_qk_norm=True, max_position_embeddings=256, n_routed_experts=8, n_shared_experts=1,
                num_experts_per_tok=2, moe_intermediate_size=32, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                norm_topk_prob=True, initializer_range=0.1,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
    base.update(over)
    return transformers.Glm4MoeConfig(**base)


# name -> (config overrides, decode steps). One config runs the 32-step decode, the rest 4 steps.
CONFIGS = {
    "qknorm": ({}, 32),
    "no-qknorm-mha-groups": (dict(use_qk_norm=False, attention_bias=False, num_key_value_heads=4, n_group=2,
                                  topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=False,
                                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                                                   "partial_rotary_factor": 0.25}), 4),
    "heads-experts": (dict(num_hidden_layers=2, first_k_dense_replace=0, num_attention_heads=6, num_key_value_heads=1,
                           head_dim=8, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2,
                           moe_intermediate_size=24), 4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_matches_hf(tmp_path, name):
    over, steps = CONFIGS[name]
    hf = save_tiny(transformers.Glm4MoeForCausalLM, glm_config(**over), tmp_path, seed=1, tweak=bias_tweak(-0.1))
    model = ds4t.load(str(tmp_path), dtype="fp32")
    prompt = [int(t) for t in torch.randint(0, 256, (10,), generator=torch.Generator().manual_seed(2))]
    check_against_hf(model, hf, prompt, steps, 1e-4)


def test_bf16_within_stated_bound(tmp_path):
    """bf16 weights: ds4t keeps activations in fp32 (rounded to bf16 at each linear's input and in the
    KV cache), HF's oracle here runs the same bf16-valued weights in fp32. Bound: 5e-2 of the logit
    scale over prompt + 16 steps."""
    hf = save_tiny(transformers.Glm4MoeForCausalLM, glm_config(num_hidden_layers=2), tmp_path, seed=3,
                   dtype=torch.bfloat16, tweak=bias_tweak(-0.1))
    model = ds4t.load(str(tmp_path))
    assert model.dtype == torch.bfloat16
    check_against_hf(model, hf.float(), list(range(5, 17)), 16, 5e-2)


def test_mtp_module_loading(tmp_path):
    from ds4t.models import glm

    save_tiny(transformers.Glm4MoeForCausalLM, glm_config(num_hidden_layers=2), tmp_path, seed=6)
    ref = ds4t.load(str(tmp_path), dtype="fp32").new_session(16).prefill([1, 2, 3])
    check_mtp_loading(tmp_path, glm, ref)


def test_config_errors_are_clear():
    from ds4t.models.glm import GlmConfig

    c = glm_config().to_dict()
    c["num_key_value_heads"] = 3
    with pytest.raises(ds4t.CheckpointError, match="not a multiple of num_key_value_heads 3"):
        GlmConfig.from_dict(c)
    c = glm_config().to_dict()
    del c["n_routed_experts"]
    c["n_group"] = 3
    with pytest.raises(ds4t.CheckpointError, match="n_routed_experts 128 is not a positive multiple of n_group 3"):
        GlmConfig.from_dict(c)
