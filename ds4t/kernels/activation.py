"""Elementwise activations between kernels, in fp32.

    silu_mul(gate, up)      [R, C] -> fp32 [R, C] = silu(gate) · up      (SwiGLU MLPs)
    sigmoid_mul(x, gate)    [R, C] -> fp32 [R, C] = x · sigmoid(gate)    (gated attention output)
    add(a, b)               [R, C] -> fp32 [R, C] = a + b

Inputs are 2-D, any float dtype (fp32 / bf16 / fp16), with unit column stride and any row stride,
so column slices of a fused projection (``gu[:, :I]``, ``gu[:, I:]``) need no copy. Elementwise:
trivially batch invariant (no reductions).

``out_dtype`` (silu_mul, sigmoid_mul): bf16 / fp16 stores the fp32 result rounded to nearest even, with
:func:`ds4t.backend.cast`, the rounding every ds4t linear applies to its input: a caller whose only reader
is such a linear (the SwiGLU down projection, ``ds4t.models.blocks.swiglu``) gets the same bits from half
the bytes. With no reduction in the kernel, the compiled bf16-output variant computes the same fp32
values as the fp32 one.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, cast, grid_dependency, sigmoid, timer
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op, rows_invariant
from ds4t.kernels.tensors import float_out, rows_view

__all__ = ["silu_mul", "sigmoid_mul", "add", "silu_mul_ref", "sigmoid_mul_ref", "add_ref"]

_OP_SILU_MUL, _OP_SIGMOID_MUL, _OP_ADD = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class ActivationConfig:
    """Launch constants of the elementwise kernel: rows and columns per program, warps."""
    block_r: int
    block_c: int
    num_warps: int = 4


def _activation_config(C: int, block_r: int, max_block_c: int) -> ActivationConfig:
    return ActivationConfig(block_r=block_r, block_c=min(triton.next_power_of_2(C), max_block_c))


ACTIVATION_CONFIGS: ConfigTable[ActivationConfig] = ConfigTable(
    "activation", gpu={},
    gpu_rule=lambda C: _activation_config(C, block_r=1, max_block_c=2048),
    interp_rule=lambda C: _activation_config(C, block_r=64, max_block_c=1 << 14),
    source="rule: one row per program, columns in tiles of <= 2048, 4 warps; not swept")
"""Keyed on the row width C (elementwise: no tile changes a value)."""


@triton.jit
def _binary_kernel(a_ptr, b_ptr, y_ptr, R, C, stride_a, stride_b, stride_y,
                   OP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    grid_dependency()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < R)[:, None] & (cols < C)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    a = tl.load(a_ptr + r64 * stride_a + cols[None, :], mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + r64 * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if OP == 0:
        y = a * sigmoid(a) * b
    elif OP == 1:
        y = a * sigmoid(b)
    else:
        y = a + b
    tl.store(y_ptr + r64 * stride_y + cols[None, :], cast(y, y_ptr.dtype.element_ty), mask=m)


def _binary(a, b, out, op, names, out_dtype=torch.float32):
    a = rows_view(a, names[0])
    b = rows_view(b, names[1])
    if a.shape != b.shape:
        raise ValueError(f"{names[0]} {tuple(a.shape)} and {names[1]} {tuple(b.shape)} differ in shape")
    R, C = a.shape
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    out = float_out(out, (R, C), a.device, dtype=out_dtype)
    if R == 0 or C == 0:
        return out
    cfg = ACTIVATION_CONFIGS(C)
    grid = (triton.cdiv(R, cfg.block_r), triton.cdiv(C, cfg.block_c))
    _binary_kernel[grid](a, b, out, R, C, a.stride(0), b.stride(0), out.stride(0),
                         OP=op, BLOCK_R=cfg.block_r, BLOCK_C=cfg.block_c, num_warps=cfg.num_warps, **LAUNCH)
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor, *, out: Optional[torch.Tensor] = None,
             out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, I] = silu(gate) · up, computed in fp32 and stored as ``out_dtype`` (fp32, or bf16 / fp16
    rounded to nearest even)."""
    return _binary(gate, up, out, _OP_SILU_MUL, ("gate", "up"), out_dtype)


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x · sigmoid(gate), same 2-D shape, computed in fp32 and stored as ``out_dtype``."""
    return _binary(x, gate, out, _OP_SIGMOID_MUL, ("x", "gate"), out_dtype)


def add(a: torch.Tensor, b: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 = a + b elementwise (2-D, same shape), in fp32."""
    return _binary(a, b, out, _OP_ADD, ("a", "b"))


def silu_mul_ref(gate, up, *, out_dtype=torch.float32):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(out_dtype)


def sigmoid_mul_ref(x, gate, *, out_dtype=torch.float32):
    return (x.float() * torch.sigmoid(gate.float())).to(out_dtype)


def add_ref(a, b):
    return a.float() + b.float()


_TOL = 1e-6  # relative to max|ref|: fp32 math, exp may be approximate on the GPU


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(3)
    B, C = 7, 333
    t = (torch.randn(B, 2 * C, generator=g) * 3).to(device)
    results = []
    for name, fn, ref in (("silu_mul", silu_mul, silu_mul_ref), ("sigmoid_mul", sigmoid_mul, sigmoid_mul_ref),
                          ("add", add, add_ref)):
        def run(u, fn=fn):
            return fn(u[:, :C], u[:, C:])
        y, yr = run(t), ref(t[:, :C], t[:, C:])
        err = ((y - yr).abs().max() / yr.abs().max()).item()
        results.append(CheckResult(name, f"B={B} C={C} fp32 (strided halves)", err, _TOL,
                                   rows_invariant(run, t), timer(lambda: run(t), warmup=1, iters=3),
                                   note="relative to max|ref|"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(silu_mul, reference=silu_mul_ref)
register_op(sigmoid_mul, reference=sigmoid_mul_ref)
register_op(add, reference=add_ref)
