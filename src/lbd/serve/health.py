"""The health port (``--data-parallel-supervisor-port``, 9256) of an `lbd serve` deployment node.

Same endpoints and /status shape as `lbd supervise` (see supervisor/health.py), so orchestrators and
``lbd route --upstreams supervisor://node:9256`` work unchanged, over *this node's view*:

- an internal-LB head answers for the whole group: every rank 0..N-1 (its own, the registered nodes', and
  ``missing`` placeholders), readiness by ``--ready-policy`` over N;
- a ``--headless`` or hybrid node answers for its own ranks, and is ready only while registered with the head.

/status adds a ``deployment`` object: role, the group (head: nodes, missing ranks, refusals, rendezvous) or
the registration (member: state, reason, head), and the router child. Answers come from the last poll of the
node's supervisor (a child on an internal loopback port) and the registration state: no handler waits on a
rank. The admin endpoints (drain, restart, rolling restart, with the supervisor's token) are passed to the
node's supervisor; a rank of another node is answered 404 naming that node's health port. ``POST /scale``
(lbd.supervisor.scale, ``lbd scale``) resizes this node's own ranks through its supervisor, with the same
rules for who may (the admin or cluster token; with neither, open only on a loopback-only health port); on
a multi-node head that is the head's local ranks only (each other node is resized on its own health port).
Readiness and the sizes in /status follow the supervisor's local size once a resize happened.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import ssl
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp
from aiohttp import web
from msgspec.structs import replace

from lbd.common.cluster import is_loopback
from lbd.common.limits import PeerReadTooLarge, read_aiohttp, read_capped
from lbd.common.tls import server_context
from lbd.serve.group import Group, rendezvous, span
from lbd.serve.member import REGISTERED, Membership, url_host
from lbd.serve.plan import Plan
from lbd.supervisor.health import AppServer, error_response, json_errors
from lbd.supervisor.scale import scale_denied, scale_keys
from lbd.wire import scale as wire_scale
from lbd.wire.roles import NodeRole
from lbd.wire.states import NodePhase, RankState
from lbd.wire.status import (
    AutoscaleState,
    Deployment,
    RankStatus,
    RouterInfo,
    SupervisorStatus,
    decode_supervisor_status,
    encode,
)

RUNNING, STOPPING, FAILED = NodePhase.RUNNING, NodePhase.STOPPING, NodePhase.FAILED
_STALE_S = 5.0  # a supervisor status older than this is not trusted for readiness


def with_host(url: str, host: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{url_host(host)}:{parts.port}" if parts.port else url


class LocalSupervisor:
    """The node's `lbd supervise` child, seen through its /status (polled) and its other endpoints."""

    def __init__(self, port: int, interval_s: float, tls: ssl.SSLContext | None = None) -> None:
        self.base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
        self.tls = tls  # verifies the supervisor's certificate (a TLS deployment)
        self.interval_s = interval_s
        self.status: SupervisorStatus | None = None
        self.at = 0.0
        self.error: str | None = "not polled yet"
        self._session: aiohttp.ClientSession | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0),
                                                  connector=aiohttp.TCPConnector(ssl=self.tls or True))
        return self._session

    async def poll(self) -> None:
        while True:
            try:
                async with self.session().get(self.base + "/status") as resp:
                    if resp.status != 200:
                        raise ValueError(f"/status answered {resp.status}")
                    self.status = decode_supervisor_status(await read_aiohttp(resp, timeout_s=2.0))
                    self.at, self.error = time.monotonic(), None
            except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as e:
                self.error = f"the node's supervisor does not answer ({type(e).__name__}: {e})"
            await asyncio.sleep(self.interval_s)

    def fresh(self) -> bool:
        return self.status is not None and time.monotonic() - self.at < _STALE_S

    async def forward(self, method: str, path: str, headers: dict[str, str],
                      body: bytes | None = None) -> web.Response:
        try:
            async with self.session().request(method, self.base + path, headers=headers, data=body) as resp:
                return web.Response(status=resp.status, body=await read_aiohttp(resp, timeout_s=2.0),
                                    content_type=resp.content_type or "application/json")
        except (OSError, aiohttp.ClientError, TimeoutError) as e:
            return error_response(503, f"the node's supervisor does not answer: {type(e).__name__}")

    async def metrics(self) -> bytes:
        with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
            async with self.session().get(self.base + "/metrics") as resp:
                if resp.status == 200:
                    return await read_aiohttp(resp, timeout_s=2.0)
        return b""

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class NodeHealth(AppServer):
    def __init__(self, plan: Plan, local: LocalSupervisor | None, group: Group | None,
                 membership: Membership | None, router_alive: Callable[[], bool | None]) -> None:
        self.plan = plan
        self.limits = plan.limits
        self.tls = server_context(plan.ssl_certfile, plan.ssl_keyfile)
        self.local = local
        self.group = group
        self.membership = membership
        self.router_alive = router_alive  # None: this node runs no router
        self.phase = RUNNING
        self.failure: str | None = None
        self.started = time.monotonic()
        self.autoscale: Callable[[], AutoscaleState] | None = None  # --autoscale's planner state (node.py)
        self._scale_keys = scale_keys(plan.admin_token, plan.cluster_token)
        self.app = web.Application(middlewares=[json_errors])
        self.app.add_routes([
            web.get("/health", self.health), web.get("/readyz", self.readyz), web.get("/status", self.status),
            web.get("/metrics", self.metrics), web.post("/ranks/{rank}/{action}", self.admin_rank),
            web.post("/rolling-restart", self.admin_node), web.post("/scale", self.scale)])

    # ---- the view -----------------------------------------------------------------------------------------
    def local_ranks(self, advertised: bool) -> list[RankStatus]:
        """This node's ranks as its supervisor last reported them; ``advertised``: URLs others can reach."""
        if self.local is None or self.local.status is None:
            return []
        ranks = list(self.local.status.ranks)
        host = self.plan.advertise or (self.membership.advertise if self.membership else None)
        if advertised and host and self.plan.rank_host in (None, "", "0.0.0.0", "::"):
            ranks = [replace(r, url=with_host(r.url, host)) for r in ranks]
        return ranks

    def group_ranks(self) -> list[RankStatus]:
        own = self.local_ranks(advertised=True)
        return self.group.ranks(own, time.monotonic()) if self.group is not None else own

    def view_ranks(self) -> list[RankStatus]:
        if self.plan.view_is_group:
            return self.group_ranks()
        return self.local_ranks(advertised=self.plan.member or self.plan.registry)

    def readiness(self) -> tuple[bool, str]:
        if self.phase != RUNNING:
            return False, f"lbd serve is {self.phase}" + (f": {self.failure}" if self.failure else "")
        if self.local is not None and not self.local.fresh():
            return False, self.local.error or "the node's supervisor status is stale"
        if self.membership is not None and self.membership.state != REGISTERED:
            return False, self.membership.reason
        if self.router_alive() is False:
            return False, "the router is not running (restarting)"
        ranks = self.view_ranks()
        ready = sum(map(_serving, ranks))
        _, _, total, need = self.sizes()
        head = f"{ready}/{total} ranks ready (policy {self.plan.ready_policy}"
        if ready >= need:
            return True, head + ")"
        groups = self.local.status.groups if self.local is not None and self.local.status is not None else []
        why = "; ".join(g.reason for g in groups if not g.ready) or _not_ready(ranks)
        return False, f"{head} needs {need}): {why}"

    def liveness(self) -> tuple[bool, str]:
        if self.phase == FAILED:
            return False, f"gave up: {self.failure}"
        status = self.local.status if self.local is not None else None
        if status is not None and not status.live:
            return False, "the node's supervisor gave up: " + status.reason
        return True, f"lbd serve {self.plan.role} {self.phase}"

    def deployment(self) -> Deployment:
        plan = self.plan
        info = Deployment(
            role=plan.role, load_balancing="hybrid" if plan.role is NodeRole.HYBRID else "internal",
            data_parallel_size=plan.dp_size, data_parallel_size_local=plan.dp_size_local,
            data_parallel_start_rank=plan.dp_start_rank, address=plan.address, rpc_port=plan.rpc_port,
            registry=plan.registry)
        if self.group is not None:
            info.group = self.group.describe(time.monotonic())
            info.rendezvous = rendezvous(plan.address, plan.rpc_port)
        if self.membership is not None:
            info.registration = self.membership.describe()
        alive = self.router_alive()
        if alive is not None:
            info.router = RouterInfo(port=plan.router_port, workers=plan.router_workers, alive=alive)
        if self.autoscale is not None:
            info.autoscale = self.autoscale()
        return info

    def status_body(self) -> SupervisorStatus:
        """The supervisor's /status over this node's view, with the node's own answers and deployment."""
        ready, reason = self.readiness()
        live, _ = self.liveness()
        base = self.local.status if self.local is not None else None
        ranks = self.view_ranks()
        size, local, _, _ = self.sizes()
        return replace(base or SupervisorStatus(), ready=ready, live=live, reason=reason, phase=self.phase,
                       pid=os.getpid(), supervisor_pid=base.pid if base is not None else None,
                       data_parallel_size=size, data_parallel_size_local=local,
                       data_parallel_start_rank=self.plan.dp_start_rank, ready_policy=self.plan.ready_policy,
                       ready_ranks=sum(map(_serving, ranks)), uptime_s=time.monotonic() - self.started,
                       ranks=ranks, deployment=self.deployment())

    def sizes(self) -> tuple[int, int, int, int]:
        """(DP size, local size, view size, ready ranks needed): the plan's, or after a resize of this node's
        ranks (POST /scale) with the supervisor's local size in place of the plan's."""
        plan, status = self.plan, self.local.status if self.local is not None else None
        if status is None or status.scaling is None:
            return plan.dp_size, plan.dp_size_local, plan.view_size, plan.ready_needed
        delta = status.data_parallel_size_local - plan.dp_size_local
        view = max(plan.view_size + delta, 1)
        policy = plan.ready_policy
        need = view if policy == "all" else 1 if policy == "any" else min(int(policy), view)
        return plan.dp_size + delta, status.data_parallel_size_local, view, need

    # ---- endpoints ----------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        ok, reason = self.liveness()
        return web.Response(status=200 if ok else 503, text=reason + "\n")

    async def readyz(self, request: web.Request) -> web.Response:
        ok, reason = self.readiness()
        return web.Response(status=200 if ok else 503, text=reason + "\n")

    async def status(self, request: web.Request) -> web.Response:
        return web.Response(body=encode(self.status_body()), content_type="application/json")

    async def metrics(self, request: web.Request) -> web.Response:
        own = await self.local.metrics() if self.local is not None else b""
        return web.Response(body=own + self._own_metrics().encode(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    def _own_metrics(self) -> str:
        ranks = self.view_ranks()
        states: dict[str, int] = {}
        for r in ranks:
            states[r.state.value] = states.get(r.state.value, 0) + 1
        lines = ["# HELP lbd_serve_ready 1 when this node's /readyz answers 200.",
                 "# TYPE lbd_serve_ready gauge",
                 f"lbd_serve_ready {int(self.readiness()[0])}",
                 "# HELP lbd_serve_ranks Ranks this node's health port answers for, by state.",
                 "# TYPE lbd_serve_ranks gauge"]
        lines += [f'lbd_serve_ranks{{state="{s}"}} {n}' for s, n in sorted(states.items())]
        if self.group is not None:
            nodes = self.group.describe(time.monotonic()).nodes
            lines += ["# HELP lbd_serve_group_nodes Nodes registered with this head, by lease state.",
                      "# TYPE lbd_serve_group_nodes gauge"]
            for state in ("registered", "lost"):
                lines.append(f'lbd_serve_group_nodes{{state="{state}"}} '
                             f"{sum(n.state == state for n in nodes)}")
        if self.membership is not None:
            lines += ["# HELP lbd_serve_registered 1 while this node is registered with the head.",
                      "# TYPE lbd_serve_registered gauge",
                      f"lbd_serve_registered {int(self.membership.state == REGISTERED)}"]
        return "\n".join(lines) + "\n"

    async def admin_rank(self, request: web.Request) -> web.Response:
        try:
            rank = int(request.match_info["rank"])
        except ValueError:
            return error_response(400, f"rank must be an integer, got {request.match_info['rank']!r}", "rank")
        local = {r.rank for r in self.local_ranks(advertised=False)}
        if rank not in local and self.group is not None:
            owner = next((m for m in self.group.members.values() if rank in m.rank_ids), None)
            if owner is not None:
                return error_response(404, f"rank {rank} runs on node {owner.address}: send this to its "
                                           f"health port {owner.health_url}", "rank")
        return await self.admin_node(request)

    async def scale(self, request: web.Request) -> web.Response:
        """POST /scale, checked here (this port may listen beyond loopback where the supervisor's does not),
        then passed to the node's supervisor, which checks the token again and carries it out."""
        if self.local is None:
            return error_response(404, "this node runs no ranks (--data-parallel-size-local 0)")
        auth = request.headers.get("Authorization")
        denied = scale_denied(auth, self._scale_keys, is_loopback(self.plan.health_host))
        if denied is not None:
            return error_response(*denied)
        try:
            body = await read_capped(request.content.readany, wire_scale.MAX_BODY_BYTES,
                                     request.content_length, "POST /scale's body")
        except PeerReadTooLarge as e:
            return error_response(400, str(e))
        headers = {"Content-Type": "application/json", **({"Authorization": auth} if auth else {})}
        return await self.local.forward("POST", "/scale", headers, body)

    async def admin_node(self, request: web.Request) -> web.Response:
        if self.local is None:
            return error_response(404, "this node runs no ranks (--data-parallel-size-local 0)")
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        return await self.local.forward("POST", request.path, headers)


def _serving(rank: RankStatus) -> bool:
    """Ready and routable (a member of an MoE group that is re-forming is ready but not routable)."""
    return rank.state is RankState.READY and bool(rank.routable)


def _not_ready(ranks: list[RankStatus]) -> str:
    """'rank 1 starting, ranks 2-3 missing (no node has registered them)'."""
    by_state: dict[str, list[int]] = {}
    for r in ranks:
        if r.state is not RankState.READY and r.rank is not None:
            by_state.setdefault(r.state.value, []).append(r.rank)
    parts = []
    for state, ids in by_state.items():
        label = f"rank {ids[0]}" if len(ids) == 1 else f"ranks {span(ids)}"
        why = {"missing": " (no node has registered them)",
               "unreachable": " (their node missed its heartbeats)"}
        parts.append(f"{label} {state}{why.get(state, '')}")
    return ", ".join(parts) or "no ranks yet"
