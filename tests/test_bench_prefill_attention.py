"""bench/prefill_attention.py: a smoke run (a tiny chunk of GLM-4.5's heads; the interpreter on the CPU) -- its
files, the runs == split-kernel check and a control that differs."""
import json

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
