"""A native decode step of several rows launches ds4t's kernels only. GPU only.

A torch kernel inside a step is a copy or a cast that a view or a kernel argument would avoid (a
``reshape`` of heads sliced out of a projection's rows copied them at every Gated DeltaNet layer from two rows
on: bench/results/2026-12-07-h100-router-tiles.md); at one row such reshapes are views, so only a step of
several rows shows them."""
import pytest
import torch

import ds4t
from ds4t.step import StepBatch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def torch_kernels(fn) -> list:
    """Names of the GPU kernels ``fn()`` launches that are not Triton's (ds4t's kernels are Triton's)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted({n for n in names if "at::native" in n or n.startswith("void ") or "cutlass" in n or "gemm" in n})


@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm", "tiny-llama"])
def test_native_step_runs_only_ds4t_kernels(preset):
    model = ds4t.load(preset)
    sessions = [model.new_session(64) for _ in range(5)]
    for i, s in enumerate(sessions):
        s.prefill([i + 1, 2, 3])
    for _ in range(2):   # compile every kernel first
        ds4t.eval_batch([ds4t.DecodeItem(s, 7) for s in sessions], mode="native")
    batch = StepBatch.build([(s.slot, [9], s.pos) for s in sessions], model.device)
    assert torch_kernels(lambda: model.forward(batch)) == []
    # the control: a copy made inside the profiled region is seen
    wide = torch.randn(64, 96, device=model.device)
    assert torch_kernels(lambda: (model.forward(batch), wide[:, 8:72].contiguous()))
