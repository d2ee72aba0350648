"""A decode step of several rows and a prefill chunk issue no torch op of their own but views and allocations.

Every op of a step is a ds4t kernel; a torch op the model code issues beside them (a ``reshape`` that copies
because no view exists, a ``.contiguous()``, a cast) is a launch a step pays and the kernels' contract does not
see -- the reshape of Qwen3-Next's gate heads out of its projection rows copied them at every Gated DeltaNet
layer. This records, in the interpreter, the aten ops the model code calls outside Triton's interpreter (whose
own bookkeeping moves tensors too); its GPU twin, ``tests/batch/test_step_kernels.py``, lists the kernels a
captured step launches."""
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ds4t
from ds4t.step import StepBatch

NO_WORK = {"_unsafe_view", "empty", "new_empty", "empty_strided", "set_"}
"""aten ops that move no data besides the views (an op whose schema says it returns a view: ``OpOverload.is_view``):
allocations, metadata changes, and ``_unsafe_view`` (a view its schema does not declare)."""
ALLOWED = {("index_select", "ds4t/models/decoder.py"),   # the rows the LM head reads (a chunk's last row)
           ("zero_", "ds4t/models/base.py")}              # a new session's state, zeroed when its slot is taken


class ModelOps(TorchDispatchMode):
    """(aten op, ds4t file) of each op called while active, outside Triton's interpreter, views left out."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f, where, in_triton = sys._getframe(1), "?", False
        while f is not None:
            name = f.f_code.co_filename
            if "/triton/" in name:
                in_triton = True
                break
            if where == "?" and "/ds4t/" in name:
                where = "ds4t/" + name.rsplit("/ds4t/", 1)[1]
            f = f.f_back
        if not in_triton and not func.is_view:
            self.ops[(func.overloadpacket.__name__, where)] += 1
        return func(*args, **(kwargs or {}))


def data_ops(fn) -> dict:
    """The ops ``fn()`` issues outside Triton that move or compute data, but :data:`ALLOWED`."""
    rec = ModelOps()
    with rec:
        fn()
    return {k: v for k, v in rec.ops.items() if k[0] not in NO_WORK and k not in ALLOWED}


@pytest.mark.parametrize("quantize", [None, "fp8"])
@pytest.mark.parametrize("preset", ["tiny-qwen", "tiny-deepseek", "tiny-glm", "tiny-llama"])
def test_step_and_prefill_issue_no_torch_data_ops(preset, quantize):
    # (GGUF MoE layers list their chosen experts on the host in the interpreter -- a nonzero and a cast there,
    # the interpreter's variant only; the GPU finds them on the device -- so GGUF files are not in this list)
    model = ds4t.load(preset, quantize=quantize)
    sessions = [model.new_session(64) for _ in range(3)]
    for i, s in enumerate(sessions):
        s.prefill([i + 1, 2, 3])
    batch = StepBatch.build([(s.slot, [9], s.pos) for s in sessions], model.device)
    assert data_ops(lambda: model.forward(batch)) == {}
    late = model.new_session(64)
    assert data_ops(lambda: late.prefill([5, 6, 7, 8, 9, 10, 11])) == {}


def test_a_copying_reshape_is_seen():
    # the control: the reshape that copied Qwen3-Next's gate heads (no [R * H, D] view of heads inside wider rows)
    proj = torch.randn(3, 2 + 4 * 8 + 5)
    z = proj[:, 2:2 + 4 * 8].unflatten(1, (4, 8))
    assert data_ops(lambda: z.unflatten(2, (2, 4))[:, 1]) == {}   # views: nothing
    assert data_ops(lambda: z.reshape(12, 8))                     # a copy: caught
