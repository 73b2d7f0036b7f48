"""One resumable stream as the client has it (``Move``): the router's one pump (``lbd.router.relay``) passes a
rank's SSE events on through it, a ``Tap`` that counts the output token ids whose text reached the client,
strips the ids the client did not ask for, and, on a continuation, rewrites the chunks as the original
stream's (a tool chat's continuation is a chat: its chunks keep their shape, tool-call deltas included). A
failure mid-stream sets ``broken``; ``lbd.router.migration`` then picks the next rank and starts the
continuation (``resume_on``).

A stream whose choice already carried its ``finish_reason`` is done: cut after that (during the usage chunk or
before ``[DONE]``) it is not resumed (that would continue past its end and send a second finish reason);
``tail`` is what it still lacks (the usage chunk it asked for), the migrator adds ``[DONE]``. A partial event
waits for its rest in pieces (no copy per read) up to ``MAX_EVENT_BYTES``: more without an event's end is a
broken upstream (``oversized``), never resumed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import orjson

from lbd.router.continuation import (
    CHAT,
    COMPLETIONS,
    RankFacts,
    as_chat_choice,
    choice_text,
    continuation,
    fix_usage,
    rank_facts,
    shift_offsets,
    tool_chat,
)
from lbd.router.messages import Response
from lbd.router.routed import Attempt, Failure
from lbd.router.state import RouterState
from lbd.router.upstream import Response as UpstreamResponse

RETRYABLE_CODES = frozenset({502, 503, 504})  # an error event with one of these codes: the rank failed
# a choice's ids as lbd's engine and vLLM write them (compact JSON); a quote in a string is escaped, so this
# cannot match text
_IDS = re.compile(rb',"token_ids":\[([0-9,]*)\]')
# the prompt's ids, with the first event: cut out as bytes and parsed only for a move (a 2,000-token prompt's
# ids are most of that event: parsing and writing it again cost more than the rest of the stream's first byte)
_PROMPT_IDS = b',"prompt_token_ids":['
_FINISH = b'"finish_reason":'
DONE = b"data: [DONE]\n\n"
MAX_EVENT_BYTES = 16 << 20  # one SSE event (a 1M-token prompt's ids are about 7 MB)


class Move:
    """One request's stream as the client has it, and its moves."""

    closing = DONE  # the one [DONE] the client gets: the ranks' are held back, a stream without one broke

    def __init__(self, kind: str, data: dict[str, Any], client_ids: bool, impossible: str | None) -> None:
        self.kind, self.data, self.client_ids, self.impossible = kind, data, client_ids, impossible
        # where a continuation goes: completions, but a tool chat goes on as a chat (continuation.tool_chat)
        self.path = CHAT if tool_chat(kind, data) else COMPLETIONS
        # the usual event (one choice's ids, nothing else to rewrite) has its ids cut out of the bytes, not
        # parsed and written again; ``chars`` is then not counted (only completions logprobs' offsets need it)
        self.fast = not client_ids and not data.get("logprobs")
        self._prompt_ids: list[int] | None = None
        self._prompt_raw: bytes | None = None  # the prompt's ids as the rank wrote them, not parsed yet
        self.out_ids: list[int] = []
        self.ids_ok = True  # every event with text had its token ids
        self.chars = 0  # text characters the client has
        self.ident: tuple[Any, Any, Any] | None = None  # the original's id, created, model
        self.resuming = False
        self.body = b""  # the continuation's body, while resuming
        self.before = 0  # output tokens before the current continuation
        self.base_chars = 0
        self.moves = 0
        self.broken: str | None = None  # why the current upstream failed mid-stream
        self.failed_key = ""
        self.failed_url = ""
        self.broke_at = 0.0
        self.gap: float | None = None  # failure to the continuation's first token
        self.done = False
        self._clock: Callable[[], float] = time.monotonic  # the router loop's clock, once it broke
        self.finished = False  # a choice carried its finish_reason: the answer is whole
        self.usage_sent = False  # the usage chunk went out
        self.echo = kind == "cmpl" and data.get("echo") is True  # the first text is the prompt, without ids
        self.top_n = int(data.get("top_logprobs") or 0) if kind == "chat" else 0
        self.origin: RankFacts | None = None  # the rank that served the stream first (its model card)
        self._origin_ep: Any = None
        self._rest: list[bytes] = []  # a partial event's pieces
        self._rest_size = 0

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids as the rank gave them with its first event (None: it gave none)."""
        if self._prompt_ids is None and self._prompt_raw is not None:
            raw, self._prompt_raw = self._prompt_raw, None
            self._prompt_ids = [int(t) for t in raw.split(b",")] if raw else []
        return self._prompt_ids

    def origin_facts(self) -> RankFacts | None:
        """The first rank's facts, read from its model card when the stream began there (or, if the router had
        not learned its card yet, at the move); None: not known."""
        ep = self._origin_ep
        if self.origin is None and ep is not None and ep.model_cards:
            self.origin = rank_facts(ep.model_cards, self.data.get("model"))
        return self.origin

    def takes(self, upstream: UpstreamResponse) -> bool:
        """Whether this answer is pumped through this tap (a continuation always is)."""
        return self.resuming or (
            upstream.status == 200
            and upstream.content_length is None
            and "text/event-stream" in upstream.content_type
        )

    def resume_on(self, max_tokens: int) -> None:
        """Start a continuation from what the client has (``max_tokens``: what the unbroken run had left)."""
        assert self.prompt_ids is not None
        body = continuation(self.kind, self.data, self.prompt_ids, self.out_ids, max_tokens)
        self.body = orjson.dumps(body)
        self.resuming, self.broken, self.gap = True, None, None
        self._rest, self._rest_size = [], 0
        self.before, self.base_chars = len(self.out_ids), self.chars
        self.moves += 1

    def refuses(self, a: Attempt, upstream: UpstreamResponse) -> Failure | None:
        """A continuation answered with anything but its stream: a failure of that try (no byte went out)."""
        if self.resuming and (upstream.status != 200 or "text/event-stream" not in upstream.content_type):
            what = f"upstream {a.ep.url} answered the continuation with {upstream.status}"
            return Failure(upstream.status, what, "continuation_refused", upstream.status >= 500)
        return None

    # ---- the pump's tap (lbd.router.relay.Tap): Relay.stream runs this stream through its one loop --------
    def begins(self, a: Attempt) -> bool:
        """The first rank is the one whose tokenizer made the ids (what a continuation must match); a
        continuation's status and headers are the client's already."""
        if self._origin_ep is None:
            self._origin_ep = a.ep
            self.origin_facts()
        return not self.resuming

    async def broke(
        self, state: RouterState, out: Response, a: Attempt, upstream: UpstreamResponse, why: str
    ) -> None:
        """A failure mid-stream: noted (``broken``) for lbd.router.migration, which resumes the stream on
        another rank."""
        self.broken = why
        state.fail(a.ep, "request", f"failed mid-stream ({why})")
        self.failed_key, self.failed_url = a.ep.key, a.ep.url
        self._clock = state.loop.time
        self.broke_at = self._clock()

    def feed(self, chunk: bytes) -> bytes:
        """The whole events in what arrived, as the client gets them (a partial event waits for its rest)."""
        if self._rest:
            ends = b"\n\n" in chunk or (chunk[:1] == b"\n" and self._rest[-1][-1:] == b"\n")
            if not ends:
                self._rest.append(chunk)
                self._rest_size += len(chunk)
                if self._rest_size > MAX_EVENT_BYTES:
                    self._rest, self._rest_size, self.broken = [], 0, "oversized"
                return b""
            buf = b"".join(self._rest) + chunk
        else:
            buf = chunk
        events = buf.split(b"\n\n")
        last = events.pop()
        self._rest, self._rest_size = ([last], len(last)) if last else ([], 0)
        if self._rest_size > MAX_EVENT_BYTES:
            self._rest, self._rest_size, self.broken = [], 0, "oversized"
        parts = []
        for ev in events:
            if self.done or self.broken is not None:
                break
            piece = self._event(ev)
            if piece is not None:
                parts.append(piece)
        return b"".join(parts)

    def tail(self) -> bytes:
        """What a finished stream cut before ``[DONE]`` still owes the client: the usage chunk it asked for
        (``stream_options.include_usage``), counted from the ids it had."""
        opts = self.data.get("stream_options")
        if self.usage_sent or not (isinstance(opts, dict) and opts.get("include_usage")):
            return b""
        if self.prompt_ids is None or not self.ids_ok:
            return b""
        prompt, done = len(self.prompt_ids), len(self.out_ids)
        return self._chunk_bytes([], {"prompt_tokens": prompt, "completion_tokens": done,
                                      "total_tokens": prompt + done})

    def ending(self) -> bytes:
        """The last chunk of an answer that reached its token limit with its finish reason cut off."""
        self.finished = True
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice["stop_reason"] = None
        return self._chunk_bytes([choice], None)

    def _chunk_bytes(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> bytes:
        ident, created, model = self.ident or (None, None, None)
        obj: dict[str, Any] = {"id": ident, "object": "chat.completion.chunk" if self.kind == "chat"
                               else "text_completion", "created": created, "model": model, "choices": choices}
        if usage is not None:
            obj["usage"] = usage
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def _event(self, ev: bytes) -> bytes | None:
        if self.fast and not self.resuming and self.ident is None and self._prompt_raw is None:
            at = ev.find(_PROMPT_IDS)
            end = ev.find(b"]", at) if at >= 0 else -1
            if end > 0:
                self._prompt_raw = ev[at + len(_PROMPT_IDS) : end]
                ev = ev[:at] + ev[end + 1 :]
        if self.fast and not self.resuming and self.ident is not None:
            m = _IDS.search(ev)
            if m is not None and b"prompt_token_ids" not in ev:
                ids = m.group(1)
                if ids:
                    self.out_ids.extend(map(int, ids.split(b",")))
                if _finishes(ev):
                    self.finished = True
                return ev[: m.start()] + ev[m.end() :] + b"\n\n"
        if not ev.startswith(b"data:"):
            return ev + b"\n\n" if ev.strip() else None
        payload = ev[5:].strip()
        if payload == b"[DONE]":
            self.done = True
            return None
        if self.impossible is not None and b'"error"' not in payload:  # it cannot move: only whether it ended
            self.finished = self.finished or _finishes(payload)
            return ev + b"\n\n"
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return ev + b"\n\n"
        if not isinstance(obj, dict):
            return ev + b"\n\n"
        err = obj.get("error")
        if err is not None:
            if isinstance(err, dict) and err.get("code") in RETRYABLE_CODES:
                self.broken = "error_event"
                return None
            return ev + b"\n\n"
        if not self.chunk(obj):  # (nothing to strip or rewrite: the rank's bytes as they were)
            return ev + b"\n\n"
        return b"data: " + orjson.dumps(obj) + b"\n\n"

    def chunk(self, obj: dict[str, Any]) -> bool:
        """Track one chunk (ids, text) and rewrite it for the client; False: it is unchanged."""
        keep = self.client_ids and not self.resuming
        prompt = obj.get("prompt_token_ids") if keep else obj.pop("prompt_token_ids", None)
        changed = self.resuming or (prompt is not None and not keep)
        if self.ident is None:
            self.ident = (obj.get("id"), obj.get("created"), obj.get("model"))
        if self.resuming:
            obj["id"], obj["created"], obj["model"] = self.ident
            if self.kind == "chat":
                obj["object"] = "chat.completion.chunk"
        choices = obj.get("choices") or []
        for i, c in enumerate(choices):
            p = c.get("prompt_token_ids") if keep else c.pop("prompt_token_ids", None)
            prompt = prompt if prompt is not None else p
            ids = c.get("token_ids") if self.client_ids else c.pop("token_ids", None)
            changed = changed or (p is not None and not keep) or (ids is not None and not self.client_ids)
            if self.resuming:
                if self.kind == "chat":
                    if self.path != CHAT:  # (a chat continuation's choices are chat choices already)
                        choices[i] = c = as_chat_choice(c, self.top_n)
                else:
                    shift_offsets(c.get("logprobs"), self.base_chars)
            text = choice_text(self.kind, c)
            if ids is not None:
                self.out_ids.extend(ids)
            elif text and self.echo and not self.out_ids and self.chars == 0 and not self.resuming:
                pass  # the echoed prompt (lbd's engine sends it first, on its own, without ids)
            elif text:
                self.ids_ok = False
            if c.get("finish_reason") is not None:
                self.finished = True
            self.chars += len(text)
            if self.resuming and self.gap is None and (ids or text):
                self.gap = self._clock() - self.broke_at
        if prompt is not None and self.prompt_ids is None and not self.resuming:
            self._prompt_ids = list(prompt)
        usage = obj.get("usage")
        if isinstance(usage, dict) and not choices:
            self.usage_sent = True
        if self.resuming and isinstance(usage, dict) and self.prompt_ids is not None:
            fix_usage(usage, len(self.prompt_ids), self.before)
        return changed


def _finishes(ev: bytes) -> bool:
    """Whether an event's compact JSON gives a choice a finish reason (a quote in a string is escaped, so
    text cannot hold the key)."""
    at = ev.find(_FINISH)
    while at >= 0:
        if not ev[at + len(_FINISH) :].lstrip().startswith(b"null"):
            return True
        at = ev.find(_FINISH, at + len(_FINISH))
    return False
