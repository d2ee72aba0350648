"""The metadata of one forward step: which rows belong to which session, at which positions.

A leaf module: both the batch layer (which builds a step) and the models (which run it) import it,
and it imports nothing of either, so ``ds4t.batch`` needs nothing of model internals.
"""
from __future__ import annotations

import dataclasses
import functools
import struct
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch


@dataclasses.dataclass
class Segment:
    """Consecutive tokens of one session inside a step batch (1 token for a decode step).

    keep: the model keeps the per-token states of this segment (a speculative verify chunk) so the
    session can be rolled back to any prefix of it (:meth:`ds4t.models.base.Model.rollback`).
    states_row: where those states start in the step's buffer of kept states, which holds the keep
    segments' rows only, in order (-1 without keep)."""

    slot: int
    start_row: int
    n: int
    start_pos: int
    keep: bool = False
    states_row: int = -1


@dataclasses.dataclass(frozen=True)
class SegmentSpec:
    """One session's tokens in a step, with what the caller wants back: logits of the last token
    (``all_logits=False``) or of every token, the final-norm hidden of every token (``hidden``, for
    an MTP head), and per-token states kept for a rollback (``keep``)."""

    slot: int
    ids: Sequence[int]
    start: int
    all_logits: bool = False
    hidden: bool = False
    keep: bool = False


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
    hidden_rows: Optional[torch.Tensor] = None  # int64 [H]: rows whose final hidden the model returns
    hidden: Optional[torch.Tensor] = None       # set by the model: fp32 [H, D] for hidden_rows
    # int64 [M, 4]: the segments of more than one token, in order, as (first row, rows, slot, states row
    # or -1: Segment.states_row) on the device, for kernels that run all of them in one launch
    multi_segments: Optional[torch.Tensor] = None
    shortest_run: int = 0   # tokens of the shortest segment of more than one (0: none, a pure decode batch)
    longest_run: int = 0    # tokens of the longest segment of more than one (0: none)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @staticmethod
    def host_meta(segments: Sequence, all_logits: bool = False):
        """The metadata of a step on the host: (meta int64 [R + O + S + H + 4M + ceil(3R / 2)], R, O,
        segments, H).

        segments, in item order: (slot, token ids, start position) tuples (logits of the last token,
        or of every token with ``all_logits``) or :class:`SegmentSpec`. ``meta`` holds tokens,
        out_rows, single_rows, hidden_rows and the M multi-token segments' (first row, rows, slot,
        states row) back to back, then positions, slots and lengths as int32 packed two to an int64
        word, so one host->device copy carries all of it and the device needs no kernel to convert
        or derive any of it (see :meth:`from_meta`).
        """
        toks, pos, slots, out_rows, hidden, segs = [], [], [], [], [], []
        kept = 0   # rows of kept states so far
        for sp in segments:
            if not isinstance(sp, SegmentSpec):
                sp = SegmentSpec(*sp, all_logits=all_logits)
            ids, start = sp.ids, sp.start
            r0 = len(toks)
            toks += list(ids)
            pos += range(start, start + len(ids))
            slots += [sp.slot] * len(ids)
            keep = sp.keep and len(ids) > 1
            segs.append(Segment(sp.slot, r0, len(ids), start, keep=sp.keep, states_row=kept if keep else -1))
            kept += len(ids) if keep else 0
            out_rows += list(range(r0, r0 + len(ids))) if sp.all_logits else [r0 + len(ids) - 1]
            if sp.hidden:
                hidden += range(r0, r0 + len(ids))
        singles = [sg.start_row for sg in segs if sg.n == 1]
        multi = [v for sg in segs if sg.n > 1 for v in (sg.start_row, sg.n, sg.slot, sg.states_row)]
        wide = toks + out_rows + singles + hidden + multi
        narrow = pos + slots + [p + 1 for p in pos]
        k = len(wide)
        meta = np.zeros(k + (len(narrow) + 1) // 2, dtype=np.int64)
        meta[:k] = wide
        meta[k:].view(np.int32)[:len(narrow)] = narrow
        return torch.from_numpy(meta), len(toks), len(out_rows), segs, len(hidden)

    @staticmethod
    def decode_meta(segments: Sequence[Tuple[int, Sequence[int], int]], out: Optional[np.ndarray] = None) -> np.ndarray:
        """:meth:`host_meta`'s ``meta`` for a pure decode step, the same int64 words, straight from
        (slot, [token], start position) tuples (one token each, its logits returned): no Segment objects,
        which a replayed graph does not read, and filled in place when ``out`` (int64, the right length:
        :meth:`decode_meta_len`) is given, e.g. a pinned staging buffer. At N = 1 the host work before a
        graph starts is part of the step's latency (bench/results/2026-12-02-h200-host-path.md)."""
        n = len(segments)
        pack, rows2, pad = _decode_layout(n)
        meta = np.empty(StepBatch.decode_meta_len(n), dtype=np.int64) if out is None else out
        pos = [sp[2] for sp in segments]
        # One C call writes every word (numpy's per-slice assignments cost ~10x more at N = 1).
        pack.pack_into(meta, 0, *[sp[1][0] for sp in segments], *rows2, *pos, *[sp[0] for sp in segments],
                       *[p + 1 for p in pos], *pad)
        return meta

    @staticmethod
    def decode_meta_len(n: int) -> int:
        """int64 words of :meth:`decode_meta` for n one-token segments."""
        return 3 * n + (3 * n + 1) // 2

    @classmethod
    def from_meta(cls, meta: torch.Tensor, n: int, o: int, segs: List[Segment], h: int = 0) -> "StepBatch":
        """A batch whose tensors are views of ``meta`` (:meth:`host_meta`'s layout) on its device:
        no host sync and no kernel, so a CUDA graph can capture it with ``meta`` as its input buffer."""
        s = sum(1 for sg in segs if sg.n == 1)
        m = len(segs) - s
        e = n + o + s + h   # end of hidden_rows
        narrow = meta[e + 4 * m:].view(torch.int32)
        return cls(
            tokens=meta[:n],
            positions=narrow[:n],
            slots=narrow[n:2 * n],
            lengths=narrow[2 * n:3 * n],
            out_rows=meta[n:n + o],
            single_rows=meta[n + o:n + o + s],
            segments=segs,
            all_single=all(sg.n == 1 for sg in segs),
            hidden_rows=meta[n + o + s:e] if h else None,
            multi_segments=meta[e:e + 4 * m].view(m, 4) if m else None,
            shortest_run=min((sg.n for sg in segs if sg.n > 1), default=0),
            longest_run=max((sg.n for sg in segs if sg.n > 1), default=0),
        )

    @classmethod
    def build(cls, segments: Sequence, device, all_logits: bool = False) -> "StepBatch":
        """segments: (slot, token ids, start position) tuples or :class:`SegmentSpec`, in item order."""
        meta, n, o, segs, h = cls.host_meta(segments, all_logits)
        return cls.from_meta(to_device(meta, device), n, o, segs, h)


@functools.lru_cache(maxsize=256)
def _decode_layout(n: int):
    """(struct of :meth:`StepBatch.decode_meta`'s words for n rows, the out_rows + single_rows values, the
    padding half-word if any): tokens, out_rows, single_rows as int64, then positions, slots, lengths as int32
    and a zero int32 when 3n is odd, native byte order as numpy's int64 / int32 views."""
    pad = (0,) * ((3 * n) % 2)
    return struct.Struct(f"={3 * n}q{3 * n + len(pad)}i"), tuple(range(n)) * 2, pad


def to_device(t: torch.Tensor, device, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Host tensor -> ``device`` (or into ``out``, a device tensor of its shape) without a host
    sync: through pinned memory on a GPU."""
    device = torch.device(device if out is None else out.device)
    if device.type == "cuda":
        t = t.pin_memory()
    if out is not None:
        return out.copy_(t, non_blocking=True)
    return t.to(device, non_blocking=True)
