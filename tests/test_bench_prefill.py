"""bench/bench_prefill.py's FLOP count (what its % of the tensor-core peak divides by), on shapes
known by hand: the tiny presets' configs, loaded on the meta device."""
import ds4t
from tests.bench_scripts import load

bp = load("bench/bench_prefill.py", "bench_prefill")


def test_weight_flops_count_each_matrix_and_top_k_experts():
    m = ds4t.load("tiny-glm", device="meta")
    c, rc = m.cfg, m.router_cfg
    dense, head = bp.weight_flops_per_token(m)
    assert head == 2 * m.vocab_size * c.hidden_size
    params = {k: v for k, v in m.parameters().items() if not k.startswith("mtp.")}
    experts = sum(t.numel() / t.shape[0] * (rc.top_k + t.shape[0] - rc.num_experts)
                  for t in params.values() if t.dim() == 3)
    matrices = sum(t.numel() for k, t in params.items() if t.dim() == 2 and k not in ("embed", "lm_head"))
    assert experts > 0 and dense == 2 * (experts + matrices)


def test_attention_flops_gqa_and_mla():
    g = ds4t.load("tiny-glm", device="meta")
    c = g.cfg
    # 3 tokens from position 5 attend to 6 + 7 + 8 positions, in every layer
    assert bp.attention_flops(g, 5, 3) == c.num_layers * 4 * 21 * c.num_heads * c.head_dim
    d = ds4t.load("tiny-deepseek", device="meta")
    c = d.cfg
    width = c.kv_lora_rank + d.pool.specs["layers.0.latent"].concrete(1)[-1]
    assert bp.attention_flops(d, 0, 2) == c.num_layers * 2 * 3 * c.num_heads * width
