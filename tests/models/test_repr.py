"""repr of a model names what a researcher needs at a glance; repr of a session its position and state."""
import pytest

import ds4t


@pytest.mark.parametrize("name, cls, family, option", [
    ("tiny-qwen", "QwenModel", "qwen3_next", None),
    ("tiny-deepseek", "DeepseekModel", "deepseek_v3", "native_path='ds4'"),
    ("tiny-glm", "GlmModel", "glm4_moe", "native_window=7"),
])
def test_model_repr(name, cls, family, option):
    opts = {"tiny-deepseek": {"native_path": "ds4"}, "tiny-glm": {"native_window": 7}}.get(name, {})
    m = ds4t.load(name, **opts)
    r = repr(m)
    assert r.startswith(f"{cls}(name={name!r}, family={family!r}, dtype=torch.float32, device={m.device.type}, ")
    for part in ("layers=2", "hidden_size=64", "vocab_size=256", "experts=8 (top 2)"):
        assert part in r
    expected = {"tiny-qwen": ["attention_products"], "tiny-deepseek": ["native_path"],
                "tiny-glm": ["native_window", "attention_products"]}[name]
    assert list(m.load_options()) == expected
    if option:
        assert option in r
    if "attention_products" in expected:
        assert "attention_products='split'" in r


def test_repr_follows_an_option_changed_after_load():
    m = ds4t.load("tiny-glm")
    m.native_window = 5
    assert "native_window=5" in repr(m)


def test_session_repr():
    m = ds4t.load("tiny-qwen")
    s = m.new_session(16)
    s.prefill([1, 2, 3])
    assert repr(s) == f"Session(model='tiny-qwen', slot={s.slot}, pos=3, max_ctx=16, closed=False)"
    s.close()
    assert repr(s).endswith("closed=True)")
