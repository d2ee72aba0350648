"""Text handling: a checkpoint's tokenizer.json + chat template + EOS, and byte-level for presets."""
import json
import types

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ds4t.text import TextCodec, TokenizeError


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("ckpt")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello world héllo wörld"] * 20, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<eos>",
        "chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{{ eos_token }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    (d / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    return types.SimpleNamespace(name=str(d), vocab_size=320, tokenizer=Tokenizer.from_file(str(d / "tokenizer.json")))


def test_checkpoint_tokenizer_round_trip_and_streaming(checkpoint):
    codec = TextCodec.for_model(checkpoint)
    assert not codec.byte_level and codec.eos_ids == [0]
    text = "héllo wörld 日本"
    ids = codec.encode(text)
    assert codec.decode(ids) == text
    d = codec.detokenizer()
    pieces = [d.push(i) for i in ids] + [d.flush()]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    assert d.push(315) == ""  # an id past the tokenizer (padded vocabulary) renders as nothing


def test_chat_template_from_tokenizer_config(checkpoint):
    codec = TextCodec.for_model(checkpoint)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert codec.chat_prompt(msgs) == "[system]be brief<eos>[user]hi<eos>[assistant]"
    assert 0 in codec.encode(codec.chat_prompt(msgs), add_special_tokens=False)  # <eos> is one special token
    with pytest.raises(TokenizeError):
        codec.chat_prompt([{"content": "no role"}])


def test_byte_level_for_presets():
    codec = TextCodec.for_model(types.SimpleNamespace(name="tiny-qwen", vocab_size=256, tokenizer=None))
    assert codec.byte_level and codec.eos_ids == []
    assert codec.encode("hé") == [104, 195, 169] and codec.decode([104, 195, 169]) == "hé"
    assert codec.chat_prompt([{"role": "user", "content": "x"}]) == "<|user|>\nx\n<|assistant|>\n"
