"""Parse a request body only as far as the policy needs: model, prompt or messages, session key, pin.

No tokenization: the prompt length is estimated from characters, and the prefix is hashed in fixed-size
chunks of text (token-id prompts: of their int32 bytes). Chat requests are keyed on the whole message list
(role and content of every message, in order), so a conversation's next turn shares the earlier turns' prefix.
"""

from __future__ import annotations

from array import array
from typing import Any

import orjson

from engine.edge.rank_header import RANK_HEADER as PIN_HEADER
from engine.edge.rank_header import RankHeaderError, parse_rank
from policies import CHARS_PER_TOKEN, RequestFacts, chunk_hashes


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


def _prompt_bytes(body: dict[str, Any]) -> tuple[bytes, int]:
    """(bytes to hash, estimated prompt tokens)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\x00{_content_text(m.get('content'))}\x01")
        text = "".join(parts)
        return text.encode("utf-8", "surrogatepass"), len(text) // CHARS_PER_TOKEN + 4 * len(parts)
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
    """The rank pin, by the engine's own rule (engine.edge.rank_header)."""
    try:
        return parse_rank(headers.get_all(PIN_HEADER))
    except RankHeaderError as e:
        raise BadRequest(str(e), PIN_HEADER) from None


def parse_facts(body: bytes, headers: Any, session_header: str) -> RequestFacts:
    """Facts for routing. Raises BadRequest for a body that is not a JSON object or a bad pin."""
    pin = pinned_rank(headers)
    session = headers.get(session_header)
    if not body:
        return RequestFacts(session_key=session, pinned_rank=pin)
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BadRequest("request body must be a JSON object")
    model = data.get("model")
    if session is None and isinstance(data.get("user"), str):
        session = data["user"]
    raw, tokens = _prompt_bytes(data)
    return RequestFacts(
        model=model if isinstance(model, str) else None,
        prefix_hashes=chunk_hashes(raw),
        session_key=session,
        pinned_rank=pin,
        prompt_tokens=tokens,
    )
