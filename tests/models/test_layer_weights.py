"""Layer weights are typed dataclasses, and ``parameters()`` lists every tensor they hold exactly once
(so the model fingerprint and ``weight_bytes()`` see every weight, none twice)."""
import dataclasses
import re

import pytest
import torch

import ds4t
from ds4t.models.blocks import DenseMLP, Layer, MoEWeights
from ds4t.models.deepseek import MLAWeights
from ds4t.models.blocks import GQAAttentionWeights
from ds4t.models.glm import GlmAttentionWeights
from ds4t.models.qwen import GatedAttentionWeights, GatedDeltaNetWeights

MIXERS = {"tiny-qwen": (GatedDeltaNetWeights, GatedAttentionWeights), "tiny-glm": (GlmAttentionWeights,),
          "tiny-deepseek": (MLAWeights,), "tiny-llama": (GQAAttentionWeights,)}
FFNS = {"tiny-qwen": {MoEWeights}, "tiny-llama": {DenseMLP}}   # the others: {DenseMLP, MoEWeights}


def held_tensors(obj):
    """Every tensor a nested dataclass holds, walked here independently of ``parameters()``."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        return [t for f in dataclasses.fields(obj) for t in held_tensors(getattr(obj, f.name))]
    assert not isinstance(obj, (dict, list, tuple)), f"weights in a container the walk would miss: {obj!r}"
    return []


@pytest.mark.parametrize("name", sorted(MIXERS))
def test_parameters_list_every_layer_tensor_once(name):
    m = ds4t.load(name)
    # the decoder layers, then the MTP module's layer (index num_layers) when the preset has one
    assert len(m.layers) == m.num_layers + (m.mtp is not None)
    held = [m.embed, m.lm_head, m.final_norm, *m.input_norms, *m.post_norms]
    if m.mtp is not None:
        held += held_tensors(m.mtp)
    for layer in m.layers:
        assert isinstance(layer, Layer)
        assert isinstance(layer.mixer, MIXERS[name]) and isinstance(layer.ffn, (DenseMLP, MoEWeights))
        held += held_tensors(layer)
    distinct = list({id(t): t for t in held}.values())

    p = m.parameters()
    assert sorted(map(id, p.values())) == sorted(map(id, distinct))
    # No two listed tensors share memory either, so byte counts hold each weight once.
    storages = [t.untyped_storage().data_ptr() for t in p.values() if t.numel()]
    assert len(set(storages)) == len(storages)
    assert m.weight_bytes() == sum(t.numel() * t.element_size() for t in distinct)
    for k in p:
        assert re.fullmatch(r"embed|lm_head|final_norm|layers\.\d+\.(input_norm|post_norm|mixer\.\w+|ffn\.\w+)"
                            r"|mtp\.(input_norm|post_norm|layer\.(mixer|ffn)\.\w+|\w+)", k), k
    # The kinds each tiny preset holds (tiny-qwen has no dense MLP layer; tests/models/test_qwen.py covers one).
    assert {type(layer.mixer) for layer in m.layers} == set(MIXERS[name])
    assert {type(layer.ffn) for layer in m.layers} == FFNS.get(name, {DenseMLP, MoEWeights})


def test_routed_only_shares_the_tensors():
    """DeepSeek's ds4 path runs the routed experts from the same tensors, without the shared expert."""
    m = ds4t.load("tiny-deepseek")
    w = m.layers[1].ffn
    r = w.routed_only()
    assert w.shared_index is not None and r.shared_index is None and r.shared_gate_up is None
    assert all(getattr(r, f) is getattr(w, f) for f in ("router", "w_gate", "w_up", "w_down", "correction_bias"))
