"""Tensor and expert parallelism on ``torch.distributed``, with batch-invariant collectives.

``ds4t.load(model, tp=K)`` inside an initialised process group of K ranks (torchrun, or
:func:`ds4t.parallel.launch.run_spmd`) gives each rank its shard; every rank then runs the same
program (SPMD: the same sessions, the same ``eval_batch`` calls) and gets the same full logits.

- :mod:`.group`    the process group, checked (:class:`ParallelError` for what a user can fix)
- :mod:`.split`    which heads / experts / columns / vocabulary rows a rank holds (integer ranges)
- :mod:`.shard`    the sharding rules, once per weight type (GQA, gated attention, Gated DeltaNet,
                   MLA, dense MLP, MoE) and the per-rank config (heads divided)
- :mod:`.comm`     the collectives: all-gather of fp32 partial sums, summed locally in rank order
                   0..K-1, so a row's bits never depend on the batch (and are the same on every rank)
- :mod:`.runtime`  :class:`TensorParallel`, what a model holds as ``model.tp``: the hooks the
                   decoder stack calls (vocab-parallel embedding and LM head, the partial-sum reduce)
- :mod:`.launch`   start K ranks from one command (``ds4t exactness --tp 2``, ``ds4t serve --tp 2``)
- :mod:`.workers`  a persistent pool of ranks that runs jobs (the CPU tests: one pair per module)
- :mod:`.mirror`   rank 0 leads, the others replay its step list (``ds4t serve --tp K``)
- :mod:`.controls` the negative control: a size-dependent reduction the checks must catch

Design and sharding rules: docs/parallel.md.
"""
from ds4t.parallel.group import ParallelError

__all__ = ["ParallelError"]
