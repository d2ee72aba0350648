"""Weights into L2 ahead of the kernel that reads them, on a side stream: a hint that never changes a value.

At one row a decode layer alternates kernels that stream a weight (the projections, the experts) with
kernels that read almost nothing (norms, the conv, the recurrence, the router's top-k, the combine): during
the second kind DRAM idles. :class:`WeightPrefetch` launches, at a point of the step, one small kernel on a
second stream that asks L2 for a list of byte ranges (PTX ``cp.async.bulk.prefetch.L2``: no register, no
value, no fault) -- the next weights the step will read -- and returns. The main stream goes on; the lines
arrive while it runs the small kernels, and the weight's kernel then finds part of its bytes in L2.

Nothing is computed from the prefetched lines: every kernel reads the same bytes from the same addresses,
so the bits of a step are those without it (tests/kernels/test_prefetch.py checks it on the GPU). Under CUDA
graph capture the side-stream launch is a branch of the graph that forks at the call and joins at
:meth:`WeightPrefetch.join`. In the interpreter (and on a GPU without the instruction: before Hopper) it
launches nothing.

    plan = WeightPrefetch.plan([t1, t2], cap_bytes)   # host, once: chunk table on the device
    prefetcher.issue(plan)                            # at the point of the step
    prefetcher.join()                                 # before the step returns
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
import triton
import triton.language as tl

from ds4t.backend import INTERPRET

__all__ = ["PrefetchPlan", "WeightPrefetch", "byte_ranges", "prefetch_supported", "parse_option"]

CHUNK = 1 << 14
"""Bytes one prefetch instruction asks for (a multiple of 16, as the instruction needs)."""
_BLOCK = 128   # chunks a program issues: one a thread of a 4-warp program


def prefetch_supported(device: torch.device) -> bool:
    """Whether bulk L2 prefetches can launch on ``device`` (a CUDA device of compute capability >= 9, not
    the interpreter)."""
    if INTERPRET or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def _prefetch_kernel(addr_ptr, size_ptr, n, EVICT_LAST: tl.constexpr, BLOCK: tl.constexpr):
    # No grid_dependency(): the kernel reads no tensor another kernel writes, and must not wait for one.
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(addr_ptr + offs, mask=m, other=0)
    s = tl.load(size_ptr + offs, mask=m, other=0)
    # a size of 0 (the masked lanes) asks for nothing
    if EVICT_LAST:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .b64 pol; createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; "
            "mov.u32 $0, 0; }", "=r,l,r", [a, s], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.u32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
            "mov.u32 $0, 0; }", "=r,l,r", [a, s], dtype=tl.int32, is_pure=False, pack=1)


def byte_ranges(tensors: Sequence[torch.Tensor], cap_bytes: int) -> list:
    """(address, bytes) of the memory ``tensors`` span, in order, cut at ``cap_bytes`` in all; each range
    starts and ends on 16 bytes inside the tensor (a tensor's span: first to last element, any strides)."""
    out, left = [], cap_bytes
    for t in tensors:
        if left <= 0:
            break
        if t.numel() == 0:
            continue
        span = (sum((d - 1) * abs(s) for d, s in zip(t.shape, t.stride())) + 1) * t.element_size()
        lo = t.data_ptr() - sum((d - 1) * -s for d, s in zip(t.shape, t.stride()) if s < 0) * t.element_size()
        start = (lo + 15) // 16 * 16
        end = (lo + span) // 16 * 16
        n = min(end - start, left // 16 * 16)
        if n > 0:
            out.append((start, n))
            left -= n
    return out


@dataclasses.dataclass(frozen=True)
class PrefetchPlan:
    """One prefetch launch: chunk start addresses (int64) and sizes (int32) on the device, ``bytes`` in all."""
    addrs: torch.Tensor
    sizes: torch.Tensor
    bytes: int

    @property
    def chunks(self) -> int:
        return self.addrs.numel()


def parse_option(value) -> Optional[dict]:
    """The ``weight_prefetch`` model option: ``"off"`` (or None / False) -> None; ``"l2"`` with optional
    ``:cap=MB`` (bytes asked for at one point of the step; default 24) and ``:last`` (the lines enter L2
    with the evict-last priority) -> ``{"cap_bytes": int, "evict_last": bool}``. Anything else raises."""
    if value in (None, False, "off"):
        return None
    if not isinstance(value, str) or value.split(":")[0] != "l2":
        raise ValueError(f"weight_prefetch must be 'off' or 'l2[:cap=MB][:last]', got {value!r}")
    out = {"cap_bytes": 24 << 20, "evict_last": False}
    for part in value.split(":")[1:]:
        if part == "last":
            out["evict_last"] = True
        elif part.startswith("cap=") and part[4:].isdigit() and int(part[4:]) > 0:
            out["cap_bytes"] = int(part[4:]) << 20
        else:
            raise ValueError(f"weight_prefetch {value!r}: unknown part {part!r} (cap=MB or last)")
    return out


class WeightPrefetch:
    """Launches :class:`PrefetchPlan` s on a side stream of ``device`` (inert where :func:`prefetch_supported`
    is False: :meth:`plan` returns None there and :meth:`issue` of None does nothing)."""

    def __init__(self, device: torch.device, evict_last: bool = False):
        self.device = torch.device(device)
        self.evict_last = evict_last
        self.active = prefetch_supported(self.device)
        self._stream = torch.cuda.Stream(self.device) if self.active else None
        self._forked = False

    def plan(self, tensors: Sequence[torch.Tensor], cap_bytes: int) -> Optional[PrefetchPlan]:
        """The chunk table of ``tensors`` (at most ``cap_bytes``), built on the host and copied to the device
        once: call it outside graph capture. None when inert or when nothing is left to ask for."""
        if not self.active:
            return None
        chunks = [(a + o, min(CHUNK, n - o)) for a, n in byte_ranges(tensors, cap_bytes) for o in range(0, n, CHUNK)]
        if not chunks:
            return None
        addrs = torch.tensor([c[0] for c in chunks], dtype=torch.int64).to(self.device)
        sizes = torch.tensor([c[1] for c in chunks], dtype=torch.int32).to(self.device)
        return PrefetchPlan(addrs, sizes, sum(c[1] for c in chunks))

    def issue(self, plan: Optional[PrefetchPlan]) -> None:
        """Fork the side stream from the current one here and launch ``plan`` on it."""
        if plan is None:
            return
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        with torch.cuda.stream(self._stream):
            _prefetch_kernel[(triton.cdiv(plan.chunks, _BLOCK),)](
                plan.addrs, plan.sizes, plan.chunks, EVICT_LAST=self.evict_last, BLOCK=_BLOCK, num_warps=4)
        self._forked = True

    def join(self) -> None:
        """Make the current stream wait for every launch issued since the last join (a graph must join its
        side branches before capture ends)."""
        if self._forked:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
            self._forked = False
