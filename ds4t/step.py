"""The metadata of one forward step: which rows belong to which session, at which positions.

A leaf module: both the batch layer (which builds a step) and the models (which run it) import it,
and it imports nothing of either, so ``ds4t.batch`` needs nothing of model internals.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass
class Segment:
    """Consecutive tokens of one session inside a step batch (1 token for a decode step)."""

    slot: int
    start_row: int
    n: int
    start_pos: int


@dataclasses.dataclass
class StepBatch:
    """The rows of one forward call: one row per token, grouped into per-session segments.

    tokens [R] int64, positions [R] int32 (position of each token), slots [R] int32,
    lengths [R] int32 (= positions + 1: cache entries each row attends to), out_rows [O] int64
    (rows whose logits are returned, in item order).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lengths: torch.Tensor
    out_rows: torch.Tensor
    segments: List[Segment]
    all_single: bool  # every segment is one token (a pure decode batch)
    single_rows: torch.Tensor  # int64 [S]: rows of the one-token segments (decode rows of a mixed batch)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def host_meta(segments: Sequence[Tuple[int, Sequence[int], int]], all_logits: bool = False):
        """The metadata of a step on the host: (meta int64 [3R + O + S], R, O, segments).

        segments: (slot, token ids, start position) per session, in item order. ``meta`` holds
        tokens, positions, slots, out_rows and single_rows back to back, so one host->device
        copy carries all of it (see :meth:`from_meta`).
        """
        toks, pos, slots, out_rows, segs = [], [], [], [], []
        for slot, ids, start in segments:
            r0 = len(toks)
            toks += list(ids)
            pos += range(start, start + len(ids))
            slots += [slot] * len(ids)
            segs.append(Segment(slot, r0, len(ids), start))
            out_rows += list(range(r0, r0 + len(ids))) if all_logits else [r0 + len(ids) - 1]
        singles = [sg.start_row for sg in segs if sg.n == 1]
        meta = torch.tensor(toks + pos + slots + out_rows + singles, dtype=torch.int64)
        return meta, len(toks), len(out_rows), segs

    @classmethod
    def from_meta(cls, meta: torch.Tensor, n: int, o: int, segs: List[Segment]) -> "StepBatch":
        """A batch whose tensors are views of / computed from ``meta`` on the device (no host
        sync, so a CUDA graph can capture it with ``meta`` as its input buffer)."""
        positions = meta[n:2 * n].to(torch.int32)
        return cls(
            tokens=meta[:n],
            positions=positions,
            slots=meta[2 * n:3 * n].to(torch.int32),
            lengths=positions + 1,
            out_rows=meta[3 * n:3 * n + o],
            single_rows=meta[3 * n + o:],
            segments=segs,
            all_single=all(s.n == 1 for s in segs),
        )

    @classmethod
    def build(cls, segments: Sequence[Tuple[int, Sequence[int], int]], device, all_logits: bool = False) -> "StepBatch":
        """segments: (slot, token ids, start position) per session, in item order."""
        meta, n, o, segs = cls.host_meta(segments, all_logits)
        return cls.from_meta(to_device(meta, device), n, o, segs)


def to_device(t: torch.Tensor, device, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Host tensor -> ``device`` (or into ``out``, a device tensor of its shape) without a host
    sync: through pinned memory on a GPU."""
    device = torch.device(device if out is None else out.device)
    if device.type == "cuda":
        t = t.pin_memory()
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)
