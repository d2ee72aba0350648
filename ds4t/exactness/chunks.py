"""Prefill chunk invariance: one prompt, fed whole, in chunks of every given size, and one token per
step inside a native batch beside another decoding session -- the logits of every position (full
float32) and the final session state must be the same bits every way.

Exact speculative decoding (verifying k drafts as one chunk) and chunked serving rest on this
property. A chunk size chosen from the batch (a split-K picked by the row count, say) breaks it;
``run_chunk_check`` under ``harness.plant("batch-dependent")`` shows the check catches that.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import torch

from ds4t.batch.engine import DecodeItem, eval_batch


@dataclasses.dataclass
class ChunkReport:
    prompt_len: int
    chunks: List[int]
    rows: int = 0            # logit rows compared (one per prompt position per way of feeding it)
    states: int = 0          # state tensors compared
    mismatches: int = 0
    first_mismatch: Optional[str] = None
    paths: Dict[str, int] = dataclasses.field(default_factory=dict)   # token-by-token rows' paths

    @property
    def ok(self) -> bool:
        return self.mismatches == 0 and not self.paths.get("ordered")

    def _miss(self, where: str) -> None:
        self.mismatches += 1
        self.first_mismatch = self.first_mismatch or where


def _compare_states(rep: ChunkReport, where: str, got: dict, want: dict) -> None:
    if got.keys() != want.keys():
        rep._miss(f"{where}: state keys differ")
        return
    for k in want:
        rep.states += 1
        if not torch.equal(got[k], want[k]):
            rep._miss(f"{where}: state {k!r} differs from the whole prompt's")


def run_chunk_check(model, prompt: Sequence[int], chunks: Sequence[int] = (1, 17, 64),
                    max_ctx: Optional[int] = None, in_batch: bool = True) -> ChunkReport:
    """Compare, bitwise, the whole prompt's prefill (all positions' logits fp32 [T, V], state) with
    prefills in chunks of each size in ``chunks`` and (``in_batch``) with feeding it one token per
    ``eval_batch(mode="native")`` step beside another session that decodes. Never raises on a
    mismatch: the report counts them and names the first."""
    prompt = list(prompt)
    if not prompt:
        raise ValueError("run_chunk_check: the prompt is empty")
    if any(not isinstance(c, int) or c < 1 for c in chunks):
        raise ValueError(f"run_chunk_check: chunk sizes must be positive ints, got {list(chunks)}")
    max_ctx = max_ctx or len(prompt) + 8
    rep = ChunkReport(prompt_len=len(prompt), chunks=list(chunks))
    ref = model.new_session(max_ctx)
    try:
        whole = ref.prefill(prompt, all_logits=True)
        state = ref.state_dict()
    finally:
        ref.close()
    for chunk in chunks:
        s = model.new_session(max_ctx)
        try:
            parts = torch.cat([s.prefill(prompt[i:i + chunk], all_logits=True) for i in range(0, len(prompt), chunk)])
            st = s.state_dict()
        finally:
            s.close()
        rep.rows += parts.shape[0]
        bad = [t for t in range(parts.shape[0]) if not torch.equal(parts[t], whole[t])]
        for t in bad:
            rep._miss(f"chunks of {chunk}: logits differ from the whole prompt (first at position {bad[0]})")
        _compare_states(rep, f"chunks of {chunk}", st, state)
    if in_batch:
        other, s = model.new_session(max_ctx), model.new_session(max_ctx)
        try:
            other.prefill(prompt[:3])
            for t, tok in enumerate(prompt):
                res = eval_batch([DecodeItem(s, tok), DecodeItem(other, 7)], mode="auto")
                for p in res.paths:
                    rep.paths[p] = rep.paths.get(p, 0) + 1
                rep.rows += 1
                if not torch.equal(res.logits[0], whole[t]):
                    rep._miss(f"token by token in a batch differs from the whole prompt (first at position {t})")
            _compare_states(rep, "token by token in a batch", s.state_dict(), state)
        finally:
            other.close()
            s.close()
    return rep
