"""One router worker: the HTTP server, its routes, the upstream client pools and the background monitor.

The front side is ``lbd.router.server`` (a protocol on llhttp) with one dispatch function: the router has a
handful of fixed paths and a prefix, so no URL dispatcher. Every outgoing request (proxied, scrapes, probes)
uses ``lbd.router.upstream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from collections.abc import Awaitable, Callable

import orjson

from lbd.common.auth import PUBLIC_PATHS, ApiKey
from lbd.common.internal_key import IdsSigner
from lbd.common.limits import raise_open_files_limit
from lbd.common.scaling import AutoscaleReport
from lbd.common.tls import server_context
from lbd.router.auth import Gate
from lbd.router.autoscale_signals import AutoscaleCollector, held_tokens, router_report
from lbd.router.config import RouterConfig
from lbd.router.kv.index import BlockIndex
from lbd.router.kv.memory import IndexCollector
from lbd.router.kv.tokenize import load_local
from lbd.router.kv.view import ExactView
from lbd.router.messages import Request, Response
from lbd.router.metrics import FlowCollector
from lbd.router.monitor import Monitor
from lbd.router.proxy import Proxy, send_error
from lbd.router.server import HttpServer
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState

log = logging.getLogger("lbd.router")
FORWARDED_PREFIX = "/v1/"  # and every path under it, except the router's own GET /v1/models
FORWARDED = frozenset({"/tokenize", "/detokenize"})
_JSON = b"Content-Type: application/json\r\n"
_START_POLL_S = 0.02  # a request held before the first endpoint serves looks this often
_TEXT_METRICS = b"Content-Type: text/plain; version=0.0.4; charset=utf-8\r\n"


class RouterApp:
    def __init__(self, cfg: RouterConfig, shared: SharedCounters) -> None:
        self.cfg = cfg
        self.shared = shared
        self.server: HttpServer | None = None

    async def start(self, sock: socket.socket | None = None) -> None:
        cfg = self.cfg
        self.state = RouterState(cfg, self.shared)
        self.tracer = None
        if cfg.otlp_traces_endpoint:
            from lbd.router.tracing import RouterTracer

            self.tracer = RouterTracer(cfg.otlp_traces_endpoint)
        self.gate = Gate(cfg.api_keys, cfg.api_key_file, cfg.rate_limit_rps, cfg.rate_limit_tps,
                         cfg.rate_limit_burst_s, cfg.workers)
        self.proxy = Proxy(self.state, self.gate, self.tracer)
        if self.proxy.flow is not None:
            self.state.metrics.register(FlowCollector(self.proxy.flow.rows))
        self.state.metrics.register(AutoscaleCollector(self.autoscale))
        self.starting = cfg.serving_health  # until this worker first sees an endpoint serve
        self.monitor = Monitor(self.state)
        if cfg.kv_events != "off":
            self.state.exact = await self._exact_view()
            self.state.metrics.register(IndexCollector(self.state.exact.index))
        # GET (and HEAD) only; other methods on these paths are proxied or 404
        self.own: dict[str, Callable[[Request, Response], Awaitable[None]]] = {
            "/health": self.health,
            "/readyz": self.readyz,
            "/v1/models": self.models,
            "/metrics": self.metrics,
            "/router/status": self.status,
        }
        raise_open_files_limit(cfg.limits.max_connections)
        tls = server_context(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs, cfg.ssl_cert_reqs)
        self.server = HttpServer(self.dispatch, cfg.limits, tls)
        await self.server.start(cfg.host, cfg.port, sock=sock)
        self.monitor.start()

    async def _exact_view(self) -> ExactView:
        local = None
        if self.cfg.tokenizer is not None:
            path = str(self.cfg.tokenizer)
            local = await asyncio.get_running_loop().run_in_executor(None, load_local, path)
        return ExactView(self.cfg.kv_events, self.monitor._get, self.cfg.stale_after_s,
                         max(1.0, self.cfg.health_timeout_s), local, getattr(self.shared, "kv_pending", None),
                         self.cfg.forward_prompt_ids,
                         IdsSigner(self.cfg.internal_key) if self.cfg.internal_key else None,
                         BlockIndex(self.cfg.kv_index_max_blocks, self.cfg.kv_index_max_blocks_per_endpoint))

    async def close(self) -> None:
        if self.state.exact is not None:
            await self.state.exact.close()
        await self.monitor.close()
        if self.proxy.flow is not None:
            self.proxy.flow.close()
        if self.server is not None:
            await self.server.close(self.cfg.shutdown_timeout_s)
        for pool in self.state.pools.values():
            pool.close()
        self.state.metrics.close()
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.shutdown)  # export what is buffered

    def dispatch(self, request: Request, out: Response) -> Awaitable[None]:
        """The handler's coroutine for ``request`` (returned, not awaited here: one coroutine level less on
        every proxied request)."""
        path = request.path
        key = None
        if self.gate.enabled and path not in PUBLIC_PATHS and request.method != "OPTIONS":
            key = self.gate.identify(request.headers.get_raw("authorization"))
            if key is None:
                return self.unauthorized(request, out)
        if request.method in ("GET", "HEAD"):
            own = self.own.get(path)
            if own is not None:
                return own(request, out)
        if path.startswith(FORWARDED_PREFIX) or path in FORWARDED:
            if self.starting:
                return self._when_serving(request, out, key)
            return self.proxy.handle(request, out, key)
        return self.not_found(request, out)

    async def _when_serving(self, request: Request, out: Response, key: ApiKey | None) -> None:
        """--serving-health, before this worker first saw an endpoint serve: another worker (or the health
        port) may have said it serves, so the request waits for this one, within --retry-budget-s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.retry_budget_s
        while self.state.not_serving() is not None and loop.time() < deadline:
            await asyncio.sleep(_START_POLL_S)
        self.starting = self.state.not_serving() is not None
        await self.proxy.handle(request, out, key)

    async def unauthorized(self, request: Request, out: Response) -> None:
        self.state.metrics.request("none", "401", None)
        send_error(out, 401, "missing or wrong API key: send Authorization: Bearer <key>",
                   "AuthenticationError", headers=b"WWW-Authenticate: Bearer\r\n")

    async def not_found(self, request: Request, out: Response) -> None:
        send_error(out, 404, f"no route for {request.method} {request.path}", "NotFoundError")

    async def health(self, request: Request, out: Response) -> None:
        if not self._refused_not_serving(out):
            out.send(200, _JSON, b'{"status":"ok"}')

    def _refused_not_serving(self, out: Response) -> bool:
        """--serving-health: /health and /v1/models answer 503 with the reason while no request would be
        served (True: answered so)."""
        if not self.cfg.serving_health:
            return False
        why = self.state.not_serving()
        if why is None:
            self.starting = False
            return False
        send_error(out, 503, f"no request would be served now: {why}", "ServiceUnavailableError")
        return True

    async def readyz(self, request: Request, out: Response) -> None:
        if self.state.ready():
            out.send(200, _JSON, b'{"ready":true}')
        else:
            have, need = self.state.ready_count(), self.state.ready_needed()
            why = "no endpoint is ready" if need == 1 else f"{have}/{need} endpoints ready"
            send_error(out, 503, why, "ServiceUnavailableError")

    async def models(self, request: Request, out: Response) -> None:
        if not self._refused_not_serving(out):
            data = self.state.models()
            if self.proxy.adapters is not None:  # --lora-modules: adapters loaded on demand, listed too
                data += self.proxy.adapters.cards(data)
            out.send(200, _JSON, orjson.dumps({"object": "list", "data": data}))

    async def metrics(self, request: Request, out: Response) -> None:
        out.send(200, _TEXT_METRICS, self.state.metrics.render())

    async def status(self, request: Request, out: Response) -> None:
        body = {
            "policy": self.cfg.policy,
            "profile": self.state.policy.describe(),  # its plugins, and decisions by the plugin that decided
            "kv_events": self.cfg.kv_events,
            "worker": self.shared.worker,
            "ready": self.state.ready(),
            "endpoints": self.state.status(),
            "kv_index": self.state.exact.index_status() if self.state.exact is not None else None,
            "migrations": self.proxy.migrator.status(),
            # P/D: the profile its prefill stages run by, and its decisions by plugin (lbd.router.disagg)
            "prefill_profile": None if self.proxy.disagg is None else self.proxy.disagg.prefill.describe(),
            # flow control per tenant and class, all workers (lbd.router.flow)
            "flow": {"mode": "off"} if self.proxy.flow is None else self.proxy.flow.status(),
            "autoscale": self.autoscale(),  # lbd.common.scaling.AutoscaleReport
        }
        out.send(200, _JSON, orjson.dumps(body))

    def autoscale(self) -> AutoscaleReport:
        """The fleet's autoscaling signals and the rule's recommendation, computed now (on a scrape)."""
        flow = self.proxy.flow
        held = held_tokens(flow.rows()) if flow is not None else 0.0
        return router_report(self.state.snapshots(), self.cfg.flow, self.cfg.stale_after_s, held,
                             self.cfg.ttft_target_s, self.state.policy, self.cfg.autoscale_target_utilization,
                             self.state.capacity)


async def serve(cfg: RouterConfig, shared: SharedCounters) -> None:
    """Run one worker until SIGTERM/SIGINT; SIGHUP re-reads --upstreams-file."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    app = RouterApp(cfg, shared)
    await app.start()
    # The hot path makes few reference cycles, but its allocations trigger young collections that scan
    # everything allocated since; freezing what start-up made (modules, config, policies) and collecting
    # less often saves router CPU (benchmarks/RESULTS.md, "Router GC").
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    def reload() -> None:
        if cfg.upstreams_file is not None:
            app.monitor.reload_file()
        app.gate.reload()

    loop.add_signal_handler(signal.SIGHUP, reload)
    log.info("listening on %s:%d, policy %s", cfg.host, cfg.port, cfg.policy)
    try:
        await stop.wait()
    finally:
        with contextlib.suppress(Exception):
            await app.close()
