"""A lean HTTP/1.1 keep-alive client for the proxied requests: one pool of connections per endpoint.

Why not aiohttp's client here: its CPU per request is several times its server's, most of the router's whole
cost (benchmarks/RESULTS.md, "HTTP client"). A proxy needs little of it (no cookies, redirects, auth,
decompression), so requests go out as one pre-serialized write and responses are parsed by llhttp (through
httptools, the parser uvicorn uses), whose callbacks hand body bytes over as they arrive, so streams are never
buffered. Closing a response before its end closes the connection, which is how the engine learns that the
client went away and aborts the request.
"""

from __future__ import annotations

import asyncio
import ssl as ssl_mod
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 1 << 20  # pause reading the upstream when this much body waits for a slow client
_SWEEP_S = 0.02  # how often a pool checks its requests' response-head deadlines


def _expire(fut: asyncio.Future) -> None:
    # A bare timer handle per wait: asyncio.timeout() costs several times more, on every proxied request.
    if not fut.done():
        fut.set_exception(TimeoutError())


class UpstreamError(Exception):
    """The connection failed or closed. ``before_response``: no response byte had arrived."""

    def __init__(self, message: str, before_response: bool) -> None:
        super().__init__(message)
        self.before_response = before_response


class _Conn(asyncio.Protocol):
    """One keep-alive connection, one request at a time; llhttp parses and calls the ``on_*`` methods."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[Response] | None = None  # the current request's response head
        self.deadline = 0.0  # loop time by which the response head must have arrived
        self.resp: Response | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_request = False
        self.got_bytes = False

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        self._stop_timer()
        why = exc or "EOF"
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(
                UpstreamError(f"connection closed before the response ({why})", not self.got_bytes)
            )
        elif self.resp is not None and not self.resp.complete:
            if self.resp.until_close:  # a body without length or chunks ends with the connection
                self.resp._finish()
            else:
                self.resp._fail(UpstreamError(f"connection closed mid-body ({why})", False))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._protocol_error(f"bad response from upstream: {e}")

    # -- llhttp callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))  # raw: the proxy filters and forwards bytes

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        headers, self.headers = self.headers, []
        if status < 200:  # interim (100 Continue): llhttp parses the real response next
            return
        self._stop_timer()
        if self.waiter is None or self.waiter.done():  # nobody asked (or gave up): unusable connection
            self._protocol_error("unsolicited response")
            return
        resp = self.resp = Response(self, status, headers)
        if self.head_request:  # llhttp cannot know that a HEAD answer has no body: finish, then close
            resp.keep_alive = False
            resp._finish()
        self.waiter.set_result(resp)

    def on_body(self, body: bytes) -> None:
        if self.resp is not None:
            self.resp._feed(body)

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is not None and not resp.complete:  # None: the end of an interim 1xx message
            resp.keep_alive = self.parser.should_keep_alive()
            resp._finish()

    # -- use --
    def _protocol_error(self, message: str) -> None:
        err = UpstreamError(message, not self.got_bytes)
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(err)
        elif self.resp is not None:
            self.resp._fail(err)
        self.abort()

    def _stop_timer(self) -> None:
        self.pool.waiting.discard(self)

    def send(self, head: bytes, body: bytes, head_request: bool, timeout: float) -> asyncio.Future[Response]:
        """Write the request; the future gets the response head, or TimeoutError after ``timeout`` s."""
        self.resp, self.got_bytes, self.head_request = None, False, head_request
        loop = self.pool.loop
        self.waiter = loop.create_future()
        self.deadline = loop.time() + timeout
        self.pool.wait_for_head(self)
        assert self.transport is not None
        if not body:
            self.transport.write(head)
        elif len(body) < 65536:  # one copy beats a writev of two buffers for small bodies
            self.transport.write(head + body)
        else:
            self.transport.writelines((head, body))
        return self.waiter

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def done_with(self, reusable: bool) -> None:
        if reusable and not self.closed:
            self.resp = self.waiter = None
            self.pool.idle.append(self)
        else:
            self.abort()


class Response:
    """Status, headers (``raw_headers``: byte pairs, order and case kept; ``headers``: the same decoded), the
    body as it arrives (``read_chunk`` until b"")."""

    __slots__ = (
        "_conn",
        "status",
        "raw_headers",
        "content_type",
        "content_length",
        "chunked",
        "until_close",
        "keep_alive",
        "complete",
        "_chunks",
        "_size",
        "_waiter",
        "_error",
        "_released",
        "_paused",
    )

    def __init__(self, conn: _Conn, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self._conn = conn
        self.status, self.raw_headers = status, headers
        self.content_type = ""
        self.content_length: int | None = None
        self.chunked = False
        for k, v in headers:  # the few headers the proxy decides on (llhttp validated the framing ones)
            n = len(k)
            if n == 12 and k.lower() == b"content-type":
                self.content_type = v.decode("latin-1")
            elif n == 14 and k.lower() == b"content-length":
                self.content_length = int(v)
            elif n == 17 and k.lower() == b"transfer-encoding":
                self.chunked = b"chunked" in v.lower()  # else (gzip alone) the body runs until close
        self.until_close = self.content_length is None and not self.chunked
        self.keep_alive = True
        self.complete = False
        self._chunks: list[bytes] = []
        self._size = 0
        self._waiter: asyncio.Future[None] | None = None
        self._error: UpstreamError | None = None
        self._released = False
        self._paused = False

    @property
    def headers(self) -> list[tuple[str, str]]:
        return [(k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers]

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, err: UpstreamError) -> None:
        self._error = err
        self._wake()

    async def read_chunk(self, timeout: float | None = None) -> bytes:
        """The body bytes that arrived since the last call (waiting for some, at most ``timeout`` s, then
        TimeoutError); b"" at the end."""
        while not self._chunks:
            if self.complete:
                self.release()
                return b""
            if self._error is not None:
                raise self._error
            loop = self._conn.pool.loop
            waiter = self._waiter = loop.create_future()
            timer = loop.call_at(loop.time() + timeout, _expire, waiter) if timeout is not None else None
            try:
                await waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
        chunks, self._chunks = self._chunks, []
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        self._size -= len(data)
        if self._paused and self._size < _HIGH_WATER // 4 and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return data

    def take_whole(self) -> bytes | None:
        """The whole body if it has all arrived (the usual small answer), without a coroutine; else None."""
        if not self.complete or self._error is not None or self._paused:
            return None
        chunks, self._chunks = self._chunks, []
        self._size = 0
        self.release()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, timeout: float | None = None) -> bytes:
        """The whole body; ``timeout`` bounds each wait for more bytes."""
        whole = self.take_whole()
        if whole is not None:
            return whole
        parts = []
        while chunk := await self.read_chunk(timeout):
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the response: a complete one gives its connection back, anything else closes it."""
        if not self._released:
            self._released = True
            self._conn.done_with(self.complete and self.keep_alive and self._error is None)

    close = release


class UpstreamPool:
    """Idle keep-alive connections to one endpoint (``http://host:port`` or https)."""

    def __init__(
        self, base_url: str, connect_timeout: float, tls: ssl_mod.SSLContext | None = None
    ) -> None:
        """``tls``: the verifying context for an https:// endpoint (default: the system's trust store)."""
        parts = urlsplit(base_url)
        self.loop = asyncio.get_running_loop()
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = (tls or ssl_mod.create_default_context()) if parts.scheme == "https" else None
        self.host_header = parts.netloc.encode("latin-1")
        self.connect_timeout = connect_timeout
        self.idle: list[_Conn] = []
        # Connections waiting for a response head, checked against their deadlines every _SWEEP_S while
        # any wait: a timer handle per request (created, then cancelled) cost more than the sweeps.
        self.waiting: set[_Conn] = set()
        self._sweeper: asyncio.TimerHandle | None = None

    def wait_for_head(self, conn: _Conn) -> None:
        self.waiting.add(conn)
        if self._sweeper is None:
            self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        now = self.loop.time()
        for conn in [c for c in self.waiting if c.deadline <= now]:
            self.waiting.discard(conn)
            if conn.waiter is not None:
                _expire(conn.waiter)
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep) if self.waiting else None

    def forget(self, conn: _Conn) -> None:
        if conn in self.idle:
            self.idle.remove(conn)

    async def _connect(self) -> _Conn:
        try:
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await self.loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self.ssl
                )
        except TimeoutError:
            raise ConnectionError(f"connect timed out after {self.connect_timeout:g}s") from None
        return conn

    async def request(
        self, method: str, target: str, headers: bytes, body: bytes, timeout: float = 300.0
    ) -> Response:
        """Send one request; returns once the response head arrived, or raises TimeoutError when it has not
        ``timeout`` s after the request went out. ``headers``: serialized header lines (``Name: value\\r\\n``
        each) without Host and Content-Length."""
        head = b"%s %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n" % (
            method.encode("latin-1"),
            target.encode("latin-1"),
            self.host_header,
            headers,
            len(body),
        )
        head_request = method == "HEAD"
        conn: _Conn | None = None
        try:
            while self.idle:
                conn = self.idle.pop()
                if conn.closed:
                    continue
                try:
                    return await conn.send(head, body, head_request, timeout)
                except UpstreamError as e:
                    if not e.before_response:
                        raise
                    # a kept-alive connection the upstream had just closed: not the endpoint's fault
                    conn.abort()
            conn = None
            conn = await self._connect()
            return await conn.send(head, body, head_request, timeout)
        except BaseException:  # timeout, failure or cancellation: the connection is in an unknown state
            if conn is not None:
                conn.abort()
            raise

    def close(self) -> None:
        for conn in self.idle:
            conn.abort()
        self.idle.clear()  # requests still in flight keep their deadlines: the sweeps stop when they end
