"""Model families by ``model_type`` and built-in presets; ``load`` builds a model from either."""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Tuple

import torch

from ds4t.backend import default_device
from ds4t.models.checkpoint import CheckpointError, ConfigError, TensorSource, check_fields, parse_dtype, read_config
from ds4t.models.gguf import is_gguf
from ds4t.models.loading import PresetSource
from ds4t.models.quant import parse_quantization, quantize_option
from ds4t.models.tokenizer import preset_tokenizer


def _families() -> Dict[str, Tuple[type, Callable, Callable, Callable]]:
    """model_type -> (model class, config parser, expected_tensors, preset_init)."""
    from ds4t.models import deepseek, glm, llama, qwen

    return {
        "qwen3_next": (qwen.QwenModel, qwen.QwenConfig.from_dict, qwen.expected_tensors, qwen.preset_init),
        "deepseek_v3": (deepseek.DeepseekModel, deepseek.DeepseekConfig.from_dict, deepseek.expected_tensors,
                        deepseek.preset_init),
        "glm4_moe": (glm.GlmModel, glm.GlmConfig.from_dict, glm.expected_tensors, glm.preset_init),
        "llama": (llama.LlamaModel, llama.LlamaConfig.from_dict, llama.expected_tensors, llama.preset_init),
        "qwen3": (llama.Qwen3Model, llama.LlamaConfig.from_dict, llama.expected_tensors, llama.preset_init),
    }


def _preset_configs() -> Dict[str, dict]:
    from ds4t.models import deepseek, glm, llama, qwen

    out = {n: qwen.preset_config(n) for n in ("tiny-qwen", "qwen3-next-80b-4l", "qwen3-next-80b-fp8",
                                                         "qwen3-next-80b")}
    for mod in (deepseek, glm, llama):
        for n in mod.PRESETS:
            out[n] = mod.preset_config(n)
    return out


def presets() -> list:
    return sorted(_preset_configs())


def preset_source(name: str, seed: int = 0):
    """A preset's HF-style config dict and its deterministic weights (a PresetSource)."""
    configs = _preset_configs()
    if name not in configs:
        raise CheckpointError(f"{name!r} is not a preset (presets: {presets()})")
    cfg = configs[name]
    _, parse, expected, init = _families()[cfg["model_type"]]
    return cfg, PresetSource(expected(parse(cfg)), init, seed, origin=f"preset {name}")


def _device(device) -> torch.device:
    """load's ``device`` as a torch.device, or a clear ValueError (a name torch does not know, CUDA where
    there is none)."""
    if device is None:
        return default_device()
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device {device!r} is not a device ({e})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r}: this machine has no CUDA GPU (torch {torch.__version__}); use 'cpu'")
    return d


def load(path_or_preset: str, device=None, dtype=None, progress: Optional[bool] = None, seed: int = 0,
         quantize: Optional[str] = None, tp: Optional[int] = None, tp_group=None, dequantize: bool = False,
         **options):
    """Load a model: an HF checkpoint directory (config.json + safetensors), a GGUF file as llama.cpp
    writes it (``model.gguf`` or the first part ``model-00001-of-0000N.gguf`` of a split one;
    :mod:`ds4t.models.gguf`: architectures llama, qwen3, qwen3next, deepseek2, glm4moe; Q8_0 / Q4_0 / Q4_1 /
    Q4_K / Q5_K / Q6_K linear weights kept as blocks,
    other quantized types dequantized at load,
    tokenizer and chat template from its metadata) or a preset name.

    ``model.tokenizer``: the checkpoint's tokenizer.json (GGUF: built from its metadata), or for a preset a byte-level tokenizer
    (token id = UTF-8 byte, :mod:`ds4t.models.tokenizer`); None when there is neither.

    device: "cuda" when a GPU is present, else "cpu" (default). dtype: torch dtype or name
    ("bf16", "fp16", "fp32"); default: the checkpoint's ``torch_dtype``/``dtype`` (presets: fp32
    for tiny-*, bf16 for the full-size presets). Tensors stored in another dtype are cast.
    options: family-specific model options, passed to the model class, e.g.
    ``native_path="ds4"`` (deepseek_v3) or ``native_window=2051`` (glm4_moe; default: no window).
    quantize: None (weights as stored; block-FP8 checkpoints stay FP8) or "fp8": the decoder's linear
    weights quantized to block-FP8 as they are read (weight-only; activations stay in ``dtype``), or
    "q8_0" / "q4_0" / "q4_1" / "q4_k" / "q5_k" / "q6_k": the same weights and an untied LM head quantized to
    GGUF blocks.
    A preset whose config carries a quantization_config (``qwen3-next-80b-fp8``) is quantized at load.
    dequantize: GGUF files only: every quantized tensor dequantized at load to ``dtype``, so the float kernels
    run the file's weights (in the Triton interpreter several times faster than the block kernels; more
    memory).
    tp: tensor + expert parallel over the ranks of the initialised torch.distributed group ``tp_group``
    (default: the world, which must have ``tp`` ranks): this rank loads its shard (:mod:`ds4t.parallel`;
    ``device`` "cuda" is this rank's current CUDA device). Every rank must then run the same calls.
    """
    device = _device(device)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    tp_runtime = None
    if tp is not None:
        from ds4t.parallel.runtime import TensorParallel

        tp_runtime = TensorParallel.create(tp, tp_group, device)
        device = tp_runtime.device
    dtype = parse_dtype(dtype)
    if dequantize not in (True, False):
        raise ValueError(f"load: dequantize must be True or False, got {dequantize!r}")
    if dequantize and not is_gguf(path_or_preset):
        raise ValueError(f"load: dequantize=True applies to GGUF files, not {path_or_preset!r}")
    text_meta = None   # GGUF: chat template and special tokens from its metadata (ds4t.text reads them)
    origin = None      # GGUF: the metadata key each config field came from (check_fields' messages)
    families = _families()
    configs = _preset_configs()
    if path_or_preset in configs:
        cfg, source = preset_source(path_or_preset, seed)
        where = path_or_preset
        model_cls = families[cfg["model_type"]][0]
        name = path_or_preset
        if dtype is None:
            dtype = torch.float32 if path_or_preset.startswith("tiny-") else torch.bfloat16
        tokenizer = preset_tokenizer(int(cfg["vocab_size"]))
    elif os.path.isdir(str(path_or_preset)):
        path = str(path_or_preset)
        cfg = read_config(path)
        where = os.path.join(path, "config.json")
        mt = cfg.get("model_type")
        if mt not in families:
            raise CheckpointError(f"{path}/config.json: model_type {mt!r} is not supported "
                                  f"(supported: {sorted(families)})")
        model_cls = families[mt][0]
        source = TensorSource.from_dir(path)
        name = os.path.abspath(path)
        if dtype is None:
            dtype = parse_dtype(cfg.get("dtype") or cfg.get("torch_dtype") or "float32")
        tokenizer = None
        tok_path = os.path.join(path, "tokenizer.json")
        if os.path.exists(tok_path):
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(tok_path)
            except Exception as e:  # noqa: BLE001 -- tokenizers raises a bare Exception on a bad file
                raise CheckpointError(f"{tok_path}: not a readable tokenizer ({e})") from None
    elif is_gguf(path_or_preset):
        from ds4t.models.gguf import field_origin, open_gguf

        path = str(path_or_preset)
        cfg, source, tokenizer, text_meta = open_gguf(path)
        where = path
        origin = field_origin(cfg)
        model_cls = families[cfg["model_type"]][0]
        name = os.path.abspath(path)
        if dtype is None:
            dtype = source.default_dtype()
        source.dequantize = bool(dequantize)
    else:
        raise CheckpointError(
            f"{path_or_preset!r} is neither a checkpoint directory, a .gguf file nor a preset (presets: {presets()})")
    check_fields(cfg, where, origin)
    source.tp = tp_runtime
    try:
        source.fp8 = parse_quantization(cfg)
        source.quantize = quantize_option(quantize, cfg)
        if path_or_preset in configs and source.fp8 is not None:
            source.quantize, source.fp8 = source.fp8, None  # a preset's weights are drawn in float
        if options:
            bad = [k for k in options if k not in model_cls.load_options()]
            if bad:
                raise TypeError(f"load: {model_cls.family} models take no option {bad[0]!r}")
        model = model_cls(cfg, source, device, dtype, name=name, progress=progress, **options)
    except ConfigError as e:   # a config check names the field; name where the config came from
        raise CheckpointError(f"{where}: {e.detail}") from None
    model.tokenizer = tokenizer
    if text_meta is not None:
        model.text_meta = text_meta
    if hasattr(source, "log_dequantized"):
        source.log_dequantized(dtype, device)
    return model
