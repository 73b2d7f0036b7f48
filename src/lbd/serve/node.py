"""One node of an `lbd serve` deployment: its children (`lbd supervise`, `lbd route`), its health port, the
registration service (head) or its membership (other nodes), and the shutdown sequence.

Children run in their own process groups with PR_SET_PDEATHSIG, so a SIGKILL of this process takes them (and,
through their own PDEATHSIG, the ranks and router workers) down with it. SIGTERM/SIGINT: readiness turns 503,
both children get SIGTERM at once (the router stops listening and lets open requests finish, each rank drains
its own), a member then leaves the group; a second signal kills everything now. Exit codes: 0 after a
signal, 2 when the node's supervisor refused its flags or the head refused this node, otherwise the
supervisor's code when it stopped on its own. A router that dies is started again after a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from typing import Any

from msgspec.structs import replace

from lbd.common.auth import API_KEYS_ENV
from lbd.common.cluster import CLUSTER_TOKEN_ENV
from lbd.common.internal_key import INTERNAL_KEY_ENV
from lbd.common.tls import client_context, server_context
from lbd.router.auth import ROUTER_KEYS_ENV, UPSTREAM_KEY_ENV
from lbd.serve.autoscale import Autoscaler
from lbd.serve.group import Group
from lbd.serve.health import FAILED, RUNNING, STOPPING, LocalSupervisor, NodeHealth
from lbd.serve.member import CONNECTING, Membership
from lbd.serve.plan import Plan
from lbd.serve.registry import Registry, registry_limits
from lbd.supervisor.process import child_setup
from lbd.wire.registration import NodeRegistration
from lbd.wire.status import SupervisorStatus

log = logging.getLogger("lbd.serve")
STOP_EXTRA_S = 10.0  # after --shutdown-timeout (+ the supervisor's own 5 s), children are killed
ROUTER_RESTART_S = 1.0
FIRST_ANSWER_S = 3.0  # a member waits this long for the head's first answer before it starts its ranks


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def key_env(plan: Plan, child: str) -> dict[str, str]:
    """The API keys for a child's environment. The supervisor hands them to its ranks; the router asks its
    clients for the same keys and sends the first to the ranks (it does not forward the client's own)."""
    internal = {INTERNAL_KEY_ENV: plan.internal_key} if plan.internal_key else {}
    # the cluster token goes to the supervisor (an MoE group's coordinator and members check it; its ranks
    # key their CURVE load streams with it) and to the router (it follows those streams, rather than scraping
    # every remote rank): by environment, never on a command line
    token = {CLUSTER_TOKEN_ENV: plan.cluster_token} if plan.cluster_token else {}
    if not plan.api_keys:
        return {**internal, **token}
    keys = "\n".join(plan.api_keys)
    if child == "supervisor":
        return {API_KEYS_ENV: keys, **internal, **token}
    return {ROUTER_KEYS_ENV: keys, UPSTREAM_KEY_ENV: plan.api_keys[0], **internal, **token}


class Child:
    """`python -m lbd <command>` tied to our life; its output goes to ours (each child prefixes its lines)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        self.name, self.argv = name, [sys.executable, "-m", "lbd", *argv]
        self.env = env or {}  # on top of ours: secrets go by environment, never on a command line
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        # the token reaches only the children given it (key_env), not whatever else this process starts
        env = {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV} | self.env
        self.proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, start_new_session=True, env=env,
            preexec_fn=child_setup(os.getpid()))
        log.info("%s started (pid %d)", self.name, self.proc.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)

    async def stop(self, grace_s: float) -> int | None:
        if self.proc is None:
            return None
        self.signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), grace_s)
        self.kill()
        return await self.proc.wait()

    def kill(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)


class DeploymentNode:
    def __init__(self, plan: Plan, health_sock: socket.socket, rpc_sock: socket.socket | None) -> None:
        self.plan = plan
        self.health_sock, self.rpc_sock = health_sock, rpc_sock
        self.exit_code = 0
        self.stop_event: asyncio.Event | None = None
        self.supervisor: Child | None = None
        self.router: Child | None = None
        self.local: LocalSupervisor | None = None
        self.group: Group | None = None
        self.registry: Registry | None = None
        self.membership: Membership | None = None
        self._signals = 0
        self._tasks: list[asyncio.Task[Any]] = []
        self._to_keep: set[asyncio.Task[Any]] = set()  # stopped only once the children are gone
        self.health: NodeHealth | None = None

    def _router_alive(self) -> bool | None:
        return None if self.plan.route_argv is None else (self.router is not None and self.router.alive())

    def _registration(self, advertise: str) -> NodeRegistration:
        """This node's part of its registration (the membership adds its identity)."""
        assert self.health is not None
        return NodeRegistration(node_id="", address=advertise, data_parallel_size=self.plan.dp_size,
                                data_parallel_size_local=self.plan.dp_size_local,
                                data_parallel_start_rank=self.plan.dp_start_rank,
                                models=list(self.plan.models),
                                ranks=self.health.local_ranks(advertised=True))

    def _rejected(self, message: str) -> None:
        log.error("the head refused this node: %s; stopping (exit 2)", message)
        self._finish(2, f"refused by the head: {message}")

    def _finish(self, code: int, why: str | None = None) -> None:
        if self.stop_event is not None and not self.stop_event.is_set():
            self.exit_code = code
            if self.health is not None and code:
                self.health.phase, self.health.failure = FAILED, why
            self.stop_event.set()

    async def run(self) -> int:
        plan = self.plan
        loop = asyncio.get_running_loop()
        self.stop_event = asyncio.Event()
        sup_port = free_loopback_port()
        if plan.dp_size_local:
            self.local = LocalSupervisor(sup_port, min(0.25, plan.probe_interval_s),
                                         client_context(plan.ssl_ca_certs) if plan.ssl_certfile else None)
        if plan.registry:
            head_ranks = range(plan.dp_start_rank, plan.dp_start_rank + plan.dp_size_local)
            lease = plan.probe_interval_s * plan.probe_failure_threshold + plan.probe_timeout_s
            self.group = Group(plan.dp_size, plan.models, head_ranks, lease)
        if plan.member:
            assert plan.address is not None
            self.membership = Membership(plan.address, plan.rpc_port, plan.advertise, plan.health_port,
                                         plan.probe_timeout_s, plan.cluster_token, self._registration,
                                         self._rejected,
                                         client_context(plan.ssl_ca_certs) if plan.ssl_certfile else None)
        self.health = NodeHealth(plan, self.local, self.group, self.membership, self._router_alive)
        await self.health.start(self.health_sock)
        if self.group is not None and self.rpc_sock is not None:
            self.registry = Registry(self.group, plan.address, plan.rpc_port, plan.probe_interval_s,
                                     plan.cluster_token, self._group_status)
            self.registry.limits = registry_limits(plan.limits)
            self.registry.tls = server_context(plan.ssl_certfile, plan.ssl_keyfile)
            await self.registry.start(self.rpc_sock)
            self._tasks.append(asyncio.create_task(self._watch_group()))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        log.info("%s node: ranks %s, health port %d%s%s", plan.role, _ranks_text(plan), plan.health_port,
                 f", router on :{plan.router_port}" if plan.route_argv else "",
                 f", registration on :{plan.rpc_port}" if plan.registry else "")
        try:
            if self.membership is not None:
                beat = asyncio.create_task(self.membership.run())
                self._to_keep.add(beat)
                self._tasks.append(beat)
                # A head that answers at once refuses a misfit before any rank is started; one that does not
                # is waited for while the ranks load.
                await self._first_answer(FIRST_ANSWER_S)
            if plan.dp_size_local and not self.stop_event.is_set():
                self.supervisor = Child("supervisor", ["supervise", *plan.supervise_argv,
                                                       "--supervisor-host", "127.0.0.1",
                                                       "--data-parallel-supervisor-port", str(sup_port)],
                                        key_env(plan, "supervisor"))
                await self.supervisor.start()
                assert self.local is not None
                poll = asyncio.create_task(self.local.poll())
                self._to_keep.add(poll)
                self._tasks += [poll, asyncio.create_task(self._watch_supervisor())]
            if plan.route_argv is not None:
                self._tasks.append(asyncio.create_task(self._keep_router()))
            if plan.autoscale is not None and self.local is not None:
                self._tasks.append(asyncio.create_task(self._autoscaler().run()))
            await self.stop_event.wait()
        finally:
            await self._shutdown()
        log.info("exit %d", self.exit_code)
        return self.exit_code

    async def _first_answer(self, timeout: float) -> None:
        assert self.membership is not None and self.stop_event is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.membership.state == CONNECTING and self.membership.attempts < 2 and loop.time() < deadline:
            if self.stop_event.is_set():
                return
            await asyncio.sleep(0.02)

    def _group_status(self) -> SupervisorStatus:
        assert self.health is not None
        return replace(self.health.status_body(), ranks=self.health.group_ranks())

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("%s again: killing everything now", signal.Signals(sig).name)
            for child in (self.router, self.supervisor):
                if child is not None:
                    child.kill()
            return
        log.info("%s: readiness is 503 now; stopping the router and the ranks", signal.Signals(sig).name)
        self._finish(0)

    async def _watch_supervisor(self) -> None:
        assert self.supervisor is not None and self.supervisor.proc is not None
        code = await self.supervisor.proc.wait()
        if self.stop_event is not None and not self.stop_event.is_set():
            log.error("the node's supervisor exited with code %s", code)
            self._finish(2 if code == 2 else (code or 1), f"the node's supervisor exited with code {code}")

    async def _keep_router(self) -> None:
        assert self.plan.route_argv is not None
        scheme = "supervisor+https" if self.plan.ssl_certfile else "supervisor"
        upstream = f"{scheme}://{_loopback_of(self.plan.health_host)}:{self.plan.health_port}"
        while True:
            self.router = Child("router", ["route", *self.plan.route_argv, "--upstreams", upstream],
                                key_env(self.plan, "router"))
            await self.router.start()
            assert self.router.proc is not None
            code = await self.router.proc.wait()
            if code == 2:
                self._finish(2, "the router refused its flags")
                return
            log.error("the router exited with code %s; starting it again in %.0f s", code, ROUTER_RESTART_S)
            await asyncio.sleep(ROUTER_RESTART_S)

    def _autoscaler(self) -> Autoscaler:
        """The built-in planner (--autoscale): the router child's signals, resizes through the supervisor."""
        plan, local = self.plan, self.local
        assert plan.autoscale is not None and local is not None and self.health is not None
        scheme = "https" if plan.ssl_certfile else "http"
        router = f"{scheme}://{_loopback_of(plan.router_host)}:{plan.router_port}"
        token = plan.cluster_token or plan.admin_token
        planner = Autoscaler(plan.autoscale, router, local.base, lambda: local.status,
                             plan.api_keys[0] if plan.api_keys else None, token, local.tls)
        self.health.autoscale = planner.state
        return planner

    async def _watch_group(self) -> None:
        assert self.registry is not None
        while True:
            self.registry.watch_losses()
            await asyncio.sleep(min(0.5, self.plan.probe_interval_s))

    async def _shutdown(self) -> None:
        if self.health is not None and self.health.phase == RUNNING:
            self.health.phase = STOPPING
        # The poll and the heartbeats go on while the ranks drain, so the head sees them stop routing.
        last = [t for t in self._tasks if t in self._to_keep]
        first = [t for t in self._tasks if t not in self._to_keep]
        for task in first:
            task.cancel()
        await asyncio.gather(*first, return_exceptions=True)
        grace = self.plan.shutdown_timeout_s + STOP_EXTRA_S
        await asyncio.gather(*(c.stop(grace) for c in (self.router, self.supervisor) if c is not None))
        for task in last:
            task.cancel()
        await asyncio.gather(*last, return_exceptions=True)
        if self.membership is not None:
            await self.membership.leave()
        for closing in (self.registry, self.health):
            if closing is not None:
                await closing.stop()
        if self.local is not None:
            await self.local.close()


def _loopback_of(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    return "[::1]" if host == "::" else (f"[{host}]" if ":" in host else host)


def _ranks_text(plan: Plan) -> str:
    if not plan.dp_size_local:
        return f"none of {plan.dp_size} (router only)"
    return f"{plan.dp_start_rank}..{plan.dp_start_rank + plan.dp_size_local - 1} of {plan.dp_size}"
