"""The pure parts of resuming a stream on another rank (``lbd.router.migration``): whether a request can be
resumed, the continuation request, and the continuation's chunks rewritten as the original stream's.

The continuation is a completions request with a token prompt (a tool chat's aside: below): the prompt's ids
followed by the output ids the client already has, ``min_tokens`` reduced by them, every other field of the
original kept as it was (temperature, seed, stop strings, stop_token_ids, the engines' extras). Its
``max_tokens`` is what the unbroken run had left (``left``): the original's limit less the tokens sent; with
no limit, what the engines default to (lbd's engine and vLLM alike): 16 for a completion, and for a chat the
context length of the rank that served it less prompt and output (both engines refuse a request whose prompt +
``max_tokens`` passes the context, so "up to the context" must be sent as a number). A chat is resumed the
same way, its prompt as the rank rendered it (the ``prompt_token_ids`` it returned): the completions chunks
are turned back into chat chunks (``delta.content``) and completions logprobs into chat logprobs (the
original's ``top_logprobs`` alternatives, none for 0).

Frequency and presence penalties count output tokens only: after a move the sent tokens are prompt tokens, so
the continuation tells lbd's engine that its prompt's last n tokens are output (``RESUMED_FIELD``); an engine
that does not read that field (vLLM) would penalise differently, so such a request moves only to ranks of
lbd's engine (``penalised``; the repetition penalty counts prompt and output alike and needs nothing).

Structured outputs (``response_format`` json_object / json_schema, vLLM's ``structured_outputs`` and
``guided_*`` fields) move the same way, their fields kept on the continuation (a completions request takes
them too): lbd's engine, told by ``RESUMED_FIELD`` which prompt tokens were output, advances the request's
grammar over them before it samples, so the answer goes on where the grammar was (it answers 400 if they are
not a prefix the grammar allows). vLLM would start the grammar again mid-answer, so such a request moves only
between ranks of lbd's engine (``needs_lbd``).

A chat with tools (``tool_choice`` ``auto``, ``required`` or a named function; ``none`` is plain text) is not
a completion: the rank turns its text into tool-call deltas with its parser (``auto``) or reads the calls its
grammar forced (``required``, named), so a completion's text would reach the client as content. Its
continuation is therefore the chat itself (``tool_chat``; ``Move.path`` is the chat path): the original body
with ``RESUMED_IDS_FIELD``, the output ids the client has. lbd's engine renders the messages as the first rank
did (the same tokenizer fingerprint: the same template), appends those ids, counts them as output (penalties,
the forced grammar's matcher advanced over them) and has its formatter read their text before it samples, so
the parser is where the first rank's was when the client's last chunk left: a call already announced is not
announced again, its arguments go on where they stopped, and the one finish reason is the whole answer's.
The chunks need no rewriting but the original's ``id``, ``created`` and ``model`` and the usage; the engine
leaves out the role delta the client had. Only lbd's engine takes the field (``needs_lbd``), and ranks of one
model are assumed to share their tool-call flags (``--enable-auto-tool-choice --tool-call-parser``), which the
fingerprint does not cover.

What a continuation cannot reproduce is refused with its reason: legacy ``functions``, images or audio (the
ids hold their placeholders, not the media), ``n`` > 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
FIELD = b'"return_token_ids":true'
RESUMED_FIELD = "lbd_resumed_output_tokens"  # lbd's engine: the prompt's last n tokens count as output
# lbd's engine, on a chat: these output ids follow the rendered messages and count as output (its chat.py)
RESUMED_IDS_FIELD = "lbd_resumed_output_token_ids"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # a completion without max_tokens (lbd's engine and vLLM)
# vLLM's structured-output fields: only lbd's engine continues their grammar from the tokens sent
STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs",
              "structural_tag")
# fields a continuation must not carry: its prompt is ids already cut and rendered, and the original sent
# the prompt's logprobs and echo
_DROPPED = ("suffix", "truncate_prompt_tokens", "prompt_logprobs", "add_special_tokens", RESUMED_FIELD)
# fields a chat continuation must not carry: the client had the prompt's logprobs; its limit is max_tokens
_CHAT_DROPPED = ("prompt_logprobs", RESUMED_FIELD, "max_completion_tokens")
# chat fields that a completions request does not take (the rest, sampling included, goes over as it is)
_CHAT_ONLY = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
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


@dataclass(frozen=True, slots=True)
class RankFacts:
    """What a rank's /v1/models card says about the model a request names: the engine (``owned_by``), the
    model it loaded (``root``), its context length, and lbd's tokenizer fingerprint (``lbd_tokenizer``, the
    one /tokenizer_info publishes: tokenizer and chat template)."""

    engine: str | None = None
    root: str | None = None
    max_model_len: int | None = None
    tokenizer: str | None = None

    def takes_ids_of(self, origin: RankFacts, lbd_only: bool) -> bool:
        """Whether ids made by ``origin``'s tokenizer mean the same here: the same fingerprint; where the
        origin published none (a vLLM rank), a rank that publishes none either and loaded the same model.
        ``lbd_only`` (``needs_lbd``: penalties, a grammar): only lbd's engine continues them exactly."""
        if lbd_only and self.engine != "lbd":
            return False
        if origin.tokenizer is not None:
            return self.tokenizer == origin.tokenizer
        return self.tokenizer is None and self.root == origin.root and self.engine == origin.engine


def rank_facts(cards: list[dict[str, Any]], model: Any) -> RankFacts:
    """The facts of the card for ``model`` (the first card when the request names none)."""
    card = next((c for c in cards if c.get("id") == model), cards[0] if cards and model is None else None)
    if card is None:
        return RankFacts()
    ctx, fp = card.get("max_model_len"), card.get("lbd_tokenizer")
    root, engine = card.get("root"), card.get("owned_by")
    return RankFacts(engine if isinstance(engine, str) else None, root if isinstance(root, str) else None,
                     ctx if isinstance(ctx, int) and ctx > 0 else None, fp if isinstance(fp, str) else None)


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
    if data.get("functions"):
        return "a chat with functions (the router cannot parse function calls from a token continuation)"
    for m in data.get("messages") or ():
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    return f"a chat with {part.get('type')} content (a token prompt cannot carry it)"
    return None


def append_field(body: bytes, field: bytes) -> bytes | None:
    """The JSON object ``body`` with ``field`` (``"key":value``) added last, its other bytes as they were (a
    later key wins); None when ``body`` does not end as an object."""
    head = body.rstrip()
    if not head.endswith(b"}"):
        return None
    inner = head[:-1].rstrip()
    return inner + (field if inner.endswith(b"{") else b"," + field) + b"}"


def with_token_ids(body: bytes) -> bytes:
    """The JSON object ``body`` with ``"return_token_ids": true`` added last (a later key wins)."""
    spliced = append_field(body, FIELD)
    return body if spliced is None else spliced


def penalised(data: dict[str, Any]) -> bool:
    """Whether a penalty counts the output tokens apart from the prompt's (frequency, presence)."""
    return any(isinstance(data.get(k), int | float) and data[k] != 0
               for k in ("frequency_penalty", "presence_penalty"))


def structured(data: dict[str, Any]) -> str | None:
    """The field that constrains the output to a grammar (None: free text)."""
    for name in STRUCTURED:
        if data.get(name) is not None:
            return name
    fmt = data.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        return f"response_format {fmt.get('type')}"
    return None


def tool_chat(kind: str, data: dict[str, Any]) -> bool:
    """Whether this chat's answer may be tool calls (its continuation is a chat: ``chat_continuation``)."""
    return kind == "chat" and bool(data.get("tools")) and data.get("tool_choice") != "none"


def needs_lbd(data: dict[str, Any]) -> str | None:
    """Why only lbd's engine can continue this request (None: any engine can): output-counting penalties, a
    grammar to advance over the tokens sent (both read ``RESUMED_FIELD``), or tool calls to parse on from
    them (``RESUMED_IDS_FIELD``)."""
    if tool_chat("chat", data) and isinstance(data.get("messages"), list):
        return "a chat with tools must parse its tool calls on from the tokens sent"
    if penalised(data):
        return "frequency or presence penalties count output tokens"
    what = structured(data)
    if what is not None:
        return f"a structured output ({what}) must continue its grammar from the tokens sent"
    return None


def left(kind: str, data: dict[str, Any], prompt_len: int, n: int, context: int | None) -> int | None:
    """Output tokens the unbroken run had left after ``n`` (<= 0: it was done; None: not known, a chat with no
    limit on a rank whose context length is unknown)."""
    limit = data.get("max_tokens")
    if kind == "chat" and data.get("max_completion_tokens") is not None:
        limit = data["max_completion_tokens"]
    if isinstance(limit, int) and not isinstance(limit, bool):
        return limit - n
    if kind == "cmpl":
        return COMPLETIONS_DEFAULT_MAX_TOKENS - n
    return None if context is None else context - prompt_len - n


def continuation(kind: str, data: dict[str, Any], prompt_ids: list[int], sent: list[int],
                 max_tokens: int) -> dict[str, Any]:
    """The completions request that continues ``data`` after the output tokens ``sent`` (``max_tokens``:
    what is ``left``); a tool chat's is a chat (``chat_continuation``)."""
    if tool_chat(kind, data):
        return chat_continuation(data, sent, max_tokens)
    body = {k: v for k, v in data.items() if k not in _CHAT_ONLY} if kind == "chat" else dict(data)
    for k in _DROPPED:
        body.pop(k, None)
    body["prompt"] = list(prompt_ids) + sent
    body["echo"] = False
    body["return_token_ids"] = True
    n = len(sent)
    body["max_tokens"] = max_tokens
    if kind == "chat":
        body.pop("max_completion_tokens", None)
    if isinstance(data.get("min_tokens"), int):
        body["min_tokens"] = max(data["min_tokens"] - n, 0)
    if kind == "chat" and data.get("logprobs"):
        body["logprobs"] = int(data.get("top_logprobs") or 0)
    if needs_lbd(data) and n:
        body[RESUMED_FIELD] = n
    return body


def chat_continuation(data: dict[str, Any], sent: list[int], max_tokens: int) -> dict[str, Any]:
    """The tool chat ``data`` again, told the output ids ``sent`` (after any it was itself told)."""
    body = {k: v for k, v in data.items() if k not in _CHAT_DROPPED}
    before = data.get(RESUMED_IDS_FIELD)
    body[RESUMED_IDS_FIELD] = (list(before) if isinstance(before, list) else []) + list(sent)
    body["max_tokens"] = max_tokens
    body["return_token_ids"] = True
    if isinstance(data.get("min_tokens"), int):
        body["min_tokens"] = max(data["min_tokens"] - len(sent), 0)
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


def chat_logprobs(lp: dict[str, Any] | None, top_n: int) -> dict[str, Any] | None:
    """Completions logprobs (tokens, token_logprobs, top_logprobs) as chat logprobs (content entries) with
    ``top_n`` alternatives each: a completion's top dict lists the best first and adds the chosen token when
    it is not among them, which a chat's ``top_logprobs`` does not (0: none)."""
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
                {"token": t, "logprob": v, "bytes": list(t.encode())}
                for t, v in list((top or {}).items())[:top_n]
            ],
        }
        content.append(entry)
    return {"content": content}


def as_chat_choice(c: dict[str, Any], top_n: int = 0) -> dict[str, Any]:
    """A completions chunk's choice as a chat chunk's (``top_n``: the chat's top_logprobs)."""
    text = c.get("text") or ""
    choice: dict[str, Any] = {
        "index": c.get("index", 0),
        "delta": {"content": text} if text else {},
        "logprobs": chat_logprobs(c.get("logprobs"), top_n),
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
