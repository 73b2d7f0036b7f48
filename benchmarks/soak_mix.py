"""The soak's request mix and its judge: what each kind of request sends, the unbroken answer it must get, and
how one streamed or whole answer is read back and compared with it.

Every kind is greedy, so its answer is fixed: the soak asks each kind once on the quiet deployment before any
chaos (``reference``) and then holds every answer under chaos to that text, one finish reason and, for a
stream, one ``[DONE]`` (a resumed stream must be exactly the unbroken one). The kinds are those a resumed
stream used to get wrong:

- ``completion``: a completion with ``max_tokens`` and ``ignore_eos`` (the old soak's only kind);
- ``chat_no_max``: a chat with no ``max_tokens``, which ends by length at the context (``--max-model-len``);
- ``penalised``: a completion with frequency and presence penalties, which count the output tokens;
- ``chat_stop``: a chat that ends by a stop token (an EOS, as far as the engine can tell: ``stop_token_ids``
  names a token its greedy answer produces), so nothing may follow the finish;
- ``long_prompt``: a completion whose prompt is long enough for the router to disaggregate it (prefill on a
  prefill rank, decode on a decode rank) when the node has P/D ranks: the router estimates it at 57 tokens
  (4 characters a token; the tiny model's tokenizer makes 147 of it), over the soak's
  ``--pd-min-prompt-tokens 32``; the other kinds' prompts are estimated under 32 and run on a decode rank.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
STORY = "Once upon a time"
LONG_PROMPT = " ".join(f"The {i}th guest brought a lamp, a map and a bell to the house by the sea." for i in
                       range(3))


@dataclass
class Kind:
    """One kind of request: its path and body (without ``stream``) and the unbroken answer it must get."""

    name: str
    path: str
    body: dict[str, Any]
    text: str | None = None  # the unbroken answer's text (``reference``)
    finish: str | None = None  # and its finish reason
    tokens: int | None = None  # and its output tokens

    def request(self, model: str, stream: bool) -> dict[str, Any]:
        return {"model": model, **self.body, "stream": stream}


def kinds(max_tokens: int) -> list[Kind]:
    """The mix, in the order the load cycles through it (``reference`` sets ``chat_stop``'s stop token)."""
    greedy = {"temperature": 0}
    return [
        Kind("completion", COMPLETIONS, {"prompt": STORY, "max_tokens": max_tokens, "ignore_eos": True,
                                         **greedy}),
        Kind("chat_no_max", CHAT, {"messages": [{"role": "user", "content": "Tell me about the sea."}],
                                   **greedy}),
        Kind("penalised", COMPLETIONS, {"prompt": "The old lighthouse keeper said",
                                        "max_tokens": 3 * max_tokens,
                                        "frequency_penalty": 1.0, "presence_penalty": 0.5, "ignore_eos": True,
                                        **greedy}),
        Kind("chat_stop", CHAT, {"messages": [{"role": "user", "content": "Name three colours."}],
                                 "max_tokens": 4 * max_tokens, **greedy}),
        Kind("long_prompt", COMPLETIONS, {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                                          **greedy}),
    ]


@dataclass
class Answer:
    """What one answer held: its text, finish reasons, ``[DONE]`` markers, error events and output tokens."""

    text: str = ""
    finishes: list[str] = field(default_factory=list)
    dones: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int | None = None
    trailing: bool = False  # data after [DONE]


def read_whole(kind: Kind, obj: dict[str, Any]) -> Answer:
    choice = obj["choices"][0]
    text = choice["text"] if kind.path == COMPLETIONS else choice["message"].get("content") or ""
    tokens = (obj.get("usage") or {}).get("completion_tokens")
    return Answer(text, [choice.get("finish_reason")], 0, [], tokens)


def read_stream(kind: Kind, sse: str) -> Answer:
    """An SSE body's events, as the client has them."""
    a = Answer()
    for event in sse.split("\n\n"):
        if not event.strip():
            continue
        if a.dones:
            a.trailing = True
        payload = event[5:].strip() if event.startswith("data:") else ""
        if payload == "[DONE]":
            a.dones += 1
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            a.errors.append(f"not JSON: {event[:80]!r}")
            continue
        if "error" in obj:
            a.errors.append(str(obj["error"].get("message", obj["error"]))[:160])
            continue
        for c in obj.get("choices") or ():
            part = c.get("text") if kind.path == COMPLETIONS else (c.get("delta") or {}).get("content")
            a.text += part or ""
            if c.get("finish_reason") is not None:
                a.finishes.append(c["finish_reason"])
        if obj.get("usage"):
            a.tokens = obj["usage"].get("completion_tokens")
    return a


def judge(kind: Kind, a: Answer, stream: bool) -> str | None:
    """Why the answer is not the unbroken one (None: it is)."""
    if a.errors:
        return "error event: " + a.errors[0]
    if stream and (a.dones != 1 or a.trailing):
        return f"{a.dones} [DONE] markers" + (", data after [DONE]" if a.trailing else "")
    if len(a.finishes) != 1:
        return f"{len(a.finishes)} finish reasons {a.finishes}"
    if a.finishes[0] != kind.finish:
        return f"finish_reason {a.finishes[0]!r}, unbroken {kind.finish!r}"
    if a.text != kind.text:
        at = next((i for i, (x, y) in enumerate(zip(a.text, kind.text, strict=False)) if x != y),
                  min(len(a.text), len(kind.text)))
        return f"text differs at character {at} ({len(a.text)} characters, unbroken {len(kind.text)})"
    if a.tokens is not None and kind.tokens is not None and a.tokens != kind.tokens:
        return f"{a.tokens} output tokens, unbroken {kind.tokens}"
    return None


def reference(url: str, model: str, mix: list[Kind]) -> None:
    """Each kind's unbroken answer, asked once (not streamed) on the quiet deployment; ``chat_stop`` gets a
    stop token from its own unbroken answer (its 6th output token) and is asked again with it."""
    with httpx.Client(base_url=url, timeout=300) as client:
        for kind in mix:
            if kind.name == "chat_stop":
                ids = _ask(client, kind, model, return_token_ids=True)["choices"][0]["token_ids"]
                kind.body["stop_token_ids"] = [ids[min(5, len(ids) - 1)]]
            obj = _ask(client, kind, model)
            a = read_whole(kind, obj)
            kind.text, kind.finish, kind.tokens = a.text, a.finishes[0], a.tokens


def _ask(client: httpx.Client, kind: Kind, model: str, **extra: Any) -> dict[str, Any]:
    r = client.post(kind.path, json={**kind.request(model, False), **extra})
    if r.status_code != 200:
        raise RuntimeError(f"reference answer of {kind.name}: {r.status_code} {r.text[:300]}")
    return r.json()
