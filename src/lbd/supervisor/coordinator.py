"""The MoE group's DP coordinator as the supervisor sees it: the process beside rank 0, and its HTTP port.

On rank 0's node the supervisor starts ``python -m lbd.engine.dp.coordinator`` (it hosts the group's TCPStore,
the ranks' ZMQ channel and an HTTP port; see ``lbd.engine.dp``, its wire in ``lbd.wire.dp_messages``) before
the ranks, tied to our life (PR_SET_PDEATHSIG), in a process group of its own so that on shutdown it is
stopped *after* the ranks (they drain with their group intact), and starts it again with the same flags if it
dies: the ranks then re-form a new generation around it without restarting. On every other node of a group the
coordinator is remote: only its HTTP port is read.

Every node polls the coordinator's ``GET /status`` every ``POLL_S`` (the group's generation, wave state and
each member's waiting/running, fresh to ~100 ms) and tells it ``POST /members/{rank}/failed`` when one of its
members died or hung. A resize of the group (``lbd.supervisor.group``) is ``POST /resize``; the coordinator's
command line follows the new size, so a restarted coordinator keeps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable

import aiohttp
import orjson

from lbd.common.limits import read_aiohttp
from lbd.supervisor.moe import GroupSpec
from lbd.supervisor.process import child_setup
from lbd.supervisor.spawn import Child, spawn
from lbd.wire.dp import CoordinatorStatus, decode_coordinator_status
from lbd.wire.status import CoordinatorInfo

log = logging.getLogger("lbd.supervisor")

POLL_S = 0.1  # the coordinator's members report about every 100 ms
STALE_S = 2.0  # a status older than this (no answer since) does not count as the group's state
RESTART_INITIAL_S, RESTART_MAX_S = 0.5, 10.0
STOP_GRACE_S = 5.0
CONTROL_TIMEOUT_S = 2.0
CONTROL_TRIES = 5


class Coordinator:
    """The group's coordinator: its process when this node runs it, and its last /status in any case."""

    def __init__(self, spec: GroupSpec, log_level: str, on_fatal: Callable[[str], None]) -> None:
        self.spec = spec
        self.url = spec.coordinator_url
        self.log_level = log_level
        self.argv = spec.coordinator_argv(sys.executable, log_level)
        self.on_fatal = on_fatal  # the coordinator refused its flags (exit 2): restarting cannot help
        self.proc: Child | None = None
        self.restarts = 0
        self.last_exit_code: int | None = None
        self.status: CoordinatorStatus | None = None
        self.status_at: float | None = None  # monotonic time of the last good /status
        self.error: str | None = "not polled yet"
        self.on_poll: Callable[[], None] = lambda: None
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    # ---- lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        if self.spec.runs_coordinator:
            await self._spawn()
            self._tasks.append(asyncio.create_task(self._keep_alive(), name="coordinator"))
        self._tasks.append(asyncio.create_task(self._poll(), name="coordinator-poll"))

    async def _spawn(self) -> None:
        self.proc = await spawn(self.argv, env={**os.environ, **self.spec.child_env()},
                                preexec_fn=child_setup(os.getpid()), pipe_output=False)
        log.info("DP coordinator: started pid %d (store :%d, ZMQ :%d, HTTP %s)", self.proc.pid,
                 self.spec.rendezvous().store_port, self.spec.rendezvous().coordinator_port, self.url)

    async def _keep_alive(self) -> None:
        delay = RESTART_INITIAL_S
        while True:
            assert self.proc is not None
            started = time.monotonic()
            code = await self.proc.wait()
            self.last_exit_code = code
            if self._stopping:
                return
            if code == 2:
                self.on_fatal(f"the DP coordinator refused its flags (exit 2): {' '.join(self.argv[1:])}")
                return
            if time.monotonic() - started > 60:
                delay = RESTART_INITIAL_S
            log.warning("DP coordinator pid %d exited with code %s; starting it again in %.1f s (the ranks "
                        "re-form their group around it)", self.proc.pid, code, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RESTART_MAX_S)
            if self._stopping:
                return
            self.restarts += 1
            await self._spawn()

    async def stop(self) -> None:
        """After the ranks are down: SIGTERM, then SIGKILL its process group."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        proc = self.proc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), STOP_GRACE_S)
        if self._session is not None:
            await self._session.close()

    # ---- its HTTP port --------------------------------------------------------------------------------
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # the cluster token, when the group has one: the coordinator's HTTP port checks it
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0),
                                                  headers=self.spec.auth_headers())
        return self._session

    async def _poll(self) -> None:
        while True:
            try:
                async with self._client().get(self.url + "/status") as resp:
                    body = await read_aiohttp(resp)
                    if resp.status != 200:
                        raise ValueError(f"/status answered {resp.status}")
                    self.status = decode_coordinator_status(body)
                    self.status_at, self.error = time.monotonic(), None
            except (OSError, aiohttp.ClientError, TimeoutError, ValueError) as e:
                self.error = f"{self.url}/status: {type(e).__name__}: {e}".rstrip(": ")
                self.status_at = None  # what it said last is kept for /status, never trusted for readiness
            self.on_poll()
            await asyncio.sleep(POLL_S)

    def fresh_status(self) -> CoordinatorStatus | None:
        """The coordinator's word, if its last poll answered (recently) and the process we run is alive."""
        if self.status is None or self.status_at is None or time.monotonic() - self.status_at > STALE_S:
            return None
        if self.alive() is False:  # it died since that answer: the group breaks
            return None
        return self.status

    def alive(self) -> bool | None:
        """Whether our coordinator process runs (None: it runs on another node)."""
        if not self.spec.runs_coordinator:
            return None
        return self.proc is not None and self.proc.returncode is None

    async def member_failed(self, rank: int, reason: str) -> bool:
        """Tell the coordinator member ``rank`` is gone (retried while it does not answer)."""
        body = orjson.dumps({"reason": reason})
        for attempt in range(CONTROL_TRIES):
            try:
                async with self._client().post(
                        f"{self.url}/members/{rank}/failed", data=body,
                        headers={"Content-Type": "application/json"},
                        timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as resp:
                    answer = await read_aiohttp(resp)
                    if resp.status == 200:
                        log.info("DP coordinator: member %d reported failed: %s", rank, answer.decode()[:200])
                        return True
                    log.warning("DP coordinator answered %d to member %d failed: %s", resp.status, rank,
                                answer.decode(errors="replace")[:200])
                    return False
            except (OSError, aiohttp.ClientError, TimeoutError) as e:
                log.warning("DP coordinator unreachable telling it member %d failed (%s); try %d of %d", rank,
                            type(e).__name__, attempt + 1, CONTROL_TRIES)
                await asyncio.sleep(0.2 * (attempt + 1))
        return False

    async def resize(self, spec: GroupSpec) -> str | None:
        """Ask the coordinator to re-form the group at ``spec.size`` members; None when it accepted, else
        why not (its answer, or that it does not answer). Its command line follows the new spec."""
        try:
            async with self._client().post(
                    f"{self.url}/resize", data=orjson.dumps({"size": spec.size}),
                    headers={"Content-Type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)) as resp:
                answer = await read_aiohttp(resp)
        except (OSError, aiohttp.ClientError, TimeoutError) as e:
            return f"the DP coordinator at {self.url} does not answer ({type(e).__name__})"
        if resp.status != 200:
            try:
                return str(orjson.loads(answer)["error"]["message"])
            except (ValueError, KeyError, TypeError):
                return f"the DP coordinator answered {resp.status}"
        self.spec, self.argv = spec, spec.coordinator_argv(sys.executable, self.log_level)
        log.info("DP coordinator: re-forming the group at %d members: %s", spec.size, answer.decode()[:200])
        return None

    def describe(self) -> CoordinatorInfo:
        age = time.monotonic() - self.status_at if self.status_at is not None else None
        return CoordinatorInfo(
            url=self.url, local=self.spec.runs_coordinator,
            pid=self.proc.pid if self.proc is not None and self.proc.returncode is None else None,
            alive=self.alive(), restarts=self.restarts, last_exit_code=self.last_exit_code,
            status_age_s=round(age, 3) if age is not None else None, error=self.error)
