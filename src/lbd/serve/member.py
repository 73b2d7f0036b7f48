"""A node's membership of the group: register its ranks with the head, keep the lease alive, say why not.

The wire is HTTP/JSON to the head's registration service (`lbd.serve.registry`): POST /v1/nodes once, then
PUT /v1/nodes/{id} every heartbeat interval the head asked for, carrying the node's ranks as its supervisor
reports them (state, pid, reachable URL), DELETE at shutdown. A refusal (409: mismatched
--data-parallel-size, overlapping ranks, other models; 401: wrong LBD_CLUSTER_TOKEN) is final: the node stops
and exits 2, except a 409 about the node id (this node's previous run still holds the lease: it is waited
out). A head that cannot be reached is retried for ever, with the reason in the node's /status and a 503 from
its /readyz; a head that forgot us (404: it restarted) is registered with again. The head's answers are read
up to ``MAX_REPLY_BYTES`` within the probe timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
import uuid
from collections.abc import Callable

import aiohttp
import msgspec
from msgspec.structs import replace

from lbd.common.limits import read_aiohttp
from lbd.wire.registration import NodeRegistration, RegistrationAnswer, decode_answer, decode_error
from lbd.wire.status import Registration

log = logging.getLogger("lbd.serve")

CONNECTING, REGISTERED, DISCONNECTED, REJECTED = "connecting", "registered", "disconnected", "rejected"
MAX_REPLY_BYTES = 64 * 1024  # the head's answers are a few hundred bytes


def route_source_address(host: str, port: int) -> str:
    """The address of the interface this machine uses to reach ``host`` (what the head can reach us at)."""
    family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(addr)  # UDP: no packet is sent, the kernel only picks the route
        return str(s.getsockname()[0])


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class Membership:
    def __init__(self, head: str, rpc_port: int, advertise: str | None, health_port: int, timeout_s: float,
                 token: str | None, registration: Callable[[str], NodeRegistration],
                 on_rejected: Callable[[str], None], tls: ssl.SSLContext | None = None) -> None:
        self.head, self.rpc_port = head, rpc_port
        self.tls = tls  # verifies the head's certificate (a TLS deployment: every link is HTTPS)
        self.scheme = "https" if tls is not None else "http"
        self.base = f"{self.scheme}://{url_host(head)}:{rpc_port}"
        self.advertise = advertise
        self.health_port = health_port
        self.timeout_s = timeout_s
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.registration = registration  # advertised address -> the node's range, models and ranks
        self.on_rejected = on_rejected
        self.node_id = uuid.uuid4().hex
        self.state = CONNECTING
        self.reason = f"registering with the head at {head}:{rpc_port}"
        self.since = time.time()
        self.attempts = 0
        self.interval_s = 1.0
        self.lease_s = 3.0
        self.reply: RegistrationAnswer | None = None  # the head's answer (lease, rendezvous); None: none yet
        self._last_ok = time.monotonic()
        self._session: aiohttp.ClientSession | None = None

    def describe(self) -> Registration:
        return Registration(state=self.state, reason=self.reason, since=self.since,
                            head=f"{self.head}:{self.rpc_port}", node_id=self.node_id, attempts=self.attempts,
                            advertise_address=self.advertise,
                            rendezvous=self.reply.rendezvous if self.reply is not None else None)

    def _set(self, state: str, reason: str) -> None:
        if state != self.state or reason != self.reason:
            bad = state in (DISCONNECTED, REJECTED) or self.attempts == 1
            level = logging.WARNING if bad else logging.INFO
            if state != CONNECTING or self.attempts <= 1 or self.attempts % 30 == 0:
                log.log(level, "membership: %s: %s", state, reason)
        if state != self.state:
            self.since = time.time()
        self.state, self.reason = state, reason

    async def run(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(ssl=self.tls or True))
        try:
            while self.state != REJECTED:
                if self.reply is None:
                    await self._register()
                else:
                    await self._heartbeat()
                registered = self.state == REGISTERED
                await asyncio.sleep(self.interval_s if registered else min(self.interval_s, 1.0))
        finally:
            await self._session.close()

    def _body(self) -> NodeRegistration:
        if self.advertise is None:
            self.advertise = route_source_address(self.head, self.rpc_port)
        return replace(self.registration(self.advertise), node_id=self.node_id, address=self.advertise,
                       hostname=socket.gethostname(),
                       health_url=f"{self.scheme}://{url_host(self.advertise)}:{self.health_port}")

    async def _call(self, method: str, path: str, body: NodeRegistration) -> tuple[int, bytes]:
        """The head's status and body (capped at MAX_REPLY_BYTES; the session's timeout caps the time)."""
        assert self._session is not None
        async with self._session.request(method, self.base + path, data=msgspec.json.encode(body), headers={
                **self.headers, "Content-Type": "application/json"}) as resp:
            return resp.status, await read_aiohttp(resp, max_bytes=MAX_REPLY_BYTES)

    async def _register(self) -> None:
        self.attempts += 1
        try:
            status, reply = await self._call("POST", "/v1/nodes", self._body())
        except (OSError, aiohttp.ClientError, TimeoutError) as e:
            self._set(self.state, f"cannot reach the head at {self.head}:{self.rpc_port} "
                                  f"({type(e).__name__}: {e or 'timeout'}; attempt {self.attempts})")
            return
        if status == 200:
            try:
                self.reply = decode_answer(reply)
            except ValueError as e:
                self._set(self.state, f"the head's answer is not a registration answer ({e})")
                return
            self.interval_s, self.lease_s = self.reply.heartbeat_interval_s, self.reply.lease_s
            self._last_ok = time.monotonic()
            self._set(REGISTERED, f"registered with the head at {self.head}:{self.rpc_port}")
            return
        error = decode_error(reply)
        message = error.message or f"the head answered {status}"
        if status == 409 and error.param == "node_id":  # our previous run's lease: it lapses soon
            self._set(CONNECTING, f"waiting for the head to release this node's old registration: {message}")
            return
        if status in (400, 401, 409):
            self._set(REJECTED, f"the head refused this node: {message}")
            self.on_rejected(message)
            return
        self._set(self.state, f"the head answered {status}: {message} (attempt {self.attempts})")

    async def _heartbeat(self) -> None:
        try:
            status, _ = await self._call("PUT", f"/v1/nodes/{self.node_id}", self._body())
        except (OSError, aiohttp.ClientError, TimeoutError) as e:
            if time.monotonic() - self._last_ok > self.lease_s:
                self._set(DISCONNECTED, f"no heartbeat reached the head at {self.head}:{self.rpc_port} for "
                                        f"{time.monotonic() - self._last_ok:.1f} s ({type(e).__name__})")
            return
        if status == 200:
            self._last_ok = time.monotonic()
            self._set(REGISTERED, f"registered with the head at {self.head}:{self.rpc_port}")
        elif status == 404:  # the head restarted and forgot us
            self.reply = None
            self._set(CONNECTING, "the head does not know this node any more: registering again")
        elif status in (400, 401, 409):
            self.reply = None
            self._set(CONNECTING, f"the head refused a heartbeat ({status}): registering again")

    async def leave(self) -> None:
        """Best effort: tell the head this node is going (its ranks then leave the group at once)."""
        if self.state != REGISTERED:
            return
        with contextlib.suppress(OSError, aiohttp.ClientError, TimeoutError):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2.0),
                                             connector=aiohttp.TCPConnector(ssl=self.tls or True)) as session:
                async with session.delete(f"{self.base}/v1/nodes/{self.node_id}", headers=self.headers):
                    pass
