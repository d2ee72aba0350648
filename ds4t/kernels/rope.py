"""Rotary position embedding (RoPE), partial rotary, rotate-half (HF) and interleaved (GPT-J) pairs.

For row b, head h and pair index i < R/2 (R = rotary_dim)::

    angle = float32(positions[b]) * inv_freq[i]            # fp32 product, as HF computes it
    c = cos(angle) * scale ;  s = sin(angle) * scale        # scale: YaRN attention scaling
    (x1, x2) -> (x1*c - x2*s,  x2*c + x1*s)

with the pair (x1, x2) = (x[i], x[i + R/2]) for rotate-half (HF ``rotate_half`` /
``apply_rotary_pos_emb`` on the first R dims) or (x[2i], x[2i+1]) for ``interleaved=True``
(written back in place, GPT-J style). Dims R..D-1 pass through unchanged. All math in fp32; the
output is fp32.

Interleaved vs HF: HF's interleaved models (DeepSeek-V3 ``rope_interleave``) first de-interleave
the rotary dims with the fixed permutation P (evens, then odds) and then apply rotate-half, so
``hf(x) = P · rope(x, interleaved=True)`` on the rotary dims. Since q and k get the same P,
``q·k`` (and so attention) is unchanged; only the stored layout of the rotary dims differs
(tests/kernels/test_rope.py checks both facts).

On the GPU cos/sin come from libdevice (``__nv_cosf`` / ``__nv_sinf``, the same accurate functions
torch uses), not the approximate hardware instructions, which lose accuracy at large angles
(positions of 100k+). In the interpreter they are numpy's.

Batch invariance: elementwise per row; nothing crosses rows.
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

if not INTERPRET:
    from triton.language.extra import libdevice
else:  # the interpreter has no libdevice; its tl.cos / tl.sin are numpy's (accurate)
    libdevice = None

_INTERPRET_C = tl.constexpr(INTERPRET)


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Launch constants of rope (one program per row and head block): heads per program, the
    rotated half and the pass-through part as powers of two. Warps: Triton's default."""
    block_h: int
    block_half: int
    block_p: int


def _rope_config(H: int, D: int, R: int, gpu: bool) -> RopeConfig:
    block_half = triton.next_power_of_2(max(R // 2, 1))
    block_h = triton.next_power_of_2(H)                   # interpreter: one program per row
    if gpu:   # ~128 rotated pairs a program: a decode row's heads spread over many programs
        block_h = min(block_h, max(1, 128 // block_half))
    return RopeConfig(block_h=block_h, block_half=block_half, block_p=triton.next_power_of_2(max(D - R, 1)))


ROPE_CONFIGS: ConfigTable[RopeConfig] = ConfigTable(
    "rope", gpu={},
    gpu_rule=lambda H, D, R: _rope_config(H, D, R, gpu=True),
    interp_rule=lambda H, D, R: _rope_config(H, D, R, gpu=False),
    source="rule: heads per program up to 128 rotated pairs (DeepSeek-V3-4l's 129 x 32 pairs on 33 programs "
           "instead of 3: N = 1 step 2.143 -> 2.083 ms, bench/results/2026-12-02-h200-n1-steps.md)")
"""Keyed on (heads H, head dim D, rotary dim R)."""


@triton.jit
def cos_sin(a):
    """cos(a), sin(a) in fp32: libdevice's on the GPU (numpy's in the interpreter)."""
    if _INTERPRET_C:
        c = tl.cos(a)
        s = tl.sin(a)
    else:
        c = libdevice.cos(a)
        s = libdevice.sin(a)
    return c, s


@triton.jit
def angles(pos_ptr, b, freq_ptr, scale, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """Row b's (cos, sin) [BLOCK_HALF] fp32 of its position times each inverse frequency, both times
    ``scale``: the module docstring's c and s (zeros past HALF)."""
    i = tl.arange(0, BLOCK_HALF)
    pos = tl.load(pos_ptr + b).to(tl.float32)
    f = tl.load(freq_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
    c, s = cos_sin(pos * f)
    return c * scale, s * scale


@triton.jit
def pair_columns(HALF: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """(d1, d2) [BLOCK_HALF]: the columns of each rotated pair (i, i + HALF), or (2i, 2i + 1) interleaved."""
    i = tl.arange(0, BLOCK_HALF)
    if INTERLEAVED:
        d1 = 2 * i
        d2 = 2 * i + 1
    else:
        d1 = i
        d2 = i + HALF
    return d1, d2


@triton.jit
def rotate(xb, sx_d, m, d1, d2, c, s):
    """The rotated pairs (o1, o2) fp32 of the heads at pointers xb [BLOCK_H, 1] (column stride sx_d):
    x1 * c - x2 * s and x2 * c + x1 * s, loaded where m [BLOCK_H, BLOCK_HALF] holds. Every op that
    rotates (:func:`rope`, :func:`ds4t.kernels.mla.norm_rope_write_latent`) computes it here."""
    x1 = tl.load(xb + d1[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xb + d2[None, :] * sx_d, mask=m, other=0.0).to(tl.float32)
    return x1 * c[None, :] - x2 * s[None, :], x2 * c[None, :] + x1 * s[None, :]


@triton.jit
def _rope_kernel(
    x_ptr, sx_b, sx_h, sx_d,
    pos_ptr, freq_ptr,
    out_ptr, so_b, so_h, so_d,
    scale,
    H: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_P: tl.constexpr,
):
    grid_dependency()
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = h < H
    c, s = angles(pos_ptr, b, freq_ptr, scale, HALF, BLOCK_HALF)
    d1, d2 = pair_columns(HALF, INTERLEAVED, BLOCK_HALF)
    m = hm[:, None] & (tl.arange(0, BLOCK_HALF) < HALF)[None, :]
    xb = x_ptr + b * sx_b + h[:, None] * sx_h
    ob = out_ptr + b * so_b + h[:, None] * so_h
    o1, o2 = rotate(xb, sx_d, m, d1, d2, c, s)
    if D > 2 * HALF:
        pd = 2 * HALF + tl.arange(0, BLOCK_P)
        pm = hm[:, None] & (pd < D)[None, :]
        xp = tl.load(xb + pd[None, :] * sx_d, mask=pm, other=0.0).to(tl.float32)
    # every load above precedes every store: out may alias x (in place)
    tl.store(ob + d1[None, :] * so_d, o1, mask=m)
    tl.store(ob + d2[None, :] * so_d, o2, mask=m)
    if D > 2 * HALF:
        tl.store(ob + pd[None, :] * so_d, xp, mask=pm)


def _rope_args(x, positions, inv_freq, rotary_dim):
    if x.dim() != 3:
        raise ValueError(f"x must be [B, H, D], got {tuple(x.shape)}")
    B, H, D = x.shape
    if positions.shape != (B,):
        raise ValueError(f"positions must be [{B}], got {tuple(positions.shape)}")
    if rotary_dim is None:
        rotary_dim = 2 * inv_freq.numel()
    if rotary_dim % 2 or rotary_dim > D or inv_freq.numel() != rotary_dim // 2 or inv_freq.dim() != 1:
        raise ValueError(f"rotary_dim={rotary_dim} must be even, <= D={D}, and inv_freq must be "
                         f"[{rotary_dim // 2}] (got {tuple(inv_freq.shape)})")
    return B, H, D, rotary_dim


def rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *,
         rotary_dim: Optional[int] = None, interleaved: bool = False, scale: float = 1.0,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Apply RoPE to the first ``rotary_dim`` dims of every head; the rest pass through.

    x [B, H, D] (fp32/bf16/fp16, any strides), positions [B] int32/int64, inv_freq [R/2] fp32
    (R = rotary_dim, default 2 * len(inv_freq)). ``interleaved`` picks pairs (2i, 2i+1) instead of
    (i, i + R/2); ``scale`` multiplies cos and sin (YaRN attention scaling). Returns fp32
    [B, H, D] (``out`` if given; ``out`` may be ``x`` itself when x is fp32).
    """
    B, H, D, R = _rope_args(x, positions, inv_freq, rotary_dim)
    if out is None:
        out = torch.empty((B, H, D), dtype=torch.float32, device=x.device)
    elif out.shape != (B, H, D) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{B}, {H}, {D}]")
    if B == 0 or H == 0:
        return out
    cfg = ROPE_CONFIGS(H, D, R)
    grid = (B, triton.cdiv(H, cfg.block_h))
    _rope_kernel[grid](
        x, *x.stride(), positions, inv_freq, out, *out.stride(), float(scale),
        H=H, D=D, HALF=R // 2, INTERLEAVED=bool(interleaved),
        BLOCK_H=cfg.block_h, BLOCK_HALF=cfg.block_half, BLOCK_P=cfg.block_p, **LAUNCH,
    )
    return out


# ----------------------------------------------------------------------------- references


def default_inv_freq(rotary_dim: int, theta: float, device=None) -> torch.Tensor:
    """fp32 ``1 / theta ** (arange(0, R, 2) / R)``, computed as HF transformers does (in fp32)."""
    exps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / rotary_dim
    return 1.0 / (theta ** exps)


def rope_ref(x, positions, inv_freq, *, rotary_dim=None, interleaved=False, scale=1.0, out=None):
    """Plain-torch :func:`rope` (same signature); rotate-half exactly as HF writes it."""
    B, H, D, R = _rope_args(x, positions, inv_freq, rotary_dim)
    half = R // 2
    xf = x.float()
    ang = positions.to(torch.float32)[:, None] * inv_freq.float()[None, :]     # [B, R/2]
    c = (ang.cos() * scale)[:, None, :]
    s = (ang.sin() * scale)[:, None, :]
    rot = xf[..., :R]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        o = torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    else:
        cc = torch.cat([c, c], dim=-1)
        ss = torch.cat([s, s], dim=-1)
        rotate_half = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        o = rot * cc + rotate_half * ss
    res = torch.cat([o, xf[..., R:]], dim=-1)
    if out is not None:
        out.copy_(res)
        return out
    return res


# ----------------------------------------------------------------------------- self-check


@register_check
def _check(device) -> List[CheckResult]:
    results = []
    g = torch.Generator(device="cpu").manual_seed(0)
    B, H, D, R = 5, 6, 80, 40
    x = torch.randn(B, H, D, generator=g).to(device)
    pos = torch.tensor([0, 7, 131, 4095, 70001], dtype=torch.int64, device=device)
    inv = default_inv_freq(R, 10000.0, device=device)
    for inter in (False, True):
        def run(idx, inter=inter):
            return rope(x[idx], pos[idx], inv, interleaved=inter, scale=1.1)

        idx = torch.arange(B, device=device)
        got = run(idx)
        ref = rope_ref(x, pos, inv, interleaved=inter, scale=1.1)
        err = (got - ref).abs().max().item()
        inv_ok = all(torch.equal(run(idx[i:i + 1])[0], got[i]) for i in range(B))
        ms = timer(lambda: run(idx), warmup=1, iters=1 if INTERPRET else 20)
        results.append(CheckResult(f"rope {'interleaved' if inter else 'rotate-half'}",
                                   f"B={B} H={H} D={D} R={R}", err, 1e-5, inv_ok, ms))
    return results


# ----------------------------------------------------------------------------- ops (the models call these)

register_op(rope, reference=rope_ref)
