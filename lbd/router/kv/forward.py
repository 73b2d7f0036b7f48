"""Send the router's token ids of a prompt with the request to ranks that take them (engine.server.forwarded).

The exact view tokenizes every request (per message, cached: a new turn costs its own tokens only); a rank
would render and tokenize the whole prompt again before its prefill. A rank of lbd's engine advertises in
``/tokenizer_info`` that it takes the ids, under which field, and the fingerprint of the tokenizer and chat
template they must come from. The router learns its tokenizer from that same answer, so it sends the ids to
a rank only when the rank's fingerprint is the one its tokenizer was built from (any other rank, or a vLLM
one, gets the body unchanged), and the rank checks the fingerprint again (and verifies the first few prompts
and a sample after them against its own tokenization).

Only generation requests (``PATHS``: /tokenize and the rest tokenize for themselves), and only prompts the
router renders exactly as Hugging Face's ``apply_chat_template`` does go: chat requests
without tools, template kwargs or ``continue_final_message`` (the router renders those too, for routing, where
a small difference costs a cache hit, not a different prompt), and completions with one text prompt. The body
is not parsed again: the field is spliced in before its closing brace (a JSON object's last key wins, so a
client's own copy of the field is overridden).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

FIELD = "lbd_prompt_token_ids"  # the engine's name for it (engine.server.forwarded.FIELD)
PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # where the engine reads it


@dataclass(slots=True)
class ExactPrompt:
    """A request's prompt as the router tokenized it: token-id pieces, and its tokenizer's fingerprint."""

    pieces: Sequence[Sequence[int]]
    fingerprint: str


def advertised(info: Any) -> str | None:
    """The fingerprint a rank's /tokenizer_info says forwarded ids must carry (None: it takes none)."""
    entry = info.get("prompt_token_ids") if isinstance(info, dict) else None
    if not isinstance(entry, dict) or entry.get("field") != FIELD:
        return None
    fp = entry.get("fingerprint")
    return fp if isinstance(fp, str) and fp.isascii() and fp.isalnum() else None


def forwardable(data: dict[str, Any]) -> bool:
    """The request's prompt is one the router renders exactly as the engine does (see above)."""
    if "messages" in data:
        return not (data.get("tools") or data.get("chat_template_kwargs")
                    or data.get("continue_final_message"))
    return isinstance(data.get("prompt"), str)


def with_ids(body: bytes, prompt: ExactPrompt) -> bytes | None:
    """``body`` with the field added, or None when it does not end as a JSON object."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return None
    inner = end[:-1].rstrip()
    ids: list[int] = []
    for piece in prompt.pieces:
        ids += piece
    field = b'"%s":{"ids":%s,"tokenizer":"%s"}}' % (FIELD.encode(), orjson.dumps(ids),
                                                    prompt.fingerprint.encode())
    return inner + (b"" if inner.endswith(b"{") else b",") + field
