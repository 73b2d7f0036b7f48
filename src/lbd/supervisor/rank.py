"""One local rank's lifecycle: start, probe, declare unhealthy, restart with backoff, drain.

Each rank is an actor: one task (`RankWorker.run`) owns the process and reacts to events from its exit
watcher, its probe loop, its start-up timer and the admin endpoints, all through one queue. Events carry the
generation (process incarnation) they are about, so a late event of a killed process is ignored. Everything
the health port reads is plain attributes updated here: answering never waits on a child.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from lbd.common.redact import redact_argv
from lbd.supervisor.config import RankSpec, SupervisorConfig
from lbd.supervisor.drain import until_idle
from lbd.supervisor.metrics import SupervisorMetrics
from lbd.supervisor.probe import CORE_DEAD, GROUP_WAIT, Prober, ProbeResult
from lbd.supervisor.process import RankProcess
from lbd.supervisor.rank_types import (
    SUPERVISED_STATES,
    Backoff,
    Command,
    FailureAction,
    RankHandle,
    StartRank,
)
from lbd.wire.events import RankEvent, RankEventKind
from lbd.wire.roles import RankRole
from lbd.wire.states import RankState

if TYPE_CHECKING:
    from lbd.wire.status import RankStatus, WorkerProcess

log = logging.getLogger("lbd.supervisor")

STARTUP_PROBE_INTERVAL_S = 0.25  # while starting, probe this often (connection refused costs nothing)
FAILED_STOP_GRACE_S = 3.0  # a hung or dead rank gets this long to exit on SIGTERM before SIGKILL


class RankWorker:
    def __init__(self, spec: RankSpec, cfg: SupervisorConfig, prober: Prober, metrics: SupervisorMetrics,
                 on_failure: Callable[[RankWorker, str, bool], FailureAction],
                 start_rank: StartRank = RankProcess.start) -> None:
        self.spec = spec
        self._start_rank = start_rank
        self.cfg = cfg
        self.prober = prober
        self.metrics = metrics
        self._on_failure = on_failure
        self.backoff = Backoff(cfg.backoff_initial_s, cfg.backoff_max_s, cfg.backoff_reset_s)
        self.state = RankState.STARTING
        self.state_since = time.time()
        self.generation = 0
        self.restarts = 0
        self.pid: int | None = None
        self.workers: list[WorkerProcess] = []  # TP/PP worker processes, read when the rank got ready
        self.consecutive_failures = 0
        self.generate_failures = 0  # consecutive failed generation probes (--dp-supervisor-probe-generate)
        self.last_probe_latency_s: float | None = None
        self.last_probe_at: float | None = None
        self.last_probe_error: str | None = None
        self.last_failure: str | None = None
        self.last_failure_at: float | None = None
        self.last_exit_code: int | None = None
        self.next_start_at: float | None = None
        self.attempts = 0  # consecutive starts that failed before the rank was ready (a crash loop)
        self.backoff_s: float | None = None  # the restart delay last applied
        self.stderr_tail: list[str] = []  # the last lines of the last process that failed (redacted)
        self.error_lines: list[str] = []  # and its last error lines, from stdout or stderr (redacted)
        self.operation: str | None = None  # admin command being carried out
        self.kv_event_sources: dict | None = None  # the ready process's /kv_event_sources
        self.group_wait: str | None = None  # an MoE member alive but waiting for its group (last probe)
        # called once a failed member's process is gone (REPLACE_MEMBER): the group is told
        self.after_stop: Callable[[RankWorker, str], None] | None = None
        # awaited once a new process first passes its probe, before it is marked ready (the node's LoRA
        # adapters loaded back: supervisor/adapters.py); it stays starting meanwhile (start-up timeout holds)
        self.before_ready: Callable[[RankWorker], Awaitable[None]] | None = None
        self._readying: asyncio.Task[None] | None = None
        self._probes = 0  # probes of the current process since it became ready
        self._started_mono: float | None = None
        self._ready_mono: float | None = None
        self._ever_ready = False
        self._proc: RankHandle | None = None
        self._spawn_task: asyncio.Future[RankHandle] | None = None
        self._events: asyncio.Queue[RankEvent] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        self._command: tuple[tuple[str, ...], list[str]] = ((), [])  # (argv, its redaction), see command()
        metrics.add_rank(spec.rank, tuple(s.value for s in SUPERVISED_STATES))
        metrics.set_state(spec.rank, RankState.STARTING.value, RankState.STARTING.value)

    # ---- public, called by the node and the health server -------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"rank-{self.spec.rank}")

    def request(self, command: Command) -> str | None:
        """Queue an admin command; returns why it cannot be taken (None when accepted)."""
        if self._stopping or self.state in (RankState.STOPPED, RankState.FAILED):
            return f"rank {self.spec.rank} is {self.state.value}: the supervisor is shutting down"
        if self.operation is not None:
            return f"rank {self.spec.rank} is already carrying out {self.operation!r}"
        self.operation = command.value
        self._events.put_nowait(RankEvent(None, RankEventKind.COMMAND, command.value))
        return None

    async def shutdown(self, grace_s: float) -> None:
        """Stop the lifecycle, SIGTERM the rank, SIGKILL its tree after ``grace_s``."""
        await self._halt()
        if self.state is not RankState.FAILED:
            self._set_state(RankState.STOPPED)
        await self._stop_process(grace_s)

    def mark_leaving(self) -> None:
        """The node shrinks past this dense rank (lbd.supervisor.scale): ``draining`` now, so routers stop
        sending it new requests the moment the resize is accepted, before ``retire`` runs (a dense shrink
        cannot fail after that; an MoE group's can, so its members are not marked)."""
        if self.state is RankState.READY:
            self._set_state(RankState.DRAINING)

    async def retire(self, drain_timeout_s: float, grace_s: float) -> None:
        """Leave for good (the node shrinks, lbd.supervisor.scale). The lifecycle ends first, so no failure
        policy restarts it; state draining (routers stop sending) until it is idle (lbd.supervisor.drain) or
        ``drain_timeout_s``; then SIGTERM (the engine gives what still runs its --shutdown-timeout, then cuts
        it), SIGKILL of the tree after ``grace_s``; state stopped."""
        await self._halt()
        if self._proc is not None:
            self._set_state(RankState.DRAINING)
            await until_idle(self.prober, self.spec.probe_url, drain_timeout_s)
        await self._stop_process(grace_s)
        self._set_state(RankState.STOPPED)

    async def _halt(self) -> None:
        """End the lifecycle task (probes, restarts) and its side tasks; a spawn under way is recorded."""
        self._stopping = True
        for task in self._side_tasks:
            task.cancel()
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._spawn_task is not None and self._proc is None:
            with contextlib.suppress(Exception):
                self._proc = await self._spawn_task

    async def kill_now(self) -> None:
        if self._proc is not None:
            await self._proc.kill_tree()

    def status(self, url_host: str) -> RankStatus:
        """This rank's entry in /status (see supervisor/health.py for the shape)."""
        from lbd.wire.status import RankStatus  # lazily, for cold start (lbd.wire.states)

        now = time.monotonic()
        live = getattr(self._proc, "stderr_tail", None)
        tail = list(live) if live and self.state is not RankState.READY else self.stderr_tail
        errors = getattr(self._proc, "error_lines", None)
        errors = list(errors) if errors and self.state is not RankState.READY else self.error_lines
        return RankStatus(
            rank=self.spec.rank, local_rank=self.spec.local_rank,
            url=self.spec.url(url_host), port=self.spec.port, pid=self.pid,
            state=self.state,
            routable=self.state is RankState.READY and self.group_wait is None,
            state_since=self.state_since, consecutive_failures=self.consecutive_failures,
            restarts=self.restarts, last_probe_latency_s=self.last_probe_latency_s,
            last_probe_at=self.last_probe_at, last_probe_error=self.last_probe_error,
            uptime_s=now - self._started_mono if self._started_mono is not None else None,
            ready_for_s=now - self._ready_mono if self._ready_mono is not None else None,
            last_failure=self.last_failure, last_failure_at=self.last_failure_at,
            last_exit_code=self.last_exit_code,
            next_start_in_s=max(0.0, self.next_start_at - time.time()) if self.next_start_at else None,
            operation=self.operation, group_wait=self.group_wait,
            devices=self.spec.devices, cpus=self.spec.cpus,
            engine=self.spec.engine, workers=list(self.workers), attempts=self.attempts,
            backoff_s=self.backoff_s, stderr_tail=list(tail), error_lines=list(errors),
            command=self.command(),
            kv_event_sources=self.kv_event_sources, role=RankRole(self.spec.role),
        )

    def command(self) -> list[str]:
        """The rank's command line with secret values masked, redacted again only when the argv changed (a
        Ray placement rewrites it): /status reads it for every rank on every call."""
        argv = tuple(self.spec.argv)
        if argv != self._command[0]:
            self._command = (argv, redact_argv(argv))
        return list(self._command[1])

    def why_not_ready(self) -> str:
        """One clause for /readyz: the state, a crash loop's attempt and delay, the last failure."""
        text = f"rank {self.spec.rank} {self.state.value}"
        if self.state is RankState.RESTARTING and self.next_start_at is not None:
            text += f" (attempt {self.attempts + 1} in {max(0.0, self.next_start_at - time.time()):.1f} s)"
        if self.last_failure and self.state is not RankState.READY:
            text += f": {self.last_failure}"
        return text

    # ---- the lifecycle ------------------------------------------------------------------------------------
    async def run(self) -> None:
        while not self._stopping:
            kind, detail = await self._run_once()
            if kind == "failure":
                was_ready = self._ready_mono is not None
                healthy_for = time.monotonic() - self._ready_mono if self._ready_mono is not None else 0.0
                self.attempts = 0 if was_ready else self.attempts + 1
                proc = self._proc
                # Before ever being ready, exit code 2 or the engine refusing its flags or config on stderr
                # (process.RankProcess.refusal): a usage error (no such model...); restarts cannot help.
                refused = getattr(proc, "refusal", lambda: None)() if not self._ever_ready else None
                detail = f"{detail}: {refused}" if refused else detail
                self._record_failure(detail)
                usage_error = (self.last_exit_code == 2 or refused is not None) and not self._ever_ready
                action = self._on_failure(self, detail, usage_error)
                if action is FailureAction.EXIT:
                    self._set_state(RankState.FAILED)  # before any await: the node's shutdown keeps it
                    await self._stop_process(FAILED_STOP_GRACE_S)
                    self._note_cause(proc, was_ready)
                    return
                member = action is FailureAction.REPLACE_MEMBER
                await self._stop_process(0.0 if member else FAILED_STOP_GRACE_S)
                self._note_cause(proc, was_ready)
                if member and self.after_stop is not None:
                    self.after_stop(self, detail)
                await self._backoff(healthy_for)
            self.restarts += 1
            self.metrics.rank_restarts.labels(rank=str(self.spec.rank)).inc()

    async def _run_once(self) -> tuple[str, str]:
        """Start one incarnation and wait for its end: ("failure", why) or ("planned", command)."""
        self.generation += 1
        gen = self.generation
        self.consecutive_failures = self.generate_failures = 0
        self._ready_mono = None
        self.kv_event_sources = None
        self.group_wait = None
        self._set_state(RankState.STARTING)
        try:
            proc = await self._spawn()
        except OSError as e:
            return "failure", f"could not start: {e}"
        loop = asyncio.get_running_loop()
        log.info("rank %d: started pid %d on port %d (generation %d)", self.spec.rank, proc.pid,
                 self.spec.port, gen)
        helpers = [asyncio.create_task(self._watch_exit(gen, proc)),
                   asyncio.create_task(self._probe_loop(gen))]
        timer = loop.call_later(self.cfg.startup_timeout_s, self._startup_timeout, gen)
        try:
            while True:
                ev = await self._events.get()
                if ev.generation is not None and ev.generation != gen:
                    continue  # about a process that is already gone
                if ev.kind is RankEventKind.STARTUP_TIMEOUT and self.state is RankState.STARTING:
                    return "failure", ev.detail
                if ev.kind in (RankEventKind.EXITED, RankEventKind.UNHEALTHY):
                    return "failure", ev.detail
                if ev.kind is RankEventKind.COMMAND:
                    await self._planned_stop(gen, Command(ev.detail))
                    return "planned", ev.detail
        finally:
            timer.cancel()
            for task in [*helpers, self._readying]:
                if task is not None:
                    task.cancel()
            self._readying = None

    async def _spawn(self) -> RankHandle:
        # Shielded: if shutdown() cancels us mid-spawn, the process still gets recorded and stopped there.
        self._spawn_task = asyncio.ensure_future(self._start_rank(self.spec))
        proc = await asyncio.shield(self._spawn_task)
        self._proc, self._spawn_task = proc, None
        self.pid = proc.pid
        self._started_mono = time.monotonic()
        self.operation = None  # a restart command is done once the new process exists
        return proc

    async def _planned_stop(self, gen: int, command: Command) -> None:
        if command is Command.DRAIN and self.state is RankState.READY:
            await self._drain(gen)
        log.info("rank %d: %s: stopping pid %s", self.spec.rank, command.value, self.pid)
        grace = FAILED_STOP_GRACE_S if self.state is RankState.UNHEALTHY else self.cfg.shutdown_timeout_s + 5
        self._set_state(RankState.RESTARTING)  # from here on, probe failures are expected and ignored
        await self._stop_process(grace)

    async def _drain(self, gen: int) -> None:
        """Routers stop sending (state draining); wait until the rank has no request in flight."""
        self._set_state(RankState.DRAINING)

        async def gone_within(wait_s: float) -> bool:
            with contextlib.suppress(TimeoutError):
                ev = await asyncio.wait_for(self._events.get(), wait_s)
                return ev.generation == gen and ev.kind in (RankEventKind.EXITED, RankEventKind.UNHEALTHY)
            return False

        if await until_idle(self.prober, self.spec.probe_url, self.cfg.drain_timeout_s, gone_within):
            return
        log.warning("rank %d: still busy after the %.0f s drain timeout; restarting anyway", self.spec.rank,
                    self.cfg.drain_timeout_s)

    async def _backoff(self, healthy_for: float) -> None:
        """Wait out the restart delay (reset if the rank had been ready long); an admin restart ends it."""
        delay = self.backoff.next_delay(healthy_for)
        self.backoff_s = delay
        self._set_state(RankState.RESTARTING)
        self.next_start_at = time.time() + delay
        log.info("rank %d: restarting in %.1f s", self.spec.rank, delay)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        try:
            while (left := deadline - loop.time()) > 0:
                with contextlib.suppress(TimeoutError):
                    ev = await asyncio.wait_for(self._events.get(), left)
                    if ev.kind is RankEventKind.COMMAND:
                        return
        finally:
            self.next_start_at = None

    async def _stop_process(self, grace_s: float) -> None:
        proc = self._proc
        if proc is not None:
            t0 = time.monotonic()
            code = await proc.stop(grace_s)
            self.last_exit_code = code if code is not None else self.last_exit_code
            log.info("rank %d: pid %d stopped (exit code %s) in %.1f s", self.spec.rank, proc.pid, code,
                     time.monotonic() - t0)
            if self._proc is proc:  # cleared only once stopped: a cancelled stop is finished by shutdown()
                self._proc = None
        self.pid = None
        self.workers = []
        self._started_mono = None
        self._ready_mono = None

    # ---- event sources ------------------------------------------------------------------------------------
    async def _watch_exit(self, gen: int, proc: RankHandle) -> None:
        code = await proc.wait()
        self.last_exit_code = code
        why = f"exited with code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"
        if self.state in (RankState.STARTING, RankState.READY):  # not one we are stopping on purpose
            log.warning("rank %d: pid %d %s", self.spec.rank, proc.pid, why)
        self._events.put_nowait(RankEvent(gen, RankEventKind.EXITED, why))

    def _startup_timeout(self, gen: int) -> None:
        self._events.put_nowait(RankEvent(gen, RankEventKind.STARTUP_TIMEOUT,
                                          f"not ready {self.cfg.startup_timeout_s:g} s after its start"))

    async def _probe_loop(self, gen: int) -> None:
        """Probe on a fixed cadence, overlapping if need be: a hang shows in interval*threshold + timeout."""
        loop = asyncio.get_running_loop()
        pending: set[asyncio.Task[None]] = set()
        tick = loop.time()
        try:
            while True:
                starting = self.state is RankState.STARTING
                if not (starting and pending):  # while starting, one probe at a time is plenty
                    task = asyncio.create_task(self._probe_once(gen))
                    pending.add(task)
                    task.add_done_callback(pending.discard)
                interval = self.cfg.probe_interval_s
                # starting, or waiting for its group to re-form: probe often, to see it serve at once
                fast = starting or self.group_wait is not None
                tick += min(interval, STARTUP_PROBE_INTERVAL_S) if fast else interval
                tick = max(tick, loop.time())  # after a stall, do not fire a burst to catch up
                await asyncio.sleep(tick - loop.time())
        finally:
            for task in pending:
                task.cancel()

    async def _probe_once(self, gen: int) -> None:
        every = self.cfg.probe_generate_every
        if self.state is RankState.READY:
            self._probes += 1
        generate = bool(every) and self.state is RankState.READY and self._probes % every == 0
        if generate:
            key = self.cfg.api_keys[0] if self.cfg.api_keys else None
            result = await self.prober.generate(self.spec.probe_url, self.cfg.model_name, key)
        else:
            result = await self.prober.health(self.spec.probe_url)
        if gen == self.generation:
            self._on_probe(gen, result, generate)

    def _on_probe(self, gen: int, res: ProbeResult, generate: bool = False) -> None:
        """Generation probes count their failures apart: the /health probes between them answering does not
        excuse a core that no longer generates."""
        self.metrics.probe_duration.labels(rank=str(self.spec.rank)).observe(res.latency_s)
        self.last_probe_latency_s = res.latency_s
        self.last_probe_at = time.time()
        self.last_probe_error = res.detail
        if res.reason == GROUP_WAIT:  # alive, its group is (re-)forming: no failure, not serving
            self.consecutive_failures = 0
            self.group_wait = res.detail
            return
        self.group_wait = None
        if res.ok:
            if generate:
                self.generate_failures = 0
            else:
                self.consecutive_failures = 0
            if self.state is RankState.STARTING and self.before_ready is None:
                self._became_ready(gen)
            elif self.state is RankState.STARTING and self._readying is None:
                self._readying = asyncio.create_task(self._ready_after(gen, self.before_ready))
            return
        if self.state not in (RankState.READY, RankState.DRAINING):
            return  # not serving yet: refusals while it loads are expected; the start-up timeout bounds them
        if generate:
            self.generate_failures += 1
        else:
            self.consecutive_failures += 1
        failures = self.generate_failures if generate else self.consecutive_failures
        self.metrics.probe_failures.labels(rank=str(self.spec.rank), reason=res.reason or "unknown").inc()
        if res.reason == CORE_DEAD or failures >= self.cfg.probe_failure_threshold:
            why = f"{res.detail} ({failures} consecutive failed {'generation ' if generate else ''}probes)"
            log.warning("rank %d: unhealthy: %s", self.spec.rank, why)
            self._set_state(RankState.UNHEALTHY)
            self._events.put_nowait(RankEvent(gen, RankEventKind.UNHEALTHY, why))

    async def _ready_after(self, gen: int, hook: Callable[[RankWorker], Awaitable[None]]) -> None:
        await hook(self)
        if gen == self.generation and self.state is RankState.STARTING:
            self._became_ready(gen)

    def _became_ready(self, gen: int) -> None:
        self._ready_mono = time.monotonic()
        self._ever_ready = True
        self.attempts = 0
        self._probes = 0
        # A rank answers /health only once all its workers are up, and a worker never changes
        # without the rank restarting: one read per incarnation is enough.
        self.workers = self._proc.workers() if self._proc is not None else []
        self._set_state(RankState.READY)
        log.info("rank %d: ready (%.1f s after start)", self.spec.rank,
                 self._ready_mono - (self._started_mono or self._ready_mono))
        self._side_tasks.add(task := asyncio.create_task(self._learn_sources(gen)))
        task.add_done_callback(self._side_tasks.discard)

    async def _learn_sources(self, gen: int) -> None:
        """Copy the ready rank's KV-event sources into /status (routers and operators read them there)."""
        sources = await self.prober.kv_event_sources(self.spec.probe_url)
        if gen == self.generation:
            self.kv_event_sources = sources

    # ---- bookkeeping --------------------------------------------------------------------------------------
    def _set_state(self, state: RankState) -> None:
        if state is not self.state:
            self.metrics.set_state(self.spec.rank, self.state.value, state.value)
            self.state = state
            self.state_since = time.time()
        self.metrics.rank_ready.labels(rank=str(self.spec.rank)).set(1 if state is RankState.READY else 0)

    def _note_cause(self, proc: RankProcess | None, was_ready: bool) -> None:
        """Once the failed process is gone and its output drained: keep its last stderr lines, and for a
        start-up failure add the line that says why (a crash loop then explains itself in /status)."""
        if proc is None or not hasattr(proc, "stderr_tail"):
            return
        self.stderr_tail = list(proc.stderr_tail)
        self.error_lines = list(getattr(proc, "error_lines", ()))
        cause = proc.error_line()
        if cause and not was_ready and self.last_failure and cause not in self.last_failure:
            self.last_failure = f"{self.last_failure}: {cause}"

    def _record_failure(self, why: str) -> None:
        self.last_failure = why
        self.last_failure_at = time.time()
        if self.state is not RankState.UNHEALTHY:
            log.warning("rank %d: failed: %s", self.spec.rank, why)
            self._set_state(RankState.UNHEALTHY)
