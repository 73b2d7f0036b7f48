"""The limits of ``lbd.common.limits`` on an aiohttp server (the engine's front end, the supervisor's health
port): what aiohttp enforces itself (line, header and count sizes, keep-alive) is passed as its settings; what
it does not (a head that trickles in, too many connections) is added by a request-handler subclass and a sweep
once a second.

aiohttp's ``RequestHandler`` keeps its state in private attributes; the two read here (``_request_count``,
``_manager``) are read with defaults, and the malformed-HTTP tests fail if a new aiohttp renames them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from lbd.common.limits import Limits

SWEEP_S = 1.0
LINGER_S = 2.0  # after an answer to a request whose body was not read, drop what still comes this long
_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s")
_TOO_BIG = (b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n%s")
_FULL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
         b"Retry-After: 1\r\nContent-Length: %d\r\n\r\n%s")


def _error_body(status: int, message: str, etype: str) -> bytes:
    return (b'{"error":{"message":"%s","type":"%s","param":null,"code":%d}}'
            % (message.encode(), etype.encode(), status))


_TIMEOUT_BODY = _error_body(408, "request head not received in time (--header-read-timeout-s)",
                            "RequestTimeoutError")
_TOO_BIG_BODY = _error_body(431, "request head too large (--max-head-bytes)",
                            "RequestHeaderFieldsTooLargeError")
_FULL_BODY = _error_body(503, "too many open connections (--max-connections)", "ServiceUnavailableError")


def server_settings(limits: Limits) -> dict[str, Any]:
    """Keyword arguments for ``web.AppRunner`` (passed on to every request handler)."""
    return {"keepalive_timeout": limits.keep_alive_timeout_s, "max_line_size": limits.max_request_line_bytes,
            "max_field_size": limits.max_header_bytes, "max_headers": limits.max_headers,
            "lingering_time": LINGER_S}


class _GuardedHandler(RequestHandler):
    """Counts the bytes and the time of a request head while no request is open on the connection (heads
    parsed minus requests handled, and the last body read to its end)."""

    __slots__ = ("_lbd_head_since", "_lbd_head_bytes", "_lbd_open", "_lbd_payload")

    def __init__(self, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._lbd_head_since: float | None = None
        self._lbd_head_bytes = 0
        self._lbd_open = 0  # heads parsed and not yet answered
        self._lbd_payload: Any = None  # the body stream of the last request handled

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        guard: Guard | None = getattr(self._manager, "lbd_guard", None)
        if guard is not None and len(guard.server.connections) > guard.limits.max_connections:
            transport.write(_FULL % (len(_FULL_BODY), _FULL_BODY))  # type: ignore[attr-defined]
            self.force_close()
            return
        self._lbd_head_since = self._loop.time()  # a connection that sends nothing is a slow head too

    def _reading_head(self) -> bool:
        payload = self._lbd_payload
        return self._lbd_open == 0 and (payload is None or payload.is_eof())

    def data_received(self, data: bytes) -> None:
        counting = self._reading_head()
        if counting:
            if self._lbd_head_since is None:
                self._lbd_head_since = self._loop.time()
            self._lbd_head_bytes += len(data)
        before = getattr(self, "_request_count", 0)
        super().data_received(data)
        parsed = getattr(self, "_request_count", 0) - before
        if parsed:
            self._lbd_open += parsed
            self._lbd_head_since, self._lbd_head_bytes = None, 0
            return
        guard: Guard | None = getattr(self._manager, "lbd_guard", None)
        if counting and guard is not None and self._lbd_head_bytes > guard.limits.max_head_bytes:
            # still no complete head after this many bytes: aiohttp would buffer them line by line
            if self.transport is not None:
                self.transport.write(_TOO_BIG % (len(_TOO_BIG_BODY), _TOO_BIG_BODY))
            self.force_close()

    async def _handle_request(self, request: Any, start_time: Any, request_handler: Any) -> Any:
        self._lbd_payload = getattr(request, "content", None)
        guard: Guard | None = getattr(self._manager, "lbd_guard", None)
        if guard is not None and _head_size(request) > guard.limits.max_head_bytes:
            request_handler = _head_too_large
        try:
            return await super()._handle_request(request, start_time, request_handler)
        finally:
            self._lbd_open = max(0, self._lbd_open - 1)


def _head_size(request: Any) -> int:
    raw = getattr(request, "raw_headers", ())
    return len(getattr(request, "raw_path", "")) + sum(len(k) + len(v) + 4 for k, v in raw)


async def _head_too_large(request: web.BaseRequest) -> web.Response:
    return web.Response(status=431, body=_TOO_BIG_BODY, content_type="application/json",
                        headers={"Connection": "close"})


class _GuardedServer(web.Server):
    lbd_guard: Guard | None = None

    def __call__(self) -> RequestHandler:
        return _GuardedHandler(self, loop=self._loop, **self._kwargs)


class Guard:
    """Closes connections whose request head is not complete ``header_read_timeout_s`` after its first byte
    (after the connection opened, for the first request), with a 408."""

    def __init__(self, server: web.Server, limits: Limits) -> None:
        self.server = server
        self.limits = limits
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._sweep_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _sweep_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(loop.time())

    def sweep(self, now: float) -> None:
        cutoff = now - self.limits.header_read_timeout_s
        for handler in self.server.connections:
            since = getattr(handler, "_lbd_head_since", None)
            if since is not None and since < cutoff and getattr(handler, "_lbd_open", 1) == 0:
                transport = handler.transport
                if transport is not None and not transport.is_closing():
                    transport.write(_TIMEOUT % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
                handler.force_close()


class GuardedAppRunner(web.AppRunner):
    """``web.AppRunner`` whose server enforces ``limits`` (sizes and keep-alive through aiohttp's settings,
    the head timeout and the connection cap here)."""

    __slots__ = ("_lbd_limits", "_lbd_guard")

    def __init__(self, app: web.Application, limits: Limits, **kwargs: Any) -> None:
        super().__init__(app, **{**server_settings(limits), **kwargs})
        self._lbd_limits = limits
        self._lbd_guard: Guard | None = None

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _GuardedServer
        guard = Guard(server, self._lbd_limits)
        server.lbd_guard = guard  # type: ignore[attr-defined]
        guard.start()
        self._lbd_guard = guard
        return server

    async def _cleanup_server(self) -> None:
        if self._lbd_guard is not None:
            await self._lbd_guard.stop()
        await super()._cleanup_server()
