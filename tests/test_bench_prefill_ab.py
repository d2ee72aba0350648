"""bench/prefill_ab.py: a CPU smoke run on a tiny preset, the bits column's control, refusals."""
import json

import pytest
import torch

from tests.bench_scripts import load

ab = load("bench/prefill_ab.py", "bench_prefill_ab")

DV = {"state_order": {"recurrent": None}}   # Qwen3-Next's GDN state re-laid Dv-contiguous for the variant


def test_smoke_on_a_tiny_preset(tmp_path, device):
    """One session in chunks and two sessions sharing each step, base and a layout variant: the interpreter
    reduces alike in either layout, so there the variant keeps the base's bits (a GPU's kernels reduce a
    re-laid state in another order: there the column may say so, and is not asserted)."""
    assert ab.main(["--model", "tiny-qwen", "--device", str(device), "--prompt", "8", "--chunk", "4",
                    "--sessions", "1,2", "--rounds", "1", "--variant", f"dv={json.dumps(DV)}",
                    "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "prefill_ab.json").read_text())["rows"]
    assert [(r["n"], r["variant"]) for r in rows] == [(1, "base"), (1, "dv"), (2, "base"), (2, "dv")]
    assert all(len(r["rounds"]) == 1 and r["ms"] > 0 for r in rows)
    if device.type == "cpu":
        assert all(r["bits"] for r in rows)
    md = (tmp_path / "prefill_ab.md").read_text()
    assert "| 1 | 4 | dv |" in md and "| 2 | 2 x 2 | base |" in md


def test_bits_column_sees_a_variant_that_changes_the_result(monkeypatch):
    """Control: a variant whose prefill gives other logits is reported as such (the column can fail)."""
    import ds4t

    model = ds4t.load("tiny-qwen")
    real = ab.prefill_prompt

    def skewed(model_, prompt, chunk, n, collect=True):
        if not collect:   # the timed runs return nothing
            return real(model_, prompt, chunk, n, collect)
        logits, states = real(model_, prompt, chunk, n)
        rec = next(t for name, t in model_.pool.tensors.items() if name.endswith(".recurrent"))
        if rec.is_contiguous():   # inside the "dv" variant only
            logits = logits.clone()
            logits.view(torch.int32).view(-1)[0] ^= 1
        return logits, states

    monkeypatch.setattr(ab, "prefill_prompt", skewed)
    rows = ab.run(model, [3, 1, 4, 1], 2, [1], [("base", {}), ("dv", DV)], 1, torch.device("cpu"), lambda s: None)
    assert [r["bits"] for r in rows] == [True, False]


def test_refusals():
    with pytest.raises(SystemExit, match="at least one --variant"):
        ab.main(["--model", "tiny-qwen", "--device", "cpu"])
    with pytest.raises(SystemExit, match="names must differ"):
        ab.main(["--model", "tiny-qwen", "--device", "cpu", "--variant", "a={}", "--variant", "a={}"])


def test_the_prompt_is_random_tokens_not_one_token_repeated():
    """The A/B prompts spread over the vocabulary (a prompt of one repeated token routes every row to the same
    experts: a MoE chunk then reads a handful of them), and the same seed gives the same prompt."""
    p = ab.random_prompt(151_000, 4096)
    assert len(p) == 4096 and len(set(p)) > 3000 and max(p) < 151_000
    assert p == ab.random_prompt(151_000, 4096) != ab.random_prompt(151_000, 4096, seed=1)
    control = [ab.random.Random(0).randrange(151_000) for _ in range(4096)]   # the old construction
    assert len(set(control)) == 1
