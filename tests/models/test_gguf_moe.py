"""GGUF files of the MoE families (llama.cpp architectures ``qwen3next``, ``deepseek2``, ``glm4moe``): written by
``ds4t convert`` from the tiny presets and loaded back. HF transformers has no GGUF loader for these
architectures, so the oracle is the preset itself (the same weights): F32 files give its logits bit for bit (every
converter transform is undone exactly, or -- Qwen3-Next's ``1 + w`` norms -- to values the kernels turn into the
same bits); Q8_0 files keep the experts as stacked blocks and run native == ordered bitwise."""
import dataclasses

import numpy as np
import pytest
import torch

import ds4t
from ds4t.kernels.quant_blocks import GGUFWeight, quantize
from ds4t.models.checkpoint import CheckpointError
from ds4t.models.convert import convert

gguf = pytest.importorskip("gguf")
PROMPT = [5, 104, 105, 33, 7, 250]
ARCH = {"tiny-qwen": "qwen3next", "tiny-deepseek": "deepseek2", "tiny-glm": "glm4moe"}


def _logits(model):
    return model.new_session(64).prefill(PROMPT, all_logits=True)


def _rewrite(src, dst, drop=(), meta_drop=(), add=None, arch=None):
    """Copy a GGUF file without the tensors ``drop`` / metadata keys ``meta_drop``, plus float tensors ``add``."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in meta_drop:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        if t.name not in drop:
            q = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type if q else None)
    for name, a in (add or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("preset", list(ARCH))
def test_f32_round_trip_is_the_preset(tmp_path, preset):
    path = tmp_path / "m.gguf"
    written = convert(preset, str(path))
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == ARCH[preset]
    assert "blk.1.ffn_gate_exps.weight" in written and "blk.1.exp_probs_b.bias" in written or preset == "tiny-qwen"
    src, model = ds4t.load(preset), ds4t.load(str(path))
    assert model.family == src.family
    assert torch.equal(_logits(model), _logits(src))
    if preset == "tiny-qwen":
        assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_a", "blk.0.ssm_dt.bias"} <= set(written)
        ssm_a = next(t for t in r.tensors if t.name == "blk.0.ssm_a")
        A_log = ds4t.models.registry.preset_source(preset)[1].get("model.layers.0.linear_attn.A_log")
        assert torch.equal(torch.from_numpy(np.array(ssm_a.data)), -torch.exp(A_log))   # stored as -exp(A_log)
        # exp is many-to-one in fp32, so A_log itself need not come back bit for bit (which of several
        # values log() lands on depends on the platform's libm); the decay the model computes does.
        got, want = model.layers[0].mixer.A_log, src.layers[0].mixer.A_log
        assert torch.equal(torch.exp(got), torch.exp(want))
        ulps = (got.view(torch.int32).long() - want.view(torch.int32).long()).abs()
        assert int(ulps.max()) <= 4
        assert model.mtp is None   # llama.cpp's converter drops mtp.* (convert(..., mtp=True) keeps it)
    if preset == "tiny-deepseek":
        assert "blk.0.attn_k_b.weight" in written and "blk.0.attn_kv_b.weight" not in written
        assert r.fields["deepseek2.expert_gating_func"].contents() == 2
        assert model.mtp is None   # DeepseekV2Model.skip_mtp
    if preset == "tiny-glm":   # nextn layer written as block 2, loaded as the MTP head
        assert r.fields["glm4moe.nextn_predict_layers"].contents() == 1
        assert r.fields["glm4moe.block_count"].contents() == 3 and "blk.2.nextn.eh_proj.weight" in written
        assert model.mtp is not None and torch.equal(model.mtp.eh_proj, src.mtp.eh_proj)


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek"])
def test_mtp_as_nextn_blocks_loads_the_head(tmp_path, preset):
    """Files of newer converters carry the MTP layer as a nextn block: it loads as the model's MTP head."""
    convert(preset, str(tmp_path / "m.gguf"), mtp=True)
    src, model = ds4t.load(preset), ds4t.load(str(tmp_path / "m.gguf"))
    assert model.mtp is not None and torch.equal(model.mtp.eh_proj, src.mtp.eh_proj)
    assert torch.allclose(model.mtp.enorm, src.mtp.enorm, rtol=0, atol=1e-7)
    assert torch.equal(_logits(model), _logits(src))


def test_old_deepseek2_files_with_attn_kv_b(tmp_path):
    """Files from before llama.cpp split kv_b (one attn_kv_b per layer) load the same."""
    convert("tiny-deepseek", str(tmp_path / "new.gguf"))
    r = gguf.GGUFReader(str(tmp_path / "new.gguf"))
    t = {x.name: np.array(x.data) for x in r.tensors}
    add, drop = {}, []
    for i in range(2):
        kb, vb = t[f"blk.{i}.attn_k_b.weight"], t[f"blk.{i}.attn_v_b.weight"]   # [H, R, dn], [H, dv, R]
        kv = np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(-1, kb.shape[1])
        add[f"blk.{i}.attn_kv_b.weight"] = kv.astype(np.float32)
        drop += [f"blk.{i}.attn_k_b.weight", f"blk.{i}.attn_v_b.weight"]
    _rewrite(tmp_path / "new.gguf", tmp_path / "old.gguf", drop=drop, add=add)
    assert torch.equal(_logits(ds4t.load(str(tmp_path / "old.gguf"))), _logits(ds4t.load("tiny-deepseek")))


@pytest.mark.parametrize("preset", list(ARCH))
def test_q8_0_keeps_stacked_expert_blocks_and_runs_exact(tmp_path, preset):
    path = tmp_path / "q8.gguf"
    convert(preset, str(path), "Q8_0")
    model = ds4t.load(str(path))
    moe = model.layers[1].ffn
    assert isinstance(moe.w_gate, GGUFWeight) and moe.w_gate.qtype == "Q8_0" and moe.w_gate.dim() == 3
    src = ds4t.models.registry.preset_source(preset)[1]
    E = moe.w_up.shape[0] - (moe.shared_index is not None)
    want = quantize(torch.stack([src.get(f"model.layers.1.mlp.experts.{e}.up_proj.weight") for e in range(E)]), "Q8_0")
    assert torch.equal(moe.w_up.blocks()[:E].cpu(), want.blocks().cpu())   # the file's bytes: gguf-py's Q8_0 of the preset's experts
    # the same blocks as load(preset, quantize="q8_0"), given the file's (quantized) embedding and, for
    # DeepSeek, its F16 k_b / v_b (K = 16 fits no Q8_0 block): bitwise the same logits
    q = ds4t.load(preset, quantize="q8_0")
    q.embed = model.embed
    if preset == "tiny-deepseek":
        for i, (lq, lg) in enumerate(zip(q.layers, model.layers)):
            q.layers[i] = dataclasses.replace(lq, mixer=dataclasses.replace(lq.mixer, w_uk_t=lg.mixer.w_uk_t,
                                                                             w_uv=lg.mixer.w_uv))
    assert torch.equal(_logits(model), _logits(q))
    ds4t.testing.assert_native_exact(model, sessions=2, steps=2, negative_control=True)


MIXED = {"tiny-qwen": {"attn_v": "Q4_0", "attn_gate": "Q4_0", "ssm_ba": "Q4_0"}, "tiny-deepseek": {"attn_kv_a_mqa": "Q4_0"},
         "tiny-glm": {"attn_v": "Q4_0"}}
"""A type mix inside the fused matrices of each family, as llama.cpp's Q4_K_M mixes them (``--tensor-type``)."""


@pytest.mark.parametrize("preset", list(ARCH))
def test_fusions_of_mixed_types_keep_each_part_in_its_blocks(tmp_path, preset):
    """q / k / v (GLM, Qwen3-Next), GDN's qkvz + ba (Qwen3-Next: attn_qkv in one type, attn_gate and ssm_ba in
    another, as Q4_K_M writes them), DeepSeek's q_a + kv_a written in two types: each fusion is a RowParts of
    blocks (not a float matrix), the logits those of the same file dequantized at load (fp32 activations:
    within 1e-5), and native == ordered bitwise with the negative control."""
    from ds4t.kernels.weights import RowParts

    path = tmp_path / "mixed.gguf"
    written = convert(preset, str(path), "Q8_0", tensor_types=MIXED[preset])
    assert {written[n] for n in written if any(k + ".weight" in n for k in MIXED[preset])} == {"Q4_0"}
    model = ds4t.load(str(path))
    fused = [w for layer in model.layers for w in vars(layer.mixer).values() if isinstance(w, RowParts)]
    assert fused and all(w.qtype == "Q8_0+Q4_0" for w in fused)
    if preset == "tiny-qwen":   # every GDN layer's qkvz + ba: [q | k | v] in Q8_0, then [z | b | a] in Q4_0
        c = model.cfg
        gdn = [layer.mixer.w_in for layer in model.layers if hasattr(layer.mixer, "w_in")]
        qkv = 2 * c.lin_k_heads * c.lin_k_dim + c.lin_v_heads * c.lin_v_dim
        assert gdn and all(isinstance(w, RowParts) and w.row_ranges()[0] == (0, qkv) for w in gdn)
    floats = ds4t.load(str(path), dequantize=True)
    got, want = _logits(model), _logits(floats)
    assert ((got - want).abs().max() / want.abs().max()).item() < 1e-5
    ds4t.testing.assert_native_exact(model, sessions=2, steps=2, negative_control=True)


def test_errors_name_the_problem(tmp_path):
    convert("tiny-glm", str(tmp_path / "glm.gguf"))
    _rewrite(tmp_path / "glm.gguf", tmp_path / "a.gguf", meta_drop=("glm4moe.expert_feed_forward_length",))
    with pytest.raises(CheckpointError, match="missing metadata 'glm4moe.expert_feed_forward_length'"):
        ds4t.load(str(tmp_path / "a.gguf"))
    _rewrite(tmp_path / "glm.gguf", tmp_path / "b.gguf", arch="deepseek2")   # wrong architecture
    with pytest.raises(CheckpointError, match="missing metadata 'deepseek2.block_count'"):
        ds4t.load(str(tmp_path / "b.gguf"))
    convert("tiny-deepseek", str(tmp_path / "ds.gguf"))
    _rewrite(tmp_path / "ds.gguf", tmp_path / "c.gguf", meta_drop=("deepseek2.expert_gating_func",))
    with pytest.raises(CheckpointError, match="missing metadata 'deepseek2.expert_gating_func'.*softmax"):
        ds4t.load(str(tmp_path / "c.gguf"))
    _rewrite(tmp_path / "ds.gguf", tmp_path / "d.gguf", drop=("blk.1.exp_probs_b.bias",))
    with pytest.raises(CheckpointError, match=r"missing tensor 'blk.1.exp_probs_b.bias' \(model.layers.1.mlp.gate"):
        ds4t.load(str(tmp_path / "d.gguf"))
    convert("tiny-qwen", str(tmp_path / "qn.gguf"))
    _rewrite(tmp_path / "qn.gguf", tmp_path / "e.gguf", drop=("blk.0.attn_gate.weight",))
    with pytest.raises(CheckpointError, match="missing tensor 'blk.0.attn_gate.weight'"):
        ds4t.load(str(tmp_path / "e.gguf"))
    _rewrite(tmp_path / "qn.gguf", tmp_path / "f.gguf", arch="glm4moe")
    with pytest.raises(CheckpointError, match="glm4moe"):
        ds4t.load(str(tmp_path / "f.gguf"))
