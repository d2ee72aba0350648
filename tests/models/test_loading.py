"""Checkpoint loading: sharded safetensors, dtype casts, clear errors, tokenizer pickup, presets,
progress bar. Tiny HF Qwen3-Next checkpoints are built here with save_pretrained."""
import json
import os
import re
import shutil

import pytest
import torch

import ds4t
from tests.models.hf_oracle import rel_err, save_tiny

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPT = [3, 17, 250, 42, 9]


def tiny_config():
    # Two layers (one of each mixer) keep the Triton-interpreter forward passes short.
    return transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
        norm_topk_prob=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        initializer_range=0.1)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(hf_model, single-file dir, sharded dir) of one fp32 tiny model."""
    single = tmp_path_factory.mktemp("single")
    sharded = tmp_path_factory.mktemp("sharded")
    hf = save_tiny(transformers.Qwen3NextForCausalLM, tiny_config(), single, seed=5)
    hf.save_pretrained(sharded, max_shard_size="20KB")
    return hf, str(single), str(sharded)


@pytest.fixture
def ckpt(ckpts, tmp_path):
    """A private copy of the single-file checkpoint, free to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(ckpts[1], d)
    return str(d)


def _params(model):
    return model.parameters()


# -- 1. sharded == single-file == HF -----------------------------------------------------------

def test_sharded_matches_single_file_and_hf(ckpts):
    hf, single, sharded = ckpts
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    shards = [f for f in os.listdir(sharded) if f.endswith(".safetensors")]
    assert len(shards) >= 3, shards
    assert not os.path.exists(os.path.join(single, "model.safetensors.index.json"))
    assert [f for f in os.listdir(single) if f.endswith(".safetensors")] == ["model.safetensors"]

    a = ds4t.load(single, dtype="fp32")
    b = ds4t.load(sharded, dtype="fp32")
    pa, pb = _params(a), _params(b)
    assert pa.keys() == pb.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    la = a.new_session(max_ctx=16).prefill(PROMPT, all_logits=True)
    lb = b.new_session(max_ctx=16).prefill(PROMPT, all_logits=True)
    assert torch.equal(la, lb)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([PROMPT])).logits[0].float()
    assert rel_err(la, want) < 1e-4


# -- 2. dtype at load --------------------------------------------------------------------------

def _weights(model):
    p = _params(model)
    return [p["embed"], p["lm_head"], p["layers.0.mixer.w_in"], p["layers.1.mixer.w_qkv"]]


@pytest.mark.parametrize("name,want", [("bf16", torch.bfloat16), ("fp16", torch.float16),
                                       (torch.bfloat16, torch.bfloat16)])
def test_load_casts_fp32_checkpoint(ckpts, name, want):
    single = ckpts[1]
    assert ds4t.load(single).dtype == torch.float32  # checkpoint default
    m = ds4t.load(single, dtype=name)
    assert m.dtype == want
    assert all(t.dtype == want for t in _weights(m))
    # cast values, not re-drawn ones
    ref = _params(ds4t.load(single, dtype="fp32"))
    assert torch.equal(_params(m)["embed"], ref["embed"].to(want))


def test_load_bf16_checkpoint_as_fp32(tmp_path):
    save_tiny(transformers.Qwen3NextForCausalLM, tiny_config(), tmp_path, seed=6, dtype=torch.bfloat16)
    sd = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    assert sd["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert ds4t.load(str(tmp_path)).dtype == torch.bfloat16  # checkpoint default
    m = ds4t.load(str(tmp_path), dtype=torch.float32)
    assert m.dtype == torch.float32
    assert all(t.dtype == torch.float32 for t in _weights(m))
    assert torch.equal(_params(m)["embed"].cpu(), sd["model.embed_tokens.weight"].float())


@pytest.mark.parametrize("bad", ["int8", "float64", torch.float64, torch.int8])
def test_bad_dtype(ckpts, bad):
    with pytest.raises(ds4t.CheckpointError, match=re.escape(str(bad))):
        ds4t.load(ckpts[1], dtype=bad)


# -- 3. clear errors ---------------------------------------------------------------------------

def _rewrite(path, fn):
    f = os.path.join(path, "model.safetensors")
    sd = safetensors_torch.load_file(f)
    fn(sd)
    safetensors_torch.save_file(sd, f)


def _edit_config(path, fn):
    f = os.path.join(path, "config.json")
    cfg = json.load(open(f))
    fn(cfg)
    json.dump(cfg, open(f, "w"))


def test_missing_tensor(ckpt):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite(ckpt, lambda sd: sd.pop(name))
    with pytest.raises(ds4t.CheckpointError, match=f"missing tensor '{re.escape(name)}'"):
        ds4t.load(ckpt)


def test_wrong_shape(ckpt):
    name = "model.layers.0.linear_attn.out_proj.weight"

    def fn(sd):
        sd[name] = sd[name][:, :-1].contiguous()
    _rewrite(ckpt, fn)
    with pytest.raises(ds4t.CheckpointError, match=re.escape(f"'{name}' has shape (64, 63)") + ".*64, 64"):
        ds4t.load(ckpt)


def test_unexpected_tensor(ckpt):
    name = "model.layers.0.mlp.extra_proj.weight"

    def fn(sd):
        sd[name] = torch.zeros(4, 4)
    _rewrite(ckpt, fn)
    with pytest.raises(ds4t.CheckpointError, match=f"unexpected tensor '{re.escape(name)}'"):
        ds4t.load(ckpt)


def test_config_missing(ckpt):
    os.remove(os.path.join(ckpt, "config.json"))
    with pytest.raises(ds4t.CheckpointError, match="no config.json"):
        ds4t.load(ckpt)


@pytest.mark.parametrize("text, match", [
    ('{"model_type": "qwen3_next",', "config.json: invalid JSON"),
    ("[1, 2]", "config.json: should hold a JSON object, got list"),
])
def test_config_that_is_not_a_json_object(ckpt, text, match):
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        f.write(text)
    with pytest.raises(ds4t.CheckpointError, match=match):
        ds4t.load(ckpt)


@pytest.mark.parametrize("edit, detail", [
    (lambda c: c.update(layer_types=["full_attention"]), "layer_types ['full_attention'] must list"),
    (lambda c: c.pop("vocab_size"), "missing field 'vocab_size'"),
    (lambda c: c.update(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method 'gptq'"),
])
def test_config_errors_name_the_file_they_came_from(ckpt, edit, detail):
    """A family's config check and the quantization settings raise ConfigError, which names the field only
    ("config.json: ..."); load names the file the config came from. Control: the error caught is the load's
    CheckpointError with the directory's path, not the ConfigError itself."""
    _edit_config(ckpt, edit)
    with pytest.raises(ds4t.CheckpointError) as e:
        ds4t.load(ckpt)
    assert str(e.value).startswith(os.path.join(ckpt, "config.json") + ": ") and detail in str(e.value)
    assert type(e.value) is ds4t.CheckpointError


def test_config_error_says_config_json_outside_load():
    from ds4t.models.checkpoint import ConfigError, require
    with pytest.raises(ConfigError, match="^config.json: missing field 'hidden_size'$") as e:
        require({}, "hidden_size", int)
    assert e.value.detail == "missing field 'hidden_size'" and isinstance(e.value, ds4t.CheckpointError)


@pytest.mark.parametrize("field", ["num_hidden_layers", "hidden_size", "linear_key_head_dim"])
def test_config_missing_field(ckpt, field):
    _edit_config(ckpt, lambda c: c.pop(field))
    with pytest.raises(ds4t.CheckpointError, match=f"missing field '{field}'"):
        ds4t.load(ckpt)


@pytest.mark.parametrize("path, value, match", [
    (("num_hidden_layers",), "two", r"field 'num_hidden_layers' = 'two' should be an integer in \[1, 16777216\]"),
    (("num_hidden_layers",), True, "field 'num_hidden_layers' = True should be an integer"),
    (("num_hidden_layers",), 10 ** 12, "field 'num_hidden_layers' = 1000000000000 should be an integer"),
    (("head_dim",), -16, "field 'head_dim' = -16 should be an integer"),
    (("max_position_embeddings",), 1.5, "field 'max_position_embeddings' = 1.5 should be an integer"),
    (("rms_norm_eps",), "tiny", "field 'rms_norm_eps' = 'tiny' should be a finite number > 0"),
    (("tie_word_embeddings",), "no", "field 'tie_word_embeddings' = 'no' should be true or false"),
    (("rope_parameters", "rope_theta"), [1e4], r"field 'rope_parameters.rope_theta' = \[10000.0\] should be a finite"),
    (("rope_parameters", "partial_rotary_factor"), 2, "'rope_parameters.partial_rotary_factor' = 2 should be a number"),
    (("rope_parameters",), "default", "field 'rope_parameters' = 'default' should be an object"),
    (("layer_types",), 2, "field 'layer_types' = 2 should be a list of strings"),
    (("num_experts_per_tok",), None, r"num_experts_per_tok 0 must be in \[1, num_experts = 4\]"),
])
def test_config_field_of_the_wrong_kind(ckpt, path, value, match):
    """A config value of the wrong kind is a CheckpointError naming the field (before: TypeError or
    ValueError deep in the model, a layer count of 10**12 building its name table until the process was
    killed)."""
    def edit(c):
        d = c
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = value
    _edit_config(ckpt, edit)
    with pytest.raises(ds4t.CheckpointError, match=match):
        ds4t.load(ckpt)


def test_a_family_config_error_names_the_checkpoints_config(ckpt):
    """The families' own config checks (layer types, head divisibility) name the file's path, not a bare
    "config.json"."""
    _edit_config(ckpt, lambda c: c.update(layer_types=["full_attention"]))
    with pytest.raises(ds4t.CheckpointError) as e:
        ds4t.load(ckpt)
    assert str(e.value).startswith(os.path.join(str(ckpt), "config.json") + ": layer_types")


def test_null_config_fields_take_the_defaults(ckpt):
    """null is an absent field (HF writes null for unset optional fields): the model loads and runs."""
    _edit_config(ckpt, lambda c: c.update(max_position_embeddings=None, rms_norm_eps=None, head_dim=None,
                                          num_key_value_heads=2))
    model = ds4t.load(ckpt)
    assert model.max_position == 4096
    model.new_session(8).prefill([1, 2])


def test_more_layers_in_the_config_than_in_the_checkpoint(ckpt):
    _edit_config(ckpt, lambda c: c.update(num_hidden_layers=9, layer_types=["linear_attention"] * 9))
    with pytest.raises(ds4t.CheckpointError, match=r"missing tensor 'model.layers.8.input_layernorm.weight' "
                                                   r"\(num_hidden_layers is 9; the checkpoint has tensors of 2 layers\)"):
        ds4t.load(ckpt)


def test_unsupported_model_type(ckpt):
    _edit_config(ckpt, lambda c: c.update(model_type="gpt_neox"))
    with pytest.raises(ds4t.CheckpointError, match=r"model_type 'gpt_neox' is not supported \(supported: .*'llama'"):
        ds4t.load(ckpt)


def test_neither_dir_nor_preset(tmp_path):
    bogus = str(tmp_path / "no-such-model")
    with pytest.raises(ds4t.CheckpointError, match="neither a checkpoint directory, a .gguf file nor a preset"):
        ds4t.load(bogus)
    with pytest.raises(ds4t.CheckpointError, match="'tiny-mamba' is neither"):
        ds4t.load("tiny-mamba")


def test_index_names_missing_shard(ckpts, tmp_path):
    d = tmp_path / "sharded"
    shutil.copytree(ckpts[2], d)
    shard = sorted(json.load(open(d / "model.safetensors.index.json"))["weight_map"].values())[-1]
    os.remove(d / shard)
    with pytest.raises(ds4t.CheckpointError, match=f"names shard '{re.escape(shard)}', which is missing"):
        ds4t.load(str(d))


# -- 4. tokenizer.json -------------------------------------------------------------------------

def test_tokenizer_pickup(ckpt):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world", "hello there", "the world is wide", "low lower lowest"] * 4,
                            trainer=trainer)
    assert ds4t.load(ckpt).tokenizer is None
    tok.save(os.path.join(ckpt, "tokenizer.json"))
    got = ds4t.load(ckpt).tokenizer
    assert isinstance(got, Tokenizer)
    text = "hello wide world!"
    ids = got.encode(text).ids
    assert ids == tok.encode(text).ids and len(ids) < len(text.encode())  # merges were learned
    assert got.decode(ids) == text


@pytest.mark.parametrize("text", ['{"version": "1.0", "model": 5', '{"model": {"type": "BPE", "vocab": 3}}'])
def test_a_broken_tokenizer_json_is_a_clear_error(ckpt, text):
    with open(os.path.join(ckpt, "tokenizer.json"), "w") as f:
        f.write(text)
    with pytest.raises(ds4t.CheckpointError, match=r"tokenizer.json: not a readable tokenizer"):
        ds4t.load(ckpt)


@pytest.mark.parametrize("kw, match", [
    (dict(device="tpu9"), "device 'tpu9' is not a device"),
    (dict(seed="x"), "seed must be an int, got 'x'"),
] + ([] if torch.cuda.is_available() else [(dict(device="cuda"), "device 'cuda': this machine has no CUDA GPU")]))
def test_bad_load_arguments_are_clear_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        ds4t.load("tiny-qwen", **kw)


# -- 5. presets --------------------------------------------------------------------------------

def test_preset_is_deterministic():
    a, b = _params(ds4t.load("tiny-qwen")), _params(ds4t.load("tiny-qwen"))
    assert a.keys() == b.keys() and len(a) > 5
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = _params(ds4t.load("tiny-qwen", seed=1))
    assert not torch.equal(a["embed"], c["embed"])


def test_presets_listed():
    assert {"tiny-qwen", "tiny-deepseek", "tiny-glm", "qwen3-next-80b-4l", "deepseek-v3-4l",
            "glm-4.5-4l"} <= set(ds4t.presets())


def test_full_size_preset_on_meta():
    m = ds4t.load("qwen3-next-80b-4l", device="meta")
    assert m.dtype == torch.bfloat16
    assert all(t.device.type == "meta" for t in _params(m).values())
    # 14.4e9 for the 4 decoder layers, stack and LM head, + 3.3e9 for the MTP module (one more layer
    # and its eh_proj; it shares the embedding and the LM head)
    assert m.mtp is not None
    assert m.weight_bytes() == pytest.approx(17.7e9, rel=0.01)
    assert sum(t.numel() * t.element_size() for k, t in m.parameters().items()
               if not k.startswith("mtp.")) == pytest.approx(14.4e9, rel=0.01)


# -- 6. progress bar ---------------------------------------------------------------------------

def test_progress_bar(ckpts, capsys):
    ds4t.load(ckpts[1], progress=True)
    err = capsys.readouterr().err
    assert "loading weights" in err and "tensor" in err
    ds4t.load(ckpts[1], progress=False)
    assert "loading weights" not in capsys.readouterr().err



def _load_peak(family: str) -> float:
    """Peak bytes allocated while a MoE config of ``family``'s structure (2 layers, 32 experts of 256 x 256, fp32)
    loads on the CPU, over the loaded weights' bytes: from the allocator's events (torch.profiler), not RSS."""
    from torch.profiler import ProfilerActivity, profile

    from ds4t.models.blocks import MoEWeights
    from ds4t.models.registry import _preset_configs
    from ds4t.testing.parallel import config_model

    cfg = dict(_preset_configs()[family])
    cfg.update(hidden_size=256, moe_intermediate_size=256, n_routed_experts=32, num_experts=32, num_hidden_layers=2)
    for key, value in (("first_k_dense_replace", 1), ("shared_expert_intermediate_size", 256)):
        if key in cfg:
            cfg[key] = value
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = config_model(cfg)
    moe = [lw.ffn for lw in model.layers if isinstance(lw.ffn, MoEWeights)]
    assert moe and all(w.shared_index == 32 and w.shared_gate_up is None for w in moe)   # the shared one fused
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    held = sum(t.numel() * t.element_size() for t in model.parameters().values())
    return peak / held


@pytest.mark.parametrize("family", ["tiny-deepseek", "tiny-qwen"])
def test_experts_load_without_a_second_copy(family, monkeypatch):
    """A MoE layer's experts (and its shared expert, fused in as expert E) load into their stacks as they are
    read: the allocator's peak ~ the weights. Control: stacking a list of the experts, then appending the shared
    expert, peaks at 1.3-1.5x."""
    from ds4t.kernels.weights import stack
    from ds4t.models.loading import WeightReader

    assert _load_peak(family) < 1.1   # measured 1.015-1.02
    monkeypatch.setattr(WeightReader, "_stack_in_place", lambda self, names, tail: stack([self(n) for n in names]))
    assert _load_peak(family) > 1.2   # measured 1.32-1.47


def test_meta_joins_are_torchs_shapes_without_its_meta_decompositions():
    """weights.cat / stack of meta tensors give torch.cat / torch.stack's shape and dtype from the shapes alone, and
    mismatches raise as torch does. A Qwen3-Next-80B load on meta (``serve --device meta --plan-only``) then never
    imports torch._dynamo, which torch's meta cat and stack do on first use (~2 s a planning process). Control: a
    torch.cat of meta tensors in the same fresh process imports it."""
    import subprocess
    import sys

    from ds4t.kernels import weights as W

    a, b = torch.empty(4, 8, device="meta"), torch.empty(2, 8, device="meta")
    for got, want in [(W.cat([a, b]), (6, 8)), (W.cat([a, a], dim=1), (4, 16)), (W.cat([a, a], dim=-1), (4, 16)),
                      (W.stack([a, a, a]), (3, 4, 8))]:
        assert got.is_meta and tuple(got.shape) == want and got.dtype == a.dtype
    with pytest.raises(RuntimeError):
        W.cat([a, torch.empty(2, 7, device="meta")])
    with pytest.raises(RuntimeError):
        W.stack([a, b])
    with pytest.raises(IndexError):   # a dim past the tensors' own, as torch.cat refuses it
        W.cat([a, a], dim=2)
    assert W.cat([a, b.half()]).dtype == torch.cat([a, b.half()]).dtype   # mixed dtypes: torch's promotion
    code = ("import sys, torch, ds4t\nds4t.load('qwen3-next-80b', device='meta')\nbefore = 'torch._dynamo' in sys.modules\n"
            "torch.cat([torch.empty(2, device='meta')] * 2)\nprint(before, 'torch._dynamo' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split()[-2:] == ["False", "True"], p.stdout
