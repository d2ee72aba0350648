"""RMSNorm family: plain / zero-centred, fused residual add, gated (Qwen3-Next GDN output norm).

Shapes and dtypes
    x, residual, z  [R, D]  any float dtype (fp32 / bf16 / fp16); rows R = batch (or batch*heads)
    weight          [D]     any float dtype, applied in fp32
    returns         fp32 [R, D]; or ``out_dtype`` (bf16 / fp16), rounded to nearest even as it is stored:
                    half the bytes for a consumer that would round the fp32 output to that dtype anyway.
                    The same values for every output dtype, compiled or not: the fp32 sum of squares is a
                    fixed tree (:func:`rstd_of`), whatever layout each output dtype's compiled variant gets
                    (before it was, an fp16 variant at D = 2048 rounded rstd differently on an H200). A
                    row's bits depend on the row and D only.

Math (all in fp32):  x̂ = x * rsqrt(mean(x², over D) + eps)
    rms_norm        y = x̂ · w            (zero_centered: y = x̂ · (1 + w), Qwen3-Next)
    add_rms_norm    s = x + residual;  y = rms_norm(s)  -> (y, s)
    gated_rms_norm  y = x̂ · w · silu(z)  (callers reshape [B, H*D] -> [B*H, D] for per-head norms)

Batch invariance: each row's statistics are reduced over D alone, in an order fixed by D
(BLOCK_D chunks, then :func:`ds4t.backend.pair_sum`'s fixed tree over the chunk accumulator, whose bits no
layout changes: another kernel holding a whole row recomputes the norm bit for bit, :func:`gated_rms`). On the GPU a program owns one row;
in the interpreter a program owns up to 32 rows (programs are what cost time there; NORM_CONFIGS),
fewer when R is smaller (its loads cost per element). The row count is the M tile: each row's sum
is its own tree over D, whatever the other rows of the tile (tests/kernels/test_norm.py checks
rows alone against rows in batches of 1..33, bitwise).
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from ds4t.backend import LAUNCH, cast, grid_dependency, pair_sum, sigmoid, split_sum_bias, timer
from ds4t.kernels.config import ConfigTable
from ds4t.kernels.registry import CheckResult, register_check, register_op, rows_invariant
from ds4t.kernels.moe import combine_rows
from ds4t.kernels.tensors import MoEPartials, SplitPartials, float_out, rows_view

__all__ = [
    "rms_norm", "add_rms_norm", "gated_rms_norm",
    "rms_norm_ref", "add_rms_norm_ref", "gated_rms_norm_ref",
]


@dataclasses.dataclass(frozen=True)
class NormConfig:
    """Launch constants of the norm kernel: the most rows per program (the launcher takes
    ``min(rows, next_pow2(R))``: each row's sum is its own tree over D, so the row count never
    changes a row's bits), the D chunk and the warps -- ``moe_warps`` for the launches that combine a MoE's
    pair outputs first (:class:`MoEPartials`: k + 1 loaded rows a row where a plain launch has one; no warp
    count changes a bit, the squares' tree being fixed by ``block_d``)."""
    rows: int
    block_d: int
    num_warps: int
    moe_warps: int = 0   # 0: num_warps

    def warps(self, combine: bool) -> int:
        """Warps of a launch (``combine``: it combines a MoE's pair outputs)."""
        return (self.moe_warps or self.num_warps) if combine else self.num_warps


def _norm_config(D: int, rows: int, max_block_d: int) -> NormConfig:
    block_d = min(triton.next_power_of_2(D), max_block_d)
    # The combine holds k + 1 loaded chunks of block_d columns a row: at 4 warps and block_d 8192 its sm_90 build
    # takes 255 registers and spills 432 (GLM-4.5, D 5120) / 640 (DeepSeek-V3, D 7168) bytes a thread; 16 warps
    # take 99 / 101 registers and spill nothing (8: 170 / 255). Qwen3-Next's D 2048 (top 10 + shared) takes 168
    # at 4 warps, no spill. Timed: bench/results/2026-12-06-h100-prefill-norms-down.md.
    return NormConfig(rows=rows, block_d=block_d, num_warps=1 if block_d <= 256 else 4,
                      moe_warps=16 if block_d >= 4096 else 0)


NORM_CONFIGS: ConfigTable[NormConfig] = ConfigTable(
    "rms_norm", gpu={},
    gpu_rule=lambda D: _norm_config(D, rows=1, max_block_d=8192),
    interp_rule=lambda D: _norm_config(D, rows=32, max_block_d=1 << 16),
    source="bench/results/2026-12-06-h100-gdn-norm.md (scratch/norm_warps.py): one row per program, D in chunks "
           "of <= 8192; 1 warp to 256 columns, else 4 -- at D = 5120 / 7168 0-5 % faster than the 8 warps the rule "
           "had, 1 and 16 warps slower; every warp count 1-16 gave the same bits (the fixed tree); moe_warps: "
           "bench/results/2026-12-06-h100-prefill-norms-down.md (16 against 4: DeepSeek-V3-4l FP8 prompt -4.0 %, "
           "GLM-4.5-4l -0.4 %, same bits)")
"""Keyed on the row width D (never on R)."""


@triton.jit
def rstd_of(sq, D: tl.constexpr, eps):
    """1 / sqrt(mean + eps) [..., 1] of the squares sq fp32 [..., BLOCK] (zeros past D; BLOCK a power of
    two) of each row: the row's sum as :func:`ds4t.backend.pair_sum`'s fixed tree -- the same bits in whatever
    kernel and layout computes it -- then IEEE sqrt and division (not the approximate GPU defaults), as torch
    computes them. Every RMSNorm in ds4t (this module's kernel and the fused prologues) computes it here."""
    ms = tl.div_rn(pair_sum(sq), tl.full(sq.shape[:-1], D, tl.float32))
    rstd = tl.div_rn(tl.full(sq.shape[:-1], 1.0, tl.float32), tl.sqrt_rn(ms + eps))
    return tl.expand_dims(rstd, len(sq.shape) - 1)


@triton.jit
def add_square(sq, v):
    """sq + v * v rounded once (an FMA; sq = 0 gives v * v itself). Spelled out so no compiler can contract a
    square into :func:`rstd_of`'s first additions (an FMA there would round otherwise) in one kernel and
    not in another: every norm's squares are these."""
    return tl.fma(v, v, sq)


@triton.jit
def scale_row(v, rstd, w):
    """(v · rstd) · w: a normalised row scaled by its weight, in the one order every RMSNorm uses."""
    return (v * rstd) * w


@triton.jit
def silu_gate(y, z):
    """y · silu(z), written as the gated norm has always computed it (y · (z · sigmoid(z)))."""
    return y * (z * sigmoid(z))


@triton.jit
def gated_rms(v, w, z, D: tl.constexpr, eps):
    """x̂ · w · silu(z) of whole rows v fp32 [..., BLOCK] (zeros past D), w and z fp32 broadcastable to it:
    :func:`gated_rms_norm`'s arithmetic in its order, for a kernel that holds each row whole (the Gated
    DeltaNet decode program); the same bits as the norm kernel wherever that kernel takes the row in one chunk
    (``NORM_CONFIGS(D).block_d >= D``: up to 8192 columns on the GPU; past that it adds the chunks' squares
    column by column first, and a caller must too)."""
    return silu_gate(scale_row(v, rstd_of(add_square(tl.zeros(v.shape, tl.float32), v), D, eps), w), z)


@triton.jit
def _load_x(x_row, cc, m, stride_ps, pb_ptr, D: tl.constexpr, EVEN: tl.constexpr, SPLIT: tl.constexpr,
            HAS_PB: tl.constexpr, KT: tl.constexpr = 0, KTOP: tl.constexpr = 0, GATED: tl.constexpr = False,
            r64=None, sy_p=0, cw_ptr=None, sw_b=0, gate_ptr=None, sg_b=0, ids_ptr=None, si_b=0, SHARED=-1):
    """fp32 chunk ``cc`` [1, BLOCK_D] of the rows (mask ``m``, used when not EVEN): x itself (SPLIT 0), or a
    linear's SPLIT split-K partials at ``x_row + s * stride_ps`` added in split order, then its bias
    (``pb_ptr``) -- the operations and order of :func:`ds4t.kernels.linear._splitk_sum_kernel`, so the bits
    that kernel would have stored. KT > 0: the grouped MoE's pair outputs combined over KT ranks
    (:func:`ds4t.kernels.moe.combine_rows`, the combine kernel's arithmetic) for the rows r64 [ROWS] (in
    bounds): x_row the pair outputs' base, ``sy_p`` their row stride, the rest as :func:`_norm_kernel` names
    them."""
    if KT > 0:
        rm = r64 >= 0
        v = combine_rows(x_row, sy_p, r64, rm, cc, (cc < D) & rm[:, None], cw_ptr, sw_b, gate_ptr, sg_b, ids_ptr,
                         si_b, SHARED, KTOP, KT, GATED, SPLIT, stride_ps)
    elif SPLIT > 0:
        if EVEN:
            v = split_sum_bias(x_row + cc, cc < D, stride_ps, SPLIT, pb_ptr + cc, HAS_PB)
        else:
            v = split_sum_bias(x_row + cc, m, stride_ps, SPLIT, pb_ptr + cc, HAS_PB)
    elif EVEN:
        v = tl.load(x_row + cc).to(tl.float32)
    else:
        v = tl.load(x_row + cc, mask=m, other=0.0).to(tl.float32)
    return v


@triton.jit
def _norm_kernel(
    x_ptr, r_ptr, z_ptr, w_ptr, y_ptr, s_ptr,
    R, stride_x, stride_r, stride_z, stride_y, stride_s, eps,
    D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr, GATED: tl.constexpr, ZERO_CENTERED: tl.constexpr,
    SPLIT: tl.constexpr = 0, stride_ps=0, pb_ptr=None, HAS_PB: tl.constexpr = False,
    KT: tl.constexpr = 0, KTOP: tl.constexpr = 0, SHARED=-1, GATED_SHARED: tl.constexpr = False,
    cw_ptr=None, sw_b=0, gate_ptr=None, sg_b=0, ids_ptr=None, si_b=0, Z_HEADS: tl.constexpr = 1, stride_zh=0,
):
    """ROWS rows per program. Optional residual add (writes the sum to s), optional silu(z) gate.
    SPLIT > 0: x is a linear's split-K partials [SPLIT, R, D] (split stride ``stride_ps``) plus its bias
    ``pb_ptr`` (HAS_PB), added here as the linear's sum kernel adds them (:func:`_load_x`).
    KT > 0: x is the grouped MoE's pair outputs [R KT, D] (row stride ``stride_x``; SPLIT > 1: the down
    kernel's partials, split stride ``stride_ps``), combined over the KT ranks of each row with the routing
    weights ``cw_ptr`` [R, KTOP], expert ids ``ids_ptr`` [R, KTOP], the shared expert ``SHARED`` (-1: none) and
    its router logit ``gate_ptr`` [R] (GATED_SHARED), as the MoE's combine kernel does (:func:`_load_x`).
    Z_HEADS > 1 (a per-head gated norm): row r's gate is head r % Z_HEADS of z row r // Z_HEADS (strides
    ``stride_z``, ``stride_zh``), so a z of heads inside wider rows needs no copy."""
    grid_dependency()
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < R)[:, None]
    # Rows past R read row R-1 (in bounds, so row loads need no mask) and store nothing.
    rows64 = tl.minimum(rows, R - 1).to(tl.int64)[:, None]
    x_row = x_ptr + rows64 * stride_x
    r1 = None
    if KT > 0:   # combine_rows addresses the pair rows from the row numbers
        x_row = x_ptr
        r1 = tl.minimum(rows, R - 1).to(tl.int64)
    if ADD_RESIDUAL:
        r_row = r_ptr + rows64 * stride_r
        s_row = s_ptr + rows64 * stride_s
    cols = tl.arange(0, BLOCK_D)
    NUM_CHUNKS: tl.constexpr = (D + BLOCK_D - 1) // BLOCK_D
    EVEN: tl.constexpr = D % BLOCK_D == 0

    # Pass 1: sum of squares, per-column partials over the chunks in order, then the fixed tree.
    sq = tl.zeros((ROWS, BLOCK_D), dtype=tl.float32)
    for c in tl.static_range(NUM_CHUNKS):
        cc = (cols if c == 0 else c * BLOCK_D + cols)[None, :]
        if EVEN:
            v = _load_x(x_row, cc, row_ok, stride_ps, pb_ptr, D, EVEN, SPLIT, HAS_PB,
                        KT, KTOP, GATED_SHARED, r1, stride_x, cw_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED)
            if ADD_RESIDUAL:
                v += tl.load(r_row + cc).to(tl.float32)
                tl.store(s_row + cc, v, mask=row_ok)
        else:
            m = row_ok & (cc < D)
            v = _load_x(x_row, cc, m, stride_ps, pb_ptr, D, EVEN, SPLIT, HAS_PB,
                        KT, KTOP, GATED_SHARED, r1, stride_x, cw_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED)
            if ADD_RESIDUAL:
                v += tl.load(r_row + cc, mask=m, other=0.0).to(tl.float32)
                tl.store(s_row + cc, v, mask=m)
        sq = add_square(sq, v)
    rstd = rstd_of(sq, D, eps)

    # Pass 2: normalise and scale. One chunk: the row is still in registers. More: re-read it
    # (the sum of squares needs the whole row first).
    y_row = y_ptr + rows64 * stride_y
    if GATED:
        if Z_HEADS > 1:
            z_row = z_ptr + (rows64 // Z_HEADS) * stride_z + (rows64 % Z_HEADS) * stride_zh
        else:
            z_row = z_ptr + rows64 * stride_z
    for c in tl.static_range(NUM_CHUNKS):
        cc = (cols if c == 0 else c * BLOCK_D + cols)[None, :]
        if EVEN:
            m = row_ok
            if NUM_CHUNKS > 1:
                v = _load_x(x_row, cc, m, stride_ps, pb_ptr, D, EVEN, SPLIT, HAS_PB,
                            KT, KTOP, GATED_SHARED, r1, stride_x, cw_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED)
                if ADD_RESIDUAL:
                    v += tl.load(r_row + cc).to(tl.float32)
            w = tl.load(w_ptr + cc).to(tl.float32)
        else:
            m = row_ok & (cc < D)
            if NUM_CHUNKS > 1:
                v = _load_x(x_row, cc, m, stride_ps, pb_ptr, D, EVEN, SPLIT, HAS_PB,
                            KT, KTOP, GATED_SHARED, r1, stride_x, cw_ptr, sw_b, gate_ptr, sg_b, ids_ptr, si_b, SHARED)
                if ADD_RESIDUAL:
                    v += tl.load(r_row + cc, mask=m, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + cc, mask=cc < D, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = 1.0 + w
        y = scale_row(v, rstd, w)
        if GATED:
            if EVEN:
                z = tl.load(z_row + cc).to(tl.float32)
            else:
                z = tl.load(z_row + cc, mask=m, other=0.0).to(tl.float32)
            y = silu_gate(y, z)
        tl.store(y_row + cc, cast(y, y_ptr.dtype.element_ty), mask=m)


def _launch(x, weight, eps, *, residual=None, z=None, zero_centered=False, out=None, summed=None,
            out_dtype=torch.float32):
    """``x``: a tensor [R, D], a linear's :class:`SplitPartials` (added in the kernel), or the grouped MoE's
    :class:`MoEPartials` (combined in the kernel)."""
    parts = moe = None
    if isinstance(x, MoEPartials):
        moe, y2 = x, (x.y if x.y.dim() == 2 else x.y[0])
        if (x.y.dim() not in (2, 3) or x.y.dtype != torch.float32 or y2.stride(1) != 1
                or y2.shape[0] != x.rows * x.ranks):
            raise ValueError(f"MoE pair outputs must be fp32 [rows * ranks = {x.rows * x.ranks}, D] (or [S, ..]) "
                             f"with unit column stride, got {x.y.dtype} {list(x.y.shape)}")
        x = y2.as_strided((moe.rows, y2.shape[1]), y2.stride())   # [R, D]: the shape checks below; never read so
    elif isinstance(x, SplitPartials):
        if x.splits == 1 and x.bias is None:
            x = x.part[0]          # the finished product: the plain kernel
        else:
            parts = x
            if parts.part.dim() != 3 or parts.part.dtype != torch.float32 or not parts.part.is_contiguous():
                raise ValueError(f"split partials must be contiguous fp32 [S, R, D], got {parts.part.dtype} "
                                 f"{list(parts.part.shape)}")
            x = parts.part[0]
    x = rows_view(x, "x")
    R, D = x.shape
    if parts is not None and parts.bias is not None and parts.bias.shape != (D,):
        raise ValueError(f"split partials' bias must be [{D}], got {tuple(parts.bias.shape)}")
    if weight.shape != (D,):
        raise ValueError(f"weight must be [{D}], got {tuple(weight.shape)}")
    weight = weight.contiguous()
    if residual is not None:
        residual = rows_view(residual, "residual")
        if residual.shape != x.shape:
            raise ValueError(f"residual must be {tuple(x.shape)}, got {tuple(residual.shape)}")
    z_heads = {}
    if z is not None:
        if z.dim() == 3:   # [R / H, H, D]: head h of a row's gate, rows of any stride (no copy)
            if z.shape[0] * z.shape[1] != R or z.shape[2] != D:
                raise ValueError(f"z must be [{R}, {D}] or [rows, heads, {D}] with rows * heads = {R}, "
                                 f"got {tuple(z.shape)}")
            if z.stride(2) != 1:
                z = z.contiguous()
            if z.shape[1] > 1:
                z_heads = dict(Z_HEADS=z.shape[1], stride_zh=z.stride(1))
        else:
            z = rows_view(z, "z")
            if z.shape != x.shape:
                raise ValueError(f"z must be {tuple(x.shape)}, got {tuple(z.shape)}")
    if out_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_dtype must be float32, bfloat16 or float16, got {out_dtype}")
    y = float_out(out, (R, D), x.device, dtype=out_dtype)
    if residual is not None:
        summed = float_out(summed, (R, D), x.device, "summed")
    if R == 0:
        return y, summed
    cfg = NORM_CONFIGS(D)
    r_arg = residual if residual is not None else x
    z_arg = z if z is not None else x
    s_arg = summed if summed is not None else y
    rows = min(cfg.rows, triton.next_power_of_2(R))
    split = {} if parts is None else dict(
        SPLIT=parts.splits, stride_ps=parts.part.stride(0),
        pb_ptr=parts.bias.contiguous() if parts.bias is not None else x, HAS_PB=parts.bias is not None)
    if moe is not None:
        w_, ids_, g_ = moe.weights, moe.ids, moe.gate
        split = dict(SPLIT=moe.splits, stride_ps=moe.y.stride(0) if moe.splits > 1 else 0,
                     KT=moe.ranks, KTOP=moe.top_k, SHARED=moe.shared, GATED_SHARED=moe.gated,
                     cw_ptr=w_, sw_b=w_.stride(0), gate_ptr=g_, sg_b=g_.stride(0), ids_ptr=ids_, si_b=ids_.stride(0))
    _norm_kernel[(triton.cdiv(R, rows),)](
        x, r_arg, z_arg, weight, y, s_arg,
        R, x.stride(0), r_arg.stride(0), z_arg.stride(0), y.stride(0), s_arg.stride(0), float(eps),
        D=D, ROWS=rows, BLOCK_D=cfg.block_d,
        ADD_RESIDUAL=residual is not None, GATED=z is not None, ZERO_CENTERED=bool(zero_centered),
        num_warps=cfg.warps(moe is not None), **split, **z_heads, **LAUNCH,
    )
    return y, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, zero_centered: bool = False,
             out: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[B, D] = x̂ · w (or x̂ · (1 + w) when zero_centered) in fp32, stored as ``out_dtype``; x [B, D] any
    float, w [D]."""
    return _launch(x, weight, eps, zero_centered=zero_centered, out=out, out_dtype=out_dtype)[0]


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 zero_centered: bool = False, out_dtype: torch.dtype = torch.float32
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(normed, summed) [B, D]: summed = x + residual in fp32 (stored fp32), normed = rms_norm(summed)
    stored as ``out_dtype``. ``x`` may also be a linear's :class:`SplitPartials`, added in the kernel
    (:func:`ds4t.kernels.linear_norm.linear_add_rms_norm`)."""
    return _launch(x, weight, eps, residual=residual, zero_centered=zero_centered, out_dtype=out_dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *,
                   out: Optional[torch.Tensor] = None, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[R, D] = x̂ · w · silu(z) (plain weight) in fp32, stored as ``out_dtype``; x [R, D], z [R, D] or, for
    per-head norms (x a [B*H, D] view), [B, H, D] with unit last stride and any other strides -- e.g. heads
    sliced out of a wider projection row, read in place (a [B*H, D] view of those does not exist, and
    ``reshape`` would copy them)."""
    return _launch(x, weight, eps, z=z, out=out, out_dtype=out_dtype)[0]


# ----------------------------------------------------------------------------------------------
# References
# ----------------------------------------------------------------------------------------------
def rms_norm_ref(x, weight, eps, *, zero_centered=False, out=None, out_dtype=torch.float32):
    xf = x.float()
    xh = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float()
    return (xh * ((1.0 + w) if zero_centered else w)).to(out_dtype)


def add_rms_norm_ref(x, residual, weight, eps, *, zero_centered=False, out_dtype=torch.float32):
    s = x.float() + residual.float()
    return rms_norm_ref(s, weight, eps, zero_centered=zero_centered, out_dtype=out_dtype), s


def gated_rms_norm_ref(x, z, weight, eps, *, out=None, out_dtype=torch.float32):
    z = z.reshape(x.shape)   # [B, H, D] per-head gates as x's [B*H, D] rows
    return (rms_norm_ref(x, weight, eps) * torch.nn.functional.silu(z.float())).to(out_dtype)


# ----------------------------------------------------------------------------------------------
# Self-check
# ----------------------------------------------------------------------------------------------
_TOL = 1e-5  # relative to max|ref|; everything is fp32 arithmetic on the same inputs


@register_check
def _check(device) -> list:
    device = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(2)
    B, D, eps = 6, 333, 1e-6
    x = (torch.randn(B, D, generator=g) * 3).to(device)
    r = torch.randn(B, D, generator=g).to(device)
    z = torch.randn(B, D, generator=g).to(device)
    w = (1 + 0.3 * torch.randn(D, generator=g)).to(device)
    cases = [
        ("rms_norm", lambda t: rms_norm(t, w, eps), lambda t: rms_norm_ref(t, w, eps)),
        ("rms_norm zero_centered", lambda t: rms_norm(t, w - 1, eps, zero_centered=True),
         lambda t: rms_norm_ref(t, w - 1, eps, zero_centered=True)),
        ("add_rms_norm", lambda t: torch.cat(add_rms_norm(t[:, :D], t[:, D:], w, eps), 1),
         lambda t: torch.cat(add_rms_norm_ref(t[:, :D], t[:, D:], w, eps), 1)),
        ("gated_rms_norm", lambda t: gated_rms_norm(t[:, :D], t[:, D:], w, eps),
         lambda t: gated_rms_norm_ref(t[:, :D], t[:, D:], w, eps)),
    ]
    inputs = {"rms_norm": x, "rms_norm zero_centered": x.bfloat16(),
              "add_rms_norm": torch.cat([x, r], 1), "gated_rms_norm": torch.cat([x, z], 1)}
    results = []
    for name, run, ref in cases:
        t = inputs[name]
        y, yr = run(t), ref(t)
        err = ((y - yr).abs().max() / yr.abs().max()).item()
        results.append(CheckResult(name, f"B={B} D={D} {str(t.dtype).replace('torch.', '')}", err, _TOL,
                                   rows_invariant(run, t), timer(lambda: run(t), warmup=1, iters=3),
                                   note="relative to max|ref|"))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(rms_norm, reference=rms_norm_ref)
register_op(add_rms_norm, reference=add_rms_norm_ref)
register_op(gated_rms_norm, reference=gated_rms_norm_ref)
