"""The HF transformers twin of a ds4t preset: the same config and the same weights in an HF
``*ForCausalLM``, for side-by-side benchmarks and checks (needs ``transformers``, the test extra).

HF keeps each MoE layer's routed experts as two 3-D parameters (``experts.gate_up_proj``
[E, 2I, D], gate rows first, and ``experts.down_proj`` [E, D, I]); checkpoints and presets name
them per expert, so those two are assembled from the per-expert tensors. Everything else maps
name for name.
"""
from __future__ import annotations

import re

import torch

from ds4t.models.checkpoint import CheckpointError, parse_dtype
from ds4t.models.registry import preset_source

_FUSED = re.compile(r"(.*\.experts)\.(gate_up_proj|down_proj)$")


def _fused_experts(source, prefix: str, kind: str, shape, dtype, device) -> torch.Tensor:
    E = shape[0]
    out = torch.empty(shape, dtype=dtype, device=device)
    for e in range(E):
        p = f"{prefix}.{e}."
        if kind == "down_proj":
            out[e].copy_(source.get(p + "down_proj.weight", None, dtype, device))
        else:
            g = source.get(p + "gate_proj.weight", None, dtype, device)
            out[e, : g.shape[0]].copy_(g)
            out[e, g.shape[0]:].copy_(source.get(p + "up_proj.weight", None, dtype, device))
    return out


@torch.no_grad()
def hf_twin(preset: str, device="cpu", dtype=None, seed: int = 0):
    """An HF model with the preset's config and exactly the weights ``ds4t.load(preset,
    device=device, dtype=dtype, seed=seed)`` gets (same source, same device, so the same draws).

    dtype: default as ds4t.load (fp32 for tiny-*, bf16 otherwise); parameters HF keeps in fp32
    (e.g. DeepSeek's router) stay fp32. Returns the model in eval mode.
    """
    import transformers

    cfg, source = preset_source(preset, seed)
    dtype = parse_dtype(dtype) or (torch.float32 if preset.startswith("tiny-") else torch.bfloat16)
    device = torch.device(device)
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, t in model.state_dict().items():
        m = _FUSED.match(name)
        if m:
            src = _fused_experts(source, m.group(1), m.group(2), t.shape, t.dtype, device)
        elif name in source:
            src = source.get(name, None, t.dtype, device)
        elif name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        else:
            raise CheckpointError(f"hf_twin({preset!r}): HF tensor {name!r} has no counterpart in the preset")
        if tuple(src.shape) != tuple(t.shape):
            raise CheckpointError(f"hf_twin({preset!r}): {name!r} is {tuple(src.shape)} in the preset, "
                                  f"{tuple(t.shape)} in HF")
        t.copy_(src)
        del src
    return model.eval()
