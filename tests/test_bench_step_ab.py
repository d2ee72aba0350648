"""bench/step_ab.py: variant parsing, the bitwise comparison (with its control), and a CPU smoke run."""
import json

import pytest
import torch

from tests.bench_scripts import load

ab = load("bench/step_ab.py", "bench_step_ab")

SPEC = {"moe": [{"key": ["gate_up", "fp8", "few", 64], "fields": {"num_stages": 4, "max_rows": 2}}],
        "passthrough": ["router_softmax_topk"]}   # linear_router as its two calls: the same bits


def test_variants_inline_file_and_unnamed(tmp_path):
    f = tmp_path / "v.json"
    f.write_text(json.dumps(SPEC))
    assert ab.parse_variant(f"st4={json.dumps(SPEC)}", 1) == ("st4", SPEC)
    assert ab.parse_variant(f"file={f}", 2) == ("file", SPEC)
    assert ab.parse_variant(json.dumps(SPEC), 3) == ("v3", SPEC)
    with pytest.raises(SystemExit, match="no such file"):
        ab.parse_variant("x=missing.json", 1)
    with pytest.raises(SystemExit, match="not valid JSON"):
        ab.parse_variant("x={oops", 1)


def test_same_result_sees_one_bit():
    """The comparison a variant's 'bits' column rests on: equal results are equal, one flipped bit of the
    logits or of one session's state is not (negative controls), and a NaN equals itself bit for bit."""
    logits = torch.randn(2, 8)
    logits[0, 3] = float("nan")
    states = [{"k": torch.randn(3, 4).bfloat16(), "pos": torch.tensor([5])}]
    a = (logits, states)
    assert ab.same_result(a, (logits.clone(), [{k: v.clone() for k, v in states[0].items()}]))
    moved = logits.clone()
    moved.view(torch.int32)[1, 2] ^= 1
    assert not ab.same_result(a, (moved, states))
    st = {k: v.clone() for k, v in states[0].items()}
    st["k"].view(torch.int16)[0, 0] ^= 1
    assert not ab.same_result(a, (logits, [st]))


def test_smoke_on_a_tiny_preset(tmp_path, device):
    """The whole script on a tiny preset (the interpreter ignores GPU entries; on a GPU this FP8 entry does
    not apply to bf16 experts), so the variant keeps the base's bits."""
    assert ab.main(["--model", "tiny-qwen", "--device", str(device), "--ns", "1,2", "--ctx", "8", "--rounds", "2",
                    "--iters", "1", "--variant", f"st4={json.dumps(SPEC)}", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "step_ab.json").read_text())["rows"]
    assert [(r["n"], r["variant"]) for r in rows] == [(1, "base"), (1, "st4"), (2, "base"), (2, "st4")]
    assert all(r["bits"] and len(r["rounds"]) == 2 for r in rows)
    assert [r["exact"] for r in rows] == [None, None, True, True]   # N = 1 has no ordered twin to differ from
    assert "| 1 | st4 |" in (tmp_path / "step_ab.md").read_text()


def test_refusals():
    with pytest.raises(SystemExit, match="at least one --variant"):
        ab.main(["--model", "tiny-qwen", "--device", "cpu"])
    with pytest.raises(SystemExit, match="names must differ"):
        ab.main(["--model", "tiny-qwen", "--device", "cpu", "--variant", "a={}", "--variant", "a={}"])


def test_state_order_relays_the_pool_and_puts_it_back():
    """A ``state_order`` variant: the named states are row-major inside (same values), the pool's own tensors
    (Dk-contiguous for Qwen3-Next's recurrent state) come back after, holding what the block wrote."""
    import ds4t

    model = ds4t.load("tiny-qwen")
    s = model.new_session(max_ctx=8)
    s.prefill([3, 1, 4])
    pool = model.pool
    name = next(n for n in pool.tensors if n.endswith(".recurrent"))
    before, gen = pool.tensors[name], pool.generation
    values = before.clone()
    assert before.stride(2) == 1 and not before.is_contiguous()
    with ab.relaid(model, {"recurrent": None}):
        inside = pool.tensors[name]
        assert inside.is_contiguous() and torch.equal(inside, values) and pool.generation > gen
        inside.add_(1.0)
    assert pool.tensors[name] is before and torch.equal(before, values + 1.0)
    assert pool.generation > gen + 1


def test_options_variant_sets_load_options_for_its_block_only():
    """An ``"options"`` variant sets the model's load options inside ``applied`` and restores them after (also
    when the block raises); an option the family does not take is refused before anything changes."""
    import ds4t

    model = ds4t.load("tiny-glm", dtype="bf16")
    s = model.new_session(max_ctx=16)
    base = s.prefill([3, 1, 4, 1, 5])
    with ab.applied(model, {"options": {"attention_products": "cache", "native_window": 9}}):
        assert model.attention_products == "cache" and model.native_window == 9
        s2 = model.new_session(max_ctx=16)
        assert not torch.equal(s2.prefill([3, 1, 4, 1, 5]), base)   # the launches saw the option
        s2.close()
    assert model.attention_products == "split" and model.native_window is None
    with pytest.raises(RuntimeError), ab.applied(model, {"options": {"attention_products": "cache"}}):
        raise RuntimeError
    assert model.attention_products == "split"
    with pytest.raises(SystemExit, match="native_path"):
        with ab.applied(model, {"options": {"native_path": "ds4"}}):
            pass
    assert model.attention_products == "split"


def test_fp8_fields_variant_patches_fp8_keys_for_its_block_only():
    from ds4t.kernels import linear as L
    from ds4t.kernels import moe as M

    import ds4t

    model = ds4t.load("tiny-glm")
    key = (4096, 4096, torch.float8_e4m3fn, 128, torch.bfloat16)
    with ab.applied(model, {"fp8_fields": {"linear": {"tma": True}, "moe": {"tma": True}}}):
        assert L.LINEAR_CONFIGS.gpu_rule(*key).tma
        assert M.MOE_CONFIGS.gpu_rule("gate_up", "fp8").tma
        assert not L.LINEAR_CONFIGS.gpu_rule(4096, 4096, torch.bfloat16).tma
    assert not L.LINEAR_CONFIGS.gpu_rule(*key).tma
    with pytest.raises(SystemExit, match="no config table"):
        with ab.applied(model, {"fp8_fields": {"nope": {"tma": True}}}):
            pass

