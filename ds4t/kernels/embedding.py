"""Token embedding lookup.

    embedding(ids, table)   ids [B] int32/int64, table [V, D] any float -> fp32 [B, D] = table[ids]

Out-of-range ids are the caller's job: the launcher does not look at id values (that would
synchronise with the host, and decode steps are captured in CUDA graphs), so an id outside
[0, V) reads out of bounds. ds4t.eval_batch rejects tokens outside the vocabulary before any
kernel runs. A pure gather: trivially batch invariant.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency, timer
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op, rows_invariant

__all__ = ["embedding", "embedding_ref"]


@dataclasses.dataclass(frozen=True)
class EmbeddingConfig:
    """Launch constants of the gather: rows and columns per program, warps."""
    block_r: int
    block_d: int
    num_warps: int = 4


def _embedding_config(D: int, block_r: int, max_block_d: int) -> EmbeddingConfig:
    return EmbeddingConfig(block_r=block_r, block_d=min(triton.next_power_of_2(D), max_block_d))


EMBEDDING_CONFIGS: ConfigTable[EmbeddingConfig] = ConfigTable(
    "embedding", gpu={},
    gpu_rule=lambda D: _embedding_config(D, block_r=1, max_block_d=2048),
    interp_rule=lambda D: _embedding_config(D, block_r=32, max_block_d=1 << 14),
    source="rule: one row per program, columns in tiles of <= 2048, 4 warps; not swept")
"""Keyed on the row width D (a gather: no tile changes a value)."""


@triton.jit
def _embedding_kernel(ids_ptr, t_ptr, y_ptr, B, D, stride_t, stride_y,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    grid_dependency()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rows < B
    ids = tl.load(ids_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    m = row_ok[:, None] & (cols < D)[None, :]
    v = tl.load(t_ptr + ids[:, None] * stride_t + cols[None, :], mask=m, other=0.0)
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], v.to(tl.float32), mask=m)


def embedding(ids: torch.Tensor, table: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fp32 [B, D] rows ``table[ids]``. ids [B] int32/int64 in [0, V) (not checked: caller's job)."""
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be 1-D int32/int64, got {tuple(ids.shape)} {ids.dtype}")
    if table.dim() != 2 or table.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"table must be 2-D float [V, D], got {tuple(table.shape)} {table.dtype}")
    if table.stride(1) != 1:
        table = table.contiguous()
    ids = ids.contiguous()
    B, D = ids.shape[0], table.shape[1]
    if out is None:
        out = torch.empty((B, D), dtype=torch.float32, device=table.device)
    elif out.shape != (B, D) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be fp32 [{B}, {D}] with unit column stride")
    if B == 0 or D == 0:
        return out
    cfg = EMBEDDING_CONFIGS(D)
    grid = (triton.cdiv(B, cfg.block_r), triton.cdiv(D, cfg.block_d))
    _embedding_kernel[grid](ids, table, out, B, D, table.stride(0), out.stride(0),
                            BLOCK_R=cfg.block_r, BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, **LAUNCH)
    return out


def embedding_ref(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    return table[ids.long()].float()


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(4)
    V, D, B = 100, 333, 9
    results = []
    for dt in (torch.float32, torch.bfloat16):
        table = torch.randn(V, D, generator=g).to(dt).to(device)
        ids = torch.randint(0, V, (B,), generator=g, dtype=torch.int32).to(device)
        y = embedding(ids, table)
        err = (y - embedding_ref(ids, table)).abs().max().item()
        results.append(CheckResult(f"embedding {str(dt).replace('torch.', '')}", f"B={B} V={V} D={D}", err, 0.0,
                                   rows_invariant(lambda i: embedding(i, table), ids),
                                   timer(lambda: embedding(ids, table), warmup=1, iters=3), note="exact"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(embedding, reference=embedding_ref)
