"""Block-FP8 checkpoints: what ``quantization_config`` says, and which tensors it covers.

Published FP8 releases (DeepSeek-V3, Qwen3-Next-80B-A3B-FP8, GLM-4.5-FP8) carry in config.json::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "modules_to_not_convert": [...]}

and store each quantized linear weight ``X.weight`` as float8_e4m3fn with ``X.weight_scale_inv`` fp32
``[ceil(N/bn), ceil(K/bk)]``. ds4t runs them weight-only (W8A16): activations stay in the model dtype, so
``activation_scheme`` "dynamic" (scales computed per token at run time by FP8-activation engines) needs
nothing from the checkpoint; "static" would come with input scales ds4t has no use for and is refused.

``ds4t.load(..., quantize="fp8")`` makes the same format from float weights: the tensors a published
checkpoint quantizes (:func:`is_quantized_linear`), in the config's blocks (default 128 x 128).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Optional, Tuple

from ds4t.models.checkpoint import ConfigError

SCALE_SUFFIX = "_scale_inv"
FP8_STORED = "F8_E4M3"   # safetensors' name of float8_e4m3fn

# The linear layers of the decoder (attention / Gated DeltaNet projections, dense MLPs, experts): every
# weight whose module name ends in ``proj`` (q_proj, kv_a_proj_with_mqa, in_proj_qkvz, out_proj, gate_proj,
# ...). Router gates, shared-expert gates, norms, conv1d, embeddings and the LM head stay unquantized.
_LINEAR = re.compile(r"^(model|mtp)\.layers\.\d+\..*proj(_[a-z]+)*\.weight$")


@dataclasses.dataclass(frozen=True)
class FP8Config:
    """A checkpoint's (or a load's) block-FP8 settings."""
    block: Tuple[int, int] = (128, 128)          # (rows, columns) of one scale block
    not_converted: Tuple[str, ...] = ()          # module names kept in float (modules_to_not_convert)

    def keeps_float(self, name: str) -> bool:
        """Is tensor ``name`` in a module listed in modules_to_not_convert?"""
        return any(name == m or name.startswith(m + ".") for m in self.not_converted)


def is_quantized_linear(name: str) -> bool:
    """Is ``name`` a tensor that block-FP8 checkpoints store in FP8 (a decoder linear weight)?"""
    return bool(_LINEAR.match(name))


def parse_quantization(cfg: dict) -> Optional[FP8Config]:
    """The FP8 settings of a config dict (None without ``quantization_config``); ConfigError naming
    the field for anything ds4t would run wrong."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ConfigError(f"quantization_config must be an object, got {q!r}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"quantization_config.quant_method {method!r} is not supported "
                          f"(ds4t reads block-FP8 checkpoints: 'fp8')")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"quantization_config.fmt {fmt!r} is not supported (only 'e4m3')")
    act = q.get("activation_scheme", "dynamic")
    if act != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {act!r} is not supported: ds4t "
                          f"runs FP8 weights with unquantized activations ('dynamic' checkpoints)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size must be two positive ints "
                          f"(per-tensor FP8 is not supported), got {block!r}")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"quantization_config.modules_to_not_convert must be a list of "
                          f"module names, got {skip!r}")
    return FP8Config(block=(int(block[0]), int(block[1])), not_converted=tuple(skip))


@dataclasses.dataclass(frozen=True)
class BlockQuantConfig:
    """``load(quantize="q8_0" | "q4_0" | "q4_1" | "q4_k" | "q5_k" | "q6_k")``: the decoder's linear weights (and
    an untied LM head)
    quantized to GGUF blocks as they are read (:mod:`ds4t.kernels.quant_blocks`), weight-only; a weight
    whose K the type does not fit falls back as llama-quantize does (K-quants -> Q8_0 -> float)."""
    qtype: str

    def keeps_float(self, name: str) -> bool:
        return False


BLOCK_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q4_k": "Q4_K", "q5_k": "Q5_K", "q6_k": "Q6_K"}


def quantize_option(quantize, cfg: dict):
    """``load(quantize=...)``: None (as stored), "fp8" (float weights quantized at load, in the
    checkpoint's blocks if it names them, else 128 x 128) or a GGUF block type "q8_0" / "q4_0" / "q4_1" /
    "q4_k" / "q5_k" / "q6_k" (:class:`BlockQuantConfig`)."""
    if quantize is None:
        return None
    if isinstance(quantize, str) and quantize.lower() in BLOCK_TYPES:
        return BlockQuantConfig(BLOCK_TYPES[quantize.lower()])
    if quantize != "fp8":
        raise ValueError(f"quantize must be None, 'fp8' or a GGUF block type ({', '.join(map(repr, BLOCK_TYPES))}), "
                         f"got {quantize!r}")
    return parse_quantization(cfg) or FP8Config()
