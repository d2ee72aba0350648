"""bench/prefill_attention.py: a smoke run (a tiny chunk of GLM-4.5's heads; the interpreter on the CPU) -- its
files, the runs == split-kernel check and a control that differs."""
import json

import torch

from tests.bench_scripts import load

pa = load("bench/prefill_attention.py", "bench_prefill_attention")


def test_smoke_run_writes_its_tables(tmp_path, monkeypatch, device):
    monkeypatch.setattr("sys.argv", ["prefill_attention.py", "--device", str(device), "--only", "glm", "--chunk", "8",
                                     "--at", "40", "--rounds", "1", "--iters", "1", "--out", str(tmp_path),
                                     "--variant", 'r2={"decode_attention": [{"key": [64, 128, 128], '
                                                  '"fields": {"run_rows": 2}}]}',
                                     "--variant", 'cache={"products": "cache"}'])
    assert pa.main() == 0
    md = (tmp_path / "prefill_attention.md").read_text()
    assert "runs == split kernel (decode's bits): True" in md
    assert "control (splits of 32) differs: True" in md
    rows = json.loads((tmp_path / "prefill_attention.json").read_text())
    assert {r["variant"] for r in rows} == {"base", "r2", "cache", "sdpa (flash, not invariant)"}
    assert [r["bits"] for r in rows if r["variant"] == "r2"] == ["True"]
    assert [r["bits"] for r in rows if r["variant"] == "cache"] == ["False"]   # other numerics: other bits
    # FLOPs of the chunk: 8 rows at lengths 41..48, 96 heads, d 128 for q.k and p.v
    assert pa.chunk_case("gqa", pa.SHAPES["glm"], 40, 8, device)[1] == 2 * 96 * 256 * sum(range(41, 49))


def test_mla_smoke_run_checks_the_fused_rows_against_the_split_programs(tmp_path, monkeypatch, device):
    """The MLA case passes the chunk's runs table (the interpreter's table folds the splits of runs of 16
    rows; which programs fold is the kernel test's to show): the variant that switches folding off, and
    decode's split programs, give the base's bits."""
    from ds4t.kernels import mla as M

    key = [128, 512, 64, M.default_split_schedule(512, 64, torch.bfloat16).min_split]
    monkeypatch.setattr("sys.argv", ["prefill_attention.py", "--device", str(device), "--only", "mla", "--chunk", "16",
                                     "--at", "200", "--rounds", "1", "--iters", "1", "--out", str(tmp_path),
                                     "--variant", 'nofuse={"mla_decode": [{"key": %s, "fields": {"fuse_rows": null}}]}'
                                     % json.dumps(key)])
    assert pa.main() == 0
    md = (tmp_path / "prefill_attention.md").read_text()
    assert "runs == split kernel (decode's bits): True" in md and "differs: True" in md
    rows = json.loads((tmp_path / "prefill_attention.json").read_text())
    assert [r["bits"] for r in rows if r["variant"] == "nofuse"] == ["True"]
