"""The last step of the request path: pass an upstream's answer to the client, chunk by chunk.

The status and headers go out only with the answer's first body bytes, so an upstream that fails before
those is still retried elsewhere (a ``Failure``). Once a byte went out there is no retry: a failure mid-stream
ends the stream with a clear error (an SSE error event, or a cut connection for a sized body). A gap of
--stream-idle-timeout-s, waiting on the upstream or on a slow client, ends a stream the same way. A streamed
chat or completion that may move to another rank goes through ``lbd.router.migration`` instead, which resumes
it there from the tokens already sent.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

import orjson

from lbd.policies import Decision
from lbd.router.headers import HeaderRewriter
from lbd.router.messages import Response, serialize_headers
from lbd.router.routed import Attempt, ClientGone, Failure
from lbd.router.state import RouterState
from lbd.router.upstream import Response as UpstreamResponse
from lbd.router.upstream import UpstreamError


class Tracked(Protocol):
    """A stream that may move to another rank mid-stream (lbd.router.resumable.Move)."""

    def takes(self, upstream: UpstreamResponse) -> bool: ...

    async def relay(
        self, relay: Relay, out: Response, a: Attempt, upstream: UpstreamResponse, rid_header: bytes
    ) -> Failure | None: ...

log = logging.getLogger("lbd.router")

SMALL_BODY = 1 << 20  # sized answers up to this are read whole and sent in one write


class Relay:
    def __init__(self, state: RouterState, rewriter: HeaderRewriter) -> None:
        self.state = state
        self.cfg = state.cfg
        self.loop = state.loop
        self.rewriter = rewriter

    async def relay(
        self,
        out: Response,
        a: Attempt,
        upstream: UpstreamResponse,
        rid_header: bytes,
        move: Tracked | None = None,
    ) -> Failure | None:
        """Pass the answer through; a failure before its first byte is still retryable. A stream that may move
        to another rank (``move``) goes through its tracking pump (lbd.router.resumable) instead."""
        if move is not None and move.takes(upstream):
            return await move.relay(self, out, a, upstream, rid_header)
        idle = self.cfg.stream_idle_timeout_s
        length = upstream.content_length
        # sized and small, or already whole (a 204 or 304 has no body: it must not be sent as a chunked one)
        small = (length is not None and length <= SMALL_BODY and not upstream.chunked) or upstream.complete
        try:
            first = upstream.take_whole() if small else None
            if first is None:
                first = await (upstream.read(idle) if small else upstream.read_chunk(idle))
        except (UpstreamError, TimeoutError) as e:
            return self.no_first_byte(a, e, idle)
        self.began(a, upstream, not small)
        headers = self.response_headers(upstream, a.decision, rid_header)
        try:
            if small:
                out.send(upstream.status, headers, first)
                return None
            out.start(upstream.status, headers, length)
        except ConnectionResetError:
            raise ClientGone() from None
        await self.pump(out, upstream, first, a.ep.url, idle)
        return None

    def began(self, a: Attempt, upstream: UpstreamResponse, stream: bool) -> None:
        """The answer began: the endpoint makes progress, the request's prefill is over (its pending blocks
        settle), and a stream's first event is a time to first token for the policy to learn from."""
        state = self.state
        a.started = True
        state.outliers.answered(a.ep, a, self.loop.time())
        state.shared.start(a.ep.slot, a.charge)
        if a.pending is not None:
            state.exact.settle(a.pending, True)  # type: ignore[union-attr]
        if stream and "text/event-stream" in upstream.content_type:  # (a whole answer includes decode)
            state.policy.on_first_byte(a.decision, self.loop.time() - a.dispatched_at)

    def no_first_byte(self, a: Attempt, e: Exception, idle: float) -> Failure:
        """The upstream closed or went quiet before its answer's first byte: retryable when it closed."""
        gone = not isinstance(e, TimeoutError)
        self.state.fail(a.ep, "request", f"{type(e).__name__} before the first byte")
        what = "closed the connection" if gone else f"sent nothing for {idle:g}s (--stream-idle-timeout-s)"
        return Failure(
            502 if gone else 504,
            f"upstream {a.ep.url} {what} before the first byte",
            "upstream_gone" if gone else "stream_idle_timeout",
            gone,
        )

    def response_headers(self, upstream: UpstreamResponse, d: Decision, rid_header: bytes) -> bytes:
        """The upstream's headers for the client (lbd.router.headers), plus ours."""
        parts = self.rewriter.response(upstream.raw_headers)
        parts.append(rid_header)
        if self.cfg.debug_headers:
            extra = (("x-lbd-endpoint", d.endpoint.key), ("x-lbd-route-reason", d.line()))
            parts.append(serialize_headers(extra))
        return b"".join(parts)

    async def pump(
        self, out: Response, upstream: UpstreamResponse, chunk: bytes, url: str, idle: float
    ) -> None:
        """Copy the stream; a gap of ``idle`` s (waiting on the upstream or on a slow client) ends it."""
        task = asyncio.current_task()
        assert task is not None
        dog = Watchdog(self.loop, idle, task)
        try:
            while chunk:
                try:
                    await out.write(chunk)
                except ConnectionResetError:
                    raise ClientGone() from None
                dog.last = self.loop.time()
                chunk = await upstream.read_chunk()
        except asyncio.CancelledError:
            if not dog.fired:
                raise
            task.uncancel()
            await self.end_broken_stream(out, upstream, url, TimeoutError())
            return
        except UpstreamError as e:
            await self.end_broken_stream(out, upstream, url, e)
            return
        finally:
            dog.cancel()
        try:
            out.end()
        except ConnectionResetError:
            raise ClientGone() from None

    async def end_broken_stream(
        self, out: Response, upstream: UpstreamResponse, url: str, e: BaseException
    ) -> None:
        """After bytes went out no retry is possible: end the stream with a clear error."""
        what = "stalled" if isinstance(e, TimeoutError) else "failed"
        self.state.metrics.upstream_errors.labels(url, "mid_stream").inc()
        log.warning("upstream %s %s mid-stream: %s", url, what, type(e).__name__)
        sse = "text/event-stream" in upstream.content_type and upstream.content_length is None
        if sse and not out.backed_up:  # (a client that stopped reading would never take the error event)
            err = {
                "error": {
                    "message": f"upstream {what} mid-stream ({type(e).__name__}); the response is incomplete",
                    "type": "BadGatewayError",
                    "param": None,
                    "code": 502,
                }
            }
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
                out.end()
                return
            except ConnectionResetError:
                raise ClientGone() from None
        # A sized or non-SSE body: cut the connection so the client cannot take a truncated body for whole.
        out.abort()
        raise ClientGone()


class Watchdog:
    """Cancels ``task`` once ``last`` (loop time, set by the caller per event) is ``idle`` s old.

    One timer per stream, moved only when it fires early: per event the caller just stores the time, where
    rescheduling a timeout per chunk (asyncio.timeout) cancelled and created a timer handle per token."""

    __slots__ = ("loop", "idle", "task", "last", "fired", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float, task: asyncio.Task[object]) -> None:
        self.loop, self.idle, self.task = loop, idle, task
        self.last = loop.time()
        self.fired = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + idle, self._check)

    def _check(self) -> None:
        due = self.last + self.idle
        if self.loop.time() < due:
            self._handle = self.loop.call_at(due, self._check)
            return
        self._handle = None
        self.fired = True
        self.task.cancel()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
