"""The DP coordinator's HTTP side (``lbd.engine.dp.coordinator`` serves it): ``/status`` (JSON), ``/metrics``
(Prometheus), ``POST /members/{rank}/failed`` and ``POST /resize``; the cluster token as a bearer on each when
there is one; a body capped at ``MAX_BODY_BYTES`` and ``BODY_READ_S``."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from lbd.common.cluster import CLUSTER_TOKEN_ENV, bearer_ok
from lbd.wire.dp import CoordinatorStatus, DPState

if TYPE_CHECKING:
    from aiohttp import web

Outgoing = list[tuple[bytes, bytes]]  # (rank identity, message)


class Machine(Protocol):
    """The coordinator's state machine (``lbd.engine.dp.coordinator.Coordinator``), as the port uses it."""

    size: int
    generation: int
    state: DPState

    def status(self, now: float) -> CoordinatorStatus: ...

    def member_failed(self, rank: int, reason: str) -> Outgoing: ...

    def resize(self, size: int) -> Outgoing: ...


class CoordinatorMetrics:
    """Prometheus families of /metrics, filled from the state when scraped."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Gauge

        self.registry = CollectorRegistry()

        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        self.waiting = gauge("lbd_dp_num_requests_waiting", "Waiting requests per rank (last report).",
                             ("engine",))
        self.running = gauge("lbd_dp_num_requests_running", "Running requests per rank (last report).",
                             ("engine",))
        self.joined = gauge("lbd_dp_member_joined", "1 while the rank is in the current generation.",
                            ("engine",))
        self.age = gauge("lbd_dp_member_report_age_seconds", "Seconds since the rank's last report.",
                         ("engine",))
        self.generation = gauge("lbd_dp_generation", "The generation being formed or in service.")
        self.ready = gauge("lbd_dp_group_ready", "1 while every member is in the current generation.")
        self.wave_active = gauge("lbd_dp_wave_active", "1 while a wave runs.")
        self.waves = gauge("lbd_dp_waves_total", "Waves started since the coordinator started.")
        self.aborts = gauge("lbd_dp_generation_aborts_total", "Generations aborted since start.")

    def render(self, c: CoordinatorStatus) -> bytes:
        from prometheus_client import generate_latest

        for family in (self.waiting, self.running, self.joined, self.age):
            family.clear()  # a member a resize removed leaves /metrics
        for m in c.members:
            r = str(m.rank)
            self.waiting.labels(r).set(m.waiting)
            self.running.labels(r).set(m.running)
            self.joined.labels(r).set(int(m.joined))
            self.age.labels(r).set(-1 if m.last_report_age_s is None else m.last_report_age_s)
        self.generation.set(c.generation)
        self.ready.set(int(c.state is DPState.READY))
        self.wave_active.set(int(c.wave.active))
        self.waves.set(c.wave.count)
        self.aborts.set(c.generation_aborts)
        return generate_latest(self.registry)


MAX_BODY_BYTES = 4096  # POST /members/{rank}/failed: {"reason": "..."}; POST /resize: {"size": N}
BODY_READ_S = 5.0


def http_app(coord: Machine, metrics: CoordinatorMetrics, send: Callable[[Outgoing], Awaitable[None]],
             token: str | None) -> web.Application:
    """/status, /metrics, POST /members/{rank}/failed and POST /resize; the bearer token on each when there is
    one; a body capped at ``MAX_BODY_BYTES`` and ``BODY_READ_S``."""
    from aiohttp import web

    from lbd.engine.server.errors import APIError, error_response

    async def status(request: web.Request) -> web.Response:
        return web.Response(body=msgspec.json.encode(coord.status(time.monotonic())),
                            content_type="application/json")

    async def metrics_text(request: web.Request) -> web.Response:
        return web.Response(body=metrics.render(coord.status(time.monotonic())),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def failed(request: web.Request) -> web.Response:
        try:
            rank = int(request.match_info["rank"])
        except ValueError:
            rank = -1
        if not 0 <= rank < coord.size:
            name = request.match_info["rank"]
            return error_response(APIError(f"no member {name}: ranks are 0..{coord.size - 1}", 404, "rank"))
        try:
            body = await _read_body(request, '{"reason": "..."}')
        except APIError as e:
            return error_response(e)
        reason = str(body.get("reason") or "reported failed by the supervisor")
        await send(coord.member_failed(rank, reason))
        return web.json_response({"generation": coord.generation, "state": coord.state})

    async def resize(request: web.Request) -> web.Response:
        try:
            body = await _read_body(request, '{"size": N}')
            size = body.get("size")
            if not isinstance(size, int) or isinstance(size, bool):
                raise APIError('body must be {"size": N} with N a whole number of ranks', 400, "size")
            out = coord.resize(size)
        except APIError as e:
            return error_response(e)
        except ValueError as e:  # not ready, or no ranks: nothing changed
            return error_response(APIError(f"cannot resize: {e}", 409, "size"))
        await send(out)
        return web.json_response({"generation": coord.generation, "state": coord.state, "size": coord.size})

    app = web.Application(middlewares=[_auth(token)], client_max_size=MAX_BODY_BYTES)
    app.router.add_get("/status", status)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_post("/members/{rank}/failed", failed)
    app.router.add_post("/resize", resize)
    return app


async def _read_body(request: web.Request, example: str) -> dict[str, Any]:
    """The JSON object of a POST (empty: {}); APIError for a body too big, too slow or not an object."""
    from lbd.engine.server.errors import APIError

    if not request.can_read_body:
        return {}
    if (request.content_length or 0) > MAX_BODY_BYTES:
        raise APIError(f"body over {MAX_BODY_BYTES} bytes", 413)
    try:
        raw = await asyncio.wait_for(request.content.read(MAX_BODY_BYTES + 1), BODY_READ_S)
    except TimeoutError:
        raise APIError(f"body not received within {BODY_READ_S:g} s", 408) from None
    try:
        body = json.loads(raw) if len(raw) <= MAX_BODY_BYTES else None
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise APIError(f"body must be a JSON object of at most {MAX_BODY_BYTES} bytes: {example}", 400)
    return body


def _auth(token: str | None) -> Any:
    """The bearer-token middleware (a no-op without a token)."""
    from aiohttp import web

    from lbd.engine.server.errors import APIError, error_response

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and not bearer_ok(request.headers.get("Authorization"), token):
            return error_response(APIError("missing or wrong cluster token: start every node with the same "
                                           f"{CLUSTER_TOKEN_ENV}", 401))
        return await handler(request)

    return auth
