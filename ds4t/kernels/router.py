"""MoE routers (top-k expert selection), shared by every model family.

Two routers, each a Triton kernel + launcher beside a plain-torch reference:

* :func:`router_softmax_topk` — Qwen3-Next (``Qwen3NextTopKRouter``): softmax over the experts in
  fp32, top-k, optionally renormalised to sum 1 (``norm_topk_prob``).
* :func:`router_sigmoid_grouped` — DeepSeek-V3 / GLM-4.5 ``noaux_tc`` (``DeepseekV3TopkRouter``,
  ``Glm4MoeTopkRouter``): sigmoid scores, selection on scores + ``e_score_correction_bias`` restricted
  to the ``topk_group`` best of ``n_group`` expert groups, weights = the *unbiased* scores of the chosen
  experts, renormalised (``/ (sum + 1e-20)``) when ``norm_topk_prob``, × ``routed_scaling_factor``.

Both take the router linear output ``logits`` [B, E] (fp32; other float dtypes are upcast) and return
``(weights fp32 [B, k], ids int32 [B, k])`` with the experts in descending order of the selection score,
ties to the lower expert index (the rank order the MoE combine sums in).

Dropped groups. HF transformers 5.x (the oracle; checked against 5.24) fills the biased scores of experts
in dropped groups with ``-inf`` before the final top-k; transformers 4.x filled them with ``0.0``, which
picks differently when biased scores are negative (a dropped expert at 0.0 beats a kept expert at < 0).
``router_sigmoid_grouped(..., dropped=...)`` takes the fill value; the default :data:`DROPPED_SCORE`
follows the installed oracle (``-inf``). tests/kernels/test_router.py runs HF's own router on a case
where the two fills choose differently, so a change of HF's behaviour fails loudly.

Batch invariance: one program per block of ROWS rows; every reduction is along a row (over experts);
nothing depends on B. Selection is an iterated "max, then first index holding it, then remove it", so a
row's result depends on that row only.
"""
from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Tuple

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency, sigmoid, split_sum_bias, timer
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op
from ds4t.kernels.tensors import SplitPartials

DROPPED_SCORE: float = float("-inf")
"""The biased score HF transformers 5.x gives experts of dropped groups (HF 4.x gives 0.0)."""


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """Launch constants of the router kernels: rows per program. Warps: Triton's default."""
    rows: int


# Rows per program: a fixed constant (never from B). The interpreter's cost is per program and
# per op, so one block of 16 rows keeps a decode batch to one or two programs. On the GPU one
# row per program: measured on an H200 (triton 3.6, E=512), the softmax of a row inside a
# 16-row block differed in the last bit from the same row alone (bench/diagnose_invariance.py).
ROUTER_CONFIGS: ConfigTable[RouterConfig] = ConfigTable(
    "router", gpu={},
    gpu_rule=lambda E: RouterConfig(rows=1), interp_rule=lambda E: RouterConfig(rows=16),
    source="rule: one row per program on the GPU (16-row programs change a row's softmax bits: "
           "bench/diagnose_invariance.py); not swept")
"""Keyed on the expert count E (the rule does not read it)."""


@triton.jit
def _take_max(x, avail, cols, BIG: tl.constexpr):
    """Per row of x [R, C] among the ``avail`` columns: (max value, first column holding it, avail
    without that column). Works when the max is -inf (a separate mask, not a sentinel value).

    One reduction, not two (a max, then a min over the columns holding it): each value becomes an int64
    key, its fp32 bits made order-preserving (negatives' magnitude bits flipped; -0.0 first made +0.0,
    which compares equal to it) above ``BIG - 1 - column``, so the largest key is the largest value at
    its lowest column. A max of integers is exact in any order: the same value and column as the two
    reductions give (x without NaNs). The value is decoded from the key."""
    b = (x + 0.0).to(tl.int32, bitcast=True)
    b = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    key = (b.to(tl.int64) << 32) | (BIG - 1 - cols[None, :]).to(tl.int64)
    km = tl.max(tl.where(avail, key, -9223372036854775807 - 1), axis=1)
    idx = (BIG - 1 - (km & 0xFFFFFFFF)).to(tl.int32)
    hb = (km >> 32).to(tl.int32)
    m = tl.where(hb < 0, hb ^ 0x7FFFFFFF, hb).to(tl.float32, bitcast=True)
    avail = avail & (cols[None, :] != idx[:, None])
    return m, idx, avail


@triton.jit
def _summed_logits(x_ptr, sx_b, rl, rok, c2, E, N, fill, SPLIT: tl.constexpr, sp_s, pb_ptr, HAS_PB: tl.constexpr,
                   y_ptr, sy_b, BT: tl.constexpr):
    """fp32 [ROWS, BE] router logits (columns >= E: ``fill``) from a linear's SPLIT split-K partials
    (``x_ptr``, stride sp_s between splits; row stride sx_b) added in split order, then its bias (``pb_ptr``)
    -- :func:`ds4t.kernels.linear._splitk_sum_kernel`'s operations and order, so its bits. All N columns of
    the sums are stored to y (row stride sy_b) for the readers of the finished logits (Qwen3-Next's shared
    expert gate is column E): columns < E from the same registers, E .. N-1 in a tail of BT lanes, so the
    selection runs on the BE lanes it runs on without the fusion."""
    v = split_sum_bias(x_ptr + rl * sx_b + c2, (c2 < E) & (rl >= 0), sp_s, SPLIT, pb_ptr + c2, HAS_PB)
    tl.store(y_ptr + rl * sy_b + c2, v, mask=rok[:, None] & (c2 < E))
    if BT > 0:
        t2 = E + tl.arange(0, BT)[None, :]
        tv = split_sum_bias(x_ptr + rl * sx_b + t2, (t2 < N) & (rl >= 0), sp_s, SPLIT, pb_ptr + t2, HAS_PB)
        tl.store(y_ptr + rl * sy_b + t2, tv, mask=rok[:, None] & (t2 < N))
    return tl.where(c2 < E, v, fill)


@triton.jit
def _softmax_topk_kernel(
    x_ptr, sx_b, w_ptr, id_ptr, B, E,
    K: tl.constexpr, RENORM: tl.constexpr, ROWS: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
    EVEN_E: tl.constexpr = False,
    N=0, SPLIT: tl.constexpr = 0, sp_s=0, pb_ptr=None, HAS_PB: tl.constexpr = False, y_ptr=None, sy_b=0,
    BT: tl.constexpr = 0,
):
    """SPLIT > 0: x holds a linear's split-K partials [SPLIT, B, N], summed here (:func:`_summed_logits`)."""
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rok = r < B
    r1 = tl.minimum(r, B - 1).to(tl.int64)      # rows past B redo row B-1 and store nothing
    rl = r1[:, None]
    c2 = tl.arange(0, BE)[None, :]
    if SPLIT > 0:
        x = _summed_logits(x_ptr, sx_b, rl, rok, c2, E, N, float("-inf"), SPLIT, sp_s, pb_ptr, HAS_PB, y_ptr, sy_b,
                           BT)
    elif EVEN_E:
        x = tl.load(x_ptr + rl * sx_b + c2).to(tl.float32)
    else:
        # padded columns: -inf, so exp gives them probability 0 exactly
        x = tl.load(x_ptr + rl * sx_b + c2, mask=c2 < E, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    e = tl.exp(x - m[:, None])
    den = tl.sum(e, axis=1)
    p = e / den[:, None]
    # Top-k on the probabilities (HF: topk(softmax)), descending, ties to the lower index; chosen and
    # padded columns leave ``avail``.
    avail = (c2 < E) & (rl >= 0)
    kc2 = tl.arange(0, BK)[None, :]
    id_row = id_ptr + r1 * K
    wk = tl.zeros([ROWS, BK], dtype=tl.float32)
    tot = tl.zeros([ROWS], dtype=tl.float32)
    for j in tl.static_range(K):
        v, idx, avail = _take_max(p, avail, tl.arange(0, BE), BE)
        tot = tot + v  # rank order
        wk = tl.where(kc2 == j, v[:, None], wk)
        tl.store(id_row + j, idx, mask=rok)
    if RENORM:
        wk = wk / tot[:, None]
    if BK == K:
        tl.store(w_ptr + rl * K + kc2, wk, mask=rok[:, None])
    else:
        tl.store(w_ptr + rl * K + kc2, wk, mask=rok[:, None] & (kc2 < K))


@triton.jit
def _sigmoid_grouped_kernel(
    x_ptr, sx_b, bias_ptr, w_ptr, id_ptr, B, E, GS, scaling, dropped,
    K: tl.constexpr, NG: tl.constexpr, TOPKG: tl.constexpr, TWO: tl.constexpr, RENORM: tl.constexpr,
    ROWS: tl.constexpr, BE: tl.constexpr, BG: tl.constexpr, BK: tl.constexpr,
    N=0, SPLIT: tl.constexpr = 0, sp_s=0, pb_ptr=None, HAS_PB: tl.constexpr = False, y_ptr=None, sy_b=0,
    BT: tl.constexpr = 0,
):
    """SPLIT > 0: x holds a linear's split-K partials [SPLIT, B, N], summed here (:func:`_summed_logits`)."""
    grid_dependency()
    pid = tl.program_id(0)
    r = pid * ROWS + tl.arange(0, ROWS)
    rm = r < B
    c = tl.arange(0, BE)
    cm = c < E
    if SPLIT > 0:
        x = _summed_logits(x_ptr, sx_b, tl.where(rm, r, -1).to(tl.int64)[:, None], rm, c[None, :], E, N, 0.0,
                           SPLIT, sp_s, pb_ptr, HAS_PB, y_ptr, sy_b, BT)
    else:
        x = tl.load(x_ptr + r.to(tl.int64)[:, None] * sx_b + c[None, :], mask=rm[:, None] & cm[None, :],
                    other=0.0).to(tl.float32)
    s = sigmoid(x)
    bias = tl.load(bias_ptr + c, mask=cm, other=0.0).to(tl.float32)
    biased = s + bias[None, :]
    gid = c // GS
    all_rows = (r >= 0)[:, None]
    # Group score: sum of the two largest biased scores of each group (HF: topk(2).sum()).
    gc = tl.arange(0, BG)
    gscore = tl.zeros([ROWS, BG], dtype=tl.float32)
    for g in tl.static_range(NG):
        ing = ((gid == g) & cm)[None, :] & all_rows
        m1, _, ing = _take_max(biased, ing, c, BE)
        if TWO:
            m2, _, ing = _take_max(biased, ing, c, BE)
            m1 = m1 + m2
        gscore = tl.where(gc[None, :] == g, m1[:, None], gscore)
    # Keep the TOPKG best groups (ties to the lower group index).
    gavail = (gc < NG)[None, :] & all_rows
    keep = (c < 0)[None, :] & all_rows
    for j in tl.static_range(TOPKG):
        _, gi, gavail = _take_max(gscore, gavail, gc, BG)
        keep = keep | (gid[None, :] == gi[:, None])
    sel = tl.where(keep, biased, dropped)
    avail = cm[None, :] & all_rows
    kc = tl.arange(0, BK)
    wk = tl.zeros([ROWS, BK], dtype=tl.float32)
    ik = tl.zeros([ROWS, BK], dtype=tl.int32)
    tot = tl.zeros([ROWS], dtype=tl.float32)
    for j in tl.static_range(K):
        _, idx, avail = _take_max(sel, avail, c, BE)
        v = tl.sum(tl.where(c[None, :] == idx[:, None], s, 0.0), axis=1)  # s[idx], exact
        tot = tot + v  # rank order
        wk = tl.where(kc[None, :] == j, v[:, None], wk)
        ik = tl.where(kc[None, :] == j, idx[:, None], ik)
    if RENORM:
        wk = wk / (tot + 1e-20)[:, None]
    wk = wk * scaling
    om = rm[:, None] & (kc < K)[None, :]
    tl.store(w_ptr + r[:, None] * K + kc[None, :], wk, mask=om)
    tl.store(id_ptr + r[:, None] * K + kc[None, :], ik, mask=om)


def _check_logits_and_out(logits: torch.Tensor, top_k: int, out):
    if logits.dim() != 2:
        raise ValueError(f"logits must be [B, E], got {tuple(logits.shape)}")
    B, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in 1..E={E}")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if out is None:
        w = torch.empty((B, top_k), dtype=torch.float32, device=logits.device)
        ids = torch.empty((B, top_k), dtype=torch.int32, device=logits.device)
    else:
        w, ids = out
        if w.shape != (B, top_k) or w.dtype != torch.float32 or not w.is_contiguous() or \
                ids.shape != (B, top_k) or ids.dtype != torch.int32 or not ids.is_contiguous():
            raise ValueError(f"out must be contiguous (fp32 [{B}, {top_k}], int32 [{B}, {top_k}])")
    return logits, B, E, w, ids


def router_softmax_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, *, out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Softmax router (Qwen3-Next).

    logits [B, E] (fp32 router output). p = softmax(logits) in fp32; the top_k largest p in
    descending order (ties to the lower expert index); weights = p / sum(top-k p) when ``renormalize``.
    Returns (weights fp32 [B, top_k], ids int32 [B, top_k]) (``out`` if given).
    """
    logits, B, E, w, ids = _check_logits_and_out(logits, top_k, out)
    return _softmax(logits, logits.stride(0), B, E, top_k, renormalize, w, ids, {})


def _softmax(x, sx_b, B, E, top_k, renormalize, w, ids, fused: dict):
    if B == 0:
        return w, ids
    ROWS = ROUTER_CONFIGS(E).rows
    _softmax_topk_kernel[(triton.cdiv(B, ROWS),)](
        x, sx_b, w, ids, B, E,
        K=top_k, RENORM=bool(renormalize), ROWS=ROWS, BE=triton.next_power_of_2(E),
        BK=triton.next_power_of_2(top_k), EVEN_E=triton.next_power_of_2(E) == E and not fused, **fused, **LAUNCH,
    )
    return w, ids


def router_sigmoid_grouped(
    logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
    *,
    dropped: float = DROPPED_SCORE,
    out: Optional[Tuple[torch.Tensor, torch.Tensor]] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Grouped sigmoid router, DeepSeek-V3 / GLM-4.5 ``noaux_tc``.

    logits [B, E] (fp32 router output), correction_bias [E] (``e_score_correction_bias``).
    s = sigmoid(logits); biased = s + bias; group score = sum of the 2 largest biased scores of each of
    the n_group contiguous groups; the topk_group best groups are kept; experts of dropped groups get the
    selection score ``dropped`` (HF 5.x: -inf); the top_k of the selection scores are chosen (descending,
    ties to the lower index). weights = s[ids] (unbiased), / (sum + 1e-20) when ``renormalize``, then
    × ``scaling``. Returns (weights fp32 [B, top_k], ids int32 [B, top_k]) (``out`` if given).
    """
    logits, B, E, w, ids = _check_logits_and_out(logits, top_k, out)
    return _sigmoid_grouped(logits, logits.stride(0), B, E, correction_bias, top_k, n_group, topk_group, renormalize,
                            scaling, dropped, w, ids, {})


def _sigmoid_grouped(x, sx_b, B, E, correction_bias, top_k, n_group, topk_group, renormalize, scaling, dropped, w,
                     ids, fused: dict):
    if E % n_group != 0:
        raise ValueError(f"E={E} is not a multiple of n_group={n_group}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be in 1..n_group={n_group}")
    if correction_bias.shape != (E,):
        raise ValueError(f"correction_bias must be [{E}], got {tuple(correction_bias.shape)}")
    if B == 0:
        return w, ids
    ROWS = ROUTER_CONFIGS(E).rows
    _sigmoid_grouped_kernel[(triton.cdiv(B, ROWS),)](
        x, sx_b, correction_bias.contiguous(), w, ids, B, E, E // n_group,
        float(scaling), float(dropped),
        K=top_k, NG=n_group, TOPKG=topk_group, TWO=E // n_group >= 2, RENORM=bool(renormalize),
        ROWS=ROWS, BE=triton.next_power_of_2(E), BG=triton.next_power_of_2(n_group),
        BK=triton.next_power_of_2(top_k), **fused, **LAUNCH,
    )
    return w, ids


def route_partials(parts: SplitPartials, num_experts: int, kind: str, top_k: int, renormalize: bool, *,
                   correction_bias: Optional[torch.Tensor] = None, n_group: int = 1, topk_group: int = 1,
                   scaling: float = 1.0, dropped: float = DROPPED_SCORE,
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The router ``kind`` ("softmax": :func:`router_softmax_topk`; "sigmoid_grouped":
    :func:`router_sigmoid_grouped`, with ``correction_bias`` and the group arguments) on the first
    ``num_experts`` columns of a router linear's split-K partials, which the router kernel adds itself in
    the linear's order (one launch instead of two, the same bits). ``parts``: S > 1 splits of fp32 [B, N],
    N >= num_experts (columns past the experts, e.g. Qwen3-Next's shared-expert gate, are summed and stored
    only). Returns (weights fp32 [B, k], ids int32 [B, k], logits fp32 [B, N]: the finished sums)."""
    S, B, N = parts.part.shape
    E = num_experts
    if parts.part.dtype != torch.float32 or parts.part.stride(-1) != 1 or S < 2 or not 1 <= E <= N:
        raise ValueError(f"route_partials: fp32 partials [S >= 2, B, N >= num_experts={E}] with unit column stride "
                         f"expected, got {parts.part.dtype} {list(parts.part.shape)}")
    logits = torch.empty((B, N), dtype=torch.float32, device=parts.part.device)
    _, _, _, w, ids = _check_logits_and_out(logits[:, :E], top_k, None)
    pb = parts.bias
    fused = dict(N=N, SPLIT=S, sp_s=parts.part.stride(0), pb_ptr=parts.part if pb is None else pb,
                 HAS_PB=pb is not None, y_ptr=logits, sy_b=logits.stride(0),
                 BT=triton.next_power_of_2(N - E) if N > E else 0)
    x, sx_b = parts.part, parts.part.stride(1)
    if kind == "softmax":
        w, ids = _softmax(x, sx_b, B, E, top_k, renormalize, w, ids, fused)
    elif kind == "sigmoid_grouped":
        if correction_bias is None:
            raise ValueError("route_partials: the sigmoid_grouped router needs its correction_bias")
        w, ids = _sigmoid_grouped(x, sx_b, B, E, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                                  dropped, w, ids, fused)
    else:
        raise ValueError(f"unknown router kind {kind!r}: 'softmax' or 'sigmoid_grouped'")
    return w, ids, logits


# ----------------------------------------------------------------------------- references


def _topk_first(x: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim, descending, ties to the lower index (stable sort)."""
    v, i = torch.sort(x, dim=-1, descending=True, stable=True)
    return v[..., :k], i[..., :k]


def _ret(w, ids, out):
    if out is not None:
        out[0].copy_(w)
        out[1].copy_(ids)
        return out
    return w.contiguous(), ids.to(torch.int32).contiguous()


def router_softmax_topk_ref(logits, top_k, renormalize, *, out=None):
    """Plain-torch :func:`router_softmax_topk`."""
    p = torch.softmax(logits.float(), dim=-1)
    w, i = _topk_first(p, top_k)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return _ret(w, i, out)


def router_sigmoid_grouped_ref(logits, correction_bias, top_k, n_group, topk_group, renormalize, scaling,
                               *, dropped: float = DROPPED_SCORE, out=None):
    """Plain-torch :func:`router_sigmoid_grouped` (the HF formula, written out)."""
    B, E = logits.shape
    s = torch.sigmoid(logits.float())
    biased = s + correction_bias.float()
    grp = biased.view(B, n_group, E // n_group)
    gscore = _topk_first(grp, min(2, E // n_group))[0].sum(dim=-1)
    _, gi = _topk_first(gscore, topk_group)
    gmask = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gi, True)
    emask = gmask[:, :, None].expand(B, n_group, E // n_group).reshape(B, E)
    sel = biased.masked_fill(~emask, dropped)
    _, ids = _topk_first(sel, top_k)
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    w = w * scaling
    return _ret(w, ids, out)


# ----------------------------------------------------------------------------- self-check


@register_check
def _check(device) -> List[CheckResult]:
    g = torch.Generator().manual_seed(0)
    out = []
    B, E, k = 7, 10, 3
    x = (torch.randn(B, E, generator=g) * 2).to(device)
    bias = (torch.randn(E, generator=g) * 0.3).to(device)

    def one(name, fn, ref):
        w, i = fn(x)
        wr, ir = ref(x)
        err = (w - wr).abs().max().item() if torch.equal(i, ir) else math.inf
        inv = all(torch.equal(fn(x[j : j + 1])[0][0], w[j]) and torch.equal(fn(x[j : j + 1])[1][0], i[j])
                  for j in range(B))
        ms = timer(lambda: fn(x), warmup=1, iters=3)
        out.append(CheckResult(name, f"B={B} E={E} k={k}", err, 1e-6, inv, ms, note="inf if ids differ"))

    one("router_softmax_topk", lambda t: router_softmax_topk(t, k, True),
        lambda t: router_softmax_topk_ref(t, k, True))
    one("router_sigmoid_grouped", lambda t: router_sigmoid_grouped(t, bias, k, 2, 1, True, 2.5),
        lambda t: router_sigmoid_grouped_ref(t, bias, k, 2, 1, True, 2.5))
    return out


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(router_softmax_topk, reference=router_softmax_topk_ref)
register_op(router_sigmoid_grouped, reference=router_sigmoid_grouped_ref)
