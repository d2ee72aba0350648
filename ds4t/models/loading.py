"""Turning a checkpoint (or a preset) into model weights: the expected-tensor table, dtype casts,
progress, and errors that name the tensor."""
from __future__ import annotations

import sys
import zlib
from typing import Dict, Optional, Tuple

import torch
from tqdm.auto import tqdm

from ds4t.models.checkpoint import CheckpointError, TensorSource


class WeightReader:
    """Reads the tensors a family expects from a source, casting and moving them.

    ``expected`` maps each checkpoint name to its shape (from the config); reading checks the
    shape, counts progress, and ``finish`` reports tensors the family did not use.
    """

    def __init__(self, source: TensorSource, expected: Dict[str, Tuple[int, ...]], device, dtype: torch.dtype,
                 ignore_prefixes=(), progress: Optional[bool] = None):
        self.source, self.expected, self.device, self.dtype = source, expected, device, dtype
        missing = [k for k in expected if k not in source]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{source.origin}: missing tensor {missing[0]!r}{more}")
        self.ignored = sorted(k for k in source.keys() if k not in expected and k.startswith(tuple(ignore_prefixes)))
        unknown = sorted(k for k in source.keys() if k not in expected and not k.startswith(tuple(ignore_prefixes)))
        if unknown:
            raise CheckpointError(
                f"{source.origin}: unexpected tensor {unknown[0]!r} (and {len(unknown) - 1} more) "
                "for this model_type/config")
        if progress is None:
            progress = len(expected) > 200 and sys.stderr.isatty()
        self.bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress)

    def __call__(self, name: str, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        t = self.source.get(name, self.expected[name], dtype or self.dtype, self.device)
        self.bar.update(1)
        return t

    def finish(self) -> None:
        self.bar.close()


class PresetSource(TensorSource):
    """Deterministic random weights for a preset, made on demand tensor by tensor.

    Each tensor depends only on (seed, name): ``init(name, shape, generator)`` draws it in fp32
    on the CPU (so every device gets the same weights), then it is cast and moved.
    """

    def __init__(self, expected: Dict[str, Tuple[int, ...]], init, seed: int, origin: str):
        super().__init__(origin=origin)
        self.expected, self.init, self.seed = expected, init, seed

    def keys(self):
        return list(self.expected)

    def __contains__(self, name: str) -> bool:
        return name in self.expected

    def get(self, name, shape=None, dtype=None, device="cpu"):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        t = self.init(name, self.expected[name], g)
        return t.to(device=device, dtype=dtype or t.dtype).contiguous()
