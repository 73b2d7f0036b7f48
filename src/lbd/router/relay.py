"""The last step of the request path: pass an upstream's answer to the client, chunk by chunk.

The status and headers go out only with the answer's first body bytes, so an upstream that fails before
those is still retried elsewhere (a ``Failure``). Once a byte went out there is no retry: a failure mid-stream
ends the stream with a clear error (an SSE error event, or a cut connection for a sized body). A gap of
--stream-idle-timeout-s, waiting on the upstream or on a slow client, ends a stream the same way.

Every stream goes through one pump (``Relay.stream``); what differs between streams is a ``Tap``: what the
client gets of each chunk, when the answer is over, and what a break mid-stream does. A plain stream's
(``PLAIN``) passes the chunks as they came and ends a break as said above; a streamed chat or completion that
may move to another rank (``lbd.router.resumable.Move``) tracks and rewrites them, and leaves a break to
``lbd.router.migration``, which resumes the stream there from the tokens already sent.
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

log = logging.getLogger("lbd.router")

SMALL_BODY = 1 << 20  # sized answers up to this are read whole and sent in one write
# why a stream broke mid-stream (a Tap's ``broke``) -> what the client's error event says: the upstream
# "failed" or "stalled", and the cause
CAUSES = {
    "reset": ("failed", "UpstreamError"),
    "eof": ("failed", "EOF before [DONE]"),
    "stall": ("stalled", "TimeoutError"),
    "error_event": ("failed", "a retryable error event"),
    "oversized": ("failed", "an event over the router's size cap"),
}


def error_event(message: str) -> bytes:
    """The last words of an SSE stream that broke mid-stream: an OpenAI-style 502 error event, and [DONE]."""
    err = {"error": {"message": message, "type": "BadGatewayError", "param": None, "code": 502}}
    return b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n"


class Tap(Protocol):
    """One stream's part of the pump (``Relay.stream``); the loop, the idle watchdog, the client's and the
    upstream's failures are the pump's."""

    done: bool  # the answer is whole (a tracked stream saw its [DONE]): the pump reads no more
    broken: str | None  # a break that the stream's own bytes said (a CAUSES key): the pump reads no more
    closing: bytes  # an end marker the tap held back, written once at the end; an EOF before it is a break

    def begins(self, a: Attempt) -> bool:
        """The answer's first bytes came from ``a``'s endpoint; True: the client still needs its status and
        headers (False: a continuation of a stream it has)."""
        ...

    def feed(self, chunk: bytes) -> bytes:
        """What the client gets of ``chunk`` (b"": nothing yet)."""
        ...

    async def broke(
        self, state: RouterState, out: Response, a: Attempt, upstream: UpstreamResponse, why: str
    ) -> None:
        """The stream broke mid-stream (``why``: a CAUSES key), after bytes went to the client."""
        ...


class Tracked(Tap, Protocol):
    """A stream that may move to another rank mid-stream (lbd.router.resumable.Move)."""

    def takes(self, upstream: UpstreamResponse) -> bool: ...

    def refuses(self, a: Attempt, upstream: UpstreamResponse) -> Failure | None: ...


class Plain:
    """A stream passed on as it came: a break ends it with an error event (SSE) or a cut connection."""

    done = False
    broken: str | None = None
    closing = b""

    def begins(self, a: Attempt) -> bool:
        return True

    def feed(self, chunk: bytes) -> bytes:
        return chunk

    async def broke(
        self, state: RouterState, out: Response, a: Attempt, upstream: UpstreamResponse, why: str
    ) -> None:
        """After bytes went out no retry is possible: end the stream with a clear error."""
        what, cause = CAUSES[why]
        log.warning("upstream %s %s mid-stream: %s", a.ep.url, what, cause)
        message = f"upstream {what} mid-stream ({cause}); the response is incomplete"
        sse = "text/event-stream" in upstream.content_type and upstream.content_length is None
        if sse and not out.backed_up:  # (a client that stopped reading would never take the error event)
            try:
                await out.write(error_event(message))
                out.end()
                return
            except ConnectionResetError:
                raise ClientGone() from None
        # A sized or non-SSE body: cut the connection so the client cannot take a truncated body for whole.
        out.abort()
        raise ClientGone()


PLAIN = Plain()  # (it keeps nothing per stream)


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
        to another rank (``move``) goes through the pump with its tracking tap (lbd.router.resumable)."""
        if move is not None and move.takes(upstream):
            refused = move.refuses(a, upstream)  # (a continuation answered with no stream)
            if refused is not None:
                return refused
            return await self.stream(out, a, upstream, rid_header, move)
        length = upstream.content_length
        # sized and small, or already whole (a 204 or 304 has no body: it must not be sent as a chunked one)
        small = (length is not None and length <= SMALL_BODY and not upstream.chunked) or upstream.complete
        if not small:
            return await self.stream(out, a, upstream, rid_header, PLAIN)
        idle = self.cfg.stream_idle_timeout_s
        try:
            whole = upstream.take_whole()
            if whole is None:
                whole = await upstream.read(idle)
        except (UpstreamError, TimeoutError) as e:
            return self.no_first_byte(a, e, idle)
        self.began(a, upstream, False)
        try:
            out.send(upstream.status, self.response_headers(upstream, a.decision, rid_header), whole)
        except ConnectionResetError:
            raise ClientGone() from None
        return None

    async def stream(
        self, out: Response, a: Attempt, upstream: UpstreamResponse, rid_header: bytes, tap: Tap
    ) -> Failure | None:
        """The pump: the first chunk (none within --stream-idle-timeout-s, or a closed upstream: a Failure),
        then every chunk as ``tap`` makes it, until the upstream's end or the tap's. A gap of
        --stream-idle-timeout-s (waiting on the upstream or on a slow client) or a failed upstream breaks
        the stream: the tap says what that does. The only reader of an upstream's stream in the router."""
        idle = self.cfg.stream_idle_timeout_s
        try:
            chunk = await upstream.read_chunk(idle)
        except (UpstreamError, TimeoutError) as e:
            return self.no_first_byte(a, e, idle)
        self.began(a, upstream, True)
        if tap.begins(a):
            headers = self.response_headers(upstream, a.decision, rid_header)
            try:
                out.start(upstream.status, headers, upstream.content_length)
            except ConnectionResetError:
                raise ClientGone() from None
        loop = self.loop
        task = asyncio.current_task()
        assert task is not None
        dog = Watchdog(loop, idle, task)
        why = None
        try:
            while chunk:
                data = tap.feed(chunk)
                if data:
                    try:
                        await out.write(data)
                    except ConnectionResetError:
                        raise ClientGone() from None
                    dog.last = loop.time()
                if tap.done or tap.broken is not None:
                    break
                chunk = await upstream.read_chunk()
            else:  # the upstream's end: a break if the tap still waits for its end marker
                why = "eof" if tap.closing else None
        except asyncio.CancelledError:
            if not dog.fired:
                raise
            task.uncancel()
            why = "stall"
        except UpstreamError:
            why = "reset"
        finally:
            dog.cancel()
        await self._end(out, a, upstream, tap, why or tap.broken)
        return None

    async def _end(
        self, out: Response, a: Attempt, upstream: UpstreamResponse, tap: Tap, why: str | None
    ) -> None:
        """End a pumped stream: whole (with the tap's end marker), or broken (``why``) as the tap says."""
        if why is not None:
            self.state.metrics.upstream_errors.labels(a.ep.url, "mid_stream").inc()
            await tap.broke(self.state, out, a, upstream, why)
            return
        try:
            if tap.closing:
                await out.write(tap.closing)
            out.end()
        except ConnectionResetError:
            raise ClientGone() from None

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
