"""Build tiny random HF checkpoints in a temp dir and run HF transformers as the oracle."""
from __future__ import annotations

import pytest
import torch

import ds4t


def perturb_(model, scale: float = 0.1, seed: int = 0) -> None:
    """Move every 1-D parameter/buffer away from its default (ones/zeros): mistakes must not hide."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if p.dim() == 1 and p.is_floating_point() and "inv_freq" not in name:
                p.add_(scale * torch.randn(p.shape, generator=g).to(p.dtype))


def save_tiny(model_cls, config, path, seed: int = 0, dtype=torch.float32, tweak=None):
    torch.manual_seed(seed)
    m = model_cls(config).to(dtype)
    perturb_(m, seed=seed)
    if tweak is not None:
        tweak(m)
    m.eval()
    m.save_pretrained(path)
    return m


@torch.no_grad()
def hf_prefill_and_decode(m, prompt, steps: int):
    """HF logits for the prompt (all positions) and ``steps`` greedy cached decode steps.

    Returns (prompt_logits [T, V], decode_logits [steps, V], decode_tokens [steps])."""
    ids = torch.tensor([prompt])
    out = m(input_ids=ids, use_cache=True)
    prompt_logits = out.logits[0].float()
    pkv = out.past_key_values
    tok = int(prompt_logits[-1].argmax())
    logits, toks = [], []
    for _ in range(steps):
        toks.append(tok)
        out = m(input_ids=torch.tensor([[tok]]), past_key_values=pkv, use_cache=True)
        pkv = out.past_key_values
        lg = out.logits[0, -1].float()
        logits.append(lg)
        tok = int(lg.argmax())
    return prompt_logits, torch.stack(logits), toks


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (logits scale); ds4t's logits may be on the GPU, HF's on the CPU."""
    a, b = a.float().cpu(), b.float().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def bias_tweak(shift=0.0, scale=0.3, seed=0):
    """Set every router's e_score_correction_bias to shift + scale·N(0,1) (negative values included)."""
    def tweak(m):
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for layer in m.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    b = gate.e_score_correction_bias
                    b.copy_((shift + scale * torch.randn(b.shape, generator=g)).to(b.dtype))
    return tweak


def check_against_hf(model, hf, prompt, steps, tol):
    """ds4t prefill logits (all positions) and ``steps`` cached greedy decode steps against HF,
    each within ``tol`` relative to the logit scale; returns (prefill err, decode err)."""
    want_prompt, want_steps, toks = hf_prefill_and_decode(hf, prompt, steps)
    s = model.new_session(max_ctx=64)
    err_p = rel_err(s.prefill(prompt, all_logits=True), want_prompt)
    got = [ds4t.eval_batch([ds4t.DecodeItem(s, t)]).logits[0] for t in toks]
    err_d = rel_err(torch.stack(got), want_steps)
    assert err_p < tol, f"prefill rel err {err_p:.2e}"
    assert err_d < tol, f"{steps} decode steps: rel err {err_d:.2e}"
    return err_p, err_d


def check_mtp_loading(tmp_path, family_module, ref_logits):
    """A checkpoint's MTP module: a partial one is a CheckpointError naming the missing tensor; with
    the config declaring none its tensors are skipped with one warning; a whole one loads into
    ``model.mtp`` without changing the main model's logits. ``tmp_path`` holds a saved checkpoint."""
    import json
    import warnings

    from safetensors.torch import save_file

    cfg = json.loads((tmp_path / "config.json").read_text())
    c = family_module.DeepseekConfig.from_dict(cfg) if hasattr(family_module, "DeepseekConfig") else \
        family_module.GlmConfig.from_dict(cfg)
    names = set(family_module.expected_tensors(c, mtp=True)) - set(family_module.expected_tensors(c, mtp=False))
    shapes = family_module.expected_tensors(c, mtp=True)
    g = torch.Generator().manual_seed(0)
    full = {n: (torch.ones(shapes[n]) if len(shapes[n]) == 1 else 0.1 * torch.randn(shapes[n], generator=g))
            for n in sorted(names)}
    eh = next(n for n in names if n.endswith("eh_proj.weight"))
    save_file({eh: full[eh]}, str(tmp_path / "model-mtp.safetensors"))
    with pytest.raises(ds4t.CheckpointError, match="missing tensor 'model.layers"):
        ds4t.load(str(tmp_path), dtype="fp32")
    save_file(full, str(tmp_path / "model-mtp.safetensors"))
    model = ds4t.load(str(tmp_path), dtype="fp32")
    assert model.mtp is not None and model.mtp_state_prefix == f"layers.{c.num_layers}."
    assert torch.equal(model.new_session(16).prefill([1, 2, 3]), ref_logits)
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, num_nextn_predict_layers=0)))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        model = ds4t.load(str(tmp_path), dtype="fp32")
    mtp = [str(x.message) for x in w if "multi-token-prediction" in str(x.message)]
    assert len(mtp) == 1 and model.mtp is None
    assert f"{len(names)} multi-token-prediction" in mtp[0] and f"model.layers.{c.num_layers}" in mtp[0], mtp[0]
    assert torch.equal(model.new_session(16).prefill([1, 2, 3]), ref_logits)
