"""The process group a tensor-parallel model runs in, checked with errors a user can act on."""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch


class ParallelError(ValueError):
    """A tensor-parallel set-up ds4t cannot run (no process group, wrong size, a tp that does not
    divide the heads, ...); the message says what to change."""


@dataclasses.dataclass(frozen=True)
class RankGroup:
    """This process's place in a tensor-parallel group: ``rank`` of ``size``, the torch.distributed
    ``group`` (None: the default group) and the device its shard lives on."""

    rank: int
    size: int
    group: Optional[object]
    device: torch.device
    backend: str


def resolve(tp, group=None, device=None) -> RankGroup:
    """Check ``tp`` against the initialised process group ``group`` (default: the world) and pick the
    device: ``cuda`` means this rank's current CUDA device (torchrun: set it from LOCAL_RANK)."""
    import torch.distributed as dist

    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ParallelError(f"tp must be a positive int, got {tp!r}")
    if not dist.is_available() or not dist.is_initialized():
        raise ParallelError(
            f"tp={tp} needs an initialised torch.distributed process group of {tp} ranks: launch with "
            f"`torchrun --nproc-per-node {tp} ...` and call torch.distributed.init_process_group(), or use "
            f"ds4t.parallel.launch.run_spmd (the ds4t commands take --tp and start the ranks themselves)")
    size = dist.get_world_size(group)
    if size != tp:
        raise ParallelError(f"tp={tp} but the process group has {size} ranks (one rank per shard: they must match)")
    rank = dist.get_rank(group)
    backend = str(dist.get_backend(group))
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev is not None and dev.type == "cuda" and backend == "gloo":
        raise ParallelError("a CUDA model needs the nccl backend (init_process_group('nccl')); gloo is for the CPU")
    if dev is not None and dev.type == "cpu" and backend == "nccl":
        raise ParallelError("a CPU model needs the gloo backend; nccl is for CUDA devices")
    return RankGroup(rank, size, group, dev, backend)
