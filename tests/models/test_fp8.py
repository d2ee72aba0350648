"""Block-FP8 checkpoints in the published layout: loaded as FP8 (never dequantized, never silently wrong),
HF transformers on the dequantized weights as the oracle, native == ordered and prefill-chunk invariance."""

import pytest
import torch

import ds4t
from ds4t.kernels import weights
from ds4t.kernels.weights import FP8Weight, quantize
from tests.models.fp8_checkpoint import write_dequantized_checkpoint, write_fp8_checkpoint
from tests.models.hf_oracle import hf_prefill_and_decode, rel_err, save_tiny

transformers = pytest.importorskip("transformers")

# Blocks smaller than the tiny dims, so rows and columns end in partial blocks (64 = 3 x 24 - 8 rows, 64 = 48 + 16 columns): what
# DeepSeek's 576-row kv_a_proj is to 128-row blocks. The block comes from the config, never the shapes.
BLOCK = (24, 48)


def _qwen(tmp_path):
    from tests.models.test_qwen import qwen_config

    save_tiny(transformers.Qwen3NextForCausalLM, qwen_config(), tmp_path / "float", seed=1)
    return tmp_path / "float"


def _glm(tmp_path):
    from tests.models.test_glm import glm_config

    save_tiny(transformers.Glm4MoeForCausalLM, glm_config(), tmp_path / "float", seed=1)
    return tmp_path / "float"


def _deepseek(tmp_path):
    from tests.models.test_deepseek import ds_config as deepseek_config

    save_tiny(transformers.DeepseekV3ForCausalLM, deepseek_config(), tmp_path / "float", seed=1)
    return tmp_path / "float"


FAMILIES = {"qwen3_next": _qwen, "glm4_moe": _glm, "deepseek_v3": _deepseek}


@pytest.fixture(scope="module")
def qwen_float(tmp_path_factory):
    return _qwen(tmp_path_factory.mktemp("qwen"))


def _fp8_dir(src, dst, **kw):
    tensors = write_fp8_checkpoint(str(src), str(dst), block=kw.pop("block", BLOCK), **kw)
    return str(dst), tensors


# -- loading: FP8 kept as FP8 -----------------------------------------------------------------------

def test_published_layout_loads_as_fp8_without_a_dequantized_copy(qwen_float, tmp_path):
    path, tensors = _fp8_dir(qwen_float, tmp_path / "fp8")
    m = ds4t.load(path, dtype="fp32")
    w = m.layers[0].mixer.w_in
    assert isinstance(w, FP8Weight) and w.block_k == BLOCK[1]
    assert not any(t.dtype == torch.float32 and t.dim() == 2 and t.shape == w.shape for t in m.parameters().values())
    # the fused in_proj rows are the checkpoint's fp8 values, per-row scales the checkpoint's blocks
    fp8 = tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    assert w.data.dtype == torch.float8_e4m3fn and w.data.shape[0] > fp8.shape[0]
    assert m.weight_bytes() < ds4t.load(str(qwen_float), dtype="fp32").weight_bytes() / 2


@pytest.mark.parametrize("edit, match", [
    (lambda t, c: t.pop("model.layers.0.linear_attn.out_proj.weight_scale_inv"),
     "missing scale of float8 tensor 'model.layers.0.linear_attn.out_proj.weight_scale_inv'"),
    (lambda t, c: t.__setitem__("model.layers.0.linear_attn.out_proj.weight_scale_inv", torch.ones(1, 1)),
     r"out_proj.weight_scale_inv.*must be \[3, 2\]"),
    (lambda t, c: c.pop("quantization_config"), "float8_e4m3fn but config.json has no quantization_config"),
    (lambda t, c: c["quantization_config"].update(quant_method="gptq"), "quant_method 'gptq' is not supported"),
    (lambda t, c: c["quantization_config"].update(fmt="e5m2"), "fmt 'e5m2' is not supported"),
    (lambda t, c: c["quantization_config"].update(activation_scheme="static"), "activation_scheme 'static'"),
    (lambda t, c: c["quantization_config"].update(weight_block_size=None), "weight_block_size must be two"),
    (lambda t, c: c["quantization_config"].update(weight_block_size=[24, 40, 1]), "weight_block_size must be two"),
    (lambda t, c: c["quantization_config"].update(modules_to_not_convert=["model.layers.0.linear_attn.out_proj"]),
     "out_proj.weight' is float8_e4m3fn but its module is in quantization_config.modules_to_not_convert"),
    (lambda t, c: t.__setitem__("model.layers.3.self_attn.q_proj.weight",
                                t["model.layers.3.self_attn.q_proj.weight"].to(torch.float8_e5m2)),
     "q_proj.weight' is torch.float8_e5m2"),
    (lambda t, c: t.__setitem__("model.norm.weight", t["model.norm.weight"].to(torch.float8_e4m3fn)),
     "'model.norm.weight' is float8_e4m3fn, but only the decoder's linear weights run in FP8"),
    (lambda t, c: t.__setitem__("model.layers.0.mlp.gate.weight", t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn)),
     "'model.layers.0.mlp.gate.weight' is float8_e4m3fn, but only the decoder's linear weights run in FP8"),
    (lambda t, c: t.update({"model.layers.0.mlp.gate.weight": t["model.layers.0.mlp.gate.weight"].to(torch.float8_e4m3fn),
                            "model.layers.0.mlp.gate.weight_scale_inv": torch.ones(1, 2)}),
     "'model.layers.0.mlp.gate.weight' is float8_e4m3fn, but only the decoder's linear weights run in FP8"),
    (lambda t, c: t.__setitem__("model.layers.0.mlp.gate.weight_scale_inv", torch.ones(1, 1)),
     "'model.layers.0.mlp.gate.weight_scale_inv' scales 'model.layers.0.mlp.gate.weight', which is stored as torch.float32"),
])
def test_every_bad_fp8_checkpoint_is_a_clear_error(qwen_float, tmp_path, edit, match):
    path, _ = _fp8_dir(qwen_float, tmp_path / "bad", edit=edit)
    with pytest.raises(ds4t.CheckpointError, match=match):
        ds4t.load(path, dtype="fp32")


def test_modules_to_not_convert_stay_float(qwen_float, tmp_path):
    keep = "model.layers.3.self_attn.o_proj"
    path, tensors = _fp8_dir(qwen_float, tmp_path / "skip", skip=[keep])
    assert tensors[keep + ".weight"].dtype == torch.float32
    m = ds4t.load(path, dtype="fp32")
    assert isinstance(m.layers[3].mixer.w_o, torch.Tensor) and isinstance(m.layers[3].mixer.w_qkv, FP8Weight)


def test_quantize_at_load_matches_the_published_layout(qwen_float, tmp_path):
    """load(quantize="fp8") on the float checkpoint == loading the FP8 checkpoint made from it (both
    quantized on the CPU: quantized on the H200 the fp8 values of a few elements differed from the CPU's;
    cause not isolated, see bench/results/2026-11-30-h200-fp8.md)."""
    path, _ = _fp8_dir(qwen_float, tmp_path / "fp8", block=(128, 128))
    a = ds4t.load(path, dtype="fp32", device="cpu").parameters()
    b = ds4t.load(str(qwen_float), dtype="fp32", quantize="fp8", device="cpu").parameters()
    assert a.keys() == b.keys() and all(torch.equal(a[k].float(), b[k].float()) for k in a)
    with pytest.raises(ValueError, match="quantize must be None, 'fp8'"):
        ds4t.load("tiny-qwen", quantize="int4")


def test_quantize_at_load_on_meta_has_the_cpus_shapes():
    """On 'meta' (memory plans) quantize computes nothing but gives every weight the shapes, dtypes and block the
    CPU's quantization gives it (dims that 128 does not divide included)."""
    shapes = lambda m: {k: (tuple(v.shape), v.dtype) for k, v in m.parameters().items()}  # noqa: E731
    cpu, meta = (ds4t.load("tiny-deepseek", quantize="fp8", device=d) for d in ("cpu", "meta"))
    assert shapes(meta) == shapes(cpu)
    fp8 = [w for w in vars(cpu.layers[1].ffn).values() if isinstance(w, FP8Weight)]
    assert fp8 and all(w.block_k == 128 for w in fp8)


# -- running: the HF oracle on the dequantized weights, exactness ------------------------------------

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp32_activations_match_hf_on_the_dequantized_weights(tmp_path, family):
    src = FAMILIES[family](tmp_path)
    path, tensors = _fp8_dir(src, tmp_path / "fp8")
    write_dequantized_checkpoint(tensors, str(src), str(tmp_path / "deq"), BLOCK)
    cls = {"qwen3_next": transformers.Qwen3NextForCausalLM, "glm4_moe": transformers.Glm4MoeForCausalLM,
           "deepseek_v3": transformers.DeepseekV3ForCausalLM}[family]
    hf = cls.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32).eval()
    prompt = [int(t) for t in torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(4))]
    want_prompt, want_steps, toks = hf_prefill_and_decode(hf, prompt, 6)
    model = ds4t.load(path, dtype="fp32")
    s = model.new_session(max_ctx=64)
    assert rel_err(s.prefill(prompt, all_logits=True), want_prompt) < 1e-4
    got = torch.stack([ds4t.eval_batch([ds4t.DecodeItem(s, t)]).logits[0] for t in toks])
    assert rel_err(got, want_steps) < 1e-4


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-glm", "tiny-deepseek"])
def test_fp8_native_equals_ordered_with_the_negative_control(name):
    from ds4t.testing import assert_native_exact

    assert_native_exact(ds4t.load(name, quantize="fp8"), sessions=4, steps=3)


@pytest.mark.parametrize("name", ["tiny-qwen", "tiny-glm", "tiny-deepseek"])
def test_fp8_prefill_chunks_are_bitwise_equal_and_equal_token_by_token(name):
    from ds4t.testing import assert_prefill_chunk_invariant

    # 24 tokens: chunks of 17 leave a ragged second chunk, and 64 takes the whole prompt
    prompt = [int(t) for t in torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5))]
    assert_prefill_chunk_invariant(ds4t.load(name, quantize="fp8"), prompt)


def test_bf16_activations_within_the_bf16_bound(qwen_float, tmp_path):
    """FP8 weights with bf16 activations (the model dtype, rounded at each linear's input) against HF in
    fp32 on the dequantized weights, held to the bound of the bf16 float path
    (tests/models/test_qwen.py::test_bf16_within_stated_bound): within HF-bf16's own error on the same
    weights. (On this fp32-initialised checkpoint bf16 rounding costs more than the 5e-2 cap of that
    test's bf16 checkpoint: ds4t's float path in bf16 is at 0.17 here, HF-bf16 at 0.15-0.18.)"""
    path, tensors = _fp8_dir(qwen_float, tmp_path / "fp8")
    write_dequantized_checkpoint(tensors, str(qwen_float), str(tmp_path / "deq"), BLOCK)
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(str(tmp_path / "deq"), dtype=torch.float32).eval()
    prompt = [int(t) for t in torch.randint(0, 256, (11,), generator=torch.Generator().manual_seed(2))]
    want, _, _ = hf_prefill_and_decode(hf, prompt, 1)
    hf_bf16 = hf.to(torch.bfloat16)(input_ids=torch.tensor([prompt])).logits[0].float()
    model = ds4t.load(path, dtype="bf16")
    assert model.layers[0].mixer.w_in.act_dtype == torch.bfloat16
    err = rel_err(model.new_session(max_ctx=64).prefill(prompt, all_logits=True), want)
    assert 1e-4 < err <= rel_err(hf_bf16, want), err   # bf16 rounding is visible, and within HF-bf16's


def test_quantizing_experts_one_at_a_time_gives_the_stacks_bits():
    """The loader quantizes a MoE layer's experts one at a time and stacks the parts (the float stack at once
    took ~60 GB at peak for DeepSeek-V3's 256 experts): a block never spans two experts, so the result is the
    quantized stack's, bitwise -- dims that 128 does not divide included. Control: a different block size
    does change the bits."""
    g = torch.Generator().manual_seed(5)
    experts = [torch.randn(200, 300, generator=g) * (1 + i) for i in range(3)]
    whole = quantize(torch.stack(experts), (128, 128))
    parts = weights.stack([quantize(e, (128, 128)) for e in experts])
    assert torch.equal(parts.data.view(torch.uint8), whole.data.view(torch.uint8))
    assert torch.equal(parts.scale, whole.scale) and parts.block_k == whole.block_k
    other = quantize(torch.stack(experts), (64, 64))
    assert not torch.equal(other.data.view(torch.uint8), whole.data.view(torch.uint8))
