"""The node: every local rank's worker, the readiness policy, rolling restarts and the shutdown sequence."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time
from typing import TYPE_CHECKING, Protocol

from lbd.common.tls import client_context
from lbd.supervisor.adapters import NodeAdapters
from lbd.supervisor.config import SupervisorConfig
from lbd.supervisor.metrics import SupervisorMetrics
from lbd.supervisor.probe import Prober
from lbd.supervisor.process import RankProcess
from lbd.supervisor.rank import RankWorker
from lbd.supervisor.rank_types import Command, FailureAction, StartRank
from lbd.wire.states import NodePhase, RankState, RollingState

if TYPE_CHECKING:
    from lbd.supervisor.config import RankSpec
    from lbd.supervisor.group import MoeGroup
    from lbd.wire.scale import ScaleResult
    from lbd.wire.status import RollingRestart, SupervisorStatus

log = logging.getLogger("lbd.supervisor")

RUNNING, STOPPING, FAILED = NodePhase.RUNNING, NodePhase.STOPPING, NodePhase.FAILED
PHASES = (RUNNING, STOPPING, FAILED)
SHUTDOWN_EXTRA_S = 5.0  # on SIGTERM ranks get --shutdown-timeout plus this before their trees are killed
ROLLING_POLL_S = 0.1


class HealthPort(Protocol):
    """The health port (``health.HealthServer``; node and port are wired in ``cli``)."""

    async def start(self, sock: socket.socket) -> None: ...

    async def stop(self) -> None: ...


class Supervisor:
    def __init__(self, cfg: SupervisorConfig, start_rank: StartRank = RankProcess.start) -> None:
        self.cfg = cfg
        self.metrics = SupervisorMetrics()
        tls = client_context(cfg.ssl_ca_certs) if cfg.ssl_certfile else None
        self.prober = Prober(cfg.probe_timeout_s, tls)
        self._start_rank = start_rank
        self.workers = [RankWorker(spec, cfg, self.prober, self.metrics, self.on_rank_failure, start_rank)
                        for spec in cfg.ranks]
        # the node's LoRA adapters: loaded on every rank, and back on one that starts again
        self.adapters = NodeAdapters(self.workers, cfg.api_keys[0] if cfg.api_keys else None, tls)
        for w in self.workers:
            w.before_ready = self.adapters.restore
        self.scaling: ScaleResult | None = None  # the last resize (lbd.supervisor.scale), shown in /status
        # the ranks of an MoE model form one group (None: independent dense ranks)
        self.group: MoeGroup | None = None
        if cfg.group is not None:
            from lbd.supervisor.group import MoeGroup  # only an MoE node loads the group and its coordinator

            self.group = MoeGroup(cfg.group, self.workers, self.metrics.registry, cfg.on_rank_failure,
                                  cfg.log_level, self._coordinator_fatal)
        self.phase = RUNNING
        self.exit_code = 0
        self.failure: str | None = None
        self.rolling: RollingRestart | None = None  # the last rolling restart, shown in /status
        self._rolling_task: asyncio.Task[None] | None = None
        self._started_mono = time.monotonic()
        self._stop: asyncio.Event | None = None
        self._signals = 0

    # ---- answers for the health port (never wait on a child) ----------------------------------------------
    def worker(self, rank: int) -> RankWorker | None:
        return next((w for w in self.workers if w.spec.rank == rank), None)

    def ready_count(self) -> int:
        if self.group is not None and not self.group.routable():
            return 0
        return sum(w.state is RankState.READY and w.group_wait is None for w in self.workers)

    def readiness(self) -> tuple[bool, str]:
        if self.phase != RUNNING:
            return False, f"supervisor is {self.phase}" + (f": {self.failure}" if self.failure else "")
        if self.group is not None:
            return self.group.readiness()
        ready, need, total = self.ready_count(), self.cfg.ready_needed, len(self.workers)
        head = f"{ready}/{total} ranks ready (policy {self.cfg.ready_policy}"
        if ready >= need:
            return True, head + ")"
        waiting = "; ".join(w.why_not_ready() for w in self.workers if w.state is not RankState.READY)
        return False, f"{head} needs {need}): {waiting}"

    def liveness(self) -> tuple[bool, str]:
        if self.phase == FAILED:
            return False, f"gave up: {self.failure}"
        return True, f"supervisor {self.phase}"

    def status(self, url_host: str) -> SupervisorStatus:
        from lbd.wire.status import ProbeSettings, SupervisorStatus  # lazily, for cold start

        ready, reason = self.readiness()
        live, _ = self.liveness()
        cfg = self.cfg
        ranks = [w.status(url_host) for w in self.workers]
        return SupervisorStatus(
            ready=ready, live=live, reason=reason, phase=self.phase, pid=os.getpid(),
            node_rank=cfg.node_rank, data_parallel_size=cfg.dp_size,
            data_parallel_size_local=cfg.dp_size_local, data_parallel_start_rank=cfg.dp_start_rank,
            ready_policy=cfg.ready_policy, ready_ranks=self.ready_count(),
            on_rank_failure=cfg.on_rank_failure,
            probe=ProbeSettings(interval_s=cfg.probe_interval_s, timeout_s=cfg.probe_timeout_s,
                                failure_threshold=cfg.probe_failure_threshold,
                                generate_every=cfg.probe_generate_every),
            uptime_s=time.monotonic() - self._started_mono,
            rolling_restart=self.rolling,
            scaling=self.scaling,
            ranks=ranks,
            groups=[self.group.status(ranks)] if self.group is not None else [],
        )

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def run(self, server: HealthPort, health_sock: socket.socket) -> int:
        """Serve ``server`` on ``health_sock`` and run every rank until told to stop; the exit code."""
        self._stop = asyncio.Event()
        await server.start(health_sock)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        where = ("on their Ray placement groups" if self.cfg.backend == "ray" else
                 f"on ports {self.cfg.base_port}..{self.cfg.base_port + len(self.workers) - 1}")
        log.info("health port %s:%d; starting %d ranks %d..%d %s", self.cfg.supervisor_host,
                 self.cfg.supervisor_port, len(self.workers), self.cfg.dp_start_rank,
                 self.cfg.dp_start_rank + len(self.workers) - 1, where)
        try:
            if self.group is not None:  # its coordinator first: it hosts the group's store
                await self.group.start()
            for w in self.workers:
                w.start()
            await self._stop.wait()
            await self._shutdown()
        finally:
            if self.group is not None:  # after the ranks: they drain with their group intact
                await self.group.stop()
            await server.stop()
            await self.prober.close()
        log.info("exit %d", self.exit_code)
        return self.exit_code

    def add_worker(self, spec: RankSpec) -> RankWorker:
        """Start one more local rank at run time (a resize, lbd.supervisor.scale), like those started with
        the node; it shows in /status at once."""
        w = RankWorker(spec, self.cfg, self.prober, self.metrics, self.on_rank_failure, self._start_rank)
        w.before_ready = self.adapters.restore  # the node's LoRA adapters, before it is ready
        self.workers.append(w)
        w.start()
        return w

    def request_stop(self, sig: signal.Signals) -> None:
        """First SIGTERM/SIGINT: graceful shutdown. A second one: kill every rank now."""
        self._signals += 1
        if self._signals > 1:
            log.warning("%s again: killing every rank now", sig.name)
            for w in self.workers:
                asyncio.get_running_loop().create_task(w.kill_now())
            return
        log.info("%s: readiness is 503 now; stopping every rank (up to %.0f s)", sig.name,
                 self.cfg.shutdown_timeout_s + SHUTDOWN_EXTRA_S)
        if self.phase == RUNNING:
            self.phase = STOPPING
        assert self._stop is not None
        self._stop.set()

    def on_rank_failure(self, worker: RankWorker, why: str, usage_error: bool) -> FailureAction:
        """Decide what a rank's failure means for the node (the policy lives here, not in the worker)."""
        if usage_error:
            self._give_up(worker, why, 2)
            return FailureAction.EXIT
        if self.cfg.on_rank_failure == "exit":
            self._give_up(worker, why, 1)
            return FailureAction.EXIT
        if self.group is not None:
            self.group.member_failed(worker, why)
            return FailureAction.REPLACE_MEMBER
        return FailureAction.RESTART_RANK

    def _coordinator_fatal(self, why: str) -> None:
        if self.phase == RUNNING:
            self.phase, self.failure, self.exit_code = FAILED, why, 2
            log.error("%s: shutting the node down", why)
            assert self._stop is not None
            self._stop.set()

    def _give_up(self, worker: RankWorker, why: str, code: int) -> None:
        """Shut the node down with ``code``: 1 under --on-rank-failure exit (as vLLM does), 2 for an engine
        usage error (e.g. a model that does not exist)."""
        if self.phase == RUNNING:
            self.phase = FAILED
            self.failure = f"rank {worker.spec.rank} {why}"
            self.exit_code = code
            cause = "--on-rank-failure exit" if code == 1 else "engine usage error: see the rank's log above"
            log.error("%s: shutting the node down (%s)", self.failure, cause)
            assert self._stop is not None
            self._stop.set()

    async def _shutdown(self) -> None:
        if self._rolling_task is not None:
            self._rolling_task.cancel()
        grace = self.cfg.shutdown_timeout_s + SHUTDOWN_EXTRA_S
        await asyncio.gather(*(w.shutdown(grace) for w in self.workers))

    # ---- rolling restart ----------------------------------------------------------------------------------
    def start_rolling_restart(self) -> str | None:
        """Begin draining and restarting one rank at a time; returns why not (None when started)."""
        if self.phase != RUNNING:
            return f"supervisor is {self.phase}"
        if self._rolling_task is not None and not self._rolling_task.done():
            return "a rolling restart is already running"
        if self.scaling is not None and self.scaling.state == "running":
            return "a resize (POST /scale) is running: restart once it is done"
        from lbd.wire.status import RollingRestart  # lazily, for cold start (lbd.wire.states)

        self.rolling = RollingRestart(state=RollingState.RUNNING, started_at=time.time())
        self._rolling_task = asyncio.create_task(self._rolling_restart(self.rolling))
        return None

    async def _rolling_restart(self, record: RollingRestart) -> None:
        limit = (self.cfg.drain_timeout_s + self.cfg.shutdown_timeout_s + SHUTDOWN_EXTRA_S
                 + self.cfg.startup_timeout_s)
        try:
            for w in self.workers:
                record.current_rank = w.spec.rank
                await asyncio.wait_for(self._restart_and_wait(w), limit)
                record.done_ranks.append(w.spec.rank)
            record.state = RollingState.DONE
        except TimeoutError:
            record.state = RollingState.FAILED
            record.error = f"rank {record.current_rank} not ready within {limit:g} s"
        except _Abort as e:
            record.state, record.error = RollingState.FAILED, str(e)
        finally:
            record.current_rank = None
            record.finished_at = time.time()
            if record.state is RollingState.RUNNING:
                record.state = RollingState.CANCELLED
            log.info("rolling restart %s", record.state.value)

    async def _restart_and_wait(self, w: RankWorker) -> None:
        while w.operation is not None:  # an admin command on that rank is still being carried out
            await asyncio.sleep(ROLLING_POLL_S)
        gen = w.generation
        why = w.request(Command.DRAIN)
        if why:
            raise _Abort(why)
        while not (w.generation > gen and w.state is RankState.READY):
            if self.phase != RUNNING:
                raise _Abort(f"supervisor is {self.phase}")
            await asyncio.sleep(ROLLING_POLL_S)


class _Abort(Exception):
    pass
