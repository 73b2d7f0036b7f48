"""The head's registration service on ``--data-parallel-rpc-port`` (HTTP/JSON): nodes join the DP group here.

POST   /v1/nodes        register: {node_id, address, hostname, health_url, data_parallel_size,
                        data_parallel_size_local, data_parallel_start_rank, models, ranks: [...]}
                        -> 200 {accepted, node_id, lease_s, heartbeat_interval_s, data_parallel_size,
                        rendezvous}; 409 (or 400) with an OpenAI-style error naming the flag to fix
PUT    /v1/nodes/{id}   heartbeat with the same body (its ``ranks`` replace the last ones) -> 200; 404:
                        unknown node (the head restarted): register again
DELETE /v1/nodes/{id}   leave (graceful shutdown of that node)
GET    /v1/group        the group: nodes, their ranges and lease state, missing ranks, recent refusals,
                        rendezvous (see ``lbd.serve.group``)
GET    /status          every rank of the group in the supervisor's /status shape (a router can follow
                        ``supervisor://head:rpc-port`` to route over the whole group; with a cluster token it
                        needs the token too: follow the head's health port instead)
GET    /health          200

With a cluster token (``LBD_CLUSTER_TOKEN`` or ``--cluster-token-file``; required when the head listens beyond
loopback, see ``lbd.common.cluster``) every call but /health needs ``Authorization: Bearer <token>`` (401
otherwise). Bodies are capped in size (``MAX_BODY_BYTES``, 413) and in time (``BODY_READ_S``, 408), and the
connection limits of ``registry_limits`` apply (heads trickled in, too many connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import msgspec
from aiohttp import web
from msgspec.structs import replace

from lbd.common.cluster import CLUSTER_TOKEN_ENV, bearer_ok
from lbd.common.limits import Limits, PeerReadTooLarge, read_capped
from lbd.serve.group import Group, Rejected, rendezvous, span
from lbd.supervisor.health import AppServer, error_response, json_errors
from lbd.wire.registration import (
    NodeHeartbeat,
    NodeRegistration,
    RegistrationAnswer,
    decode_heartbeat,
    decode_registration,
)
from lbd.wire.status import SupervisorStatus

Body = TypeVar("Body", NodeRegistration, NodeHeartbeat)

log = logging.getLogger("lbd.serve")
MAX_BODY_BYTES = 256 * 1024  # a registration lists a node's ranks: a few hundred bytes each
BODY_READ_S = 5.0
HEAD_READ_S = 5.0
MAX_CONNECTIONS = 256


def registry_limits(limits: Limits) -> Limits:
    """The node's limits, tightened for the registration port (its callers are a handful of nodes)."""
    return dataclasses.replace(
        limits, max_request_body_bytes=min(limits.max_request_body_bytes, MAX_BODY_BYTES),
        header_read_timeout_s=min(limits.header_read_timeout_s, HEAD_READ_S),
        body_read_timeout_s=min(limits.body_read_timeout_s, BODY_READ_S),
        max_connections=min(limits.max_connections, MAX_CONNECTIONS))


def _json(data: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type="application/json")


class Registry(AppServer):
    def __init__(self, group: Group, address: str | None, rpc_port: int, heartbeat_s: float,
                 token: str | None, group_status: Callable[[], SupervisorStatus]) -> None:
        self.group = group
        self.rendezvous = rendezvous(address, rpc_port)
        self.heartbeat_s = heartbeat_s
        self.token = token
        self.group_status = group_status
        self.limits = registry_limits(Limits())
        self.app = web.Application(middlewares=[json_errors, self._auth], client_max_size=MAX_BODY_BYTES)
        self.app.add_routes([
            web.post("/v1/nodes", self.register), web.put("/v1/nodes/{node_id}", self.heartbeat),
            web.delete("/v1/nodes/{node_id}", self.leave), web.get("/v1/group", self.describe),
            web.get("/status", self.status), web.get("/health", self.health)])

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if self.token and request.path != "/health" and not bearer_ok(request.headers.get("Authorization"),
                                                                     self.token):
            return error_response(401, "missing or wrong cluster token: start every node with the same "
                                       f"{CLUSTER_TOKEN_ENV} (or --cluster-token-file)")
        return await handler(request)

    async def _raw(self, request: web.Request) -> bytes | web.Response:
        cap = self.limits.max_request_body_bytes
        if (request.content_length or 0) > cap:
            return error_response(413, f"registration body over {cap} bytes")
        try:
            return await asyncio.wait_for(read_capped(lambda: request.content.read(64 * 1024), cap),
                                          self.limits.body_read_timeout_s)
        except TimeoutError:
            return error_response(408, f"registration body not received within "
                                       f"{self.limits.body_read_timeout_s:g} s")
        except PeerReadTooLarge:  # a chunked body has no length to check first
            return error_response(413, f"registration body over {cap} bytes")
        except ConnectionError:  # the link dropped mid-body (a stale heartbeat): nobody reads the answer
            return error_response(400, "registration body cut off: the connection was reset")

    async def _body(self, request: web.Request, decode: Callable[[bytes], Body]) -> Body | web.Response:
        raw = await self._raw(request)
        if isinstance(raw, web.Response):
            return raw
        try:
            return decode(raw)
        except ValueError as e:  # msgspec names the field: "Expected `int`, got `str` - at `$.data_...`"
            return error_response(400, f"registration is missing or has a bad field: {e}")

    def _answer(self, node_id: str) -> RegistrationAnswer:
        return RegistrationAnswer(node_id=node_id, lease_s=self.group.lease_s,
                                  heartbeat_interval_s=self.heartbeat_s,
                                  data_parallel_size=self.group.dp_size, rendezvous=self.rendezvous)

    async def register(self, request: web.Request) -> web.Response:
        body = await self._body(request, decode_registration)
        if isinstance(body, web.Response):
            return body
        try:
            member = self.group.register(body, time.monotonic(), time.time())
        except Rejected as e:
            log.error("registry: refused a node: %s", e.message)
            return error_response(e.status, e.message, e.param)
        log.info("registry: node %s (%s) registered ranks %s", member.address, member.hostname or "?",
                 span(list(member.rank_ids)))
        return _json(self._answer(member.node_id))

    async def heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request, decode_heartbeat)
        if isinstance(body, web.Response):
            return body
        node_id = request.match_info["node_id"]
        was_lost = (m := self.group.members.get(node_id)) is not None and m.lost
        member = self.group.heartbeat(node_id, body.ranks, time.monotonic())
        if member is None:
            return error_response(404, f"node {node_id} is not registered (the head restarted?): "
                                       "register again")
        if was_lost:
            log.info("registry: node %s is back (ranks %s)", member.address, span(list(member.rank_ids)))
        return _json(self._answer(node_id))

    async def leave(self, request: web.Request) -> web.Response:
        node_id = request.match_info["node_id"]
        member = self.group.members.get(node_id)
        if not self.group.leave(node_id):
            return error_response(404, f"node {node_id} is not registered")
        log.info("registry: node %s left (ranks %s)", member.address if member else node_id,
                 span(list(member.rank_ids)) if member else "?")
        return _json({"left": True, "node_id": node_id})

    async def describe(self, request: web.Request) -> web.Response:
        return _json(replace(self.group.describe(time.monotonic()), rendezvous=self.rendezvous))

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.group_status())

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    def watch_losses(self) -> None:
        """Log nodes whose lease just ran out (called on the health port's poll)."""
        now = time.monotonic()
        for m in self.group.members.values():
            lost = now - m.last_seen > self.group.lease_s
            if lost and not m.lost:
                log.warning("registry: node %s missed its heartbeats for %.1f s: ranks %s are unreachable",
                            m.address, now - m.last_seen, span(list(m.rank_ids)))
            m.lost = lost
