"""Drive one Generation to an HTTP answer: a JSON body, or SSE chunks flushed as the core produces them.

A streamed response's headers are sent only once the first output arrives, so a refusal by the core (e.g.
admission 503) still gets its own HTTP status. Errors after that become an SSE error event, then the end
marker. Chat and completions frame events as ``data: {json}`` and end with ``data: [DONE]``; a formatter may
frame them otherwise (the Responses API: ``event: type``, lead-in and closing events, no end marker).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
from aiohttp import web

from lbd.engine.server.errors import APIError, error_body
from lbd.engine.server.generate import Generation
from lbd.engine.server.sequence import Delta, Sequence

logger = logging.getLogger(__name__)
_DONE = b"data: [DONE]\n\n"


class Formatter(Protocol):
    """Turns deltas into one endpoint's JSON shapes."""

    def stream_start(self, seq: Sequence) -> dict[str, Any] | None: ...

    def stream_chunk(self, delta: Delta) -> dict[str, Any] | list[dict[str, Any]] | None: ...

    def collect(self, delta: Delta) -> None: ...

    def response(self) -> dict[str, Any]: ...

    def usage_chunk(self) -> dict[str, Any]: ...


class EventFraming:
    """How a stream's events are written; the defaults are chat's and completions' (a formatter inherits)."""

    done = _DONE

    def encode(self, event: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(event) + b"\n\n"

    def lead_in(self) -> list[dict[str, Any]]:
        """Events before the first chunk."""
        return []

    def closing(self) -> list[dict[str, Any]]:
        """Events after the last chunk (and after the usage chunk, when asked for)."""
        return []

    def error_event(self, message: str, status: int) -> dict[str, Any]:
        return error_body(message, status)


def json_response(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def respond(request: web.Request, gen: Generation, fmt: Formatter) -> web.StreamResponse:
    state = gen.state
    state.in_flight += 1
    deltas = gen.deltas()
    error: str | None = "client gone"
    try:
        await gen.start()
        if not gen.common.stream:
            async for delta in deltas:
                fmt.collect(delta)
            _log_done(gen)
            error = None
            return json_response(fmt.response())
        first = await anext(deltas, None)
        resp = await _stream(request, gen, fmt, first, deltas)
        error = None
        return resp
    except APIError as e:
        error = e.message
        raise
    finally:
        await deltas.aclose()
        await gen.close()
        state.in_flight -= 1
        if state.tracer is not None:
            model = getattr(fmt, "model", state.config.model.model_name)
            state.tracer.request_done(request.headers, gen, model, error)


async def _stream(request: web.Request, gen: Generation, fmt: Formatter, first: Delta | None,
                  rest: AsyncIterator[Delta]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no"})
    await resp.prepare(request)
    started: set[int] = set()
    usage_each = gen.common.continuous_usage
    usage_key = gen.common.include_usage or usage_each
    framing: EventFraming = fmt if isinstance(fmt, EventFraming) else EventFraming()
    prof = gen.state.client.profiler
    try:
        try:
            for event in framing.lead_in():
                await resp.write(framing.encode(event))
            delta = first
            while delta is not None:
                t0 = time.perf_counter()
                chunks = []
                if delta.seq.index not in started:
                    started.add(delta.seq.index)
                    chunks.append(fmt.stream_start(delta.seq))
                out = fmt.stream_chunk(delta)  # a list: several events (the Responses API's items)
                chunks += out if isinstance(out, list) else [out]
                for chunk in chunks:
                    if chunk is not None:
                        if usage_key:
                            chunk["usage"] = gen.usage() if usage_each else None
                        await resp.write(framing.encode(chunk))
                if prof is not None:
                    prof.add("stream", time.perf_counter() - t0)
                delta = await anext(rest, None)
                if delta is not None and gen.state.streams_ending:  # the server stops (Frontend.drain)
                    raise APIError("the server is shutting down: retry the request", 503)
            if gen.common.include_usage:
                await resp.write(framing.encode(fmt.usage_chunk()))
            for event in framing.closing():
                await resp.write(framing.encode(event))
            _log_done(gen)
        except APIError as e:
            logger.warning("request %s failed mid-stream: %s", gen.id, e.message)
            await resp.write(framing.encode(framing.error_event(e.message, e.status)))
        if framing.done:
            await resp.write(framing.done)
        await resp.write_eof()
    except ConnectionResetError:  # the client went away; respond()'s finally aborts its core requests
        logger.info("client of %s disconnected", gen.id)
    return resp


def _log_done(gen: Generation) -> None:
    if not gen.state.config.observability.disable_log_requests:
        reasons = ",".join(str(s.finish_reason) for s in gen.seqs)
        logger.info("%s done: prompt %d tokens, completion %d tokens, finish %s, %.3fs", gen.id,
                    gen.prompt_tokens, gen.completion_tokens, reasons, time.monotonic() - gen.arrival)
