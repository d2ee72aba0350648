"""Eight gloo ranks: the code path of the full-depth runs over eight GPUs (DeepSeek-V3 and GLM-4.5 at tp = 8),
at CPU sizes. Each family's tiny structure is widened so that eight divides what tensor parallel splits
(attention and DeltaNet heads, experts, vocabulary, MLP blocks), with the real models' awkward cases kept:
Qwen3-Next's 2 kv heads under 8 ranks (each rank holds a copy of its group's kv head), GLM-4.5's shared expert
of 12 FP8 blocks over 8 ranks (uneven, on block boundaries), MLA's latent cache whole on every rank.

At tp = 8: logits the same on every rank and within fp32 tolerance of tp = 1; every native path equals the
ordered fallback bitwise; prefill chunk sizes bitwise equal; speculative decoding equal to plain decoding; block-FP8
weights. The negative controls at tp = 8 are the collective's: a reduction whose order or numerics follow the
message size is caught by the same native == ordered check (the reverse order, which two ranks cannot show since
two addends commute, included). The harness's own plants (a 1-ulp change, a batch-dependent linear) do not depend
on the rank count; they run at tp = 2 (test_tp.py) and on one process."""
import pytest
import torch

import ds4t
from ds4t.testing import parallel as jobs
from ds4t.testing.markers import cpu_interpreter_only

pytestmark = cpu_interpreter_only

TP = 8
PROMPT = [3, 17, 250, 9, 41, 128, 77]
FP8_16 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}

WIDE = {
    # 8 MLA heads (1 a rank), 16 experts (2 a rank) top 4, a 128-wide shared expert (8 FP8 blocks of 16)
    "tiny-deepseek": dict(num_attention_heads=8, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                          n_shared_experts=4),
    # 16 q / 8 kv heads (2 / 1 a rank), 16 experts, a 192-wide shared expert: 12 blocks of 16 over 8 ranks, as
    # GLM-4.5's 1536 are 12 blocks of 128
    "tiny-glm": dict(num_attention_heads=16, num_key_value_heads=8, n_routed_experts=16, num_experts_per_tok=4,
                     n_shared_experts=6),
    # gated attention 16 q / 2 kv heads (Qwen3-Next's ratio: a kv head per 4 ranks), DeltaNet 8 key / 16 value heads
    "tiny-qwen": dict(num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=8, linear_num_value_heads=16,
                      num_experts=16, num_experts_per_tok=4, shared_expert_intermediate_size=128),
}
# (llama's sharding is GQA's, which GLM's structure covers; tp = 2 runs it in test_tp.py)
MTP_FAMILIES = ("tiny-deepseek", "tiny-qwen")
"""GLM-4.5's MTP layer is DeepSeek-V3's nextn layer (ds4t.models.mtp) over GQA heads, which Qwen3-Next's covers at
eight ranks (2 kv heads: a copy a rank); all three families' speculative decoding runs at tp = 2 (test_tp.py)."""


def _eight_ranks(*default):
    """The families, those not in ``default`` marked long: at tp = 2 (test_tp.py) every family runs each of these
    checks; at tp = 8 ``make test`` runs the family whose structure only eight ranks show (Qwen3-Next's 2 kv
    heads, a copy a rank), ``make test-long`` all of them (eight gloo ranks of the interpreter are ~8x a tp = 1
    run)."""
    return [n if n in default else pytest.param(n, marks=pytest.mark.long) for n in WIDE]


@pytest.fixture(scope="module")
def ranks():
    from ds4t.parallel.workers import RankPool

    with RankPool(TP) as pool:
        yield pool


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Checkpoint directories of the widened structures (float32), by preset name; "<name>:fp8" the same
    with a 16 x 16 block-FP8 quantization_config (quantized as read: ``quantize="fp8"``)."""
    from ds4t.models.registry import preset_source

    out = {}
    for name, change in WIDE.items():
        cfg = dict(preset_source(name)[0], **change)
        out[name] = jobs.write_checkpoint(cfg, tmp_path_factory.mktemp(name))
        if name in ("tiny-deepseek", "tiny-glm"):
            out[name + ":fp8"] = jobs.write_checkpoint(dict(cfg, quantization_config=FP8_16),
                                                       tmp_path_factory.mktemp(name + "-fp8"))
    return out


def _same_and_close(rs, ref, tol=1e-5):
    assert all(torch.equal(rs[0], r) for r in rs[1:]), "every rank must end with the same logits"
    err = ((rs[0] - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"TP={TP} vs TP=1 relative error {err:.2e}"


@pytest.mark.parametrize("name", _eight_ranks("tiny-qwen"))
def test_tp8_agrees_with_tp1(ranks, wide, name):
    rs = ranks.run(jobs.tp_logits, wide[name], PROMPT, 3)
    _same_and_close(rs, jobs.reference_logits(ds4t.load(wide[name]), PROMPT, 3))


@pytest.mark.parametrize("name", _eight_ranks("tiny-qwen"))
def test_native_equals_ordered_under_tp8(ranks, wide, name):
    """Its negative controls: test_planted_reductions_are_caught_at_tp8 (the same check, a planted collective)."""
    for rep in ranks.run(jobs.tp_native_exact, wide[name], 3, 2, 0, negative_control=False):
        assert rep["paths"].get("native") and rep["native_batches"] > 0, rep


@pytest.mark.parametrize("name", _eight_ranks())   # make test: every family's chunks at tp = 2 (test_tp.py)
def test_prefill_chunks_bitwise_under_tp8(ranks, wide, name):
    assert ranks.run(jobs.tp_chunk_invariant, wide[name], PROMPT, (1, 5)) == [True] * TP


@pytest.mark.parametrize("kind", ["reverse-order", "size-dependent"])
def test_planted_reductions_are_caught_at_tp8(ranks, wide, kind):
    """Negative controls of the collective: a sum whose order or numerics follow the message size. At tp = 2 the
    reverse order cannot show (test_tp.py); at 8 it must."""
    from ds4t.parallel.controls import applicable

    assert applicable(kind, TP)
    for rep in ranks.run(jobs.tp_planted_reduction, wide["tiny-qwen"], kind):
        assert rep["native_batches"] > 0 and rep["mismatches"] > 0, rep


@pytest.mark.long   # tp = 2 runs every family's speculative decoding (test_tp.py)
@pytest.mark.parametrize("name", MTP_FAMILIES)
def test_speculative_decoding_under_tp8(ranks, wide, name):
    rs = ranks.run(jobs.tp_mtp, wide[name], PROMPT, 2, 3, 5, 0)
    for r in rs:
        assert r["has_mtp"] and r["mismatches"] == 0 and r["drafted"] > 0, r["first"]
    _same_and_close([r["mtp_logits"] for r in rs], jobs.mtp_logits(ds4t.load(wide[name]), PROMPT))


@pytest.mark.parametrize("name", [pytest.param("tiny-deepseek", marks=pytest.mark.long), "tiny-glm"])
def test_fp8_under_tp8(ranks, wide, name):
    """The full-depth runs' format: block-FP8 weights cut on their blocks over 8 ranks (GLM's shared expert
    unevenly: 2 blocks on ranks 0-3, 1 on ranks 4-7), logits within tolerance of tp = 1, native == ordered."""
    d = wide[name + ":fp8"]
    rs = ranks.run(jobs.tp_logits, d, PROMPT, 2, quantize="fp8")
    _same_and_close(rs, jobs.reference_logits(ds4t.load(d, quantize="fp8"), PROMPT, 2))
    for rep in ranks.run(jobs.tp_native_exact, d, 3, 2, 0, negative_control=False, quantize="fp8"):
        assert rep["native_batches"] > 0, rep
    params = ranks.run(jobs.tp_parameters, d, quantize="fp8")
    down = next(k for k in params[0] if "shared_down" in k and k.endswith("data"))
    widths = [p[down][-1] for p in params]
    assert sum(widths) == 16 * WIDE[name]["n_shared_experts"] * 2 and all(w % 16 == 0 for w in widths), widths
    if name == "tiny-glm":
        assert widths == [32] * 4 + [16] * 4, widths


@pytest.mark.parametrize("rows,dim", [(1, 7168), (9, 200), (5, 3)])
def test_scattered_sum_has_the_gathered_sums_bits(ranks, rows, dim):
    """The two-phase reduction (all-to-all of column slices, the rank-order sum of one slice, all-gather) gives
    every element the bits of the all-gather + rank-order sum, on every rank; columns that 8 does not divide
    (200, 3) included. The data are such that the order shows: the reverse order differs."""
    out = ranks.run(jobs.tp_reduce_both, rows, dim)
    for r in out:
        assert torch.equal(r["scattered"], r["gathered"]) and torch.equal(r["gathered"], out[0]["gathered"])
    if dim > 8:
        assert not torch.equal(out[0]["reverse"], out[0]["gathered"]), "the control: another order, other bits"


def test_models_at_tp8_reduce_through_the_scattered_sum(ranks, wide):
    """On the CPU at >= 4 ranks every reduction takes the two-phase path (ds4t.parallel.comm.default_scatter_from),
    so the model tests above ran it; the gathered path gives the same logits."""
    on, off = ranks.run(jobs.tp_reduction_paths, wide["tiny-glm"], PROMPT, 2)[0]
    assert on["scattered"] > 0 and off["scattered"] == 0 and torch.equal(on["logits"], off["logits"])


def test_state_and_experts_are_sharded_eight_ways(ranks, wide):
    qwen = ranks.run(jobs.tp_state_shapes, wide["tiny-qwen"])
    for shapes in qwen:
        assert shapes["layers.1.k"][-2:] == (1, 16)            # 2 kv heads over 8 ranks: one (a copy) a rank
        assert shapes["layers.0.recurrent"][-3:] == (2, 16, 16)  # 16 value heads -> 2 a rank
    ds = ranks.run(jobs.tp_state_shapes, wide["tiny-deepseek"])
    assert all(s["layers.0.latent"][-1:] == (24,) for s in ds)  # MLA's latent cache: whole on every rank
    p = ranks.run(jobs.tp_parameters, wide["tiny-deepseek"])
    assert all(q["layers.1.ffn.w_gate"][0] == 2 for q in p)     # 16 routed experts -> 2 a rank
    assert all(q["embed"] == (32, 64) and q["lm_head"] == (32, 64) for q in p)   # 256 vocabulary rows / 8


@pytest.mark.parametrize("preset,gb", [("deepseek-v3-fp8", 89.7), ("glm-4.5-fp8", 46.6)])
def test_full_depth_fp8_shards_fit_an_h200_with_64_sessions_at_4k(ranks, preset, gb):
    """Issue 19's runs, planned on 'meta' over 8 ranks: every rank's shard of the full-depth FP8 model (DeepSeek-V3:
    61 layers + MTP; GLM-4.5: 92 + MTP), 64 sessions at 4k tokens and a step of 64 rows + a 1024-token chunk fit
    one H200 (139 GiB usable), and the ranks hold the same bytes up to GLM's uneven shared-expert blocks."""
    plans = ranks.run(jobs.tp_plan, preset, 64, 4096 + 64, 64 + 1024, 139 << 30)
    weights = [p["weights"] for p in plans]
    assert all(p["fits"] for p in plans), plans
    assert abs(weights[0] / 1e9 - gb) < 0.1 and max(weights) - min(weights) < 0.01 * max(weights), weights
