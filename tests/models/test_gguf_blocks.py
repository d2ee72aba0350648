"""GGUF blocks in models: Q8_0 / Q4_K / Q6_K weights of a GGUF file stay blocks (the quantized kernels read
them), ``load(quantize="q8_0" | "q4_k" | "q5_k" | "q6_k")`` makes them from float weights; HF transformers on the
dequantized weights is the oracle, and native == ordered bitwise (with the negative control)."""
import dataclasses
import logging

import pytest

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
