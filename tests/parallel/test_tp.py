"""Tensor + expert parallel on two gloo ranks, every family's tiny preset: TP = 2 agrees with TP = 1
within fp tolerance (another summation order), every native path equals the ordered fallback bitwise
under TP = 2 (with the harness's negative controls), prefill chunk sizes stay bitwise equal, the
reduction is batch-invariant, and a planted batch-dependent reduction is caught."""
import pytest
import torch

import ds4t
from ds4t.testing import TINY_PRESETS
from ds4t.testing import parallel as jobs
from ds4t.testing.markers import cpu_interpreter_only

pytestmark = cpu_interpreter_only

PROMPT = [3, 17, 250, 9, 41, 128, 77]
FP8_16 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
"""Block-FP8 with 16 x 16 blocks: CPU-sized weights that a shard can still cut on block boundaries."""


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tp2_agrees_with_tp1(ranks, preset):
    r0, r1 = ranks.run(jobs.tp_logits, preset, PROMPT, 3)
    assert torch.equal(r0, r1), "every rank must end with the same logits (the reduction is done alike)"
    ref = jobs.reference_logits(ds4t.load(preset), PROMPT, 3)
    assert r0.shape == ref.shape
    err = ((r0 - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"{preset}: TP=2 vs TP=1 relative error {err:.2e}"
    assert not torch.equal(r0, ref) or preset == "tiny-llama", "another sum order: TP=1 bits are not expected"


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_native_equals_ordered_under_tp2(ranks, preset):
    for rep in ranks.run(jobs.tp_native_exact, preset, 3, 3, 0):
        assert rep["paths"].get("native") and rep["native_batches"] > 0, rep


def test_auto_mode_with_fallback_rows_under_tp2(ranks):
    """GLM rows past the native window run ordered inside the same call (mode auto), under TP."""
    for rep in ranks.run(jobs.tp_native_exact, "tiny-glm", 4, 3, 2, "auto", native_window=6):
        assert rep["paths"].get("ordered") and rep["paths"].get("native"), rep


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_prefill_chunks_bitwise_under_tp2(ranks, preset):
    # chunks of 5 leave a ragged last chunk; the whole prompt is always one of the compared prefills
    assert ranks.run(jobs.tp_chunk_invariant, preset, PROMPT, (1, 5)) == [True, True]


def test_reduction_is_batch_invariant_and_the_same_on_every_rank(ranks):
    r0, r1 = ranks.run(jobs.tp_reduce_rows, 9, 200)
    assert torch.equal(r0["whole"], r0["alone"]), "a row's sum depends on the rows beside it"
    assert torch.equal(r0["whole"], r1["whole"])
    assert torch.equal(r0["whole"], r0["partial"] + r1["partial"]), "rank order: p0 + p1"


def test_planted_size_dependent_reduction_is_caught(ranks):
    """Negative control: a reduction whose numerics change with the message size is caught."""
    for rep in ranks.run(jobs.tp_planted_reduction, "tiny-qwen", "size-dependent"):
        assert rep["native_batches"] > 0 and rep["mismatches"] > 0, rep


def test_reverse_order_changes_no_bit_at_tp2(ranks):
    """Two addends commute exactly: a size-dependent order cannot show at tp = 2 (the control is not
    applicable there; ds4t.parallel.controls.applicable says so)."""
    from ds4t.parallel.controls import applicable

    assert not applicable("reverse-order", 2) and applicable("reverse-order", 3)
    for rep in ranks.run(jobs.tp_planted_reduction, "tiny-qwen", "reverse-order"):
        assert rep["native_batches"] > 0 and rep["mismatches"] == 0, rep


@pytest.mark.parametrize("preset,name,shard", [
    ("tiny-qwen", "layers.1.k", (1, 16)),             # gated attention: 2 kv heads -> 1 per rank (+ CTX axis)
    ("tiny-qwen", "layers.0.recurrent", (2, 16, 16)),  # Gated DeltaNet: 4 value heads -> 2
    ("tiny-qwen", "layers.0.conv", (64, 3)),           # conv channels [q | k | v]: 128 -> 64
    ("tiny-glm", "layers.0.v", (1, 16)),
    ("tiny-llama", "layers.1.k", (1, 16)),
    ("tiny-deepseek", "layers.0.latent", (24,)),       # MLA's latent cache is shared by all heads: whole
])
def test_session_state_is_sharded_with_its_heads(ranks, preset, name, shard):
    for shapes in ranks.run(jobs.tp_state_shapes, preset):
        got = shapes[name]
        assert got[len(got) - len(shard):] == shard, (name, got)


def test_experts_split_across_ranks(ranks):
    p0, p1 = ranks.run(jobs.tp_parameters, "tiny-deepseek")
    assert p0["layers.1.ffn.w_gate"] == (4, 32, 64)          # 8 routed experts -> 4 per rank
    assert p0["layers.1.ffn.shared_gate_up"] == (32, 64)     # the shared expert split: 2 x 16 rows
    assert p0["embed"] == (128, 64) and p0["lm_head"] == (128, 64)   # vocabulary rows
    assert p0.keys() == p1.keys()


@pytest.fixture(scope="module")
def fp8_qwen_dir(tmp_path_factory):
    """tiny-qwen as an HF checkpoint directory whose quantization_config has 16 x 16 blocks, so that
    ``quantize="fp8"`` gives FP8 weights a tp = 2 shard can cut on block boundaries."""
    from ds4t.models.registry import preset_source

    cfg = dict(preset_source("tiny-qwen")[0], quantization_config=FP8_16)
    return jobs.write_checkpoint(cfg, tmp_path_factory.mktemp("fp8-qwen"))


def test_fp8_weights_under_tp2(ranks, fp8_qwen_dir):
    r0, r1 = ranks.run(jobs.tp_logits, fp8_qwen_dir, PROMPT, 2, quantize="fp8")
    assert torch.equal(r0, r1)
    ref = jobs.reference_logits(ds4t.load(fp8_qwen_dir, quantize="fp8"), PROMPT, 2)
    assert ((r0 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    p = ranks.run(jobs.tp_parameters, fp8_qwen_dir, quantize="fp8")[0]
    assert p["layers.0.mixer.w_out.data"] == (64, 32) and p["layers.0.mixer.w_out.scale"] == (64, 2)   # 16-col blocks


@pytest.fixture(scope="module")
def fp8_uneven_shared_dir(tmp_path_factory):
    """tiny-qwen's structure with a 48-wide shared expert and 16 x 16 FP8 blocks: tp = 2 cannot give each
    rank 24 columns (not a whole block), so the shared expert splits 32 + 16 on block boundaries."""
    from ds4t.models.qwen import preset_config

    cfg = dict(preset_config("tiny-qwen"), shared_expert_intermediate_size=48, quantization_config=FP8_16)
    return jobs.write_checkpoint(cfg, tmp_path_factory.mktemp("fp8-uneven"))


def test_fp8_shared_expert_split_on_block_boundaries(ranks, fp8_uneven_shared_dir):
    d = fp8_uneven_shared_dir
    r0, r1 = ranks.run(jobs.tp_logits, d, PROMPT, 2, quantize="fp8")
    assert torch.equal(r0, r1)
    ref = jobs.reference_logits(ds4t.load(d, quantize="fp8"), PROMPT, 2)
    assert ((r0 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    p0, p1 = ranks.run(jobs.tp_parameters, d, quantize="fp8")
    down = next(k for k in p0 if "shared_down" in k and k.endswith("data"))
    assert p0[down][-1] == 32 and p1[down][-1] == 16, (p0[down], p1[down])


def _glm45_structure() -> dict:
    """GLM-4.5's structure (glm-4.5-4l) at CPU sizes: 24 q heads over 8 kv heads (tp = 2 splits the kv heads
    4 + 4; groups of 3), head_dim 32 with partial rotary 0.5, q/k norm, q/k/v bias, a dense first layer,
    16 routed experts top 4 (n_group 1) with routed_scaling_factor 2.5 and a shared expert."""
    from ds4t.models.glm import preset_config

    cfg = preset_config("tiny-glm")
    cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=24,
               num_key_value_heads=8, head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=32, routed_scaling_factor=2.5, num_nextn_predict_layers=0)
    return cfg


def test_tp2_agrees_with_tp1_on_glm45_structure(ranks):
    """The structure of glm-4.5-4l (whose bf16 TP = 2 vs TP = 1 gap on the H200 is a router near-tie flipped
    by bf16 noise, not a sharding error: reference_run's docstring) agrees in fp32. The sum-order-sized
    nudge of reference_run(perturb=True) moves the logits by as little."""
    cfg = _glm45_structure()
    r0, r1 = ranks.run(jobs.tp_config_logits, cfg, PROMPT, 3)
    assert torch.equal(r0, r1)
    m = jobs.config_model(cfg)
    ref, routes = jobs.reference_run(m, PROMPT, 3)
    nudged, nudged_routes = jobs.reference_run(m, PROMPT, 3, perturb=True)
    scale = ref.abs().max()
    assert ((r0 - ref).abs().max() / scale).item() < 1e-5
    assert 0 < ((nudged - ref).abs().max() / scale).item() < 1e-5
    diff, pairs = jobs.route_differences(routes, nudged_routes)
    assert diff == 0 and pairs == 2 * (len(PROMPT) + 2 + 3 * 2), (diff, pairs)   # 2 MoE layers x rows


def test_gguf_blocks_under_tp2(ranks):
    """GGUF block weights (Q8_0 here) shard like FP8: rows with their blocks, input columns on block
    boundaries, the vocab-parallel LM head padded with zero blocks. A width too narrow to give every rank
    a whole block is a ParallelError naming the weight (tiny-qwen's 32-wide shared expert, one Q8_0 block,
    at tp = 2)."""
    from ds4t.parallel.workers import RankError

    r0, r1 = ranks.run(jobs.tp_logits, "tiny-llama", PROMPT, 2, quantize="q8_0")
    assert torch.equal(r0, r1)
    ref = jobs.reference_logits(ds4t.load("tiny-llama", quantize="q8_0"), PROMPT, 2)
    assert ((r0 - ref).abs().max() / ref.abs().max()).item() < 1e-5
    with pytest.raises(RankError, match=r"the MLP width of layers\.0\.ffn\.shared \(32 columns\) is 1 block"):
        ranks.run(jobs.tp_logits, "tiny-qwen", PROMPT, 2, quantize="q8_0")


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_mtp_head_and_speculative_decoding_under_tp2(ranks, preset):
    """The MTP head loads under TP (its layer sharded, its embedding / head vocabulary shards): its logits
    agree with TP = 1 within fp tolerance and are the same on every rank, and speculative decoding under
    TP = 2 equals plain decoding under TP = 2 bitwise (tokens, logits, state)."""
    r0, r1 = ranks.run(jobs.tp_mtp, preset, PROMPT, 2, 3, 5, 0)
    assert r0["has_mtp"] and r1["has_mtp"]
    assert torch.equal(r0["mtp_logits"], r1["mtp_logits"])
    for r in (r0, r1):
        assert r["mismatches"] == 0 and r["drafted"] > 0, r["first"]
    ref = jobs.mtp_logits(ds4t.load(preset), PROMPT)
    err = ((r0["mtp_logits"] - ref).abs().max() / ref.abs().max()).item()
    assert err < 1e-5, f"{preset}: MTP logits TP=2 vs TP=1 relative error {err:.2e}"


@pytest.fixture(scope="module")
def deepseek_own_mtp_copies_dir(tmp_path_factory):
    """tiny-deepseek as an HF checkpoint directory whose MTP layer carries its own embedding and
    shared_head.head (as DeepSeek-V3's published checkpoints do), different from the model's."""
    from ds4t.models.registry import preset_source

    cfg, src = preset_source("tiny-deepseek")
    t = {k: src.get(k) for k in src.keys()}
    L = cfg["num_hidden_layers"]
    g = torch.Generator().manual_seed(3)
    for name in ("embed_tokens.weight", "shared_head.head.weight"):
        t[f"model.layers.{L}.{name}"] = 0.05 * torch.randn(t["model.embed_tokens.weight"].shape, generator=g)
    return jobs.write_checkpoint(cfg, tmp_path_factory.mktemp("ds-mtp"), t)


def test_mtp_own_embedding_and_head_are_vocabulary_sharded(ranks, deepseek_own_mtp_copies_dir):
    d = deepseek_own_mtp_copies_dir
    r0, r1 = ranks.run(jobs.tp_mtp, d, PROMPT, 2, 2, 4, 0)
    assert torch.equal(r0["mtp_logits"], r1["mtp_logits"]) and r0["mismatches"] == 0, r0["first"]
    one = ds4t.load(d)
    assert one.mtp.embed is not one.embed and one.mtp.head is not one.lm_head   # its own copies are used
    ref = jobs.mtp_logits(one, PROMPT)
    assert ((r0["mtp_logits"] - ref).abs().max() / ref.abs().max()).item() < 1e-5
    p = ranks.run(jobs.tp_parameters, d)[0]
    V, D = one.mtp.embed.shape
    assert p["mtp.embed"] == (-(-V // 2), D) and p["mtp.head"] == (-(-V // 2), D)   # half the rows a rank


@pytest.fixture(scope="module")
def glm_q8_gguf(tmp_path_factory):
    """tiny-glm with a 192-wide shared expert (6 Q8_0 blocks: tp = 2 can split it) as a Q8_0 GGUF: routed
    experts stored stacked (``ffn_*_exps``) in blocks."""
    from ds4t.models.convert import convert
    from ds4t.models.registry import preset_source

    d = tmp_path_factory.mktemp("glm-q8")
    src = jobs.write_checkpoint(dict(preset_source("tiny-glm")[0], n_shared_experts=6), d / "hf")
    convert(src, str(d / "glm.gguf"), "Q8_0")
    return str(d / "glm.gguf")


@pytest.mark.parametrize("which", ["tiny-deepseek", "tiny-qwen", "tiny-glm", "gguf"])
def test_each_rank_reads_only_its_experts_and_holds_the_one_rank_shard(ranks, which, glm_q8_gguf):
    """Expert parallel at load: a rank's reader asks for its own routed experts only (a preset draws only
    those, a checkpoint reads only those, a GGUF takes its run of the stacked blocks), and what it holds is
    bit for bit the one-rank model's layer cut by the sharding rules."""
    from ds4t.models.blocks import MoEWeights
    from ds4t.parallel.shard import Part, layer

    path = glm_q8_gguf if which == "gguf" else which
    out = ranks.run(jobs.tp_expert_reads, path)
    whole = ds4t.load(path)
    moe = [i for i, lw in enumerate(whole.layers) if isinstance(lw.ffn, MoEWeights)]
    assert moe and all(sorted(o["experts"]) == moe for o in out)
    E = whole.router_cfg.num_experts
    for r, o in enumerate(out):
        assert o["asked"] and all(v == list(range(r * E // 2, (r + 1) * E // 2)) for v in o["asked"].values()), o["asked"]
        for i in moe:
            cut = layer(whole.layers[i], whole.cfg, Part(r, 2), f"layers.{i}").ffn
            want = [jobs.plain_tensors(w) for w in (cut.w_gate, cut.w_up, cut.w_down)]
            for a, b in zip(o["experts"][i], want):
                assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)), (which, r, i)
