"""Shared pieces of the tests of ops that add a linear's split-K partials in the kernel after it
(``linear_add_rms_norm``, ``linear_router``): every linear split, a consumer that sums the partials in
another order (the negative control), and a decode step with its calls of one op counted."""
from __future__ import annotations

import contextlib

import triton
import triton.language as tl

import ds4t
from ds4t.kernels import linear as L
from ds4t.kernels.registry import recording


@contextlib.contextmanager
def split_linears(split: int, block_k: int = 32):
    """Every linear launch split ``split`` ways (the GPU's decode shapes split; the interpreter's rule never does)."""
    cfg = L.LinearConfig(block_n=32, block_k=block_k, split=split, num_warps=4, num_stages=1, swap=True)
    with L.LINEAR_CONFIGS.forced(lambda *key: cfg):
        yield


@triton.jit
def split_sum_reversed(ptrs, mask, stride, SPLIT: tl.constexpr, CG: tl.constexpr = False):
    """The partials added last to first: a consumer that sums them in another order than the linear
    (monkeypatched over a module's ``split_sum``)."""
    acc = tl.load(ptrs + (SPLIT - 1) * stride, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        acc += tl.load(ptrs + (SPLIT - 1 - s) * stride, mask=mask, other=0.0)
    return acc


def decode_step(model, op_name: str):
    """(logits of one native decode step of a fresh session after a 5-token prefill, how many times
    ``op_name`` was called on the way)."""
    toks = [3, 1, 4, 1, 5, 9]
    with recording() as calls:
        s = model.new_session(max_ctx=32)
        s.prefill(toks[:5])
        out = ds4t.eval_batch([ds4t.DecodeItem(s, toks[5])], mode="native").logits.clone()
    return out, sum(c.name == op_name for c in calls)
