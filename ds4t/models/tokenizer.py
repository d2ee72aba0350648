"""The tokenizer of the presets: byte-level, built in-process (no download), token id = byte value.

A preset has random weights and no tokenizer.json; any vocabulary of >= 256 ids can still carry
text as UTF-8 bytes. Built with the ``tokenizers`` library (a BPE with the 256 byte symbols and no
merges, GPT-2's byte-to-unicode alphabet), so it is the same kind of object a checkpoint's
tokenizer.json gives and every consumer handles both alike. Ids >= 256 decode to nothing.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional

BYTE_VOCAB = 256


def _byte_symbols() -> Dict[int, str]:
    """GPT-2's printable stand-in for every byte: printable Latin-1 bytes map to themselves, the
    rest to U+0100 onwards in byte order (the alphabet the ByteLevel pre-tokenizer produces)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(BYTE_VOCAB):
        if b not in out:
            out[b] = chr(BYTE_VOCAB + extra)
            extra += 1
    return out


@functools.lru_cache(maxsize=1)
def _byte_tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE(vocab={s: b for b, s in _byte_symbols().items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return tok.to_str()


def preset_tokenizer(vocab_size: int) -> Optional["tokenizers.Tokenizer"]:  # noqa: F821
    """A fresh byte-level ``tokenizers.Tokenizer`` (id = UTF-8 byte) for a model of
    ``vocab_size`` ids, or None when the vocabulary cannot hold the 256 bytes."""
    if vocab_size < BYTE_VOCAB:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_byte_tokenizer_json())
