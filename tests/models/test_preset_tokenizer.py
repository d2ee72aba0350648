"""The presets' byte-level tokenizer: id = UTF-8 byte, deterministic, and the server's text handling
of a preset unchanged by it (same ids as its byte fallback, same text)."""
import random

import pytest

import ds4t
from ds4t.models.tokenizer import preset_tokenizer
from ds4t.text import TextCodec

TEXTS = ["hello", "", " two  spaces\tand\nlines\r\n", "héllo wörld ✓ 漢字 🙂", "<|eos|> [CLS] \x00\x7f"]


@pytest.fixture(scope="module")
def model():
    return ds4t.load("tiny-qwen")


@pytest.mark.parametrize("text", TEXTS)
def test_ids_are_the_utf8_bytes(model, text):
    tok = model.tokenizer
    ids = tok.encode(text).ids
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_every_byte_is_one_token_and_big_ids_decode_to_nothing():
    tok = preset_tokenizer(151936)
    assert tok.get_vocab_size() == 256
    assert sorted(tok.get_vocab().values()) == list(range(256))
    assert tok.decode([104, 300, 105, 151935]) == "hi"


def test_built_in_process_and_deterministic():
    assert preset_tokenizer(256).to_str() == preset_tokenizer(256).to_str()
    assert preset_tokenizer(255) is None  # 256 byte ids do not fit


def test_every_tiny_preset_has_one():
    for name in ("tiny-deepseek", "tiny-glm"):
        assert ds4t.load(name).tokenizer.encode("ok").ids == [111, 107]


def test_server_text_is_unchanged_for_presets(model):
    """The server's codec now uses the tokenizer; ids and final text equal its byte-level fallback."""
    codec, fallback = TextCodec.for_model(model), TextCodec(model.vocab_size)
    assert not codec.byte_level and fallback.byte_level
    for text in TEXTS:
        assert codec.encode(text) == fallback.encode(text)
    rng = random.Random(0)
    for _ in range(20):  # random generations, invalid UTF-8 included
        ids = [rng.randrange(256) for _ in range(rng.randint(1, 12))]
        streams = []
        for c in (codec, fallback):
            d = c.detokenizer()
            text = "".join(d.push(i) for i in ids) + d.flush()
            streams.append(text)
        assert streams[0] == streams[1] == fallback.decode(ids) == codec.decode(ids)
