"""Text <-> token ids (``ds4t.generate``, the server): the checkpoint's tokenizer.json (or a GGUF's
tokenizer, chat template and EOS ids, ``model.text_meta``), or bytes for the presets.

``TextCodec.for_model(model)``: ``model.tokenizer`` (a ``tokenizers.Tokenizer``) when the
checkpoint has one; otherwise byte-level (token id = byte value, vocab >= 256; ids >= 256 render
as nothing). :class:`Detokenizer` turns a stream of ids into text deltas without ever emitting a
half UTF-8 character. :meth:`TextCodec.chat_prompt` renders chat messages with the checkpoint's
``chat_template`` (tokenizer_config.json, sandboxed Jinja) or a plain fallback template.
"""
from __future__ import annotations

import codecs
import json
import os
from typing import Dict, List, Optional, Sequence


class TokenizeError(ValueError):
    """A prompt that cannot be turned into token ids (reported to the client as a 400)."""


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles of OpenAI's chat messages. Any other string would be rendered into the prompt as a speaker the
template was never trained with (or that it fails on deep inside), so :meth:`TextCodec.chat_prompt` refuses it."""


class TextCodec:
    def __init__(self, vocab_size: int, tokenizer=None, chat_template: Optional[str] = None,
                 special: Optional[Dict[str, str]] = None, eos_ids: Sequence[int] = ()):
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special = special or {}
        self.eos_ids = [int(i) for i in eos_ids if 0 <= int(i) < vocab_size]
        self.byte_level = tokenizer is None

    @classmethod
    def for_model(cls, model) -> "TextCodec":
        """The codec of a loaded ds4t model (checkpoint directory: tokenizer + chat template + EOS)."""
        tok = getattr(model, "tokenizer", None)
        template, special, eos = None, {}, []
        path = str(getattr(model, "name", ""))
        meta = getattr(model, "text_meta", None)   # GGUF: from the file's tokenizer.* metadata
        if meta is not None:
            template, special, eos = meta.chat_template, dict(meta.special), list(meta.eos_ids)
        elif os.path.isdir(path):
            tc = _read_json(os.path.join(path, "tokenizer_config.json"))
            template = tc.get("chat_template") if isinstance(tc.get("chat_template"), str) else None
            for k in ("bos_token", "eos_token"):
                v = tc.get(k)
                if isinstance(v, dict):
                    v = v.get("content")
                if isinstance(v, str):
                    special[k] = v
            for name in ("generation_config.json", "config.json"):
                e = _read_json(os.path.join(path, name)).get("eos_token_id")
                if e is not None:
                    eos = e if isinstance(e, list) else [e]
                    break
            if not eos and tok is not None and "eos_token" in special:
                i = tok.token_to_id(special["eos_token"])
                eos = [] if i is None else [i]
        if tok is None and model.vocab_size < 256:
            raise ValueError(f"model {model.name!r} has no tokenizer and a vocabulary of {model.vocab_size} "
                             f"(< 256): byte-level text needs 256 ids")
        return cls(model.vocab_size, tok, template, special, eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        """Token ids of ``text``; special tokens (e.g. BOS) added per the tokenizer's post-processor
        unless ``add_special_tokens`` is False (chat prompts: the template writes them)."""
        if self.byte_level:
            return list(text.encode("utf-8"))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        if self.byte_level:
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> "Detokenizer":
        return Detokenizer(self)

    def chat_prompt(self, messages) -> str:
        """Render OpenAI chat ``messages`` into the prompt text (with the generation prompt)."""
        if not isinstance(messages, list) or not messages:
            raise TokenizeError("'messages' must be a non-empty list of {role, content} objects")
        msgs = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise TokenizeError(f"messages[{i}] must be an object with a string 'role'")
            if m["role"] not in CHAT_ROLES:
                raise TokenizeError(f"messages[{i}].role {m['role']!r} is not one of {', '.join(CHAT_ROLES)}")
            content = m.get("content", "")
            if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
                parts = []
                for p in content:
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise TokenizeError(f"messages[{i}].content: only text parts are supported")
                    parts.append(p["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise TokenizeError(f"messages[{i}].content must be a string")
            msgs.append({"role": m["role"], "content": content})
        if self.chat_template:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment

                env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

                def raise_exception(msg):
                    raise TokenizeError(f"chat template: {msg}")

                env.globals["raise_exception"] = raise_exception
                return env.from_string(self.chat_template).render(
                    messages=msgs, add_generation_prompt=True, **self.special)
            except TokenizeError:
                raise
            except Exception as e:  # a template we cannot render: say so, don't guess
                raise TokenizeError(f"chat template failed to render: {e}") from None
        return "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in msgs) + "<|assistant|>\n"


class Detokenizer:
    """Incremental ids -> text. ``push(id)`` returns the new text that is final (no partial
    UTF-8 sequence at the end)."""

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.ids: List[int] = []
        self.text = ""
        self._stream = None
        if codec.byte_level:
            self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        else:
            try:  # O(1) per token, holds back partial UTF-8 sequences
                from tokenizers.decoders import DecodeStream

                self._stream = DecodeStream(skip_special_tokens=True)
            except ImportError:
                pass

    def push(self, tok: int) -> str:
        self.ids.append(tok)
        if self.codec.byte_level:
            delta = self._dec.decode(bytes([tok]) if tok < 256 else b"")
        elif self._stream is not None:
            try:
                delta = self._stream.step(self.codec.tokenizer, tok) or ""
            except Exception:  # noqa: BLE001  (an id the tokenizer does not know: padded vocabularies)
                delta = ""
        else:
            full = self.codec.decode(self.ids)
            if full.endswith("\ufffd") or not full.startswith(self.text):
                return ""  # an incomplete character (or a re-segmentation): wait for more ids
            delta = full[len(self.text):]
        self.text += delta
        return delta

    def flush(self) -> str:
        if self.codec.byte_level:
            delta = self._dec.decode(b"", final=True)
        else:
            full = self.codec.decode(self.ids)
            delta = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += delta
        return delta


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
