"""One client connection of the router's HTTP/1.1 server (``lbd.router.server``): an ``asyncio.Protocol`` fed
by llhttp (httptools), which queues complete requests and runs the handler on them one at a time, in order.

Behaviour, as aiohttp's server has it: keep-alive for HTTP/1.1 and close for HTTP/1.0 (or
``Connection: close``); Content-Length and chunked request bodies; a body over ``max_body`` is handed to the
handler at once with ``too_large`` set and the rest is never read (the connection closes after the answer);
``Expect: 100-continue`` answered when the request's turn comes (never for a body that is too large);
malformed requests get a 400 and a close; a client that goes away cancels its handler task, so the
handler's ``except CancelledError``/``finally`` paths release what it holds; streams honour the transport's
write back-pressure (``await write`` waits while the kernel buffer is full); streams of unknown length use
chunked transfer encoding (HTTP/1.0: the end of the connection ends the body); HEAD answers carry no body.
No ``Date``/``Server`` headers: nothing in the OpenAI API needs them.

Limits (``lbd.common.limits``, the same flags and meaning as the engine's and the supervisor's aiohttp
servers): a request line over ``max_request_line_bytes`` gets 414, a header line over ``max_header_bytes``,
more than ``max_headers`` headers or a head over ``max_head_bytes`` get 431 (checked as bytes arrive, so a
head that never ends costs at most that much memory); a head not complete ``header_read_timeout_s`` after its
first byte (or after the connection opened) and a body not complete ``body_read_timeout_s`` after its head get
408; idle keep-alive connections close after ``keep_alive_timeout_s``; a connection over ``max_connections``
gets 503. Every one of these closes the connection. A client that half-closes while its request's head or body
is still incomplete has that request dropped and its connection closed (a request that can never complete must
not hold a socket in CLOSE-WAIT).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import httptools

from lbd.common.limits import Limits
from lbd.router.gc_policy import handler_cancelled
from lbd.router.messages import Headers, Request, Response

log = logging.getLogger("lbd.router")

_MAX_QUEUED = 16  # pipelined requests buffered per connection before reading pauses
_STATUS_LINES = {400: b"400 Bad Request", 408: b"408 Request Timeout", 414: b"414 URI Too Long",
                 431: b"431 Request Header Fields Too Large", 503: b"503 Service Unavailable"}
_ERROR_TYPES = {400: b"BadRequestError", 408: b"RequestTimeoutError", 414: b"URITooLongError",
                431: b"RequestHeaderFieldsTooLargeError", 503: b"ServiceUnavailableError"}


# the handler: a coroutine function, or a function returning an awaitable
Handler = Callable[[Request, Response], Awaitable[None]]


class Host(Protocol):
    """What a connection uses of its server (``lbd.router.server.HttpServer``)."""

    handler: Handler
    limits: Limits
    max_body: int
    loop: asyncio.AbstractEventLoop
    connections: set[Connection]


class _Bad:
    """A queued request the server refuses itself (malformed, over a limit): answered, then closed."""

    __slots__ = ("message", "status")

    def __init__(self, message: str, status: int = 400) -> None:
        self.message = message
        self.status = status


class _Refused(Exception):
    """Raised from a parser callback: the request broke a limit (llhttp stops parsing)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


class Connection(asyncio.Protocol):
    """One client connection: llhttp feeds ``on_*``; complete requests run one at a time, in order."""

    def __init__(self, server: Host) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[Request | _Bad] = collections.deque()
        self.current: Request | None = None  # being parsed
        # A task per request (one long-lived task per connection waiting on a future between requests
        # is no cheaper).
        self.task: asyncio.Task[None] | None = None
        self.active: Request | None = None  # the request being handled
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.header_names: list[bytes] = []  # raw_headers' names in lower case, for lookups
        self.discarding = False  # after a too-large body or a parse error: ignore further bytes
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.eof = False
        self.idle_since = self.loop.time()
        # limits: bytes of the head being read, when its first byte came, when its body began
        self.head_bytes = 0
        self.head_since: float | None = self.idle_since
        self.lingering = False  # half-closed after a final answer; closes in 2 s
        self.body_since: float | None = None
        self.header_count = 0  # bytes of the header lines of the head being read
        limits = server.limits
        self.head_room = limits.max_head_bytes  # less the request line's length, once it is read
        self.max_line, self.max_headers = limits.max_header_bytes, limits.max_headers

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        server = self.server
        server.connections.add(self)
        if len(server.connections) > server.limits.max_connections:
            self.discarding = True
            self._write_refusal(503, "too many open connections (--max-connections)")

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: a running handler releases what it holds
            handler_cancelled(self.loop)
        self._wake_drain(ConnectionResetError("client connection closed"))

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        if self.current is None:  # reading a head (or between requests): bound what llhttp buffers
            if self.head_since is None:
                self.head_since = self.loop.time()
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as e:
            cause = e.__context__ or e.__cause__
            if isinstance(cause, _Refused):
                self._malformed(cause.message, cause.status)
            else:
                self._malformed(f"malformed HTTP request: {e}")
        except httptools.HttpParserUpgrade:
            # Upgrades are not offered: answer the request as a plain one (no body), then close.
            last = self.queue[-1] if self.queue else None
            if isinstance(last, Request):
                last.keep_alive = False
                last._size = -1
            self.current = None
            self.discarding = True
        except httptools.HttpParserError as e:
            self._malformed(f"malformed HTTP request: {e}")
        else:
            if self.current is None and self.head_bytes > self.server.limits.max_head_bytes:
                self._malformed("request head too large (--max-head-bytes)", 431)
        self._next()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain(None)

    def eof_received(self) -> bool | None:
        # A half-closed client still gets its answers; close once they are written. A request whose head or
        # body was still arriving can never complete: it is dropped (no handler waits on it).
        self.eof = True
        req = self.current
        if req is not None and self.queue and self.queue[-1] is req and req._size != -1:
            self.queue.pop()
        self.current = None
        if self.active is None and not self.queue and self.transport is not None:
            self.transport.close()
        return True

    # -- llhttp callbacks (url and raw_headers are reset once a head is consumed, which spares an
    # on_message_begin call per request) --
    def on_url(self, url: bytes) -> None:
        self.url += url
        limits = self.server.limits
        if len(self.url) > limits.max_request_line_bytes:
            raise _Refused("request line too long (--max-request-line-bytes)", 414)
        self.head_room = limits.max_head_bytes - len(self.url)  # for the header lines

    def on_header(self, name: bytes, value: bytes) -> None:
        """Keep one header line. The three limits are checked in one test (this runs for every header of
        every request); ``_header_refusal`` names the one it broke."""
        size = len(name) + len(value) + 4  # "name: value\r\n"
        self.header_count += size  # (bytes of this head's header lines)
        raw = self.raw_headers
        raw.append((name, value))
        self.header_names.append(name.lower())
        if size > self.max_line or len(raw) > self.max_headers or self.header_count > self.head_room:
            raise self._header_refusal(size)

    def _header_refusal(self, size: int) -> _Refused:
        if size > self.max_line:
            return _Refused("a header line is too long (--max-header-bytes)", 431)
        if len(self.raw_headers) > self.max_headers:
            return _Refused("too many headers (--max-headers)", 431)
        return _Refused("request head too large (--max-head-bytes)", 431)

    def on_headers_complete(self) -> None:
        p = self.parser
        raw, names, url = self.raw_headers, self.header_names, self.url
        self.raw_headers, self.header_names, self.url = [], [], b""
        self.head_bytes, self.head_since, self.header_count = 0, None, 0
        req = Request(
            p.get_method().decode("latin-1"),
            url.decode("latin-1"),
            Headers(raw, names),
            p.get_http_version() == "1.0",
        )
        req.keep_alive = p.should_keep_alive()
        if b"content-length" in names:
            req.content_length = int(raw[names.index(b"content-length")][1])  # llhttp checked the digits
        if b"expect" in names and raw[names.index(b"expect")][1].lower() == b"100-continue":
            req.expect_continue = True
        self.current = req
        self.body_since = self.loop.time()
        self.queue.append(req)
        if req.content_length is not None and req.content_length > self.server.max_body:
            self._too_large(req)

    def on_body(self, body: bytes) -> None:
        req = self.current
        if req is None or req.too_large:
            return
        req._size += len(body)
        if req._size > self.server.max_body:
            self._too_large(req)
            return
        req._body.append(body)

    def on_message_complete(self) -> None:
        req = self.current
        self.current = None
        self.body_since = None
        if req is not None and not req.too_large:
            req.keep_alive = req.keep_alive and self.parser.should_keep_alive()
            req.expect_continue = False  # the body is here already: no 100 needed
            req._size = -1  # marks complete
        if len(self.queue) >= _MAX_QUEUED and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    # -- request flow --
    def _too_large(self, req: Request) -> None:
        """Hand the request over now (the handler answers 413); the rest of the body is never read, so the
        connection cannot be reused."""
        req.too_large = True
        req.keep_alive = False
        req.expect_continue = False
        req._body = []
        req._size = -1
        self.current = None
        self.body_since = None
        self.discarding = True

    def _malformed(self, message: str, status: int = 400) -> None:
        if self.current is not None and self.queue and self.queue[-1] is self.current:
            self.queue.pop()  # its body broke: it never reaches the handler
        self.current = None
        self.head_since = self.body_since = None
        self.queue.append(_Bad(message, status))
        self.discarding = True

    def _head_ready(self) -> bool:
        """Whether the request at the head of the queue can run now; answers a malformed one and sends a
        pending ``100 Continue`` on the way."""
        if not self.queue or self.transport is None:
            return False
        item = self.queue[0]
        if isinstance(item, _Bad):
            self.queue.clear()
            self._write_refusal(item.status, item.message)
            return False
        if item._size != -1:  # still reading its body
            if item.expect_continue:
                item.expect_continue = False
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return False
        return True

    def _next(self) -> None:
        """Start the request at the head of the queue once it is complete and none is running."""
        if self.active is not None or not self._head_ready():
            return
        req = self.queue.popleft()
        assert isinstance(req, Request) and self.transport is not None
        if self.read_paused and len(self.queue) < _MAX_QUEUED // 2:
            self.read_paused = False
            self.transport.resume_reading()
        self.active = req
        self.task = self.loop.create_task(self._one(req))

    async def _one(self, req: Request) -> None:
        """Run the handler for ``req`` (one coroutine level: each level is resumed on every wake-up)."""
        resp = Response(self, req)
        try:
            await self.server.handler(req, resp)
        except asyncio.CancelledError:
            if self.transport is not None:  # cancelled by a shutdown, not by the client leaving
                self.transport.close()
            raise
        except ConnectionError:
            pass  # the client went away while the answer was written
        except Exception:
            log.exception("handler failed on %s %s", req.method, req.raw_path)
            if not resp.started and self.transport is not None:
                req.keep_alive = False
                body = b'{"error":{"message":"internal router error","type":"InternalServerError",'
                body += b'"param":null,"code":500}}'
                resp.send(500, b"Content-Type: application/json\r\n", body)
        finally:
            if not resp.ended:
                self.abort()  # the handler left an answer unfinished: the client must not wait on it
            self.active = self.task = None
        if self.transport is not None:
            if self.queue:
                self._next()  # a pipelined request waited for this one
            elif self.eof:
                self.transport.close()

    def response_done(self, req: Request) -> None:
        """The answer to ``req`` is fully written: keep the connection for the next request or close it."""
        self.idle_since = self.loop.time()
        transport = self.transport
        if transport is None:
            return
        if not req.keep_alive:
            self.queue.clear()
            if self.discarding and transport.can_write_eof():
                self._linger(transport)  # the client may still be sending a body we will not read
            else:
                transport.close()
        # A kept-alive connection: the next request starts when the handler's task ends (one at a time).

    def _write_refusal(self, status: int, message: str) -> None:
        """Answer a request the server refuses itself, then close (nothing more is read)."""
        transport = self.transport
        if transport is None or transport.is_closing() or self.lingering:
            return
        body = b'{"error":{"message":"%s","type":"%s","param":null,"code":%d}}' % (
            message.replace('"', "'").replace("\\", "/").encode("latin-1", "replace"),
            _ERROR_TYPES[status],
            status,
        )
        retry = b"Retry-After: 1\r\n" if status == 503 else b""
        transport.write(
            b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s"
            b"Connection: close\r\n\r\n%s" % (_STATUS_LINES[status], len(body), retry, body)
        )
        self.discarding = True
        if transport.can_write_eof():  # lingering close: the client may still be sending (see response_done)
            self._linger(transport)
        else:
            transport.close()

    def _linger(self, transport: asyncio.Transport) -> None:
        """Half-close now, close in 2 s: a client still sending what we will not read would get a reset
        (and might lose the answer) if we closed at once; what it sends meanwhile is dropped."""
        self.lingering = True
        transport.write_eof()
        self.loop.call_later(2.0, transport.close)

    def check_timeouts(self, now: float, limits: Limits) -> None:
        """408 for a head or a body that takes too long; close an idle keep-alive connection."""
        if self.transport is None or self.active is not None or self.lingering:
            return
        if self.head_since is not None and now - self.head_since > limits.header_read_timeout_s:
            self.discarding = True
            self._write_refusal(408, "request head not received in time (--header-read-timeout-s)")
            return
        if self.body_since is not None and now - self.body_since > limits.body_read_timeout_s:
            self.discarding = True
            self.queue.clear()
            self._write_refusal(408, "request body not received in time (--body-read-timeout-s)")
            return
        if not self.queue and self.current is None and now - self.idle_since > limits.keep_alive_timeout_s:
            self.transport.close()

    async def drain(self) -> None:
        if self.transport is None:
            raise ConnectionResetError("client connection closed")
        if not self.write_paused:
            return
        waiter = self.drain_waiter
        if waiter is None or waiter.done():
            waiter = self.drain_waiter = self.loop.create_future()
        await waiter

    def _wake_drain(self, exc: Exception | None) -> None:
        waiter, self.drain_waiter = self.drain_waiter, None
        if waiter is not None and not waiter.done():
            if exc is None:
                waiter.set_result(None)
            else:
                waiter.set_exception(exc)

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
