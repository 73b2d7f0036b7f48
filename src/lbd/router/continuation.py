"""The pure parts of resuming a stream on another rank (``lbd.router.migration``): whether a request can be
resumed, the continuation request, and the continuation's chunks rewritten as the original stream's.

The continuation is always a completions request with a token prompt: the prompt's ids followed by the output
ids the client already has, ``max_tokens`` (or chat's ``max_completion_tokens``) and ``min_tokens`` reduced by
them, every other field of the original kept as it was (temperature, seed, stop strings, stop_token_ids,
penalties, the engines' extras). A chat is resumed the same way, its prompt as the rank rendered it (the
``prompt_token_ids`` it returned): the completions chunks are turned back into chat chunks (``delta.content``)
and completions logprobs into chat logprobs. What a token continuation cannot reproduce is refused with its
reason: tool calls (the rank parses them from the chat's output, which a completion does not do), images or
audio (the ids hold their placeholders, not the media), ``n`` > 1.
"""

from __future__ import annotations

from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FIELD = b'"return_token_ids":true'
# chat fields that a completions request does not take (the rest, sampling included, goes over as it is)
_CHAT_ONLY = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "logprobs",
        "top_logprobs",
        "max_completion_tokens",
        "max_tokens",
        "functions",
        "function_call",
        "echo",
        "mm_processor_kwargs",
        "reasoning_effort",
    }
)


def kind_of(path: str) -> str | None:
    """ "chat" or "cmpl" for the two paths a stream can be resumed on, else None."""
    path = path.split("?", 1)[0].rstrip("/")
    return "chat" if path == CHAT else "cmpl" if path == COMPLETIONS else None


def impossible(kind: str, data: dict[str, Any]) -> str | None:
    """Why this request cannot be resumed from a token prompt (None: it can)."""
    if (data.get("n") or 1) != 1:
        return "n > 1 (several choices)"
    if kind == "cmpl":
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return "a batch of prompts"
        return None
    if data.get("tools") and data.get("tool_choice") != "none":
        return "a chat with tools (the router cannot parse tool calls from a token continuation)"
    if data.get("functions"):
        return "a chat with functions (the router cannot parse function calls from a token continuation)"
    for m in data.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    return f"a chat with {part.get('type')} content (a token prompt cannot carry it)"
    return None


def with_token_ids(body: bytes) -> bytes:
    """The JSON object ``body`` with ``"return_token_ids": true`` added last (a later key wins)."""
    head = body.rstrip()
    if not head.endswith(b"}"):
        return body
    inner = head[:-1].rstrip()
    return inner + (FIELD if inner.endswith(b"{") else b"," + FIELD) + b"}"


def continuation(kind: str, data: dict[str, Any], prompt_ids: list[int], sent: list[int]) -> dict[str, Any]:
    """The completions request that continues ``data`` after the output tokens ``sent``."""
    body = {k: v for k, v in data.items() if k not in _CHAT_ONLY} if kind == "chat" else dict(data)
    body["prompt"] = list(prompt_ids) + sent
    body["echo"] = False
    body["return_token_ids"] = True
    n = len(sent)
    limit = (
        data.get("max_completion_tokens", data.get("max_tokens"))
        if kind == "chat"
        else data.get("max_tokens")
    )
    if isinstance(limit, int):
        body["max_tokens"] = max(limit - n, 1)
    if isinstance(data.get("min_tokens"), int):
        body["min_tokens"] = max(data["min_tokens"] - n, 0)
    if kind == "chat" and data.get("logprobs"):
        body["logprobs"] = int(data.get("top_logprobs") or 0)
    body.pop("suffix", None)
    return body


def fix_usage(usage: dict[str, Any], prompt_tokens: int, before: int) -> None:
    """A continuation's usage as the whole request's: its prompt, and every output token."""
    done = int(usage.get("completion_tokens") or 0) + before
    usage["prompt_tokens"] = prompt_tokens
    usage["completion_tokens"] = done
    usage["total_tokens"] = prompt_tokens + done
    usage.pop("prompt_tokens_details", None)


def shift_offsets(logprobs: dict[str, Any] | None, chars: int) -> None:
    """Completions logprobs' ``text_offset`` counted from the start of the original's text."""
    if logprobs and isinstance(logprobs.get("text_offset"), list):
        logprobs["text_offset"] = [o + chars for o in logprobs["text_offset"]]


def chat_logprobs(lp: dict[str, Any] | None) -> dict[str, Any] | None:
    """Completions logprobs (tokens, token_logprobs, top_logprobs) as chat logprobs (content entries)."""
    if not lp:
        return None
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or ())
    content = []
    for token, logprob, top in zip(
        lp.get("tokens") or (), lp.get("token_logprobs") or (), tops, strict=False
    ):
        entry = {
            "token": token,
            "logprob": logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in (top or {}).items()
            ],
        }
        content.append(entry)
    return {"content": content}


def as_chat_choice(c: dict[str, Any]) -> dict[str, Any]:
    """A completions chunk's choice as a chat chunk's."""
    text = c.get("text") or ""
    choice: dict[str, Any] = {
        "index": c.get("index", 0),
        "delta": {"content": text} if text else {},
        "logprobs": chat_logprobs(c.get("logprobs")),
        "finish_reason": c.get("finish_reason"),
    }
    if c.get("finish_reason") is not None:
        choice["stop_reason"] = c.get("stop_reason")
    if "token_ids" in c:
        choice["token_ids"] = c["token_ids"]
    return choice


def choice_text(kind: str, c: dict[str, Any]) -> str:
    """The text one choice of a chunk (or of a whole answer) carries."""
    if kind == "cmpl":
        return c.get("text") or ""
    part = c.get("delta") or c.get("message") or {}
    return part.get("content") or ""
