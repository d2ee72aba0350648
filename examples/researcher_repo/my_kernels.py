"""A researcher's own kernel: a row-wise RMS norm in Triton, written the ds4t way (launcher with
``out=``, plain-torch reference beside it, a reduction order fixed by D alone, never by B)."""
from __future__ import annotations

from typing import Optional

import torch

import ds4t  # noqa: F401  (picks the Triton interpreter on a machine without a GPU, before triton loads)
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, eps, D: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row per program: sum of squares over D in BLOCK_K chunks, in order, then one tl.sum."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, D, BLOCK_K):
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=k + cols < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / D + eps)
    for k in range(0, D, BLOCK_K):
        m = k + cols < D
        x = tl.load(x_ptr + row * stride_x + k + cols, mask=m, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + k + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * stride_y + k + cols, x * inv * w, mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, out: Optional[torch.Tensor] = None,
             block_k: int = 64) -> torch.Tensor:
    """x [B, D] any float dtype, weight [D] -> float32 [B, D]: x * rsqrt(mean(x^2) + eps) * weight.
    ``block_k`` (the reduction chunk) must depend on D only: it fixes each row's summation order."""
    B, D = x.shape
    if weight.shape != (D,):
        raise ValueError(f"rms_norm: weight must be [{D}], got {tuple(weight.shape)}")
    out = torch.empty(B, D, dtype=torch.float32, device=x.device) if out is None else out
    if B:
        _rms_norm_kernel[(B,)](x, weight, out, x.stride(0), out.stride(0), eps, D=D, BLOCK_K=block_k)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
