"""bench/bench_tp.py on the CPU: a gloo smoke run of two ranks under torchrun (the same script the GPU runs
take at 2 and 8 ranks): the memory plan of every rank, the exactness checks, the two-phase reduction's rows (its logits the default
path's bits) and the summary come out."""
import os
import subprocess
import sys

from ds4t.testing.markers import cpu_interpreter_only

pytestmark = cpu_interpreter_only

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_tp_smoke_two_ranks(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "bench/bench_tp.py", "--device",
           "cpu", "--models", "tiny-qwen", "--ns", "1,2", "--ctx", "8", "--iters", "1", "--exact-sessions", "2",
           "--exact-steps", "1", "--no-tp1", "--scatter", "--out", str(tmp_path)]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    md = (tmp_path / "tp.md").read_text()
    assert "| rank | weights | sessions | workspace | total | fits |" in md
    assert md.count("| yes |") >= 2                      # a plan row for each rank
    assert "exactness under TP=2 (all ranks): PASS" in md
    assert "logits bitwise the default reduction's: yes" in md      # --scatter: the two-phase reduction
    assert "| tiny-qwen | 2 |" in md and "TP=2 ms" in md   # the summary, labelled by the rank count
    assert len((tmp_path / "tp.jsonl").read_text().splitlines()) == 2
