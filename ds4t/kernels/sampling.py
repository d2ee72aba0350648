"""Token selection: greedy argmax and seeded sampling with temperature, top-k and top-p.

``argmax(logits)`` — the first index of the row maximum.

Both return :data:`NO_TOKEN` (-1) for a row holding a NaN: such a row has no maximum and no distribution
(a model or kernel fault), and an index that looks like a token would hide it. Callers that feed tokens
on check for it (:func:`ds4t.generation.generate` raises, the server fails that request alone).

``sample(logits, seeds, streams, positions, temperature, top_k, top_p)`` — per row b:

1. temperature[b] == 0: the argmax of the raw logits (top-k / top-p ignored).
2. z = logits / temperature (fp32).
3. top-k (top_k[b] > 0): keep z >= the k-th largest z (ties at the threshold kept, as HF's
   ``TopKLogitsWarper``).
4. top-p (top_p[b] < 1): over the survivors, with e = exp(z - max z), keep z >= t for the largest
   threshold t whose kept mass sum(e[z >= t]) >= top_p * sum(e) (the smallest top set of mass
   >= top_p, ties at the threshold kept; at least the max survives — HF's ``TopPLogitsWarper``).
5. Gumbel-max: the first index of the max of z + g over the survivors, g = -log(-log(u)),
   u = (hash(seed, stream, position, vocab index) >> 8 + 0.5) / 2^24.

The noise of a row depends only on (seed, stream, position) and the vocab index: the same token comes
out alone, in any batch and at any row. Both thresholds are exact bisections (32 steps) on the
order-preserving integer key of z, counting elements / summing mass per step — no sort. Reductions run
per row over the vocabulary in a fixed chunk order (chunk size from V and the backend only).

:func:`gumbel_noise` exposes the noise in torch; :func:`sample_ref` is an independent reference that
sorts instead of bisecting; tests compare the chosen tokens exactly.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional

import torch
import triton
import triton.language as tl

from ds4t.backend import INTERPRET, LAUNCH, grid_dependency, timer
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op

_GOLDEN = 0x9E3779B9
_M1 = 0x7FEB352D
_M2 = 0x846CA68B
_MASK32 = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """Launch constants of argmax / sample: rows per program, the vocab chunk (each row is reduced
    over V in chunks of ``block_v``, in chunk order, whatever the rows beside it), and the sample
    kernel's warps (argmax launches with Triton's default)."""
    rows: int
    block_v: int
    num_warps: int


def _sampling_config(V: int, rows: int, num_warps: int) -> SamplingConfig:
    return SamplingConfig(rows=rows, block_v=min(4096, triton.next_power_of_2(V)), num_warps=num_warps)


SAMPLING_CONFIGS: ConfigTable[SamplingConfig] = ConfigTable(
    "sampling", gpu={},
    gpu_rule=lambda V: _sampling_config(V, rows=1, num_warps=8),
    interp_rule=lambda V: _sampling_config(V, rows=64, num_warps=4),
    source="rule: one row per program, vocab chunks of <= 4096, 8 warps for sample; not swept")
"""Keyed on the vocabulary size V, never on B."""


# ----------------------------------------------------------------------------- Triton pieces


@triton.jit
def _mix32(x):
    # "lowbias32" integer finaliser (C. Wellons), on uint32 (wrapping multiply, logical shifts)
    x ^= x >> 16
    x *= 0x7FEB352D
    x ^= x >> 15
    x *= 0x846CA68B
    x ^= x >> 16
    return x


@triton.jit
def _row_keys(seed, stream, pos):
    """Two 32-bit keys per row from (seed, stream, position), each int64 [R]."""
    k = tl.full(seed.shape, 0x243F6A88, tl.uint32)
    k = _mix32((k ^ seed.to(tl.uint32)) + 0x9E3779B9)
    k = _mix32((k ^ (seed >> 32).to(tl.uint32)) + 0x9E3779B9)
    k = _mix32((k ^ stream.to(tl.uint32)) + 0x9E3779B9)
    k = _mix32((k ^ (stream >> 32).to(tl.uint32)) + 0x9E3779B9)
    k = _mix32((k ^ pos.to(tl.uint32)) + 0x9E3779B9)
    k = _mix32((k ^ (pos >> 32).to(tl.uint32)) + 0x9E3779B9)
    k2 = _mix32(k + 0x9E3779B9)
    return k, k2


@triton.jit
def _gumbel(k1, k2, v):
    """Gumbel noise [R, C] for rows with keys k1, k2 [R] at vocab indices v [C]."""
    h = _mix32(_mix32(k1[:, None] ^ v.to(tl.uint32)[None, :]) ^ k2[:, None])
    u = ((h >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
    return -tl.log(-tl.log(u))


@triton.jit
def _key(z):
    """Order-preserving int64 key of fp32 z (as int32 range)."""
    bits = z.to(tl.int32, bitcast=True)
    return (bits ^ ((bits >> 31) & 0x7FFFFFFF)).to(tl.int64)


@triton.jit
def _argmax_rows(x_ptr, sx, r, rm, V, BV: tl.constexpr, R: tl.constexpr):
    """(first argmax, max) of rows r of x, in BV chunks; per lane strict '>' keeps the first index. A row
    holding a NaN gets index NO_TOKEN (-1): it has no maximum."""
    c = tl.arange(0, BV)
    best = tl.full([R, BV], float("-inf"), tl.float32)
    bidx = tl.full([R, BV], 2147483647, tl.int32)
    nan = tl.zeros([R, BV], dtype=tl.int32)
    for v0 in range(0, V, BV):
        v = v0 + c
        m = rm[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + v[None, :], mask=m, other=float("-inf")).to(tl.float32)
        nan = tl.where(x != x, 1, nan)
        better = m & ((x > best) | (bidx == 2147483647))
        best = tl.where(better, x, best)
        bidx = tl.where(better, v[None, :], bidx)
    mx = tl.max(best, axis=1)
    idx = tl.min(tl.where(best == mx[:, None], bidx, 2147483647), axis=1)
    idx = tl.where(tl.max(nan, axis=1) > 0, -1, idx)
    return idx, mx


@triton.jit
def _argmax_kernel(x_ptr, sx, out_ptr, B, V, R: tl.constexpr, BV: tl.constexpr):
    grid_dependency()
    r = tl.program_id(0) * R + tl.arange(0, R)
    rm = r < B
    idx, _ = _argmax_rows(x_ptr, sx, r, rm, V, BV, R)
    tl.store(out_ptr + r, idx.to(tl.int64), mask=rm)


@triton.jit
def _count_ge(x_ptr, sx, r, rm, V, temp, t, BV: tl.constexpr, R: tl.constexpr):
    """Per row: number of vocab entries whose key(z) >= t [R]."""
    c = tl.arange(0, BV)
    n = tl.zeros([R], tl.int32)
    for v0 in range(0, V, BV):
        v = v0 + c
        m = rm[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + v[None, :], mask=m, other=0.0).to(tl.float32)
        kz = _key(x / temp[:, None])
        n += tl.sum((m & (kz >= t[:, None])).to(tl.int32), axis=1)
    return n


@triton.jit
def _mass_ge(x_ptr, sx, r, rm, V, temp, zmax, t, BV: tl.constexpr, R: tl.constexpr):
    """Per row: sum of exp(z - zmax) over vocab entries with key(z) >= t (fixed chunk order)."""
    c = tl.arange(0, BV)
    s = tl.zeros([R], tl.float32)
    for v0 in range(0, V, BV):
        v = v0 + c
        m = rm[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + v[None, :], mask=m, other=0.0).to(tl.float32)
        z = x / temp[:, None]
        ok = m & (_key(z) >= t[:, None])
        s += tl.sum(tl.where(ok, tl.exp(z - zmax[:, None]), 0.0), axis=1)
    return s


@triton.jit
def _sample_kernel(
    x_ptr, sx, seed_ptr, stream_ptr, pos_ptr, temp_ptr, topk_ptr, topp_ptr, out_ptr, B, V,
    R: tl.constexpr, BV: tl.constexpr, SINGLE: tl.constexpr,
):
    grid_dependency()
    r = tl.program_id(0) * R + tl.arange(0, R)
    rm = r < B
    c = tl.arange(0, BV)
    temp = tl.load(temp_ptr + r, mask=rm, other=1.0).to(tl.float32)
    greedy = temp == 0.0
    temp = tl.where(greedy, 1.0, temp)
    kk = tl.load(topk_ptr + r, mask=rm, other=0).to(tl.int32)
    kk = tl.where(greedy, 0, kk)
    pp = tl.load(topp_ptr + r, mask=rm, other=1.0).to(tl.float32)
    pp = tl.where(greedy, 1.0, pp)
    seed = tl.load(seed_ptr + r, mask=rm, other=0).to(tl.int64)
    stream = tl.load(stream_ptr + r, mask=rm, other=0).to(tl.int64)
    pos = tl.load(pos_ptr + r, mask=rm, other=0).to(tl.int64)

    amax, xmax = _argmax_rows(x_ptr, sx, r, rm, V, BV, R)
    zmax = xmax / temp  # division by t > 0 is monotone: max(x / t) == max(x) / t
    zmax = tl.where(rm, zmax, 0.0)
    lo = tl.full([R], -2147483648, tl.int64)
    if SINGLE:
        # the whole row fits one chunk: keys and masses once, each bisection step is a compare + sum
        m1 = rm[:, None] & (c < V)[None, :]
        x1 = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + c[None, :], mask=m1, other=0.0).to(tl.float32)
        z1 = x1 / temp[:, None]
        kz1 = tl.where(m1, _key(z1), -4294967296)  # padding sorts below every real key
        e1 = tl.where(m1, tl.exp(z1 - zmax[:, None]), 0.0)

    # top-k threshold: the largest key t with count(key >= t) >= k
    if tl.max(kk, axis=0) > 0:
        lo_k = lo
        hi_k = tl.full([R], 2147483647, tl.int64)
        for _ in range(32):
            mid = (lo_k + hi_k + 1) >> 1
            if SINGLE:
                cnt = tl.sum((kz1 >= mid[:, None]).to(tl.int32), axis=1)
            else:
                cnt = _count_ge(x_ptr, sx, r, rm, V, temp, mid, BV, R)
            ok = cnt >= kk
            lo_k = tl.where(ok, mid, lo_k)
            hi_k = tl.where(ok, hi_k, mid - 1)
        lo = tl.where(kk > 0, lo_k, lo)

    # top-p threshold over the top-k survivors: the largest t >= lo with mass(key >= t) >= p * mass
    if tl.min(pp, axis=0) < 1.0:
        if SINGLE:
            total = tl.sum(tl.where(kz1 >= lo[:, None], e1, 0.0), axis=1)
        else:
            total = _mass_ge(x_ptr, sx, r, rm, V, temp, zmax, lo, BV, R)
        need = pp * total
        lo_p = lo
        hi_p = tl.full([R], 2147483647, tl.int64)
        for _ in range(32):
            mid = (lo_p + hi_p + 1) >> 1
            if SINGLE:
                mass = tl.sum(tl.where(kz1 >= mid[:, None], e1, 0.0), axis=1)
            else:
                mass = _mass_ge(x_ptr, sx, r, rm, V, temp, zmax, mid, BV, R)
            ok = mass >= need
            lo_p = tl.where(ok, mid, lo_p)
            hi_p = tl.where(ok, hi_p, mid - 1)
        lo = tl.where(pp < 1.0, lo_p, lo)
    lo = tl.minimum(lo, _key(zmax))  # the max always survives (also for top_p <= 0)

    # Gumbel-max over the survivors
    k1, k2 = _row_keys(seed, stream, pos)
    best = tl.full([R, BV], float("-inf"), tl.float32)
    bidx = tl.full([R, BV], 2147483647, tl.int32)
    for v0 in range(0, V, BV):
        v = v0 + c
        m = rm[:, None] & (v < V)[None, :]
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx + v[None, :], mask=m, other=0.0).to(tl.float32)
        z = x / temp[:, None]
        ok = m & (_key(z) >= lo[:, None])
        sc = z + _gumbel(k1, k2, v)
        better = ok & ((sc > best) | (bidx == 2147483647))
        best = tl.where(better, sc, best)
        bidx = tl.where(better, v[None, :], bidx)
    mx = tl.max(best, axis=1)
    idx = tl.min(tl.where(best == mx[:, None], bidx, 2147483647), axis=1)
    idx = tl.where(greedy | (amax == -1), amax, idx)   # amax -1: a NaN in the row, no token
    tl.store(out_ptr + r, idx.to(tl.int64), mask=rm)


# ----------------------------------------------------------------------------- launchers


NO_TOKEN = -1
"""The token of a row whose logits hold a NaN."""


def _check_logits(logits):
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [B, V] with V > 0, got {tuple(logits.shape)}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    return logits


def argmax(logits: torch.Tensor, *, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """First index of the maximum of each row. logits [B, V] float -> int64 [B]."""
    logits = _check_logits(logits)
    B, V = logits.shape
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    cfg = SAMPLING_CONFIGS(V)
    _argmax_kernel[(triton.cdiv(B, cfg.rows),)](logits, logits.stride(0), out, B, V, R=cfg.rows, BV=cfg.block_v,
                                                **LAUNCH)
    return out


def sample(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    streams: torch.Tensor,
    positions: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    *,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """One token per row; see the module docstring for the exact rule.

    logits [B, V] float; seeds, streams (session id), positions int64 [B]; temperature fp32 [B]
    (0 => greedy); top_k int32 [B] (0 => off); top_p fp32 [B] (1.0 => off). Returns int64 [B].
    The draw of a row depends only on (seed, stream, position) and its own logits and settings.
    """
    logits = _check_logits(logits)
    B, V = logits.shape
    for name, t in (("seeds", seeds), ("streams", streams), ("positions", positions),
                    ("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        if t.shape != (B,):
            raise ValueError(f"{name} must be [{B}], got {tuple(t.shape)}")
    if out is None:
        out = torch.empty(B, dtype=torch.int64, device=logits.device)
    if B == 0:
        return out
    cfg = SAMPLING_CONFIGS(V)
    _sample_kernel[(triton.cdiv(B, cfg.rows),)](
        logits, logits.stride(0), seeds, streams, positions, temperature, top_k, top_p, out, B, V,
        R=cfg.rows, BV=cfg.block_v, SINGLE=V <= cfg.block_v, num_warps=cfg.num_warps, **LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------- references


def _mix32_t(x: torch.Tensor) -> torch.Tensor:
    def mul(a, c):  # (a * c) mod 2^32 without int64 overflow
        return (a * (c & 0xFFFF) + (((a * (c >> 16)) & 0xFFFF) << 16)) & _MASK32

    x = x ^ (x >> 16)
    x = mul(x, _M1)
    x = x ^ (x >> 15)
    x = mul(x, _M2)
    x = x ^ (x >> 16)
    return x


def _row_keys_t(seeds, streams, positions):
    k = torch.full_like(seeds, 0x243F6A88, dtype=torch.int64)
    for w in (seeds, streams, positions):
        w = w.to(torch.int64)
        for part in (w & _MASK32, (w >> 32) & _MASK32):
            k = _mix32_t(((k ^ part) + _GOLDEN) & _MASK32)
    return k, _mix32_t((k + _GOLDEN) & _MASK32)


def gumbel_noise(seeds, streams, positions, V: int) -> torch.Tensor:
    """The Gumbel noise :func:`sample` adds: fp32 [B, V], a function of (seed, stream, position, index)."""
    k1, k2 = _row_keys_t(seeds, streams, positions)
    v = torch.arange(V, dtype=torch.int64, device=seeds.device)
    h = _mix32_t(_mix32_t(k1[:, None] ^ v[None, :]) ^ k2[:, None])
    u = ((h >> 8).to(torch.float32) + 0.5) * 2.0 ** -24
    return -torch.log(-torch.log(u))


def candidates_ref(logits, temperature, top_k, top_p) -> torch.Tensor:
    """bool [B, V]: the tokens :func:`sample` may pick (by sorting; for tests and :func:`sample_ref`)."""
    B, V = logits.shape
    t = temperature.float()
    z = logits.float() / torch.where(t == 0, torch.ones_like(t), t)[:, None]
    keep = torch.ones((B, V), dtype=torch.bool, device=logits.device)
    for b in range(B):
        zb = z[b]
        k = int(top_k[b])
        if t[b] == 0:
            continue
        if 0 < k < V:
            keep[b] &= zb >= torch.topk(zb, k).values[-1]
        p = float(top_p[b])
        if p < 1.0:
            e = torch.where(keep[b], torch.exp(zb - zb.max()), torch.zeros_like(zb))
            ev, order = torch.sort(e, descending=True, stable=True)
            csum = torch.cumsum(ev, 0)
            j = int(torch.nonzero(csum >= p * e.sum())[0]) if bool((csum >= p * e.sum()).any()) else 0
            keep[b] &= zb >= zb[order[j]]
    return keep


def _no_token_for_nan(logits, tokens):
    return torch.where(logits.isnan().any(dim=-1), torch.full_like(tokens, NO_TOKEN), tokens)


def argmax_ref(logits, *, out=None):
    """Plain-torch :func:`argmax` (torch.argmax returns the first index of the max)."""
    r = _no_token_for_nan(logits, torch.argmax(logits.float(), dim=-1))
    if out is not None:
        out.copy_(r)
        return out
    return r


def sample_ref(logits, seeds, streams, positions, temperature, top_k, top_p, *, out=None):
    """Plain-torch :func:`sample`: sort-based candidate sets, the same Gumbel noise."""
    B, V = logits.shape
    t = temperature.float()
    z = logits.float() / torch.where(t == 0, torch.ones_like(t), t)[:, None]
    keep = candidates_ref(logits, temperature, top_k, top_p)
    sc = torch.where(keep, z + gumbel_noise(seeds, streams, positions, V), torch.full_like(z, float("-inf")))
    r = _no_token_for_nan(logits, torch.where(t == 0, torch.argmax(logits.float(), dim=-1), torch.argmax(sc, dim=-1)))
    if out is not None:
        out.copy_(r)
        return out
    return r


# ----------------------------------------------------------------------------- self-check


@register_check
def _check(device) -> List[CheckResult]:
    g = torch.Generator().manual_seed(0)
    B, V = 9, 1000
    x = (torch.randn(B, V, generator=g) * 3).to(device)
    seeds = torch.full((B,), 1234, dtype=torch.int64, device=device)
    streams = torch.arange(B, dtype=torch.int64, device=device) * 7
    pos = torch.arange(B, dtype=torch.int64, device=device) + 100
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5, 2.0, 1.0, 0.9], device=device)
    tk = torch.tensor([0, 0, 5, 0, 40, 0, 1, 100, 20], dtype=torch.int32, device=device)
    tp = torch.tensor([1.0, 1.0, 1.0, 0.9, 0.8, 0.5, 1.0, 1.0, 0.95], device=device)
    res = []

    a = argmax(x)
    inv = all(torch.equal(argmax(x[i:i + 1])[0], a[i]) for i in range(B))
    res.append(CheckResult("argmax", f"B={B} V={V}", float((a != argmax_ref(x)).sum()), 0.0, inv,
                           timer(lambda: argmax(x), warmup=1, iters=3), note="mismatched rows"))

    def run(rows):
        return sample(x[rows], seeds[rows], streams[rows], pos[rows], temp[rows], tk[rows], tp[rows])

    s = run(list(range(B)))
    mism = float((s != sample_ref(x, seeds, streams, pos, temp, tk, tp)).sum())
    inv = all(torch.equal(run([i])[0], s[i]) for i in range(B))
    res.append(CheckResult("sample", f"B={B} V={V}", mism, 0.0, inv,
                           timer(lambda: run(list(range(B))), warmup=0 if INTERPRET else 3,
                                 iters=1 if INTERPRET else 10), note="mismatched rows"))
    return res


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(argmax, reference=argmax_ref)
register_op(sample, reference=sample_ref)
