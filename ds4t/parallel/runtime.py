"""What a tensor-parallel model holds as ``model.tp``: the hooks the decoder stack calls
(:class:`ds4t.models.decoder.DecoderModel`) and the sharding of its weights as they load."""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ds4t.kernels import ops
from ds4t.parallel import shard, split
from ds4t.parallel.comm import CollectiveTimer, Collectives
from ds4t.parallel.group import RankGroup, resolve


class TensorParallel:
    """Rank ``rank`` of ``size`` of one model: its shard rules, its collectives and its vocabulary rows.

    The stack calls :meth:`embedding`, :meth:`reduce` after every mixer and FFN (their outputs are
    partial sums of the hidden vector) and :meth:`logits`; loading calls :meth:`check_config`,
    :meth:`shard_vocab`, :meth:`shard_layer` and :meth:`local_config`.
    """

    def __init__(self, g: RankGroup):
        self.rank, self.size, self.group, self.backend = g.rank, g.size, g.group, g.backend
        self.device = g.device
        self.part = shard.Part(g.rank, g.size)
        self.comm = Collectives(g.group, g.size, g.backend)
        self.vocab: Optional[Tuple[int, int, int]] = None   # (lo, hi, rows) of this rank's vocabulary shard
        self.global_cfg = None

    @classmethod
    def create(cls, tp: int, group=None, device=None) -> "TensorParallel":
        """Check the process group (:func:`ds4t.parallel.group.resolve`) and make the runtime."""
        return cls(resolve(tp, group, device))

    def __repr__(self) -> str:
        return f"TensorParallel(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    # -- loading -----------------------------------------------------------------------------
    def check_config(self, cfg) -> None:
        shard.check_config(cfg, self.part)
        self.global_cfg = cfg

    def shard_vocab(self, embed: torch.Tensor, lm_head: torch.Tensor):
        """(embedding rows, LM head rows) of this rank; a tied head stays the same tensor."""
        self.vocab = split.vocab(embed.shape[0], self.rank, self.size)
        e = shard.vocab_rows(embed, self.part)
        return e, e if lm_head is embed else shard.vocab_rows(lm_head, self.part)

    def shard_vocab_rows(self, table: torch.Tensor) -> torch.Tensor:
        """This rank's rows of another [V, D] table split like the model's (an MTP head's own embedding
        or LM head); :meth:`shard_vocab` has set the split."""
        return shard.vocab_rows(table, self.part)

    def expert_range(self, n: int) -> Tuple[int, int]:
        """The routed experts [lo, hi) of ``n`` this rank keeps (expert parallel: whole experts, evenly)."""
        return self.part.even(n, "the number of routed experts")

    def shard_layer(self, layer, cfg, i: int):
        """Layer ``i``'s shard (``cfg``: the family config, global)."""
        return shard.layer(layer, cfg, self.part, f"layers.{i}")

    def local_config(self, cfg):
        return shard.local_config(cfg, self.part)

    # -- the forward hooks ---------------------------------------------------------------------
    def embedding(self, tokens: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel lookup: fp32 [R, D]. The rank holding a token's row gives it, the others 0;
        the sum (x + 0 = x) is exact."""
        lo, hi, _ = self.vocab
        local = tokens - lo
        mine = (local >= 0) & (local < hi - lo)
        h = ops.embedding(torch.where(mine, local, torch.zeros_like(local)), table)
        return self.reduce(torch.where(mine[:, None], h, torch.zeros_like(h)))

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Partial sums fp32 [R, D] -> the full sum, batch-invariantly (:mod:`ds4t.parallel.comm`)."""
        return self.comm.sum(partial)

    def logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """fp32 [O, rows] logits of this rank's vocabulary rows -> fp32 [O, V], the same on every rank."""
        return self.comm.gather_columns(local)[:, :vocab_size].contiguous()

    def time_collectives(self) -> CollectiveTimer:
        """Start timing every collective of this model (:class:`CollectiveTimer`); returns the timer."""
        self.comm.timer = CollectiveTimer(self.device if self.device is not None else torch.device("cpu"))
        return self.comm.timer
