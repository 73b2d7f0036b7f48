"""Tokenizer loading, chat templates, per-token strings for logprobs and incremental detokenization.

Front ends import this module, so it must stay light: `PreTrainedTokenizerFast` loads without torch
(`AutoTokenizer` would pull torch in). Incremental detokenization uses the Rust `DecodeStream`, so each
new token costs O(1) work instead of re-decoding the whole output.
"""

from __future__ import annotations

import os
from functools import lru_cache
from typing import Any

from tokenizers import decoders
from tokenizers.decoders import DecodeStream

# Prompt tokens fed to a fresh DecodeStream, so the first output token decodes with its true leading space
# (SentencePiece/Metaspace tokenizers strip it at the start of a text).
_PREFIX_TOKENS = 4


class ChatTemplateError(ValueError):
    """The request's messages cannot be rendered (no template, or the template rejected them)."""


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte-to-unicode table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Tokenizer:
    """A fast HF tokenizer plus what the front end needs around it."""

    def __init__(self, path: str | os.PathLike[str], chat_template: str | None = None) -> None:
        from transformers import PreTrainedTokenizerFast

        self.hf = PreTrainedTokenizerFast.from_pretrained(str(path))
        self.rust = self.hf.backend_tokenizer
        if chat_template:
            self.hf.chat_template = read_template(chat_template)
        self.eos_token_id: int | None = self.hf.eos_token_id
        self.vocab_size = len(self.hf)
        self._special = set(self.hf.added_tokens_decoder)
        self._byte_level = isinstance(self.rust.decoder, decoders.ByteLevel)
        self._piece_cache: dict[int, tuple[str, list[int]]] = {}
        self.max_chars_per_token = _max_chars_per_token(self.rust)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.rust.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.rust.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: list[Any] | None = None,
                    extra: dict[str, Any] | None = None) -> str:
        """The prompt text for ``messages`` (tokenize it with add_special_tokens=False)."""
        if not self.hf.chat_template:
            raise ChatTemplateError("this model's tokenizer has no chat template: start the server with "
                                    "--chat-template, or use /v1/completions")
        try:
            return self.hf.apply_chat_template(
                messages, tools=tools,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tokenize=False, **(extra or {}))
        except Exception as e:  # jinja errors, raise_exception() in templates, bad message shapes
            raise ChatTemplateError(f"chat template error: {e}") from e

    def piece(self, token_id: int) -> tuple[str, list[int]]:
        """(text, raw bytes) of one token, for logprobs; byte-level vocabularies give exact bytes."""
        hit = self._piece_cache.get(token_id)
        if hit is not None:
            return hit
        text = self.rust.decode([token_id], skip_special_tokens=False)
        raw: list[int] | None = None
        if self._byte_level and token_id not in self._special:
            token = self.rust.id_to_token(token_id)
            table = _byte_decoder()
            if token is not None and all(c in table for c in token):
                raw = [table[c] for c in token]
        result = (text, raw if raw is not None else list(text.encode("utf-8", errors="replace")))
        if len(self._piece_cache) < 1 << 20:
            self._piece_cache[token_id] = result
        return result


def _max_chars_per_token(rust: Any) -> int:
    """How many characters of text one token stands for, at most: a text longer than max_model_len times this
    cannot fit the context whatever it says, and is refused before it is tokenized. Normalizers can shrink a
    text (composing accents, folding width), hence the margin when there is one."""
    size = rust.get_vocab_size(with_added_tokens=True)
    longest = max((len(rust.decode([i], skip_special_tokens=False)) for i in range(size)), default=1)
    return max(1, longest) * (4 if rust.normalizer is not None else 1)


def read_template(value: str) -> str:
    """``--chat-template`` is a file path or the template itself; anything else is an error."""
    if len(value) < 4096 and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a readable file nor a Jinja template")


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text, one token at a time, and finds stop strings.

    ``add(token_id)`` appends a token and returns the stop string it completed (or None); the text is then
    cut before the stop string (or after it with ``include_stop``). ``take()`` returns text not yet handed
    out, holding back the tail that could still become the start of a stop string unless ``final``.
    Text is kept as a list of pieces and only the tail is ever looked at, so a token costs O(1) however long
    the output grows.
    """

    __slots__ = ("_tok", "_stream", "_stops", "_max_stop", "_hold", "_include_stop", "_parts", "_len",
                 "_sent")

    def __init__(self, tok: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._tok = tok
        self._stream = DecodeStream(ids=list(prompt_ids[-_PREFIX_TOKENS:]),
                                    skip_special_tokens=skip_special_tokens)
        self._stops = [s for s in (stop or []) if s]
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self._hold = 0 if include_stop else max(self._max_stop - 1, 0)
        self._include_stop = include_stop
        self._parts: list[str] = []
        self._len = 0
        self._sent = 0

    @property
    def text(self) -> str:
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def length(self) -> int:
        return self._len

    def add(self, token_id: int) -> str | None:
        try:
            chunk = self._stream.step(self._tok.rust, token_id)
        except Exception:  # an id past the tokenizer's vocabulary (padded embeddings) decodes to nothing
            chunk = None
        if not chunk:
            return None
        old_len = self._len
        self._parts.append(chunk)
        self._len += len(chunk)
        return self._find_stop(max(old_len - self._max_stop + 1, 0)) if self._stops else None

    def _tail(self, start: int) -> str:
        """``text[start:]`` for a ``start`` near the end, joining only the last pieces."""
        pieces: list[str] = []
        pos = self._len
        for part in reversed(self._parts):
            if pos <= start:
                break
            pieces.append(part)
            pos -= len(part)
        return "".join(reversed(pieces))[start - pos:]

    def _find_stop(self, start: int) -> str | None:
        window = self._tail(start)
        best: tuple[int, str] | None = None
        for s in self._stops:
            i = window.find(s)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        cut = start + i + (len(s) if self._include_stop else 0)
        self._parts = [self.text[:cut]]
        self._len = cut
        return s

    def take(self, final: bool = False) -> str:
        end = self._len if final else max(self._len - self._hold, self._sent)
        if end == self._sent:
            return ""
        out = self._tail(self._sent)[: end - self._sent]
        self._sent = end
        return out
