"""Choosing tokens from logits: greedy, or seeded sampling with temperature, top-k and top-p.

    tokens = ds4t.sampling.sample(logits, temperature=0.8, top_p=0.95, seed=1234, position=pos)

``logits`` is float32 [B, V]; every parameter is one value for all rows or one per row. A row's
token depends only on its logits, its parameters and (seed, stream, position), never on which or
how many rows share the call, so a session sampled alone or in any batch draws the same token.
The draw itself is the batch-invariant Triton kernel :func:`ds4t.kernels.sampling.sample` (Gumbel-max
over the top-k / top-p survivors; the exact rule is in that module's docstring).

``stream`` separates independent sequences that share a seed; by default it is
:func:`stream_id` of the row's seed, so a request's draws depend on its seed alone.
"""
from __future__ import annotations

import math
import numbers
from typing import List, Sequence, Union

import numpy as np
import torch

from ds4t.batch.session import is_int
from ds4t.kernels import sampling as kernel
from ds4t.kernels.sampling import NO_TOKEN  # noqa: F401  (the token of a row whose logits hold a NaN)

MIN_TEMPERATURE = 1e-5
"""Temperatures below this decode greedily (argmax), as if 0.

The kernel divides fp32 logits by the temperature. For a subnormal temperature such as 1e-40 the
quotient overflows to inf (any |logit| > 3.4e38 * 1e-40 ~ 3e-2), the order keys of the survivors
tie at inf and exp(z - max z) becomes NaN: the draw is garbage. At 1e-5 a logit would have to
exceed 3.4e33 to overflow, which no model produces; and below it sampling is greedy in all but
name anyway: the Gumbel noise spans less than 21, so two tokens whose logits differ by more than
21 * 1e-5 ~ 2e-4 are already ordered as argmax orders them. (vLLM uses the same 1e-5.)"""

_MASK64 = (1 << 64) - 1

Param = Union[int, float, Sequence, np.ndarray, torch.Tensor]


def stream_id(seed: int) -> int:
    """The default sampling stream of a seed: a 63-bit splitmix64 mix of it (not of a slot or a row)."""
    z = (int(seed) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def to_int64(v: int) -> int:
    """Any Python int as the int64 with the same low 64 bits (how a seed reaches the kernel)."""
    v = int(v) & _MASK64
    return v - (1 << 64) if v >= 1 << 63 else v


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_))


def per_row(name: str, value: Param, B: int) -> List:
    """``value`` (a scalar, or B values as a list, tuple, 1-D array or tensor) as a list of B values;
    ValueError naming ``name`` for another length or shape."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        if value.ndim == 0:
            value = value.item()
        elif value.ndim == 1:
            value = value.tolist()
        else:
            raise ValueError(f"{name} must be a scalar or 1-D, got shape {tuple(value.shape)}")
    if isinstance(value, (list, tuple)):
        if len(value) != B:
            raise ValueError(f"{name} has {len(value)} values for {B} rows")
        return list(value)
    return [value] * B


def check_params(temperature, top_k, top_p, vocab_size: int, what: str = "") -> None:
    """Raise ValueError unless one row's settings are valid: temperature a finite number >= 0
    (below :data:`MIN_TEMPERATURE`: greedy), top_k an int in [0, vocab_size] (0: off), top_p a
    number in (0, 1] (1: off). ``what`` prefixes the message (e.g. "row 3: ")."""
    if not _is_real(temperature) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"{what}temperature must be a finite number >= 0, got {temperature!r}")
    if not is_int(top_k) or not 0 <= top_k <= vocab_size:
        raise ValueError(f"{what}top_k must be an int in [0, {vocab_size}] (0: off), got {top_k!r}")
    if not _is_real(top_p) or not 0 < top_p <= 1:
        raise ValueError(f"{what}top_p must be a number in (0, 1] (1: off), got {top_p!r}")


def sample(logits: torch.Tensor, temperature: Param = 0.0, top_k: Param = 0, top_p: Param = 1.0,
           seed: Param = 0, position: Param = 0, *, stream: Param = None) -> torch.Tensor:
    """One token per row of ``logits`` (float [B, V]); returns int64 [B] on the logits' device.

    Each parameter is a scalar for every row or B values (list, tuple, 1-D array or tensor):
    temperature (>= 0; below :data:`MIN_TEMPERATURE` the row is greedy), top_k (int in [0, V],
    0: off), top_p (in (0, 1], 1: off), seed (any int; its low 64 bits are used), position (int
    in [0, 2^63): the position of the token being drawn, e.g. ``session.pos``), stream (int; default
    :func:`stream_id` of the seed). The token of a row is a function of its logits and its own
    parameters only. Invalid parameters raise ValueError naming the row. A row whose logits hold a NaN
    gets :data:`NO_TOKEN` (-1), never an index that looks like a token (no host sync is spent to check).
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.is_complex() or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor [B, V], got "
                         f"{tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__}")
    B, V = logits.shape
    temps, ks, ps = per_row("temperature", temperature, B), per_row("top_k", top_k, B), per_row("top_p", top_p, B)
    seeds, poss = per_row("seed", seed, B), per_row("position", position, B)
    streams = per_row("stream", stream, B) if stream is not None else None
    for i in range(B):
        what = f"row {i}: " if B > 1 else ""
        check_params(temps[i], ks[i], ps[i], V, what)
        if not is_int(seeds[i]):
            raise ValueError(f"{what}seed must be an int, got {seeds[i]!r}")
        if not is_int(poss[i]) or not 0 <= poss[i] < 1 << 63:
            raise ValueError(f"{what}position must be an int in [0, 2^63), got {poss[i]!r}")
        if streams is not None and not is_int(streams[i]):
            raise ValueError(f"{what}stream must be an int, got {streams[i]!r}")
    greedy = [t < MIN_TEMPERATURE for t in temps]
    if all(greedy):
        return kernel.argmax(logits)
    dev = logits.device
    if streams is None:
        streams = [stream_id(s) for s in seeds]
    return kernel.sample(
        logits,
        torch.tensor([to_int64(s) for s in seeds], dtype=torch.int64, device=dev),
        torch.tensor([to_int64(s) for s in streams], dtype=torch.int64, device=dev),
        torch.tensor([int(p) for p in poss], dtype=torch.int64, device=dev),
        torch.tensor([0.0 if g else float(t) for g, t in zip(greedy, temps)], dtype=torch.float32, device=dev),
        torch.tensor([int(k) for k in ks], dtype=torch.int32, device=dev),
        torch.tensor([float(p) for p in ps], dtype=torch.float32, device=dev),
    )
