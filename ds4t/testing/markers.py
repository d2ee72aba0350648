"""Shared pytest markers for ds4t's own test suite and for researchers' suites."""
import pytest

from ds4t.backend import INTERPRET

cpu_interpreter_only = pytest.mark.skipif(
    not INTERPRET,
    reason="runs on the CPU through the Triton interpreter only: its processes / CPU tensors cannot feed "
           "GPU-compiled kernels (the GPU path is exercised by the matching bench/ script)")
"""Tests whose setup is CPU-only by design: gloo ranks of tiny models (the 2-GPU NCCL path runs in
bench/bench_tp.py), and smoke runs of the bench scripts on tiny presets."""
