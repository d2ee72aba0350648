"""One micro-benchmark per kernel op (bench/micro/cases.py): ``make bench-kernels``, or
``pytest bench/micro --benchmark-only`` (``--benchmark-json=FILE`` to keep the numbers)."""
import pytest

from ds4t.backend import default_device

from cases import CASES, micro_size


@pytest.mark.parametrize("op", sorted(CASES))
def test_kernel(time_kernel, op):
    call = CASES[op](default_device(), micro_size() == "real")
    time_kernel(call)
