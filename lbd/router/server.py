"""The router's front side: a lean HTTP/1.1 server, an ``asyncio.Protocol`` on llhttp (httptools).

Why not aiohttp's server: a proxy's CPU per request is what caps its throughput on a shared machine, and
measured on the build machine a bare aiohttp low-level ``web.Server`` answering a fixed body costs ~35 us of
CPU per request (uvicorn's raw ASGI ~41 us), while a protocol on ``httptools.HttpRequestParser`` costs ~10 us.
The router needs little of a framework (no routing tables, middlewares, cookies, multipart, websockets), so
this is the same trade ``lbd.router.upstream`` makes for the client side.

Layers: ``_Connection`` here (the protocol: parsing, the per-connection queue, flow control) hands each
request as a ``lbd.router.messages.Request`` (method, path, raw_path, raw header pairs with a
case-insensitive ``get``, body) with a ``messages.Response`` writer (``send`` for sized answers in one write;
``start``/``write``/``end`` for streams) to the handler coroutine, one request at a time per connection;
pipelined requests wait in order.

Behaviour kept from the aiohttp front end: keep-alive for HTTP/1.1 and close for HTTP/1.0 (or
``Connection: close``); Content-Length and chunked request bodies; a body over ``max_body`` is handed to the
handler at once with ``too_large`` set and the rest is never read (the connection closes after the answer);
``Expect: 100-continue`` answered when the request's turn comes (never for a body that is too large);
malformed requests get a 400 and a close; a client that goes away cancels its handler task, so the
handler's ``except CancelledError``/``finally`` paths release what it holds; streams honour the transport's
write back-pressure (``await write`` waits while the kernel buffer is full); streams of unknown length use
chunked transfer encoding (HTTP/1.0: the end of the connection ends the body); HEAD answers carry no body.
No ``Date``/``Server`` headers: nothing in the OpenAI API needs them.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Callable

import httptools

from lbd.router.messages import Headers, Request, Response

log = logging.getLogger("lbd.router")

# the handler: a coroutine function, or a function returning an awaitable
Handler = Callable[[Request, Response], Awaitable[None]]
_MAX_QUEUED = 16  # pipelined requests buffered per connection before reading pauses
_IDLE_SWEEP_S = 10.0


class _Bad:
    """A queued malformed request: answered with 400, then the connection closes."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class _Connection(asyncio.Protocol):
    """One client connection: llhttp feeds ``on_*``; complete requests run one at a time, in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[Request | _Bad] = collections.deque()
        self.current: Request | None = None  # being parsed
        # A task per request (one long-lived task per connection waiting on a future between requests
        # measured no cheaper).
        self.task: asyncio.Task[None] | None = None
        self.active: Request | None = None  # the request being handled
        self.url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self.discarding = False  # after a too-large body or a parse error: ignore further bytes
        self.read_paused = False
        self.write_paused = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.eof = False
        self.idle_since = self.loop.time()

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        self.queue.clear()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: a running handler releases what it holds
        self._wake_drain(ConnectionResetError("client connection closed"))

    def data_received(self, data: bytes) -> None:
        if self.discarding:
            return
        try:
            self.parser.feed_data(data)
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
        self._next()

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_drain(None)

    def eof_received(self) -> bool | None:
        # A half-closed client still gets its answers; close once they are written.
        self.eof = True
        if self.active is None and not self.queue and self.transport is not None:
            self.transport.close()
        return True

    # -- llhttp callbacks (url and raw_headers are reset once a head is consumed, which spares an
    # on_message_begin call per request) --
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self.parser
        raw, url = self.raw_headers, self.url
        self.raw_headers, self.url = [], b""
        names = [k.lower() for k, _ in raw]
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
        self.discarding = True

    def _malformed(self, message: str) -> None:
        if self.current is not None and self.queue and self.queue[-1] is self.current:
            self.queue.pop()  # its body broke: it never reaches the handler
        self.current = None
        self.queue.append(_Bad(message))
        self.discarding = True

    def _head_ready(self) -> bool:
        """Whether the request at the head of the queue can run now; answers a malformed one and sends a
        pending ``100 Continue`` on the way."""
        if not self.queue or self.transport is None:
            return False
        item = self.queue[0]
        if isinstance(item, _Bad):
            self.queue.clear()
            self._answer_bad(item.message)
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
                # Lingering close: a client still sending the body we will not read would get a reset
                # (and might lose this answer) if we closed now; half-close and drop what comes instead.
                transport.write_eof()
                self.loop.call_later(2.0, transport.close)
            else:
                transport.close()
        # A kept-alive connection: the next request starts when the handler's task ends (one at a time).

    def _answer_bad(self, message: str) -> None:
        assert self.transport is not None
        body = (
            b'{"error":{"message":"%s","type":"BadRequestError","param":null,"code":400}}'
            % message.replace('"', "'").encode("latin-1", "replace")
        )
        self.transport.write(
            b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%s" % (len(body), body)
        )
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

    def close_if_idle(self, idle_before: float) -> None:
        if self.active is None and not self.queue and self.idle_since < idle_before and self.transport:
            self.transport.close()


class HttpServer:
    """Listens and runs ``handler(request, response)`` for every request. ``idle_timeout_s``: keep-alive
    connections with nothing to do for that long are closed (checked every 10 s)."""

    def __init__(self, handler: Handler, max_body: int, idle_timeout_s: float = 75.0) -> None:
        self.handler = handler
        self.max_body = max_body
        self.idle_timeout_s = idle_timeout_s
        self.loop = asyncio.get_running_loop()
        self.connections: set[_Connection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    async def start(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sock: socket.socket | None = None,
        backlog: int = 2048,
    ) -> None:
        """Listen on ``sock`` if given, else bind ``host:port`` with SO_REUSEPORT (several worker processes
        share one port and the kernel spreads connections among them)."""
        if sock is not None:
            self._server = await self.loop.create_server(
                lambda: _Connection(self), sock=sock, backlog=backlog
            )
        else:
            self._server = await self.loop.create_server(
                lambda: _Connection(self), host, port, reuse_port=True, backlog=backlog
            )
        self._sweeper = self.loop.call_later(_IDLE_SWEEP_S, self._sweep)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._server.sockets) if self._server is not None else ()

    def _sweep(self) -> None:
        cutoff = self.loop.time() - self.idle_timeout_s
        for conn in list(self.connections):
            conn.close_if_idle(cutoff)
        self._sweeper = self.loop.call_later(_IDLE_SWEEP_S, self._sweep)

    async def close(self, grace_s: float = 5.0) -> None:
        """Stop listening, give running handlers ``grace_s`` to finish, then close every connection."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        deadline = self.loop.time() + grace_s
        while any(c.active is not None for c in self.connections) and self.loop.time() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            if conn.transport is not None:
                conn.transport.close()
        if self._server is not None:
            await self._server.wait_closed()
