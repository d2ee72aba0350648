"""Memory plan of a server: weights + N resident sessions at max ctx + workspace, against the device.

The per-session bytes come from the model's state pool (``pool.bytes_per_slot(ctx)``: KV caches at
full context, recurrent and conv states), so the plan holds for any model family. The workspace is
an estimate of one step's activations at the largest step the server runs (all N decode rows plus
one prefill chunk), with a margin; it is printed as such.
"""
from __future__ import annotations

import dataclasses
import re
from typing import List, Optional

import torch

from ds4t.batch import graphs

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 10 ** 3, "kib": 1 << 10, "m": 1 << 20, "mb": 10 ** 6, "mib": 1 << 20,
          "g": 1 << 30, "gb": 10 ** 9, "gib": 1 << 30, "t": 1 << 40, "tb": 10 ** 12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """'80GiB', '512M', '1.5g', '1000000' -> bytes (k/m/g/t alone are binary units)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (e.g. 80GiB, 512MiB, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


@dataclasses.dataclass
class MemoryPlan:
    model: str
    device: str
    slots: int
    max_ctx: int
    weights: int
    per_slot: int
    workspace: int
    step_rows: int
    available: Optional[int]
    available_source: str
    graphs: int = 0   # CUDA graphs of decode batches of 1..slots sessions (their static outputs)

    @property
    def sessions(self) -> int:
        return self.slots * self.per_slot

    @property
    def total(self) -> int:
        return self.weights + self.sessions + self.workspace + self.graphs

    @property
    def fits(self) -> bool:
        return self.available is None or self.total <= self.available

    def max_slots(self) -> Optional[int]:
        """How many sessions at this max ctx would fit (None when the limit is unknown)."""
        if self.available is None:
            return None
        room = self.available - self.weights - self.workspace - self.graphs
        return max(0, room // self.per_slot) if self.per_slot else None

    def format(self) -> str:
        rows = [
            ("weights", "", self.weights),
            ("sessions", f"{self.slots} x {fmt_bytes(self.per_slot)} at ctx {self.max_ctx}", self.sessions),
            ("workspace", f"estimate, steps of up to {self.step_rows} rows", self.workspace),
            ("graphs", "CUDA graphs of decode batches, one per size" if self.graphs else "none", self.graphs),
            ("total", "", self.total),
        ]
        lines = [f"memory plan: {self.model} on {self.device}"]
        lines += [f"  {a:<10} {fmt_bytes(n):>12}  {b}" for a, b, n in rows]
        if self.available is None:
            lines.append(f"  {'available':<10} {'unknown':>12}  ({self.available_source}); not checked")
        else:
            lines.append(f"  {'available':<10} {fmt_bytes(self.available):>12}  {self.available_source}")
            lines.append(f"  fits: {'yes' if self.fits else 'NO'} "
                         f"({fmt_bytes(abs(self.available - self.total))} {'spare' if self.fits else 'short'})")
        return "\n".join(lines)

    def refusal(self) -> str:
        ms = self.max_slots()
        hint = f"at most {ms} session(s) fit at --max-ctx {self.max_ctx}" if ms is not None else ""
        return (f"ds4t serve: refusing to start: the plan needs {fmt_bytes(self.total)} but "
                f"{fmt_bytes(self.available)} is available ({self.available_source}); {hint}. "
                f"Lower --batched-session or --max-ctx, or raise --memory-limit.")


def _available(device: torch.device, weights: int):
    """(bytes the plan may use, where that number comes from). The weights are already loaded, so
    they are added back to what the device reports free."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        return free + held, f"cuda free {fmt_bytes(free)} + held by this process {fmt_bytes(held)} (of {fmt_bytes(total)})"
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        avail = int(info["MemAvailable"].split()[0]) * 1024
        return avail + weights, f"MemAvailable {fmt_bytes(avail)} + loaded weights"
    except (OSError, KeyError, ValueError):
        return None, "host memory unknown"


def workspace_estimate(model, rows: int) -> int:
    """Activations of one step of ``rows`` token rows: logits (several fp32 copies for sampling) and
    the widest intermediate activations, x 2 for double buffering, + a fixed margin."""
    widest = 1
    for t in model.parameters().values():
        dims = [d for d in t.shape[-2:] if d != model.vocab_size]
        if dims:
            widest = max(widest, max(dims))
    per_row = 4 * (4 * model.vocab_size + 16 * widest)
    margin = (256 << 20) if model.device.type in ("cuda", "meta") else (16 << 20)   # meta: planning for a GPU
    return 2 * rows * per_row + margin


def every_rank(p: MemoryPlan, group=None) -> List[MemoryPlan]:
    """Every rank's plan under tensor parallel (each rank passes its own; torch.distributed), index = rank."""
    import torch.distributed as dist

    out: List[Optional[MemoryPlan]] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, p, group=group)
    return out


def plan(model, slots: int, max_ctx: int, step_rows: int, memory_limit: Optional[int] = None) -> MemoryPlan:
    weights = model.weight_bytes()
    if memory_limit is not None:
        available, source = memory_limit, "--memory-limit"
    else:
        available, source = _available(model.device, weights)
    return MemoryPlan(
        model=f"{model.name} ({model.family}, {str(model.dtype).replace('torch.', '')})",
        device=str(model.device), slots=slots, max_ctx=max_ctx, weights=weights,
        per_slot=model.pool.bytes_per_slot(max_ctx), workspace=workspace_estimate(model, step_rows),
        step_rows=step_rows, available=available, available_source=source,
        graphs=graphs.memory_estimate(model, slots))
