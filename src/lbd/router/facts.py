"""Parse a request body only as far as the policy needs: model, prompt or messages, session key, pin.

No tokenization: the prompt length is estimated from characters, and the prefix is hashed in fixed-size
chunks of text (token-id prompts: of their int32 bytes). Chat requests are keyed on the whole message list
(role and content of every message, in order), so a conversation's next turn shares the earlier turns' prefix.
Responses API requests are keyed on ``instructions`` then ``input``; a ``previous_response_id`` of lbd's
engines (``resp_r<rank>-...``) pins the request to that rank, whose store holds the conversation, and so does
the id in ``GET``/``DELETE /v1/responses/{id}``; ``prompt_cache_key`` is a session key.
"""

from __future__ import annotations

import re
from array import array
from typing import Any

import orjson

from lbd.common.rank_header import RANK_HEADER as PIN_HEADER
from lbd.common.rank_header import RankHeaderError, parse_rank
from lbd.policies import CHARS_PER_TOKEN, RequestFacts, chunk_hashes

_RESPONSE_RANK = re.compile(r"^resp_r(\d{1,9})-")
_RESPONSES_PATH = "/v1/responses/"


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _messages_bytes(messages: list[Any]) -> tuple[bytes, int]:
    parts = []
    for m in messages:
        if isinstance(m, dict):
            parts.append(f"{m.get('role', '')}\x00{_content_text(m.get('content'))}\x01")
    text = "".join(parts)
    return text.encode("utf-8", "surrogatepass"), len(text) // CHARS_PER_TOKEN + 4 * len(parts)


def _responses_bytes(body: dict[str, Any]) -> tuple[bytes, int]:
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        items = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        items = [{"role": "system", "content": instructions}, *items]
    return _messages_bytes(items)


def _prompt_bytes(body: dict[str, Any]) -> tuple[bytes, int]:
    """(bytes to hash, estimated prompt tokens)."""
    if "input" in body:
        return _responses_bytes(body)
    messages = body.get("messages")
    if isinstance(messages, list):
        return _messages_bytes(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        prompt = prompt[0] if not isinstance(prompt[0], int) else prompt  # a batch: the first prompt keys it
    if isinstance(prompt, str):
        return prompt.encode("utf-8", "surrogatepass"), len(prompt) // CHARS_PER_TOKEN + 1
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt[:64]):
        with_ids = array("i", (t if -(2**31) <= t < 2**31 else 0 for t in prompt if isinstance(t, int)))
        return with_ids.tobytes(), len(with_ids)
    return b"", 0


def pinned_rank(headers: Any) -> int | None:
    """The rank pin, by the engine's own rule (lbd.common.rank_header)."""
    try:
        return parse_rank(headers.get_all(PIN_HEADER))
    except RankHeaderError as e:
        raise BadRequest(str(e), PIN_HEADER) from None


def response_rank(response_id: Any) -> int | None:
    """The DP rank an lbd engine put in a Responses API id, if it is one of those."""
    m = _RESPONSE_RANK.match(response_id) if isinstance(response_id, str) else None
    return int(m.group(1)) if m else None


def path_facts(path: str, headers: Any) -> RequestFacts:
    """Facts of a request without a body: the pin header, or the rank of /v1/responses/{id}."""
    pin = pinned_rank(headers)
    if pin is None and path.startswith(_RESPONSES_PATH):
        pin = response_rank(path[len(_RESPONSES_PATH):])
    return RequestFacts(pinned_rank=pin)


def parse_facts(body: bytes, headers: Any, session_header: str) -> RequestFacts:
    """Facts for routing. Raises BadRequest for a body that is not a JSON object or a bad pin."""
    return parse_request(body, headers, session_header)[0]


def parse_request(
    body: bytes, headers: Any, session_header: str, text_prefix: bool = True
) -> tuple[RequestFacts, dict[str, Any] | None]:
    """The facts and the parsed body (None when empty), for the exact view to tokenize. Without
    ``text_prefix`` the text chunk hashes are skipped (the policy reads none, or every endpoint has an exact
    view): on a 16 KiB prompt hashing is three quarters of the router's work per request."""
    pin = pinned_rank(headers)
    session = headers.get(session_header)
    if not body:
        return RequestFacts(session_key=session, pinned_rank=pin), None
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if session is None:
        for key in ("user", "prompt_cache_key"):
            if isinstance(data.get(key), str):
                session = data[key]
                break
    if pin is None:
        pin = response_rank(data.get("previous_response_id"))
    raw, tokens = _prompt_bytes(data)
    facts = RequestFacts(
        model=model if isinstance(model, str) else None,
        prefix_hashes=chunk_hashes(raw) if text_prefix else (),
        session_key=session,
        pinned_rank=pin,
        prompt_tokens=tokens,
    )
    return facts, data
