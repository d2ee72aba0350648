"""GGUF loading (ds4t.models.gguf): synthetic llama / qwen3 files written as llama.cpp's converter
writes them, against HF transformers running the weights the file holds (dequantized, q/k rows
un-permuted); split files; the tokenizer and chat template from the metadata; clear errors."""
import logging

import numpy as np
import pytest
import torch

import ds4t
from ds4t.text import TextCodec
from tests.models.gguf_files import add_spm_tokenizer, converter_permute, write_gguf
from tests.models.hf_oracle import check_against_hf, perturb_

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")


def tiny_llama(seed=1, **over):
    cfg = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
               initializer_range=0.1, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    cfg.update(over)
    torch.manual_seed(seed)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    perturb_(m, seed=seed)
    return m


def oracle(hf, held):
    """HF on exactly the weights the file holds."""
    sd = {k: v.to(hf.dtype) for k, v in held.items()}
    hf.load_state_dict(sd, strict=False)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return hf


def test_permutation_round_trip():
    """ds4t's un-permute inverts the converter's permute (as llama.cpp writes it), for q and GQA k."""
    from ds4t.models.gguf import permute_rows, unpermute_rows

    w = torch.randn(4 * 16, 7)
    for heads, kv in ((4, None), (4, 2)):
        n = kv or heads
        rows = w[: n * 16]
        p = torch.from_numpy(converter_permute(rows.numpy(), heads, kv))
        assert torch.equal(unpermute_rows(p, n), rows)
        assert torch.equal(permute_rows(rows, n), p)
    b = torch.randn(32)
    assert torch.equal(unpermute_rows(torch.from_numpy(converter_permute(b.numpy(), 2)), 2), b)


# name -> (model overrides, gguf types, decode steps)
FILES = {
    "f32-untied": ({}, {}, 8),
    "q8_0-q4_1-tied-bias": (dict(tie_word_embeddings=True, attention_bias=True),
                           {"matrix": "Q4_1", "embed": "Q8_0"}, 4),
    "f16-bf16-q4_0": (dict(num_key_value_heads=1), {"matrix": "Q4_0", "embed": "BF16", "norm": "F16"}, 4),
}


@pytest.mark.parametrize("name", sorted(FILES))
def test_llama_gguf_matches_hf_on_the_weights_it_holds(tmp_path, name, caplog):
    over, types, steps = FILES[name]
    hf = tiny_llama(**over)
    held = write_gguf(hf, tmp_path / "m.gguf", types=types)
    with caplog.at_level(logging.INFO, logger="ds4t.gguf"):
        model = ds4t.load(str(tmp_path / "m.gguf"))
    assert model.family == "llama" and model.dtype == torch.float32
    assert model.cfg.tie_embeddings == bool(over.get("tie_word_embeddings"))
    lines = [r.getMessage() for r in caplog.records if r.name == "ds4t.gguf"]
    quantized = sorted({t for t in types.values() if t.startswith("Q")})
    if quantized:   # matrices of a kernel type kept as blocks, a quantized embedding dequantized
        assert len(lines) == 1 and all(q in lines[0] for q in quantized), lines
        assert ("kept " + types["matrix"]) in lines[0]
        assert ("dequantized" in lines[0]) == types.get("embed", "F32").startswith("Q"), lines
    else:
        assert lines == []
    prompt = [int(t) for t in torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(2))]
    check_against_hf(model, oracle(hf, held), prompt, steps, 1e-4)


def test_qwen3_gguf_is_not_permuted(tmp_path):
    torch.manual_seed(3)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.1,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000.0})).eval()
    perturb_(hf, seed=3)
    held = write_gguf(hf, tmp_path / "q.gguf", arch="qwen3", types={"matrix": "Q8_0"})
    model = ds4t.load(str(tmp_path / "q.gguf"))
    assert model.family == "qwen3" and model.cfg.qk_norm
    check_against_hf(model, oracle(hf, held), [5, 6, 7, 8], 3, 1e-4)


def test_split_files_load_like_one(tmp_path):
    hf = tiny_llama()
    write_gguf(hf, tmp_path / "one.gguf", types={"matrix": "Q8_0"})
    write_gguf(hf, tmp_path / "split.gguf", types={"matrix": "Q8_0"}, split_max_tensors=7)
    parts = sorted(p.name for p in tmp_path.glob("split-*.gguf"))
    assert len(parts) > 2 and parts[0] == f"split-00001-of-{len(parts):05d}.gguf"
    a = ds4t.load(str(tmp_path / "one.gguf")).new_session(16).prefill([1, 2, 3], all_logits=True)
    b = ds4t.load(str(tmp_path / parts[0])).new_session(16).prefill([1, 2, 3], all_logits=True)
    assert torch.equal(a, b)
    (tmp_path / parts[-1]).unlink()
    with pytest.raises(ds4t.CheckpointError, match=f"split GGUF part '{parts[-1]}' is missing"):
        ds4t.load(str(tmp_path / parts[0]))


def test_tokenizer_and_chat_template_from_metadata(tmp_path):
    write_gguf(tiny_llama(), tmp_path / "m.gguf")
    model = ds4t.load(str(tmp_path / "m.gguf"))
    codec = TextCodec.for_model(model)
    assert codec.eos_ids == [255] and not codec.byte_level
    ids = codec.encode("hello world<|end|>")
    assert ids[:3] == [1, 2, ord("o")] and 3 in ids and ids[-1] == 255   # merges "he", "ll", "Ġw"; control token whole
    assert codec.decode(ids) == "hello world"
    prompt = codec.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<user>hi<|end|><assistant>"
    out = ds4t.generate(model, ["hello"], max_new_tokens=3)
    assert isinstance(out[0].text, str) and len(out[0].tokens) >= 1


def _byte_level_meta(pre: str, add_bos: bool = True) -> dict:
    """tokenizer.* metadata of a byte-level vocabulary: the 256 byte symbols, then a control BOS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    syms = list(bytes_to_unicode().values())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": syms + ["<s>"],
            "tokenizer.ggml.token_type": [1] * 256 + [3], "tokenizer.ggml.merges": [],
            "tokenizer.ggml.bos_token_id": 256, "tokenizer.ggml.add_bos_token": add_bos}


def _pieces(pre: str, text: str):
    from ds4t.models.gguf import build_tokenizer
    tok, _ = build_tokenizer(_byte_level_meta(pre), "m.gguf")
    return [text[a:b] for _, (a, b) in tok.pre_tokenizer.pre_tokenize_str(text)]


@pytest.mark.parametrize("pre,text,want", [
    # the pre-tokenizers of the issue's architectures, as llama.cpp's llama-vocab.cpp splits
    ("qwen2", "abc 12345", ["abc", " ", "1", "2", "3", "4", "5"]),                 # Qwen3-Next: single digits
    ("llama-bpe", "abc 12345", ["abc", " ", "123", "45"]),                          # control: digit triples
    ("glm4", "abc 12345", ["abc", " ", "123", "45"]),                               # GLM-4.5: llama3's
    ("deepseek-v3", "日本語abc 12345", ["日本語", "abc", " ", "123", "45"]),         # DeepSeek-V3: CJK runs apart
    ("llama-bpe", "日本語abc", ["日本語abc"]),                                       # control: one letter run
    ("gpt2", "abc 12345", ["abc", " 12345"]),
])
def test_pre_tokenizer_splits_as_llama_cpp(pre, text, want):
    assert _pieces(pre, text) == want


def test_glm_vocabulary_gets_no_bos():
    """llama.cpp gives GLM-4's vocabulary no BOS (its chat template writes [gMASK]<sop>): add_bos_token is
    ignored there, honoured elsewhere."""
    from ds4t.models.gguf import build_tokenizer
    glm, _ = build_tokenizer(_byte_level_meta("glm4"), "m.gguf")
    other, _ = build_tokenizer(_byte_level_meta("llama-bpe"), "m.gguf")
    assert glm.encode("hi").ids[0] != 256 and other.encode("hi").ids[0] == 256


def test_no_tokenizer_metadata_means_no_tokenizer(tmp_path):
    write_gguf(tiny_llama(), tmp_path / "m.gguf", tokenizer=False)
    assert ds4t.load(str(tmp_path / "m.gguf")).tokenizer is None


def _rewrite(src, dst, arch=None, drop=(), meta_drop=(), rename=None, meta_set=None):
    """Copy a GGUF file, changing its architecture, dropping tensors or metadata keys, renaming tensors,
    setting metadata values (``meta_set``: key -> value of the key's own type)."""
    r = gguf.GGUFReader(str(src))
    arch = arch or r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in meta_drop:
            continue
        v = (meta_set or {}).get(k, f.contents())
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, v, vt, sub_type=f.types[-1])
        else:
            w.add_key_value(k, v, vt)
    for t in r.tensors:
        if t.name in drop:
            continue
        name = (rename or {}).get(t.name, t.name)
        quantized = t.tensor_type not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)
        w.add_tensor(name, np.array(t.data), raw_dtype=t.tensor_type if quantized else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_errors_name_the_problem(tmp_path):
    src = tmp_path / "m.gguf"
    write_gguf(tiny_llama(), src, types={"matrix": "Q8_0"}, tokenizer=False)
    _rewrite(src, tmp_path / "arch.gguf", arch="mamba")
    with pytest.raises(ds4t.CheckpointError, match=r"architecture 'mamba' is not supported \(supported: \['llama', 'qwen3', 'qwen3next', 'deepseek2', 'glm4moe'\]\)"):
        ds4t.load(str(tmp_path / "arch.gguf"))
    _rewrite(src, tmp_path / "miss.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ds4t.CheckpointError, match=r"missing tensor 'blk.1.ffn_up.weight' \(model.layers.1.mlp.up_proj.weight\)"):
        ds4t.load(str(tmp_path / "miss.gguf"))
    _rewrite(src, tmp_path / "extra.gguf", rename={"blk.1.ffn_up.weight": "blk.1.ffn_up_exps.weight"})
    with pytest.raises(ds4t.CheckpointError, match="tensor 'blk.1.ffn_up_exps.weight' has no place in a llama model"):
        ds4t.load(str(tmp_path / "extra.gguf"))
    _rewrite(src, tmp_path / "meta.gguf", meta_drop=("llama.embedding_length",))
    with pytest.raises(ds4t.CheckpointError, match="missing metadata 'llama.embedding_length'"):
        ds4t.load(str(tmp_path / "meta.gguf"))
    (tmp_path / "bad.gguf").write_bytes(b"GGUX" + bytes(64))
    with pytest.raises(ds4t.CheckpointError, match="not a readable GGUF file"):
        ds4t.load(str(tmp_path / "bad.gguf"))
    with pytest.raises(ds4t.CheckpointError, match="no such GGUF file"):
        ds4t.load(str(tmp_path / "absent.gguf"))


@pytest.mark.parametrize("key, value, match", [
    ("llama.block_count", 10 ** 7, r"metadata 'llama.block_count' = 10000000 but the file's tensors are blocks 0\.\.1 "),
    ("llama.block_count", 1, r"metadata 'llama.block_count' = 1 but the file's tensors are blocks 0\.\.1 \(2 blocks\)"),
    ("llama.embedding_length", 10 ** 9,
     r"field 'hidden_size' \(metadata 'llama.embedding_length'\) = 1000000000 should be an integer in"),
    ("llama.rope.freq_base", -1.0,
     r"field 'rope_parameters.rope_theta' \(metadata 'llama.rope.freq_base'\) = -1.0 should be a finite number > 0"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"),
     r"field 'rms_norm_eps' \(metadata 'llama.attention.layer_norm_rms_epsilon'\) = nan should be a finite number"),
    ("llama.attention.head_count", 5, r"num_attention_heads 5 not a multiple of num_key_value_heads"),
])
def test_metadata_values_out_of_range_are_clear_errors(tmp_path, key, value, match):
    """Metadata of the right type but an impossible value: a CheckpointError naming the file, at once (a
    layer count of 10**7 is caught before a table of every layer is built)."""
    src = tmp_path / "m.gguf"
    write_gguf(tiny_llama(), src, types={"matrix": "Q8_0"}, tokenizer=False)
    _rewrite(src, tmp_path / "bad.gguf", meta_set={key: value})
    with pytest.raises(ds4t.CheckpointError, match=r"bad\.gguf: " + match):
        ds4t.load(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("keep", [0.5, 0.9, 100])
def test_a_truncated_file_is_a_clear_error(tmp_path, keep):
    """A download cut short: a clear CheckpointError naming the file, never a model with missing weights."""
    src = tmp_path / "m.gguf"
    write_gguf(tiny_llama(), src, types={"matrix": "Q8_0"}, tokenizer=False)
    data = src.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)] if keep < 1 else data[:keep])
    with pytest.raises(ds4t.CheckpointError, match=r"cut\.gguf: not a readable GGUF file"):
        ds4t.load(str(cut))


# ----------------------------------------------------------------------------- SentencePiece ("llama") vocabularies

_SPM_PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "i", "n", "g", "s", "a", "é", "he", "ll", "▁w", "or",
               "ld", "in", "ing", "▁t", "▁the", "▁a", "llo", "hello", "▁hello", "▁wor", "▁world", "th", "▁s", "er",
               "▁is", "is", "▁▁", "▁in"]


def _spm_meta(add_bos=None):
    """A SentencePiece vocabulary as llama.cpp's converter writes it: <unk>, <s>, </s>, the 256 byte tokens,
    then pieces with scores (not in score order, so ranks are not positions)."""
    import random
    rng = random.Random(5)
    pieces = list(_SPM_PIECES)
    scores = [-float(i) for i in range(len(pieces))]
    rng.shuffle(scores)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": [0.0, 0.0, 0.0] + [0.0] * 256 + scores,
            "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(pieces),
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0}
    if add_bos is not None:
        meta["tokenizer.ggml.add_bos_token"] = add_bos
    return meta


def _llama_cpp_spm(meta, text):
    """llama.cpp's SPM tokenizer (llm_tokenizer_spm_session), written out: the reference."""
    import heapq
    tokens, scores = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"]
    ids = {t: i for i, t in enumerate(tokens) if meta["tokenizer.ggml.token_type"][i] in (1, 4)}
    text = (" " + text if text else text).replace(" ", "▁")
    sym = [[c, i - 1, i + 1] for i, c in enumerate(text)]     # text, prev, next
    if sym:
        sym[-1][2] = -1
    heap = []

    def add(left, right):
        if left < 0 or right < 0:
            return
        t = sym[left][0] + sym[right][0]
        if t in ids:
            heapq.heappush(heap, (-scores[ids[t]], left, right, len(t)))

    for i in range(1, len(sym)):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if not sym[left][0] or not sym[right][0] or len(sym[left][0]) + len(sym[right][0]) != size:
            continue
        sym[left][0] += sym[right][0]
        sym[right][0] = ""
        sym[left][2] = sym[right][2]
        if sym[right][2] >= 0:
            sym[sym[right][2]][1] = left
        add(sym[left][1], left)
        add(left, sym[left][2])
    # every merged symbol is a token (a bigram is queued only if its text is one); what is left unmerged
    # and not a token is emitted as its UTF-8 byte tokens (llama.cpp's resegment)
    out, i = [], 0 if sym else -1
    while i != -1:
        t = sym[i][0]
        out.extend([ids[t]] if t in ids else [tokens.index(f"<0x{b:02X}>") for b in t.encode("utf-8")])
        i = sym[i][2]
    return out


_SPM_TEXTS = ["hello world", "the string is thinking", " leading space", "double  space in", "héllo wörld 日本",
              "a", "isis", "world hello the"]


@pytest.mark.parametrize("text", _SPM_TEXTS)
def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp(text):
    from ds4t.models.gguf import build_tokenizer
    meta = _spm_meta()
    tok, _ = build_tokenizer(meta, "m.gguf")
    ids = tok.encode(text).ids
    assert ids[0] == 1                                           # BOS: llama.cpp's default for SentencePiece
    assert ids[1:] == _llama_cpp_spm(meta, text)
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_sentencepiece_reference_negative_control():
    """The comparison can fail: scores reversed merge in another order and give other ids."""
    meta = _spm_meta()
    flipped = dict(meta, **{"tokenizer.ggml.scores": [-s for s in meta["tokenizer.ggml.scores"]]})
    assert any(_llama_cpp_spm(meta, t) != _llama_cpp_spm(flipped, t) for t in _SPM_TEXTS)
    from ds4t.models.gguf import build_tokenizer
    tok, _ = build_tokenizer(flipped, "m.gguf")
    assert any(tok.encode(t).ids[1:] != _llama_cpp_spm(meta, t) for t in _SPM_TEXTS)


def test_sentencepiece_vocabulary_matches_transformers(tmp_path):
    """The same vocabulary in a GGUF file, read by transformers' own GGUF tokenizer loader: the same ids."""
    from ds4t.models.gguf import build_tokenizer
    meta = _spm_meta(add_bos=True)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    add_spm_tokenizer(w, meta)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="t.gguf")
    tok, _ = build_tokenizer(meta, "t.gguf")
    # Text that starts with a space is where the two part: llama.cpp always prefixes one more U+2581
    # ("▁▁leading"), transformers' Metaspace does not; ds4t follows llama.cpp (the test above). The
    # segmentation is compared without special tokens: whether transformers' GGUF loader adds the BOS
    # differs between its versions (ds4t's BOS follows llama.cpp, tested above).
    for text in [t for t in _SPM_TEXTS if not t.startswith(" ")]:
        ids = tok.encode(text).ids
        assert ids[0] == 1, text
        assert ids[1:] == hf(text, add_special_tokens=False)["input_ids"], text


def test_sentencepiece_vocabulary_without_scores_is_an_error():
    from ds4t.models.gguf import build_tokenizer
    meta = _spm_meta()
    del meta["tokenizer.ggml.scores"]
    with pytest.raises(ds4t.CheckpointError, match="tokenizer.ggml.scores"):
        build_tokenizer(meta, "m.gguf")


def test_llama_gguf_with_a_sentencepiece_vocabulary_speaks(tmp_path):
    """End to end: a llama GGUF whose vocabulary is SentencePiece loads with a tokenizer; text round-trips
    through the codec and generate() returns text."""
    meta = _spm_meta()
    write_gguf(tiny_llama(vocab_size=len(meta["tokenizer.ggml.tokens"])), tmp_path / "m.gguf", tokenizer=meta)
    model = ds4t.load(str(tmp_path / "m.gguf"))
    assert model.tokenizer is not None
    codec = TextCodec.for_model(model)
    ids = codec.encode("hello world")
    assert ids == [1] + _llama_cpp_spm(meta, "hello world") and codec.decode(ids) == "hello world"
    assert codec.eos_ids == [2]
    out = ds4t.generate(model, ["hello"], max_new_tokens=3)
    assert isinstance(out[0].text, str) and len(out[0].tokens) >= 1


def test_corrupted_headers_are_clear_errors_or_models_that_run(tmp_path):
    """Bytes changed in the metadata and tensor table (a bad copy, a broken writer): each file either fails
    to load with a CheckpointError or loads a model that prefills; nothing else escapes (a metadata value
    gguf-py could not decode once raised AttributeError from the error message itself). Tensor data has no
    checksum in GGUF, so its bytes are not part of this. Control: the corruptions are real -- most of them
    are refused."""
    src = tmp_path / "m.gguf"
    write_gguf(tiny_llama(), src, types={"matrix": "Q8_0"}, tokenizer=False)
    data = src.read_bytes()
    r = gguf.GGUFReader(str(src))
    header = min(t.data_offset for t in r.tensors)
    # the first byte of every string value: 0xFF is never UTF-8
    strings = [int(f.parts[f.data[0]].ctypes.data - r.data.ctypes.data) for f in r.fields.values()
               if f.types == [gguf.GGUFValueType.STRING]]
    assert strings
    rng = np.random.default_rng(0)
    cases = [(pos, 0xFF) for pos in strings] + [(int(pos), None) for pos in
                                                rng.choice(np.arange(4, header), size=32, replace=False)]
    refused = 0
    for i, (pos, value) in enumerate(cases):
        bad = bytearray(data)
        bad[pos] = value if value is not None else (bad[pos] + int(rng.integers(1, 256))) % 256
        f = tmp_path / f"c{i}.gguf"
        f.write_bytes(bytes(bad))
        try:
            model = ds4t.load(str(f))
        except ds4t.CheckpointError as e:
            assert str(f) in str(e)
            refused += 1
            continue
        model.new_session(8).prefill([1, 2])
    assert refused >= len(cases) // 2, (refused, len(cases))
