"""Write GGUF files from tiny HF llama / qwen3 models the way llama.cpp's converter does (names,
metadata, the q/k row permutation of llama), for the loader's tests. Written independently of
ds4t.models.gguf so that the round trip tests the loader, not itself."""
from __future__ import annotations

import numpy as np
import torch

# HF name (under model.layers.{i}.) -> llama.cpp name (under blk.{i}.)
LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
         "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
         "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
         "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def converter_permute(w: np.ndarray, n_head: int, n_head_kv=None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``, as written there."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def gguf_name(hf: str) -> str:
    base, _, suffix = hf.rpartition(".")
    if base in TOP:
        return f"{TOP[base]}.{suffix}"
    parts = base.split(".")
    assert parts[:2] == ["model", "layers"], hf
    return f"blk.{parts[2]}.{LAYER['.'.join(parts[3:])]}.{suffix}"


def byte_tokenizer_meta():
    """A tiny GPT-2 style vocabulary of 256 ids: the byte symbols, a few merges, and id 255 made
    the control token <|end|> (EOS)."""
    from ds4t.models.tokenizer import _byte_symbols

    sym = _byte_symbols()
    tokens = [sym[b] for b in range(256)]
    # merges need their result in the vocabulary: reuse ids of bytes no test text contains
    merged = {"he": 1, "ll": 2, "Ġw": 3}
    for s, i in merged.items():
        tokens[i] = s
    tokens[255] = "<|end|>"
    types = [1] * 256
    types[255] = 3
    return dict(tokens=tokens, merges=["h e", "l l", "Ġ w"], types=types, eos=255)


def add_spm_tokenizer(w, meta: dict) -> None:
    """Write a SentencePiece ("llama") vocabulary's ``tokenizer.ggml.*`` metadata ``meta`` (tokens, scores,
    token types, BOS / EOS and, where given, unknown-token id and add_bos_token) with GGUFWriter ``w``."""
    w.add_tokenizer_model("llama")
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    w.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    if "tokenizer.ggml.unknown_token_id" in meta:
        w.add_unk_token_id(meta["tokenizer.ggml.unknown_token_id"])
    if "tokenizer.ggml.add_bos_token" in meta:
        w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])


def write_gguf(hf_model, path, arch="llama", types=None, split_max_tensors=0, tokenizer=True,
               chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|end|>{% endfor %}<assistant>"):
    """Write ``hf_model`` (a tiny LlamaForCausalLM / Qwen3ForCausalLM) as a GGUF file at ``path``.

    types: {"matrix": name, "embed": name, "norm": name} of gguf types (F32, F16, BF16, Q8_0, Q4_0,
    Q4_1); matrices default to F32. Returns {HF name: the float32 tensor the file holds, dequantized
    and with q/k un-permuted} -- the weights HF should run to be the oracle of the file.
    """
    import gguf
    from gguf import GGMLQuantizationType as T, quants

    types = {"matrix": "F32", "embed": "F32", "norm": "F32", **(types or {})}
    c = hf_model.config
    w = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    w.add_name("tiny test model")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    if isinstance(tokenizer, dict):   # a SentencePiece ("llama") vocabulary's tokenizer.ggml.* metadata
        add_spm_tokenizer(w, tokenizer)
        w.add_chat_template(chat_template)
    elif tokenizer:
        t = byte_tokenizer_meta()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(t["tokens"])
        w.add_token_merges(t["merges"])
        w.add_token_types(t["types"])
        w.add_eos_token_id(t["eos"])
        w.add_bos_token_id(t["eos"])
        w.add_add_bos_token(False)
        w.add_chat_template(chat_template)
    held = {}
    sd = hf_model.state_dict()
    if c.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, tensor in sd.items():
        if "rotary_emb" in name:
            continue
        a = tensor.detach().float().numpy().copy()
        kind = types["norm"] if a.ndim == 1 else types["embed" if "embed_tokens" in name else "matrix"]
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):
            a = converter_permute(a, c.num_attention_heads, c.num_key_value_heads if "k_proj" in name else None)
        q = getattr(T, kind)
        if kind == "F32":
            data = a.astype(np.float32)
        elif kind == "F16":
            data = a.astype(np.float16)
        else:
            data = quants.quantize(a, q)
        stored = quants.dequantize(data, q) if kind not in ("F32", "F16") else data.astype(np.float32)
        w.add_tensor(gguf_name(name), data, raw_dtype=q if kind not in ("F32", "F16") else None)
        back = torch.from_numpy(np.array(stored, dtype=np.float32)).reshape(tensor.shape)
        if arch == "llama" and ("q_proj" in name or "k_proj" in name):   # the inverse, for the oracle only
            n = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            back = back.reshape(n, back.shape[0] // n // 2, 2, *back.shape[1:]).transpose(1, 2).reshape(tensor.shape)
        held[name] = back
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held
