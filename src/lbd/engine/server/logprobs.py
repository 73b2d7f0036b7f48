"""Logprobs in OpenAI's two formats: chat (``content: [{token, logprob, bytes, top_logprobs}]``) and legacy
completions (``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``)."""

from __future__ import annotations

from typing import Any

from lbd.engine.tokenizer import Tokenizer
from lbd.wire.core_messages import TokenLogprobs

_FLOOR = -9999.0  # JSON has no -inf; vLLM clamps the same way


def _lp(value: float) -> float:
    return value if value > _FLOOR else _FLOOR


def chat_entries(tok: Tokenizer, ids: list[int], lps: list[TokenLogprobs]) -> list[dict[str, Any]]:
    out = []
    for token_id, lp in zip(ids, lps, strict=False):
        text, raw = tok.piece(token_id)
        top = []
        for tid, tlp in zip(lp.top_ids, lp.top_logprobs, strict=False):
            ttext, traw = tok.piece(tid)
            top.append({"token": ttext, "logprob": _lp(tlp), "bytes": traw})
        out.append({"token": text, "logprob": _lp(lp.token_logprob), "bytes": raw, "top_logprobs": top})
    return out


class CompletionLogprobs:
    """Accumulates one choice's legacy logprobs (or one streamed chunk's)."""

    __slots__ = ("tokens", "token_logprobs", "top_logprobs", "text_offset")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top_logprobs: list[dict[str, float]] = []
        self.text_offset: list[int] = []

    def add(self, tok: Tokenizer, ids: list[int], lps: list[TokenLogprobs], offsets: list[int],
            base_offset: int) -> None:
        for token_id, lp, off in zip(ids, lps, offsets, strict=False):
            text = tok.piece(token_id)[0]
            self.tokens.append(text)
            self.token_logprobs.append(_lp(lp.token_logprob))
            top: dict[str, float] = {}
            for t, v in zip(lp.top_ids, lp.top_logprobs, strict=False):
                top.setdefault(tok.piece(t)[0], _lp(v))  # tokens with the same text: keep the likeliest
            top.setdefault(text, _lp(lp.token_logprob))
            self.top_logprobs.append(top)
            self.text_offset.append(base_offset + off)

    def as_dict(self) -> dict[str, Any]:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top_logprobs, "text_offset": self.text_offset}
