"""One router worker: the aiohttp server, its routes, the upstream client pool and the background monitor."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

import aiohttp
import orjson
from aiohttp import web

from lbd.router.config import RouterConfig
from lbd.router.monitor import Monitor
from lbd.router.proxy import Proxy, error_response
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState

log = logging.getLogger("lbd.router")
FORWARDED = ("/v1/{tail:.*}", "/tokenize", "/detokenize")


class RouterApp:
    def __init__(self, cfg: RouterConfig, shared: SharedCounters) -> None:
        self.cfg = cfg
        self.shared = shared
        self.runner: web.AppRunner | None = None

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
        app = web.Application(client_max_size=cfg.max_request_body_bytes)
        app.router.add_get("/health", self.health)
        app.router.add_get("/readyz", self.readyz)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/router/status", self.status)
        for path in FORWARDED:
            app.router.add_route("*", path, self.proxy.handle)
        app.router.add_route("*", "/{tail:.*}", self.not_found)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
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

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        if self.state.ready():
            return web.json_response({"ready": True})
        return error_response(503, "no endpoint is ready", "ServiceUnavailableError")

    async def models(self, request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps({"object": "list", "data": self.state.models()}),
            content_type="application/json",
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.state.metrics.render(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def status(self, request: web.Request) -> web.Response:
        body = {
            "policy": self.cfg.policy,
            "worker": self.shared.worker,
            "ready": self.state.ready(),
            "endpoints": self.state.status(),
        }
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def not_found(self, request: web.Request) -> web.Response:
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
