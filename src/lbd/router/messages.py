"""The router's HTTP messages: the parsed ``Request`` (with its ``Headers``) and the ``Response`` writer that
``lbd.router.server`` hands to the handler for each request. See ``lbd.router.server`` for why the router has
its own HTTP/1.1 server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from http import HTTPStatus
from typing import Protocol
from urllib.parse import unquote

HeaderList = Iterable[tuple[str, str]]

_REASONS = {s.value: s.phrase.encode("latin-1") for s in HTTPStatus}
_STATUS_LINES: dict[int, bytes] = {}
_LOWER_NAMES: dict[str, bytes] = {}
_NO_BODY = frozenset({204, 304})  # answers that carry neither a body nor body framing


def status_line(status: int, http10: bool = False) -> bytes:
    if http10:
        return b"HTTP/1.0 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
    return line


def serialize_headers(headers: HeaderList) -> bytes:
    return b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in headers)


class Connection(Protocol):
    """What a ``Response`` writes through: the client's connection (``lbd.router.server``'s protocol)."""

    transport: asyncio.Transport | None
    write_paused: bool  # the client is not reading: the transport's buffer is over its high-water mark

    def response_done(self, request: Request) -> None: ...

    async def drain(self) -> None: ...

    def abort(self) -> None: ...


class Meter(Protocol):
    """What counts the bytes of an answer as they go out (lbd.router.metering.Meter)."""

    def feed(self, data: bytes) -> None: ...


class Headers:
    """The client's headers as raw ``(name, value)`` byte pairs (order and case kept, for forwarding), their
    lower-cased names in ``names`` (the same order), and a case-insensitive ``get`` decoding as latin-1."""

    __slots__ = ("raw", "names")

    def __init__(self, raw: list[tuple[bytes, bytes]], names: list[bytes] | None = None) -> None:
        self.raw = raw
        self.names = [k.lower() for k, _ in raw] if names is None else names

    def get(self, name: str, default: str | None = None) -> str | None:
        want = _LOWER_NAMES.get(name)
        if want is None:
            want = _LOWER_NAMES[name] = name.lower().encode("latin-1")
        names = self.names
        if want not in names:  # (a test beats catching index()'s ValueError: most lookups miss)
            return default
        return self.raw[names.index(want)][1].decode("latin-1")  # the first of repeated headers wins

    def get_raw(self, name: str) -> bytes | None:
        """The first value of ``name`` as the client's bytes (no decoding)."""
        want = _LOWER_NAMES.get(name)
        if want is None:
            want = _LOWER_NAMES[name] = name.lower().encode("latin-1")
        try:
            return self.raw[self.names.index(want)][1]
        except ValueError:
            return None

    def get_all(self, name: str) -> list[str]:
        """Every value of ``name``, in order (a repeated header is one value per line)."""
        want = _LOWER_NAMES.get(name)
        if want is None:
            want = _LOWER_NAMES[name] = name.lower().encode("latin-1")
        if want not in self.names:
            return []
        return [v.decode("latin-1") for (_, v), n in zip(self.raw, self.names, strict=True) if n == want]

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None


class Request:
    """One parsed request. ``body`` is complete when the handler runs, unless ``too_large`` (then empty)."""

    __slots__ = (
        "method",
        "raw_path",
        "headers",
        "http10",
        "keep_alive",
        "content_length",
        "expect_continue",
        "too_large",
        "_body",
        "_size",
    )

    def __init__(self, method: str, raw_path: str, headers: Headers, http10: bool, body: bytes = b"") -> None:
        """``body``: a complete body (the server passes none: it appends the body as it arrives)."""
        self.method, self.raw_path, self.headers, self.http10 = method, raw_path, headers, http10
        self.keep_alive = not http10
        self.content_length: int | None = len(body) if body else None
        self.expect_continue = False
        self.too_large = False
        self._body: list[bytes] = [body] if body else []
        self._size = -1 if body else 0  # -1: complete

    @property
    def path(self) -> str:
        """The decoded path without the query (an absolute-form target is reduced to its path)."""
        raw = self.raw_path
        if raw[:1] != "/" and "://" in raw:
            raw = "/" + raw.split("://", 1)[1].partition("/")[2]
        path = raw.partition("?")[0]
        return unquote(path) if "%" in path else path

    @property
    def body(self) -> bytes:
        parts = self._body
        if len(parts) == 1:
            return parts[0]
        body = b"".join(parts)
        self._body = [body]
        return body


class Response:
    """Writes one request's answer. ``send`` for a sized answer in one write; ``start``, ``write`` (awaits
    while the client's socket buffer is full) and ``end`` for a stream. Writes after the client went away
    raise ``ConnectionResetError``."""

    __slots__ = ("_conn", "_request", "_head_only", "_chunked", "started", "ended", "status", "meter")

    def __init__(self, conn: Connection, request: Request) -> None:
        self._conn = conn
        self._request = request
        self._head_only = request.method == "HEAD"
        self._chunked = False
        self.started = False
        self.ended = False
        self.status = 0
        self.meter: Meter | None = None  # counts the output that reaches the client (lbd.router.metering)

    @property
    def client_eof(self) -> bool:
        """The client closed its side of the connection (lbd.router.flow: a held request whose client did so
        is gone; the socket shows it only once something is written)."""
        return bool(getattr(self._conn, "eof", False))

    def _head(self, status: int, headers: HeaderList | bytes, framing: bytes) -> bytes:
        req = self._request
        extra = headers if isinstance(headers, bytes) else serialize_headers(headers)
        if req.keep_alive:  # an HTTP/1.0 client keeps the connection only when told so
            close = b"Connection: keep-alive\r\n" if req.http10 else b""
        else:
            close = b"Connection: close\r\n"
        return b"%s%s%s%s\r\n" % (status_line(status, req.http10), extra, framing, close)

    def send(self, status: int, headers: HeaderList | bytes, body: bytes) -> None:
        """The whole answer at once. ``headers`` without Content-Length (added here)."""
        self._check_unstarted()
        self.started = self.ended = True
        self.status = status
        if status in _NO_BODY:
            body, framing = b"", b""
        else:
            framing = b"Content-Length: %d\r\n" % len(body)
        head = self._head(status, headers, framing)
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed")
        if not body or self._head_only:
            transport.write(head)
        elif len(body) < 65536:  # one copy beats two writes (two syscalls under uvloop) for small bodies
            transport.write(head + body)
        else:
            transport.writelines((head, body))
        if self.meter is not None:
            self.meter.feed(body)
        self._conn.response_done(self._request)

    def start(self, status: int, headers: HeaderList | bytes, content_length: int | None = None) -> None:
        """Send the status line and headers of a streamed answer; without ``content_length`` the body is
        chunked (HTTP/1.0: it runs until the connection closes)."""
        self._check_unstarted()
        self.started = True
        self.status = status
        req = self._request
        if content_length is not None:
            framing = b"Content-Length: %d\r\n" % content_length
        elif req.http10:
            framing = b""
            req.keep_alive = False
        else:
            framing = b"Transfer-Encoding: chunked\r\n"
            self._chunked = not self._head_only
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed")
        transport.write(self._head(status, headers, framing))

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        conn = self._conn
        transport = conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed")
        if self._chunked:
            transport.writelines((b"%x\r\n" % len(data), data, b"\r\n"))
        else:
            transport.write(data)
        if self.meter is not None:
            self.meter.feed(data)
        if conn.write_paused:
            await conn.drain()

    def end(self) -> None:
        if self.ended:
            return
        self.ended = True
        transport = self._conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("client connection closed")
        if self._chunked:
            transport.write(b"0\r\n\r\n")
        self._conn.response_done(self._request)

    @property
    def backed_up(self) -> bool:
        """The client is not reading: the transport's buffer is over its high-water mark."""
        return self._conn.write_paused

    def abort(self) -> None:
        """Cut the connection (a body that cannot be completed must not look complete)."""
        self.ended = True
        self._conn.abort()

    def _check_unstarted(self) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
