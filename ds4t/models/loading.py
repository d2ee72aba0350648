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

from ds4t.kernels import quant_blocks
from ds4t.kernels.weights import FP8_DTYPE, FP8Weight, from_block_scales, quantize, stack
from ds4t.models.checkpoint import CheckpointError, TensorSource
from ds4t.models.quant import SCALE_SUFFIX, BlockQuantConfig, FP8Config, is_quantized_linear


def keeps_blocks(name: str) -> bool:
    """Is ``name`` a weight that runs as GGUF blocks (decoder linears and the LM head), when stored or
    quantized so? Norms, routers, conv, embeddings stay float."""
    return is_quantized_linear(name) or name == "lm_head.weight"


def _to_blocks(t: torch.Tensor, q: BlockQuantConfig, dtype: torch.dtype):
    """``t`` as GGUF blocks of ``q.qtype`` (or its fallback type for this K; float when none fits)."""
    qtype = quant_blocks.fallback_type(q.qtype, t.shape[-1])
    return t if qtype is None else quant_blocks.quantize(t, qtype, act_dtype=dtype)


class WeightReader:
    """Reads the tensors a family expects from a source, casting and moving them.

    ``expected`` maps each checkpoint name to its shape (from the config); reading checks the
    shape, counts progress, and ``finish`` reports tensors the family did not use.

    Block-FP8: with ``fp8`` (the checkpoint's quantization_config) a tensor stored as float8_e4m3fn is
    read with its ``*_scale_inv`` into an :class:`~ds4t.kernels.weights.FP8Weight` (never dequantized);
    with ``quantize`` the float weights a published FP8 checkpoint would quantize are quantized as they
    are read. Anything that would load silently wrong is a CheckpointError naming the tensor: float8
    without its scale (or without a quantization_config), a scale of the wrong shape or for a float
    tensor, another float8 format, float8 where the model needs a float tensor (norms, routers, ...).
    """

    def __init__(self, source: TensorSource, expected: Dict[str, Tuple[int, ...]], device, dtype: torch.dtype,
                 ignore_prefixes=(), progress: Optional[bool] = None, fp8: Optional[FP8Config] = None,
                 quantize: Optional[FP8Config] = None):
        self.source, self.device, self.dtype = source, device, dtype
        self.expert_split = None
        """Under tensor parallel (the model sets it before its layers load): n routed experts -> the
        [lo, hi) this rank keeps. The reader then reads (or, for a preset, draws) only those experts."""
        # load() puts the checkpoint's FP8 settings and the quantize option on the source.
        self.fp8 = fp8 if fp8 is not None else getattr(source, "fp8", None)
        self.quantize = quantize if quantize is not None else getattr(source, "quantize", None)
        self.expected = dict(expected)
        self.fp8_names = self._fp8_tensors(source, expected)
        for name in self.fp8_names:
            N, K = expected[name]
            bn, bk = self.fp8.block
            self.expected[name + SCALE_SUFFIX] = (-(-N // bn), -(-K // bk))
        missing = [k for k in self.expected if k not in source]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            what = "scale of float8 tensor" if missing[0].endswith(SCALE_SUFFIX) else "tensor"
            label = getattr(source, "describe", repr)(missing[0])   # a GGUF names its own tensor first
            raise CheckpointError(f"{source.origin}: missing {what} {label}{more}")
        self.ignored = sorted(k for k in source.keys() if k not in self.expected and k.startswith(tuple(ignore_prefixes)))
        unknown = sorted(k for k in source.keys() if k not in self.expected and not k.startswith(tuple(ignore_prefixes)))
        if unknown:
            k = unknown[0]
            base = k[: -len(SCALE_SUFFIX)] if k.endswith(SCALE_SUFFIX) else None
            if base is not None and base in expected:
                raise CheckpointError(f"{source.origin}: {k!r} scales {base!r}, which is stored as "
                                      f"{source.stored_dtype(base)}, not float8_e4m3fn")
            raise CheckpointError(
                f"{source.origin}: unexpected tensor {k!r} (and {len(unknown) - 1} more) "
                "for this model_type/config")
        if progress is None:
            progress = len(self.expected) > 200 and sys.stderr.isatty()
        self.bar = tqdm(total=len(expected), desc="loading weights", unit="tensor", disable=not progress)

    def _fp8_tensors(self, source: TensorSource, expected) -> set:
        """Names of the expected tensors stored in float8 (checked against the config)."""
        stored = getattr(source, "stored_dtype", lambda name: None)
        out = set()
        for name in expected:
            dt = stored(name)
            if dt is None or not dt.is_floating_point or dt.itemsize != 1:
                continue
            if dt != FP8_DTYPE:
                raise CheckpointError(f"{source.origin}: tensor {name!r} is {dt}; block-FP8 checkpoints store "
                                      f"float8_e4m3fn (quantization_config.fmt 'e4m3')")
            if self.fp8 is None:
                raise CheckpointError(f"{source.origin}: tensor {name!r} is float8_e4m3fn but config.json has no "
                                      f"quantization_config (its block size and scales are unknown)")
            if self.fp8.keeps_float(name):
                raise CheckpointError(f"{source.origin}: tensor {name!r} is float8_e4m3fn but its module is in "
                                      f"quantization_config.modules_to_not_convert")
            if not is_quantized_linear(name) or len(expected[name]) != 2:
                raise CheckpointError(f"{source.origin}: tensor {name!r} is float8_e4m3fn, but only the decoder's "
                                      f"linear weights run in FP8 (router gates, norms, conv, embeddings and the "
                                      f"LM head stay unquantized)")
            out.add(name)
        return out

    def __call__(self, name: str, dtype: Optional[torch.dtype] = None):
        """The tensor ``name``: a float tensor in ``dtype`` (default: the model dtype), or an
        FP8Weight for a block-FP8 linear weight (read as stored, or quantized when ``quantize``)."""
        if name in self.fp8_names:
            if dtype is not None:
                raise CheckpointError(f"{self.source.origin}: tensor {name!r} is float8_e4m3fn, but the model "
                                      f"reads it as {dtype} (norms, routers and biases stay unquantized)")
            t = self._read_fp8(name)
        elif dtype is None and keeps_blocks(name) and (b := self._stored_blocks(name)) is not None:
            t = b
        else:
            t = self.source.get(name, self.expected[name], dtype or self.dtype, self.device)
            q = self.quantize
            if isinstance(q, BlockQuantConfig):
                if dtype is None and keeps_blocks(name):
                    t = _to_blocks(t, q, self.dtype)
            elif q is not None and dtype is None and is_quantized_linear(name) and not q.keeps_float(name):
                t = quantize(t, q.block).with_act_dtype(self.dtype)
        self.bar.update(1)
        return t

    def expert_range(self, n: int) -> Optional[Tuple[int, int]]:
        """The routed experts [lo, hi) of ``n`` that this rank reads (:attr:`expert_split`); None: all."""
        return None if self.expert_split is None else self.expert_split(n)

    def skip(self, count: int) -> None:
        """``count`` expected tensors this rank does not read (another rank's experts): progress only."""
        self.bar.update(count)

    def stack(self, names, tail: Optional[torch.Tensor] = None):
        """``[get(n) for n in names]`` stacked along a new leading dim (MoE experts). Quantizing at load
        quantizes the stacked tensor once (per-block scales are the same as per expert; thousands of
        experts at full depth load in one pass per layer instead of one per expert). A source that stores
        the experts stacked (GGUF's ``ffn_*_exps``) hands over its stacked tensor as it is (blocks stay the
        file's blocks).

        Float parts are copied into the stack as they are read, so a layer's experts need the stack's memory
        and one expert's, not two stacks' (a list of parts, then their stack, then the shared expert appended
        took 1.3-1.7x the weights at peak, measured on the CPU).
        ``tail`` (a shared expert's tensor): stacked after the parts when they are float tensors of its
        shape, dtype and device -- appended without a second copy of the stack. The result holds it iff
        its leading dim is ``len(names) + 1``."""
        q = self.quantize
        hook = getattr(self.source, "stacked", None)
        if hook is not None and q is None and not self.fp8_names.intersection(names):
            w = hook(list(names), [self.expected[n] for n in names], self.device, self.dtype)
            if w is not None:
                self.bar.update(len(names))
                return w
        if isinstance(q, BlockQuantConfig) and all(is_quantized_linear(n) for n in names):
            self.quantize = None
            try:
                floats = [self(n) for n in names]
            finally:
                self.quantize = q
            if all(isinstance(f, torch.Tensor) for f in floats):   # quantize the stack once
                return _to_blocks(torch.stack(floats), q, self.dtype)
            return stack(floats)
        if q is not None and all(is_quantized_linear(n) and not q.keeps_float(n) and n not in self.fp8_names
                                 for n in names):
            # One expert at a time: quantizing the float stack at once held the floats, their stack and
            # ~4 fp32 copies of it (DeepSeek-V3's 256 experts of a layer: ~60 GB at peak, more than an H100
            # has); a block never spans two experts, so the stack of the parts has the same bits.
            self.quantize = None
            try:
                parts = [quantize(self(n), q.block) for n in names]
            finally:
                self.quantize = q
            return stack(parts).with_act_dtype(self.dtype)
        return self._stack_in_place(list(names), tail)

    def _stack_in_place(self, names, tail):
        if not names:
            return stack([])
        first = self(names[0])
        if not isinstance(first, torch.Tensor):
            return stack([first] + [self(n) for n in names[1:]])
        fits = isinstance(tail, torch.Tensor) and (tail.shape, tail.dtype, tail.device) == \
            (first.shape, first.dtype, first.device)
        out = torch.empty((len(names) + fits, *first.shape), dtype=first.dtype, device=first.device)
        out[0].copy_(first)
        del first
        for i, name in enumerate(names[1:], 1):
            t = self(name)
            if not (isinstance(t, torch.Tensor) and (t.shape, t.dtype) == (out.shape[1:], out.dtype)):
                # parts of mixed kinds: the general join (which converts or refuses them as it does elsewhere)
                return stack([out[j] for j in range(i)] + [t] + [self(n) for n in names[i + 1:]])
            out[i].copy_(t)
        if fits:
            out[-1].copy_(tail)
        return out

    def _stored_blocks(self, name: str):
        """The source's GGUF blocks of ``name`` (None: not stored as a kernel block type)."""
        blocks = getattr(self.source, "blocks", None)
        w = blocks(name, self.expected[name], self.device) if blocks is not None else None
        return None if w is None else w.with_act_dtype(self.dtype)

    def _read_fp8(self, name: str) -> FP8Weight:
        data = self.source.get(name, self.expected[name], None, self.device)
        scale_name = name + SCALE_SUFFIX
        scale = self.source.get(scale_name, None, torch.float32, self.device)
        try:
            return from_block_scales(data, scale, self.fp8.block).with_act_dtype(self.dtype)
        except ValueError as e:
            raise CheckpointError(f"{self.source.origin}: {scale_name!r}: {e}") from None

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
        if dev.type == "cuda" and torch.Size(shape).numel() >= (1 << 20):
            # Full-size presets: draw big tensors (from one 512 x 2048 expert matrix up) on the GPU
            # (minutes faster at full depth; still a function of (seed, name) on a given GPU, which
            # is all benchmarks need).
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
    """One warning per load naming the MTP layers whose tensors were recognised and not used (the
    config declares no MTP module)."""
    skipped = [k for k in reader.ignored if k.startswith(tuple(prefixes))] if prefixes else []
    if skipped:
        layers = ", ".join(p.rstrip(".") for p in prefixes)
        warnings.warn(f"{reader.source.origin}: skipped {len(skipped)} multi-token-prediction (MTP) "
                      f"tensor(s) of {layers}: the config declares no MTP module", stacklevel=3)
