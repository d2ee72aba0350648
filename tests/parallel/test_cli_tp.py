"""``ds4t exactness --tp 2`` starts its two ranks itself (gloo on the CPU), and its exit code is the
worst rank's: 0 when exact (with the TP reduction control caught), 1 on a mismatch."""
import os
import subprocess
import sys

import pytest

from ds4t.testing.markers import cpu_interpreter_only

pytestmark = cpu_interpreter_only

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# A kernel override that makes a native row differ from the same row alone: a row's output depends
# on how many rows the launch has (what a batch-dependent reduction does).
SHIFT = """
import torch
from ds4t.kernels import override
from ds4t.kernels.linear import linear as _linear

def _shifted(x, weight, bias=None, *, out=None):
    y = _linear(x, weight, bias, out=out)
    if x.shape[0] > 1:
        y.mul_(1 + 2 ** -20)
    return y

override("linear", _shifted)
"""


def _run(args, cwd):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ds4t", "exactness", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


def test_exactness_tp2_passes_and_shows_the_reduction_control(tmp_path):
    r = _run(["--model", "tiny-llama", "--tp", "2", "--sessions", "2", "--steps", "2", "--max-prompt", "4"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tensor parallel over 2 ranks (gloo)" in r.stdout
    assert "size-dependent-reduction" in r.stdout and "NOT CAUGHT" not in r.stdout
    assert "exact: yes" in r.stdout


def test_exactness_tp2_fails_on_a_mismatch(tmp_path):
    (tmp_path / "shift_linear.py").write_text(SHIFT)
    r = _run(["--model", "tiny-llama", "--tp", "2", "--sessions", "2", "--steps", "2", "--max-prompt", "4",
              "--no-negative-control", "--import", "shift_linear"], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "exact: NO" in r.stdout


def test_tp_that_does_not_divide_the_heads_is_one_line(tmp_path):
    r = _run(["--model", "tiny-llama", "--tp", "3", "--steps", "1", "--no-negative-control"], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "tp=3 does not divide num_attention_heads (4)" in r.stderr
    assert "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr   # rank 0's line, not one a rank


@pytest.mark.parametrize("bad", ["0", "x"])
def test_bad_tp_value(tmp_path, bad):
    r = _run(["--tp", bad], tmp_path)
    assert r.returncode == 2 and "--tp" in r.stderr
