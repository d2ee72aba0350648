"""The kernel micro-benchmarks (bench/micro) cover every kernel op and run: each once here, timing off."""
import os
import subprocess
import sys

from ds4t.testing import kernel_ops
from tests.bench_scripts import ROOT, load

CASES = load("bench/micro/cases.py", "micro_cases").CASES


def test_every_kernel_op_has_a_micro_benchmark():
    ops = {o for v in kernel_ops().values() for o in v}
    assert ops - set(CASES) == set(), "kernel ops without a case in bench/micro/cases.py"


def test_micro_benchmarks_run():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "bench/micro",
                        "--benchmark-disable"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(CASES)} passed" in r.stdout, r.stdout
