"""One timed request to an OpenAI-compatible endpoint: streaming SSE (or not), parsed with orjson."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class RequestRecord:
    session_id: str
    turn: int
    start: float  # seconds since the run started
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None  # kind: http_<status>, timeout, connection, stream, error_event
    error_message: str = ""
    text: str = ""  # the answer (the next turn's history); not in --result-json
    prompt: Any = None  # the prompt string or chat messages sent; not in --result-json
    group: int = -1
    kind: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def end(self) -> float:
        return self.start + (self.e2e or 0.0)

    @property
    def tpot(self) -> float | None:
        if self.e2e is None or self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def summary_dict(self) -> dict[str, Any]:
        """The record for --result-json (without the generated text)."""
        return {
            "session_id": self.session_id,
            "turn": self.turn,
            "start": self.start,
            "ttft": self.ttft,
            "e2e": self.e2e,
            "itl": self.itl,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "error": self.error,
            "error_message": self.error_message,
            "group": self.group,
            "kind": self.kind,
        }


@dataclass(slots=True)
class Target:
    name: str
    base_url: str
    model: str = ""


def _content(chunk: dict[str, Any], chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _full_text(body: dict[str, Any], chat: bool) -> str:
    choices = body.get("choices") or [{}]
    if chat:
        return (choices[0].get("message") or {}).get("content") or ""
    return choices[0].get("text") or ""


def _error_text(raw: bytes) -> str:
    try:
        err = orjson.loads(raw).get("error", {})
        return str(err.get("message", ""))[:200] if isinstance(err, dict) else str(err)[:200]
    except (orjson.JSONDecodeError, AttributeError):
        return raw[:200].decode(errors="replace")


async def _read_stream(resp: aiohttp.ClientResponse, rec: RequestRecord, chat: bool, t0: float) -> None:
    last = t0
    chunks = 0
    text: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        chunk = orjson.loads(data)
        if "error" in chunk:
            rec.error, rec.error_message = "error_event", str(chunk["error"])[:200]
            return
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            rec.output_tokens = int(usage.get("completion_tokens") or 0)
        piece = _content(chunk, chat)
        if not piece:
            continue
        now = time.perf_counter()
        if rec.ttft is None:
            rec.ttft = now - t0
        else:
            rec.itl.append(now - last)
        last = now
        chunks += 1
        text.append(piece)
    rec.e2e = time.perf_counter() - t0
    rec.text = "".join(text)
    if not done:
        rec.error, rec.error_message = "stream", "the stream ended without [DONE]"
    elif rec.output_tokens == 0:
        rec.output_tokens = chunks  # no usage chunk: one token per content chunk is the best guess


async def send(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    rec: RequestRecord,
    chat: bool,
    timeout: float,
) -> RequestRecord:
    """POST ``body`` to ``url`` and fill ``rec`` with timings, token counts, text or the error's kind."""
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with http.post(url, data=orjson.dumps(body), headers=headers) as resp:
                if resp.status != 200:
                    rec.error, rec.error_message = f"http_{resp.status}", _error_text(await resp.read())
                elif body.get("stream"):
                    await _read_stream(resp, rec, chat, t0)
                else:
                    payload = orjson.loads(await resp.read())
                    rec.e2e = rec.ttft = time.perf_counter() - t0
                    usage = payload.get("usage") or {}
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    rec.output_tokens = int(usage.get("completion_tokens") or 0)
                    rec.text = _full_text(payload, chat)
    except TimeoutError:
        rec.error, rec.error_message = "timeout", f"no complete answer within {timeout:g} s"
    except aiohttp.ClientPayloadError as e:
        rec.error, rec.error_message = "stream", str(e)[:200]
    except aiohttp.ClientError as e:
        rec.error, rec.error_message = "connection", str(e)[:200]
    except (orjson.JSONDecodeError, ValueError) as e:
        rec.error, rec.error_message = "stream", f"bad JSON in the answer: {e}"[:200]
    if rec.error is not None:
        rec.ttft = rec.e2e = None
    return rec
