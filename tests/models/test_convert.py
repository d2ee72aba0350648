"""``ds4t convert``: GGUF files written as llama.cpp's converter writes them (names, metadata, llama's q/k
permutation, llama3 RoPE as ``rope_freqs``), loaded back: F32 gives the source's logits, quantized files
agree with HF transformers on the weights the file holds (read back and dequantized by gguf-py)."""
import numpy as np
import pytest
import torch

import ds4t
from ds4t.cli import main as cli
from ds4t.kernels.quant_blocks import GGUFWeight, quantize
from ds4t.models.checkpoint import CheckpointError
from ds4t.models.convert import convert
from tests.models.hf_oracle import check_against_hf, rel_err, save_tiny

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")
PROMPT = [5, 104, 105, 33, 7, 250]


def _logits(model):
    return model.new_session(64).prefill(PROMPT, all_logits=True)


def test_preset_round_trip_f32_and_q8_0(tmp_path):
    src = ds4t.load("tiny-llama")
    assert cli(["convert", "tiny-llama", str(tmp_path / "f32.gguf")]) == 0
    f32 = ds4t.load(str(tmp_path / "f32.gguf"))
    # llama3 RoPE round-trips as rope_freqs (per-pair divisors): the same frequencies up to fp32 rounding
    assert rel_err(_logits(f32), _logits(src)) <= 1e-5
    assert f32.tokenizer.encode("hi!").ids == [104, 105, 33]   # the preset's bytes
    r = gguf.GGUFReader(str(tmp_path / "f32.gguf"))
    names = {t.name for t in r.tensors}
    assert {"token_embd.weight", "output.weight", "rope_freqs.weight", "blk.1.attn_q.weight", "blk.0.ffn_down.weight"} <= names
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["llama.attention.head_count_kv"].contents() == 2

    assert cli(["convert", "tiny-llama", str(tmp_path / "q8.gguf"), "--type", "q8_0"]) == 0
    q8 = ds4t.load(str(tmp_path / "q8.gguf"))
    down = q8.layers[0].ffn.down
    assert isinstance(down, GGUFWeight) and down.qtype == "Q8_0"
    preset = ds4t.models.registry.preset_source("tiny-llama")[1]
    want = quantize(preset.get("model.layers.0.mlp.down_proj.weight", None, torch.float32), "Q8_0")
    assert torch.equal(down.blocks().cpu(), want.blocks().cpu())          # the file's blocks are gguf-py's Q8_0, kept as stored
    assert rel_err(_logits(q8), _logits(src)) <= 5e-2  # quantization error only

    # --tensor-type: the matrices whose names match in another type (the first matching option wins)
    assert cli(["convert", "tiny-llama", str(tmp_path / "mix.gguf"), "--type", "q8_0",
                "--tensor-type", r"blk\.0\.attn_v=Q4_0", "--tensor-type", "attn_v=Q4_1"]) == 0
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "mix.gguf")).tensors}
    assert (types["blk.0.attn_v.weight"], types["blk.1.attn_v.weight"], types["blk.0.attn_q.weight"]) == \
        ("Q4_0", "Q4_1", "Q8_0")


def _file_weights(path, hf_model, arch):
    """{HF name: fp32 weight} the GGUF at ``path`` holds: gguf-py's dequantize, llama's q/k un-permuted
    (written out here, independently of ds4t's loader)."""
    from tests.models.gguf_files import LAYER, TOP

    inv = {v: k for k, v in LAYER.items()}
    top = {v: k for k, v in TOP.items()}
    c = hf_model.config
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        a = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        base, _, sfx = t.name.rpartition(".")
        sub = None
        if base.startswith("blk."):
            _, i, sub = base.split(".", 2)
            name = f"model.layers.{i}.{inv[sub]}.{sfx}"
        else:
            name = f"{top[base]}.{sfx}"
        a = a.reshape(hf_model.state_dict()[name].shape)
        if arch == "llama" and sub in ("attn_q", "attn_k"):
            n = c.num_attention_heads if sub == "attn_q" else c.num_key_value_heads
            a = a.reshape(n, a.shape[0] // n // 2, 2, -1).transpose(1, 2).reshape(a.shape)
        out[name] = a
    return out


@pytest.mark.parametrize("arch,qtype,mix", [("llama", "Q4_K", None), ("qwen3", "Q6_K", None), ("qwen3", "Q5_K", None),
                                            ("llama", "Q4_K", {"attn_v": "Q6_K", "ffn_down": "Q6_K"})])
def test_k_quant_files_match_hf_on_the_weights_they_hold(tmp_path, arch, qtype, mix):
    """mix: a Q4_K_M-like file (``--tensor-type``): q / k / v fused as a RowParts of Q4_K and Q6_K blocks."""
    cls, cfg_cls = ((transformers.LlamaForCausalLM, transformers.LlamaConfig) if arch == "llama"
                    else (transformers.Qwen3ForCausalLM, transformers.Qwen3Config))
    cfg = cfg_cls(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.05,
                  tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = save_tiny(cls, cfg, tmp_path / "hf", seed=4)
    written = convert(str(tmp_path / "hf"), str(tmp_path / "m.gguf"), qtype, tensor_types=mix)
    model = ds4t.load(str(tmp_path / "m.gguf"))
    assert model.family == arch
    assert isinstance(model.layers[0].ffn.gate_up, GGUFWeight) and model.layers[0].ffn.gate_up.qtype == qtype
    if mix:
        from ds4t.kernels.weights import RowParts

        assert written["blk.0.attn_v.weight"] == written["blk.0.ffn_down.weight"] == "Q6_K"
        assert written["blk.0.attn_q.weight"] == "Q4_K" and model.layers[0].ffn.down.qtype == "Q6_K"
        assert isinstance(model.layers[0].mixer.w_qkv, RowParts) and model.layers[0].mixer.w_qkv.qtype == "Q4_K+Q6_K"
    assert isinstance(model.lm_head, GGUFWeight)
    hf.load_state_dict(_file_weights(tmp_path / "m.gguf", hf, arch), strict=False)
    check_against_hf(model, hf, PROMPT, 3, 1e-4)
    ds4t.testing.assert_native_exact(model, sessions=2, steps=2, negative_control=False)


def test_convert_errors(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="rope_interleave"):   # what a deepseek2 file cannot say
        from unittest import mock
        from ds4t.models import deepseek
        cfg = dict(deepseek.preset_config("tiny-deepseek"), rope_interleave=False)
        with mock.patch.object(deepseek, "preset_config", lambda name: cfg):
            convert("tiny-deepseek", str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="--type"):
        convert("tiny-llama", str(tmp_path / "x.gguf"), "Q3_K")
    assert cli(["convert", "tiny-llama", str(tmp_path / "x.bin")]) == 2
    for bad, why in (("attn_v=Q3_K", "is not one of"), ("attn_v", "PATTERN=TYPE"), ("(=Q8_0", "bad pattern")):
        assert cli(["convert", "tiny-llama", str(tmp_path / "x.gguf"), "--tensor-type", bad]) == 2
        assert why in capsys.readouterr().err and not (tmp_path / "x.gguf").exists()
    assert cli(["convert", str(tmp_path / "nope"), str(tmp_path / "x.gguf")]) == 2
    assert "neither a checkpoint directory nor a preset" in capsys.readouterr().err
