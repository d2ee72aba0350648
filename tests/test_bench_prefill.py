"""bench/bench_prefill.py's FLOP count (what its % of the tensor-core peak divides by), on shapes
known by hand: the tiny presets' configs, loaded on the meta device."""
import ds4t
from tests.bench_scripts import load
from ds4t.testing.markers import cpu_interpreter_only

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


def test_weight_bytes_count_the_experts_a_chunk_hits():
    m = ds4t.load("tiny-glm", device="meta")
    rc = m.router_cfg
    params = {k: v for k, v in m.parameters().items() if not k.startswith("mtp.") and k != "embed"}
    experts = sum(float(t.nbytes) for t in params.values() if t.dim() == 3)
    rest = sum(float(t.nbytes) for t in params.values() if t.dim() != 3)
    shared = sum(float(t.nbytes) / t.shape[0] * (t.shape[0] - rc.num_experts) for t in params.values() if t.dim() == 3)
    one = bp.weight_bytes_per_chunk(m, 1)
    assert abs(one - (rest + shared + (experts - shared) * rc.top_k / rc.num_experts)) < 1e-6 * one
    assert abs(bp.weight_bytes_per_chunk(m, 10 ** 6) - (rest + experts)) < 1e-6 * one


@cpu_interpreter_only
def test_cpu_smoke_one_and_several_sessions(tmp_path):
    """The script end to end on the CPU: one session in chunks at two prompt lengths, two sessions sharing
    each step's rows, the chunk check and its control, the HF peer on the same prompts (its last logits
    within fp32 rounding of ds4t's); the table has a row for each."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_prefill.py"), "--device", "cpu", "--models", "tiny-qwen",
                        "--chunks", "8", "--prompt", "16,24", "--check-prompt", "12", "--sessions", "1,2",
                        "--opt", "attention_products=split", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    table = (tmp_path / "prefill.md").read_text()
    label = "tiny-qwen attention_products=split"   # the load option (the default here) names the rows
    assert f"| {label} | 16 | 8 |" in table and f"| {label} | 24 | 8 |" in table
    assert f"| {label} | 16 | 2 x 4 |" in table
    assert "0 mismatches" in table and "caught" in table
    import re

    ceilings = [int(c) for c in re.findall(r"\| [\d.]+ % \| (\d+) % \| [\d.]+ / [\d.]+ =", table)]
    assert len(ceilings) == 3 and all(0 < c <= 100 for c in ceilings), table[-3000:]

    errs = [float(e) for e in re.findall(r"HF prompt \d+, chunk 8: .* max rel error (\S+)", table)]
    assert len(errs) == 2 and max(errs) < 1e-4, table[-3000:]


def test_peak_ceiling_is_the_rooflines_fraction_of_the_peak():
    """A prefill that took exactly its roofline time runs at flops / floor: the whole peak when every chunk
    is compute-bound, less when streaming the weights takes longer than the FLOPs."""
    peak = 800e12
    assert bp.peak_ceiling(8e12, 10.0, peak) == 1.0            # 8 TFLOP in 10 ms at 800 TFLOP/s: compute-bound
    assert abs(bp.peak_ceiling(2e12, 10.0, peak) - 0.25) < 1e-12   # the floor is 4x the FLOPs' time: bytes
