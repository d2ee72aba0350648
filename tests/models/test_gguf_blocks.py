"""GGUF blocks in models: kernel-type weights of a GGUF file stay blocks (the quantized kernels read them;
``load(..., dequantize=True)`` makes them float), ``load(quantize="q8_0" | "q4_k" | ...)`` makes them from float
weights; HF transformers on the
dequantized weights is the oracle, and native == ordered bitwise (with the negative control)."""
import dataclasses
import logging

import pytest
import torch

import ds4t
from ds4t.kernels.quant_blocks import GGUFWeight
from ds4t.testing import assert_native_exact
from tests.models.gguf_files import write_gguf
from tests.models.hf_oracle import check_against_hf

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def _block_weights(model):
    """(name, type) of the model's GGUF-block weights (parameters() lists only a GGUFWeight's uint8 data)."""
    found = []

    def walk(obj, prefix):
        if isinstance(obj, GGUFWeight):
            found.append((prefix, obj.qtype))
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            for f in dataclasses.fields(obj):
                walk(getattr(obj, f.name), f"{prefix}.{f.name}")
    for i, layer in enumerate(model.layers):
        walk(layer, f"layers.{i}")
    walk(model.lm_head, "lm_head")
    return found


def test_llama_gguf_keeps_q8_0_blocks(tmp_path, caplog):
    from tests.models.test_gguf import oracle, tiny_llama

    hf = tiny_llama(num_key_value_heads=2)
    held = write_gguf(hf, tmp_path / "m.gguf", types={"matrix": "Q8_0", "embed": "Q8_0"})
    with caplog.at_level(logging.INFO, logger="ds4t.gguf"):
        model = ds4t.load(str(tmp_path / "m.gguf"))
    kept = _block_weights(model)
    assert kept and all(q == "Q8_0" for _, q in kept) and any(n.startswith("lm_head") for n, _ in kept)
    line = [r.getMessage() for r in caplog.records if r.name == "ds4t.gguf"]
    assert len(line) == 1 and "kept Q8_0" in line[0] and "dequantized Q8_0 (1 tensors)" in line[0], line
    # q/k rows un-permuted as blocks: HF on the dequantized, un-permuted weights agrees
    check_against_hf(model, oracle(hf, held), [3, 1, 4, 1, 5, 9], 4, 1e-4)
    assert_native_exact(model, sessions=3, steps=2)


def test_fp32_blocks_for_a_gpu_get_the_bf16_hint(tmp_path, caplog):
    """The load line of blocks kept with fp32 activations (a quantized file's default) for a GPU says to load with
    dtype='bf16' (fp32 activations take the block kernels' exact FMA route there); bf16 on a GPU says nothing of
    it; the CPU says instead that dequantize=True is faster in the interpreter, whatever the dtype. Control: the
    line without a hint is the plain one."""
    from ds4t.models.gguf import open_gguf
    from tests.models.test_gguf import tiny_llama

    write_gguf(tiny_llama(num_key_value_heads=2), tmp_path / "m.gguf", types={"matrix": "Q8_0"})
    source = open_gguf(str(tmp_path / "m.gguf"))[1]
    source.kept["Q8_0"] += 3
    lines = {}
    for dtype, dev in [(torch.float32, "cuda"), (torch.bfloat16, "cuda"), (torch.float32, "cpu"),
                       (torch.bfloat16, "cpu")]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ds4t.gguf"):
            source.log_dequantized(dtype, torch.device(dev))
        lines[dtype, dev] = [r.getMessage() for r in caplog.records if r.name == "ds4t.gguf"]
    assert all(len(v) == 1 and "kept Q8_0 (3 tensors)" in v[0] for v in lines.values()), lines
    assert "dtype='bf16'" in lines[torch.float32, "cuda"][0]
    assert "dequantize" not in lines[torch.float32, "cuda"][0] + lines[torch.bfloat16, "cuda"][0]
    plain = lines[torch.bfloat16, "cuda"][0]
    assert "dtype=" not in plain and plain.endswith("as blocks (quantized kernels)")
    for dtype in (torch.float32, torch.bfloat16):
        cpu = lines[dtype, "cpu"][0]
        assert cpu.startswith(plain) and "dequantize=True" in cpu and "dtype=" not in cpu


def test_dequantize_option_runs_the_files_weights_in_float(tmp_path, caplog):
    """``dequantize=True``: no block is kept, the one log line says why, and the logits are the kept blocks'
    up to summation order (the same dequantized values); the option is refused where it means nothing."""
    import torch

    from tests.models.test_gguf import tiny_llama

    write_gguf(tiny_llama(num_key_value_heads=2), tmp_path / "m.gguf", types={"matrix": "Q4_0", "embed": "F32"})
    kept = ds4t.load(str(tmp_path / "m.gguf"))
    assert {q for _, q in _block_weights(kept)} == {"Q4_0"}
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds4t.gguf"):
        flat = ds4t.load(str(tmp_path / "m.gguf"), dequantize=True)
    assert _block_weights(flat) == []
    line = [r.getMessage() for r in caplog.records if r.name == "ds4t.gguf"]
    assert len(line) == 1 and "dequantized Q4_0" in line[0] and "dequantize=True" in line[0], line
    logits = []
    for m in (kept, flat):
        s = m.new_session(16)
        logits.append(s.prefill([3, 1, 4, 1, 5]))
    assert not torch.equal(logits[0], logits[1])
    assert ((logits[0] - logits[1]).abs().max() / logits[1].abs().max()).item() < 1e-5
    with pytest.raises(ValueError, match="GGUF files"):
        ds4t.load("tiny-llama", dequantize=True)
    with pytest.raises(ValueError, match="True or False"):
        ds4t.load(str(tmp_path / "m.gguf"), dequantize="no")


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm"])
def test_presets_quantized_to_blocks_are_native_exact(preset):
    model = ds4t.load(preset, quantize="q8_0")
    kept = _block_weights(model)
    assert kept and {q for _, q in kept} == {"Q8_0"}
    assert any("w_gate" in n for n, _ in kept)   # the MoE experts run as blocks
    assert_native_exact(model, sessions=3, steps=2)


def test_k_quants_fall_back_where_k_does_not_fit():
    """tiny-llama's K (64, 128) is no multiple of 256: Q4_K falls back to Q8_0 as llama-quantize does."""
    model = ds4t.load("tiny-llama", quantize="q4_k")
    assert {q for _, q in _block_weights(model)} == {"Q8_0"}
    with pytest.raises(ValueError, match="quantize must be"):
        ds4t.load("tiny-llama", quantize="q3_k")
