"""One router worker: the aiohttp server, its routes, the upstream client pool and the background monitor.

The server is aiohttp's low-level ``web.Server`` with one dispatch function instead of an Application and its
URL dispatcher: the router has a handful of fixed paths and a prefix, and the Application layer (resolving
routes, building match info, middlewares) was a measurable part of every proxied request's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from lbd.router.config import RouterConfig
from lbd.router.monitor import Monitor
from lbd.router.proxy import Proxy, error_response
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState

log = logging.getLogger("lbd.router")
FORWARDED_PREFIX = "/v1/"  # and every path under it, except the router's own GET /v1/models
FORWARDED = frozenset({"/tokenize", "/detokenize"})


class RouterApp:
    def __init__(self, cfg: RouterConfig, shared: SharedCounters) -> None:
        self.cfg = cfg
        self.shared = shared
        self.runner: web.ServerRunner | None = None

    async def start(self, sock: socket.socket | None = None) -> None:
        cfg = self.cfg
        self.state = RouterState(cfg, self.shared)
        # Proxied requests go through lbd.router.upstream pools; telemetry through aiohttp with a small pool.
        self.monitor_session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=4, keepalive_timeout=60.0),
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self.proxy = Proxy(self.state)
        self.monitor = Monitor(self.state, self.monitor_session)
        self.own = {  # GET (and HEAD) only; other methods on these paths are proxied or 404
            "/health": self.health,
            "/readyz": self.readyz,
            "/v1/models": self.models,
            "/metrics": self.metrics,
            "/router/status": self.status,
        }
        loop = asyncio.get_running_loop()

        def make_request(*args: Any) -> web.BaseRequest:  # (message, payload, protocol, writer, task)
            return web.BaseRequest(*args, loop, client_max_size=cfg.max_request_body_bytes)

        server = web.Server(
            self.dispatch, request_factory=make_request, handler_cancellation=True, access_log=None
        )
        self.runner = web.ServerRunner(server)
        await self.runner.setup()
        if sock is not None:
            site: web.BaseSite = web.SockSite(self.runner, sock)
        else:
            site = web.TCPSite(self.runner, cfg.host, cfg.port, reuse_port=True, backlog=2048)
        await site.start()
        self.monitor.start()

    async def close(self) -> None:
        await self.monitor.close()
        if self.runner is not None:
            await self.runner.cleanup()
        for pool in self.state.pools.values():
            pool.close()
        await self.monitor_session.close()

    async def dispatch(self, request: web.BaseRequest) -> web.StreamResponse:
        path = request.path
        if request.method in ("GET", "HEAD"):
            own = self.own.get(path)
            if own is not None:
                return await own(request)
        if path.startswith(FORWARDED_PREFIX) or path in FORWARDED:
            return await self.proxy.handle(request)
        return await self.not_found(request)

    async def health(self, request: web.BaseRequest) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.BaseRequest) -> web.Response:
        if self.state.ready():
            return web.json_response({"ready": True})
        return error_response(503, "no endpoint is ready", "ServiceUnavailableError")

    async def models(self, request: web.BaseRequest) -> web.Response:
        return web.Response(
            body=orjson.dumps({"object": "list", "data": self.state.models()}),
            content_type="application/json",
        )

    async def metrics(self, request: web.BaseRequest) -> web.Response:
        return web.Response(
            body=self.state.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def status(self, request: web.BaseRequest) -> web.Response:
        body = {
            "policy": self.cfg.policy,
            "worker": self.shared.worker,
            "ready": self.state.ready(),
            "endpoints": self.state.status(),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def not_found(self, request: web.BaseRequest) -> web.Response:
        return error_response(404, f"no route for {request.method} {request.path}", "NotFoundError")


async def serve(cfg: RouterConfig, shared: SharedCounters) -> None:
    """Run one worker until SIGTERM/SIGINT; SIGHUP re-reads --upstreams-file."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    app = RouterApp(cfg, shared)
    await app.start()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if cfg.upstreams_file is not None:
        loop.add_signal_handler(signal.SIGHUP, app.monitor.reload_file)
    else:
        loop.add_signal_handler(signal.SIGHUP, lambda: None)
    log.info("listening on %s:%d, policy %s", cfg.host, cfg.port, cfg.policy)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await app.close()
