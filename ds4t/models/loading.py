"""Turning a checkpoint (or a preset) into model weights: the expected-tensor table, dtype casts,
progress, and errors that name the tensor."""
from __future__ import annotations

import re
import sys
import warnings
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
        seed = self.seed * 1_000_003 + zlib.crc32(name.encode())
        shape = self.expected[name]
        dev = torch.device(device)
        if dev.type == "meta":  # shapes only (byte counts, memory plans): draw nothing
            return torch.empty(shape, dtype=dtype or torch.float32, device=dev)
        if dev.type == "cuda" and torch.Size(shape).numel() > (1 << 20):
            # Full-size presets: draw big tensors on the GPU (minutes faster; still a function
            # of (seed, name) on a given GPU, which is all benchmarks need).
            g = torch.Generator(device=dev).manual_seed(seed)
            t = self.init(name, shape, g, device=dev)
        else:
            g = torch.Generator().manual_seed(seed)
            t = self.init(name, shape, g)
        return t.to(device=device, dtype=dtype or t.dtype).contiguous()


_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")


def mtp_layer_prefixes(source: TensorSource, num_layers: int) -> Tuple[str, ...]:
    """``model.layers.{j}.`` for every layer j >= num_layers that ``source`` holds: the
    multi-token-prediction (MTP) modules DeepSeek-V3 / GLM-4.5 checkpoints store after the decoder
    layers. Pass them to WeightReader as ``ignore_prefixes`` and call :func:`warn_mtp_skipped`."""
    found = set()
    for k in source.keys():
        m = _LAYER_KEY.match(k)
        if m and int(m.group(1)) >= num_layers:
            found.add(int(m.group(1)))
    return tuple(f"model.layers.{j}." for j in sorted(found))


def warn_mtp_skipped(reader: "WeightReader", prefixes: Tuple[str, ...]) -> None:
    """One warning per load naming the MTP layers whose tensors were recognised and not used."""
    skipped = [k for k in reader.ignored if k.startswith(tuple(prefixes))] if prefixes else []
    if skipped:
        layers = ", ".join(p.split(".")[2] for p in prefixes)
        warnings.warn(f"{reader.source.origin}: skipped {len(skipped)} multi-token-prediction (MTP) "
                      f"tensor(s) of layer(s) {layers}: ds4t does not use MTP", stacklevel=3)
