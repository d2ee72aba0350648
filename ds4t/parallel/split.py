"""Which part of an axis a rank holds: integer ranges only (no tensors), so every rule is easy to test."""
from __future__ import annotations

from typing import Tuple

from ds4t.parallel.group import ParallelError


def even(n: int, rank: int, size: int, what: str) -> Tuple[int, int]:
    """[lo, hi) of rank ``rank`` when ``n`` items (heads, experts, columns) split evenly over ``size``
    ranks; ParallelError naming ``what`` when size does not divide n."""
    if n % size:
        raise ParallelError(f"tp={size} does not divide {what} ({n}): each rank must hold the same number")
    k = n // size
    return rank * k, (rank + 1) * k


def blocks(n: int, unit: int, rank: int, size: int, what: str) -> Tuple[int, int]:
    """[lo, hi) of rank ``rank`` when ``n`` columns split over ``size`` ranks in whole blocks of ``unit``
    columns (FP8 scale blocks, GGUF blocks; the last block may be partial), as evenly as blocks allow:
    the first ``blocks % size`` ranks hold one block more. ParallelError naming ``what`` when there are
    fewer blocks than ranks (a rank would hold nothing)."""
    nb = -(-n // unit)
    if nb < size:
        raise ParallelError(f"tp={size}: {what} ({n} columns) is {nb} block(s) of {unit} columns, fewer than the "
                            f"ranks: some rank would hold none of it; use a smaller tp")
    base, extra = divmod(nb, size)
    b0 = rank * base + min(rank, extra)
    b1 = b0 + base + (rank < extra)
    return b0 * unit, min(b1 * unit, n)


def kv_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> Tuple[int, int]:
    """[lo, hi) of the key/value heads the query heads of ``rank`` read (GQA): KV / size of them when
    size divides KV, else the one group all its query heads fall in (size a multiple of KV: that kv
    head is replicated on size / KV ranks)."""
    q0, q1 = even(num_heads, rank, size, "num_attention_heads")
    group = num_heads // num_kv_heads
    if num_kv_heads % size == 0:
        return even(num_kv_heads, rank, size, "num_key_value_heads")
    if size % num_kv_heads == 0:
        return q0 // group, q0 // group + 1
    raise ParallelError(f"tp={size} neither divides num_key_value_heads ({num_kv_heads}) nor is a multiple of it")


def vocab(n: int, rank: int, size: int) -> Tuple[int, int, int]:
    """(lo, hi, rows) of the vocabulary rows of ``rank``: shards of ceil(n / size) rows (the last may
    hold fewer real rows; it is padded to ``rows`` so that every rank gathers the same size)."""
    rows = -(-n // size)
    lo = min(rank * rows, n)
    return lo, min(lo + rows, n), rows
