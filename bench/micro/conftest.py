"""Micro-benchmarks of every kernel op with pytest-benchmark (``make bench-kernels``).

In the Triton interpreter pytest-benchmark's wall clock is the timer (``triton.testing.do_bench``
needs a GPU); on a GPU every timed call ends with ``torch.cuda.synchronize()``, so a round is
the kernel's launch and execution. Sizes: ``DS4T_MICRO_SIZE=small`` (default in the interpreter)
or ``real`` (default on a GPU); see cases.py.
"""
import pytest
import torch

import ds4t  # noqa: F401
from ds4t.backend import INTERPRET

from cases import micro_size


def pytest_report_header(config):
    return f"ds4t micro-benchmarks: {micro_size()} shapes, {'interpreter' if INTERPRET else 'GPU'} timing"


@pytest.fixture
def time_kernel(benchmark):
    """time_kernel(call): benchmark the zero-argument ``call`` the way this device needs."""
    def run(call):
        benchmark.extra_info["size"] = micro_size()
        if INTERPRET:   # seconds per call at most: a few rounds, no calibration loop
            return benchmark.pedantic(call, rounds=3, iterations=1, warmup_rounds=1)

        def synced():
            call()
            torch.cuda.synchronize()
        return benchmark(synced)
    return run
