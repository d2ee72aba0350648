"""DeepSeek-V3 logits against HF transformers on tiny random checkpoints built here."""
import functools
import warnings

import pytest
import torch

import ds4t
from ds4t.backend import default_device
from ds4t.kernels import router as router_mod
from tests.models.hf_oracle import bias_tweak, check_against_hf, check_mtp_loading, rel_err, save_tiny

transformers = pytest.importorskip("transformers")


def ds_config(**over):
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                rope_interleave=True, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, initializer_range=0.1)
    base.update(over)
    return transformers.DeepseekV3Config(**base)


# name -> (config overrides, decode steps). Two configs run the 32-step decode, the rest 4 steps.
CONFIGS = {
    "qlora-interleave": ({}, 32),
    "yarn-allmoe-noninterleave": (dict(num_hidden_layers=2, first_k_dense_replace=0, rope_interleave=False,
                                       num_attention_heads=2, num_key_value_heads=2, n_group=4, topk_group=2,
                                       num_experts_per_tok=3,
                                       rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 64, "mscale": 0.707,
                                                        "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
                                  32),
    "no-qlora-2dense-bias": (dict(q_lora_rank=None, first_k_dense_replace=2, attention_bias=True, n_group=1,
                                  topk_group=1, n_shared_experts=2, norm_topk_prob=False, routed_scaling_factor=1.5,
                                  kv_lora_rank=24, qk_rope_head_dim=4, v_head_dim=8), 4),
    "groups4-dims": (dict(num_hidden_layers=2, n_routed_experts=12, n_group=4, topk_group=3, num_experts_per_tok=4,
                          n_shared_experts=0, num_attention_heads=3, num_key_value_heads=3, qk_nope_head_dim=8,
                          qk_rope_head_dim=16, v_head_dim=12, q_lora_rank=20), 4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp32_matches_hf(tmp_path, name):
    over, steps = CONFIGS[name]
    hf = save_tiny(transformers.DeepseekV3ForCausalLM, ds_config(**over), tmp_path, seed=1, tweak=bias_tweak(-0.1))
    model = ds4t.load(str(tmp_path), dtype="fp32")
    prompt = [int(t) for t in torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(2))]
    check_against_hf(model, hf, prompt, steps, 1e-4)


def _route(gate, h, dropped):
    """The router kernel on HF's gate inputs (on the kernels' device); expert ids on the CPU."""
    dev = default_device()
    logits = torch.nn.functional.linear(h.float(), gate.weight.float()).to(dev)
    return router_mod.router_sigmoid_grouped(
        logits, gate.e_score_correction_bias.float().to(dev), gate.top_k, gate.num_group, gate.topk_group,
        gate.norm_topk_prob, gate.routed_scaling_factor, dropped=dropped)[1].cpu()


def test_dropped_group_fill_follows_hf(tmp_path):
    """Correction biases ~ -1.5 make every biased score negative: filling dropped groups with 0.0
    (transformers 4.x, docs/design.md "Model semantics") or -inf (vLLM, transformers 5.x) then picks different experts.
    The router kernel must pick what the installed HF picks, and the model must follow HF."""
    cfg = ds_config(num_hidden_layers=2)
    hf = save_tiny(transformers.DeepseekV3ForCausalLM, cfg, tmp_path, seed=4, tweak=bias_tweak(-1.5, 0.1, seed=5))
    prompt = list(range(3, 15))
    gate = hf.model.layers[1].mlp.gate
    seen = {}
    handle = gate.register_forward_hook(lambda mod, inp, out: seen.update(h=inp[0].reshape(-1, cfg.hidden_size),
                                                                          ids=out[2]))
    with torch.no_grad():
        hf(input_ids=torch.tensor([prompt]))
    handle.remove()
    hf_ids = seen["ids"].sort(dim=-1).values
    ours = _route(gate, seen["h"], router_mod.DROPPED_SCORE).long().sort(dim=-1).values
    zero = _route(gate, seen["h"], 0.0).long().sort(dim=-1).values
    neg_inf = _route(gate, seen["h"], float("-inf")).long().sort(dim=-1).values
    assert not torch.equal(zero, neg_inf), "test case does not separate the two fills"
    assert torch.equal(ours, hf_ids), "router kernel does not choose HF's experts"

    model = ds4t.load(str(tmp_path), dtype="fp32")
    check_against_hf(model, hf, prompt, 4, 1e-4)
    # The other fill gives visibly different logits: the comparison above can tell them apart.
    other = 0.0 if torch.equal(hf_ids, neg_inf) else float("-inf")
    with ds4t.kernels.override("router_sigmoid_grouped",
                               functools.partial(router_mod.router_sigmoid_grouped, dropped=other)):
        s = model.new_session(max_ctx=32)
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float().detach()
        assert rel_err(s.prefill(prompt, all_logits=True), want) > 1e-3


def test_bf16_within_stated_bound(tmp_path):
    """bf16 weights (router weight stored F32, as DeepSeek checkpoints do): ds4t keeps activations in
    fp32 (rounded to bf16 at each linear's input and in the latent cache), HF's oracle here runs the
    same bf16-valued weights in fp32. Bound: 5e-2 of the logit scale over prompt + 32 steps."""
    def tweak(m):
        bias_tweak(-0.1)(m)
        for layer in m.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight = torch.nn.Parameter(gate.weight.float())
    hf = save_tiny(transformers.DeepseekV3ForCausalLM, ds_config(), tmp_path, seed=3, dtype=torch.bfloat16,
                   tweak=tweak)
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert f.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
        assert f.get_slice("model.layers.1.mlp.experts.0.up_proj.weight").get_dtype() == "BF16"
    model = ds4t.load(str(tmp_path))
    assert model.dtype == torch.bfloat16
    assert model.layers[1].ffn.router.dtype == torch.float32
    check_against_hf(model, hf.float(), list(range(5, 17)), 32, 5e-2)


def test_mtp_module_loading(tmp_path):
    from ds4t.models import deepseek

    save_tiny(transformers.DeepseekV3ForCausalLM, ds_config(num_hidden_layers=2), tmp_path, seed=6)
    ref = ds4t.load(str(tmp_path), dtype="fp32").new_session(16).prefill([1, 2, 3])
    check_mtp_loading(tmp_path, deepseek, ref)


@pytest.mark.parametrize("bad, match", [
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_type 'linear'"),
    (dict(n_routed_experts=6, n_group=4), "n_routed_experts 6 is not a positive multiple of n_group 4"),
    (dict(topk_group=3), "topk_group 3 outside"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax'"),
])
def test_config_errors_are_clear(bad, match):
    from ds4t.models.deepseek import DeepseekConfig

    c = ds_config().to_dict()
    c.update(bad)
    with pytest.raises(ds4t.CheckpointError, match=match):
        DeepseekConfig.from_dict(c)
