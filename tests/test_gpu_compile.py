"""Every kernel the model families launch compiles for an sm_90 GPU (bench/compile_check.py),
checked here without a GPU; its negative control must fail to compile."""
import json
import os
import subprocess
import sys

import pytest
import torch

import ds4t

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "bench", "compile_check.py")


@pytest.mark.skipif(not ds4t.backend.INTERPRET, reason="on a GPU the other tests compile every kernel for real")
def test_model_kernels_compile_for_the_gpu():
    p = subprocess.run([sys.executable, TOOL], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert " 0 failed" in p.stdout
    launches = int(p.stdout.strip().splitlines()[-1].split()[0])
    assert launches > 50, p.stdout[-500:]


def test_a_kernel_only_the_interpreter_accepts_is_caught(tmp_path):
    from tests.gpu_compile_bad import _loop_with_break_kernel

    if ds4t.backend.INTERPRET:   # the interpreter runs it: rows 0 and 1 summed, then break
        x = torch.randn(5, 16)
        y = torch.empty(16)
        _loop_with_break_kernel[(1,)](x, y, 5, BLOCK=16)
        torch.testing.assert_close(y, x[0] + x[1])
    rec = [{"module": "tests.gpu_compile_bad", "name": "_loop_with_break_kernel",
            "args": {"x_ptr": {"tensor": "float32"}, "y_ptr": {"tensor": "float32"}, "n": 5, "BLOCK": 16}}]
    f = tmp_path / "records.json"
    f.write_text(json.dumps(rec))
    p = subprocess.run([sys.executable, TOOL, "--compile", str(f)], capture_output=True, text=True, cwd=ROOT,
                       env=dict(os.environ, TRITON_INTERPRET="0"), timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    (label, ok, _, err), = json.loads(p.stdout.strip().splitlines()[-1])
    assert label.endswith("_loop_with_break_kernel") and not ok and err
