"""The interpreter's twin of :func:`ds4t.kernels.conv.conv1d_update` (op variant ``"interp"``):
ROWS rows and all C channels per program instead of one program per (row, channel block), each
output the same expression in the same order (tests/kernels/test_conv.py compares them bitwise).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ds4t.backend import LAUNCH, grid_dependency
from ds4t.backend import silu as _silu


@triton.jit
def _conv1d_update_rows_kernel(
    x_ptr, sx_b, sx_c,
    state_ptr, ss_s, ss_c, ss_w,
    w_ptr, sw_c, sw_w,
    bias_ptr,
    slots_ptr,
    out_ptr, so_b, so_c,
    B, C,
    W: tl.constexpr, BC: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):
    """Interpreter path of :func:`conv1d_update`: ROWS rows and all C channels per program, the
    same expression in the same order per output (so prefill still equals successive decodes)."""
    grid_dependency()
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    rl = tl.minimum(r, B - 1).to(tl.int64)[:, None]       # rows past B redo row B-1, store nothing
    c = tl.arange(0, BC)
    if BC == C:
        cl = c.to(tl.int64)[None, :]
        m = (r < B)[:, None]
    else:
        cl = tl.minimum(c, C - 1).to(tl.int64)[None, :]   # padded channels read in bounds
        m = (r < B)[:, None] & (c < C)[None, :]
    slot = tl.load(slots_ptr + rl)
    sp = state_ptr + slot.to(tl.int64) * ss_s + cl * ss_c      # [ROWS, BC] -> state[slot, c, 0]
    wp = w_ptr + cl * sw_c                                     # [1, BC]
    xv = tl.load(x_ptr + rl * sx_b + cl * sx_c).to(tl.float32)
    if HAS_BIAS:
        acc = tl.load(bias_ptr + cl).to(tl.float32)          # [1, BC]; broadcast by the first tap
    else:
        acc = tl.zeros([ROWS, BC], dtype=tl.float32)
    # Taps over the history (oldest first), then the new input: the fixed order.
    s1 = xv
    s2 = xv
    for j in tl.static_range(W - 1):
        sj = tl.load(sp + j * ss_w)
        acc = acc + tl.load(wp + j * sw_w).to(tl.float32) * sj
        if j == 1:
            s1 = sj
        if j == 2:
            s2 = sj
    acc = acc + tl.load(wp + (W - 1) * sw_w).to(tl.float32) * xv
    if SILU:
        acc = _silu(acc)
    tl.store(out_ptr + rl * so_b + cl * so_c, acc, mask=m)
    # Shift the history left and append x: new[i] = state[i + 1] (i < W-2), new[W-2] = x, written
    # in ascending i (state[i + 1] is read before it is overwritten; each element stays with its
    # own (row, channel), as in the GPU kernel's barrier-separated version).
    tl.debug_barrier()
    for i in tl.static_range(W - 1):
        if i == W - 2:
            tl.store(sp + i * ss_w, xv, mask=m)
        elif i == 0:
            tl.store(sp, s1, mask=m)
        elif i == 1:
            tl.store(sp + ss_w, s2, mask=m)
        else:
            tl.store(sp + i * ss_w, tl.load(sp + (i + 1) * ss_w), mask=m)


def launch_update(x, conv_state, weight, slots, bias, silu: bool, out, BC: int) -> None:
    """:func:`ds4t.kernels.conv.conv1d_update` on checked arguments, ``BC`` >= C channels per program (the
    kernel holds every channel of its rows: a config giving fewer is refused, not half computed)."""
    B, C = x.shape
    if BC < C:
        raise ValueError(f"conv1d_update (interp rows path): {BC} channels per program, the rows kernel needs all "
                         f"{C}; the interpreter's config gives next_pow2(C)")
    W = weight.shape[1]
    rows = min(16, triton.next_power_of_2(B))  # the M tile; nothing is reduced across rows
    _conv1d_update_rows_kernel[(triton.cdiv(B, rows),)](
        x, x.stride(0), x.stride(1),
        conv_state, conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        weight, weight.stride(0), weight.stride(1),
        bias if bias is not None else weight,
        slots,
        out, out.stride(0), out.stride(1),
        B, C,
        W=W, BC=BC, ROWS=rows, HAS_BIAS=bias is not None, SILU=silu, **LAUNCH,
    )
