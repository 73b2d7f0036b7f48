"""The router's front side: a lean HTTP/1.1 server, an ``asyncio.Protocol`` on llhttp (httptools).

Why not aiohttp's server: a proxy's CPU per request is what caps its throughput on a shared machine, and a
bare aiohttp low-level ``web.Server`` (or uvicorn's raw ASGI) costs several times the CPU per request of a
protocol on ``httptools.HttpRequestParser`` (benchmarks/RESULTS.md, "HTTP server").
The router needs little of a framework (no routing tables, middlewares, cookies, multipart, websockets), so
this is the same trade ``lbd.router.upstream`` makes for the client side.

Layers: ``HttpServer`` here listens and sweeps the connections against the timeouts;
``lbd.router.connection.Connection`` (the protocol: parsing, the per-connection queue, flow control) hands
each request as a ``lbd.router.messages.Request`` (method, path, raw_path, raw header pairs with a
case-insensitive ``get``, body) with a ``messages.Response`` writer (``send`` for sized answers in one write;
``start``/``write``/``end`` for streams) to the handler coroutine, one request at a time per connection;
pipelined requests wait in order.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl as ssl_mod

from lbd.common.limits import Limits
from lbd.router.connection import Connection, Handler

log = logging.getLogger("lbd.router")

_SWEEP_S = 1.0  # how often connections are checked against the timeouts


class HttpServer:
    """Listens and runs ``handler(request, response)`` for every request, within ``limits`` (timeouts checked
    every second)."""

    def __init__(self, handler: Handler, limits: Limits | None = None, ssl: ssl_mod.SSLContext | None = None):
        self.handler = handler
        self.limits = limits or Limits()
        self.max_body = self.limits.max_request_body_bytes
        self.ssl = ssl
        self.loop = asyncio.get_running_loop()
        self.connections: set[Connection] = set()
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
                lambda: Connection(self), sock=sock, backlog=backlog, ssl=self.ssl
            )
        else:
            self._server = await self.loop.create_server(
                lambda: Connection(self), host, port, reuse_port=True, backlog=backlog, ssl=self.ssl
            )
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)

    @property
    def sockets(self) -> tuple[socket.socket, ...]:
        return tuple(self._server.sockets) if self._server is not None else ()

    def _sweep(self) -> None:
        self._sweeper = self.loop.call_later(_SWEEP_S, self._sweep)
        now, limits = self.loop.time(), self.limits
        for conn in list(self.connections):
            try:
                conn.check_timeouts(now, limits)
            except Exception:  # one broken connection must not stop the sweeps of all the others
                log.exception("timeout check failed; closing that connection")
                conn.abort()

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
