"""Resize a node at run time: ``POST /scale`` on the health port (``lbd scale``) takes a new number of local
ranks (``lbd.wire.scale.ScaleRequest``) and answers a ``ScaleResult`` (202 while it runs, 200 for a no-op).

Growing: the new ranks are numbered after the highest local rank (global rank start + local rank), each on
its own port (``--port`` + local rank) with the devices, or CPU slice, that the start-up placement gives a
node of the new size (``SupervisorConfig.respec``); they start like the others and show in /status at once,
so routers following it (``supervisor://``) add them. The resize is done when they are ready; one not ready
within ``--dp-supervisor-startup-timeout-s``, or failing ``GROW_FAILED_STARTS`` starts in a row, is removed
again with the others added, and the resize failed (the node as it was).
The ranks already running keep their CPU slices (a node grown on the CPU shares CPUs until they restart).

Shrinking: the highest local ranks leave. Each is ``draining`` at once (routers send it nothing new) until its
in-flight requests finish (lbd.supervisor.drain) or ``--scale-down-drain-timeout-s``; then
SIGTERM: the engine gives what still runs its ``--shutdown-timeout``, then cuts those streams, and a router
resumes each on a rank that stays (lbd.router.migration), so its client sees one whole stream. The rank is
never restarted (its lifecycle ends before it drains) and leaves /status once its process is gone.

One resize at a time; none while a rolling restart runs. Refused (409, the node unchanged): too few CUDA
devices for the new size, a rank port in use, a Ray-placed node, an MoE group that cannot re-form at the new
size (``MoeGroup.resize_refusal``: a size its experts do not divide, a group spanning nodes...), a
size below an integer ``--ready-policy``. The node's DP sizes (/status, readiness under ``--ready-policy
all``) follow when the ranks leave (shrinking) or are ready (growing).

Who may resize (``scale_denied``): ``Authorization: Bearer`` with the admin token (``--admin-token``,
``$LBD_ADMIN_TOKEN``) or the cluster token (``$LBD_CLUSTER_TOKEN``) when either is set; with neither, the
endpoint is open on a health port bound to loopback only (whoever can reach it can reach the ranks and the
admin's signals too) and off (404) beyond loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter

from lbd.common.auth import KeyRing
from lbd.common.ports import port_in_use
from lbd.supervisor.flags import SupervisorArgError
from lbd.supervisor.node import RUNNING, SHUTDOWN_EXTRA_S, Supervisor
from lbd.supervisor.rank import RankWorker
from lbd.supervisor.rank_types import SUPERVISED_STATES
from lbd.wire.scale import DONE, FAILED, ScaleResult
from lbd.wire.states import RankState, RollingState

if TYPE_CHECKING:
    from lbd.supervisor.config import RankSpec

log = logging.getLogger("lbd.supervisor")
READY_POLL_S = 0.2
GROW_FAILED_STARTS = 3  # an added rank that failed this many starts in a row fails the resize (a crash loop)
NO_TOKEN = ("POST /scale is off: this health port listens beyond loopback and no token is set; start with "
            "--admin-token (or $LBD_ADMIN_TOKEN) or $LBD_CLUSTER_TOKEN")


class ScaleRefused(Exception):
    """The resize cannot happen (409): the reason, one line; the node is left as it was."""


def scale_denied(authorization: str | None, keys: KeyRing, loopback_only: bool) -> tuple[int, str] | None:
    """(status, message) when the caller may not resize; None when it may. A token set is always required;
    with none, only a loopback-only port is open."""
    if keys:
        if keys.check_header(authorization) is None:
            return 401, "missing or wrong bearer token: send Authorization: Bearer <admin or cluster token>"
        return None
    return None if loopback_only else (404, NO_TOKEN)


def scale_keys(admin_token: str | None, cluster_token: str | None) -> KeyRing:
    return KeyRing.from_secrets([t for t in (admin_token, cluster_token) if t])


class Scaler:
    """Carries out resizes of one node, one at a time; its record is ``node.scaling``."""

    def __init__(self, node: Supervisor) -> None:
        self.node = node
        self.resizes = Counter("lbd_supervisor_resizes_total",
                               "Resizes asked of this node (POST /scale), by direction (grow, shrink, none) "
                               "and outcome (done, failed, refused).", ["direction", "outcome"],
                               registry=node.metrics.registry)
        self._task: asyncio.Task[None] | None = None

    def request(self, target: int) -> tuple[int, ScaleResult]:
        """(HTTP status, the resize's record): 200 for a no-op, 202 once begun; ScaleRefused (409) else."""
        current = len(self.node.workers)
        direction = "grow" if target > current else "shrink" if target < current else "none"
        try:
            self._check(target, current)
            specs = self._new_specs(target, current) if target > current else []
        except ScaleRefused as e:
            self.resizes.labels(direction=direction, outcome="refused").inc()
            log.warning("resize %d -> %d refused: %s", current, target, e)
            raise
        now = time.time()
        if target == current:
            self.resizes.labels(direction=direction, outcome=DONE).inc()
            return 200, ScaleResult(previous=current, target=target, state=DONE, started_at=now,
                                    finished_at=now)
        result = ScaleResult(previous=current, target=target, started_at=now)
        self.node.scaling = result
        log.info("resize: %d -> %d local ranks", current, target)
        if specs:
            workers = [self.node.add_worker(spec) for spec in specs]
            self.node.cfg.ranks.extend(specs)
            result.added = [spec.rank for spec in specs]
            work = self._grow(result, workers)
        else:
            workers = [w for w in self.node.workers if w.spec.local_rank >= target]
            result.removing = [w.spec.rank for w in workers]
            for w in workers if self.node.group is None else ():  # (MoE: the group re-forms first)
                w.mark_leaving()
            self._set_size(target)
            work = self._shrink(result, workers)
        self._task = asyncio.create_task(self._guarded(work, result, direction), name="resize")
        return 202, result

    async def _guarded(self, work: Coroutine[Any, Any, None], result: ScaleResult, direction: str) -> None:
        """Run the resize; an error nobody foresaw fails it (logged) rather than leave it running forever,
        which would refuse every later resize."""
        try:
            await work
        except Exception as e:
            log.exception("resize %d -> %d failed", result.previous, result.target)
            result.error = f"{type(e).__name__}: {e}"
            self._finish(result, direction, FAILED)

    # ---- checks (nothing changes before they pass) --------------------------------------------------------
    def _check(self, target: int, current: int) -> None:
        node, cfg = self.node, self.node.cfg
        if node.phase != RUNNING:
            raise ScaleRefused(f"supervisor is {node.phase}")
        problem = node.group.resize_refusal(cfg.dp_size - cfg.dp_size_local + target) if node.group else None
        if problem is not None:  # an MoE node: its group re-forms at the new size (lbd.supervisor.group)
            raise ScaleRefused(problem)
        if cfg.respec is None:
            raise ScaleRefused("resizing Ray-placed ranks (--data-parallel-backend ray) is not implemented: "
                               "restart the node with the new --data-parallel-size")
        if node.scaling is not None and node.scaling.state == "running":
            raise ScaleRefused(f"a resize ({node.scaling.previous} -> {node.scaling.target} local ranks) is "
                               "running: wait for it (GET /status: scaling)")
        if node.rolling is not None and node.rolling.state is RollingState.RUNNING:
            raise ScaleRefused("a rolling restart is running: resize once it is done")
        if target < current and cfg.ready_policy not in ("all", "any") and int(cfg.ready_policy) > target:
            raise ScaleRefused(f"--ready-policy {cfg.ready_policy} needs {cfg.ready_policy} ready ranks: "
                               f"this node cannot shrink to {target}")

    def _new_specs(self, target: int, current: int) -> list[RankSpec]:
        """The specs of the ranks a node of ``target`` ranks adds: placement as at start, ports free."""
        cfg = self.node.cfg
        assert cfg.respec is not None
        try:
            specs = cfg.respec(cfg.dp_size - cfg.dp_size_local + target, target)[current:]
        except SupervisorArgError as e:
            raise ScaleRefused(f"this node cannot run {target} ranks: {e}") from None
        for spec in specs:
            if spec.port > 65535 or spec.port == cfg.supervisor_port:
                raise ScaleRefused(f"local rank {spec.local_rank} would listen on port {spec.port} (--port "
                                   f"{cfg.base_port} + {spec.local_rank}), which it cannot have")
            problem = port_in_use(spec.bind_host, spec.port)
            if problem:
                raise ScaleRefused(f"local rank {spec.local_rank}'s {problem}: free it, or resize to fewer "
                                   "ranks")
        return specs

    # ---- carrying it out ----------------------------------------------------------------------------------
    async def _grow(self, result: ScaleResult, workers: list[RankWorker]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.node.cfg.startup_timeout_s
        try:
            group = self.node.group  # MoE: the group re-forms with them once they have loaded
            why = await group.grow(workers, self.node.cfg.startup_timeout_s) if group is not None else None
            if why is not None:
                raise ScaleRefused(why)
            while not all(w.state is RankState.READY for w in workers):
                crashing = any(w.attempts >= GROW_FAILED_STARTS for w in workers)
                if self.node.phase != RUNNING or loop.time() >= deadline or crashing:
                    waiting = "; ".join(w.why_not_ready() for w in workers if w.state is not RankState.READY)
                    why = (f"supervisor is {self.node.phase}" if self.node.phase != RUNNING else
                           f"an added rank failed {GROW_FAILED_STARTS} starts in a row" if crashing else
                           f"not ready within {self.node.cfg.startup_timeout_s:g} s")
                    raise ScaleRefused(f"{why}: {waiting}")
                await asyncio.sleep(READY_POLL_S)
        except ScaleRefused as e:
            log.warning("resize %d -> %d failed: %s; removing the added ranks", result.previous,
                        result.target, e)
            result.error = str(e)
            if self.node.phase == RUNNING:  # else the node's shutdown stops them with the others
                await self._remove(workers)
            self._finish(result, "grow", FAILED)
            return
        self._set_size(result.target)
        self._finish(result, "grow", DONE)

    async def _shrink(self, result: ScaleResult, workers: list[RankWorker]) -> None:
        group = self.node.group  # MoE: the group re-forms without them first (their streams cut, to resume)
        why = await group.shrink(self.node.cfg.dp_size) if group is not None else None
        if why is not None:
            log.warning("resize %d -> %d failed: %s", result.previous, result.target, why)
            result.error = why
            self._set_size(result.previous)
            self._finish(result, "shrink", FAILED)
            return
        await self._remove(workers)
        self._finish(result, "shrink", DONE)

    async def _remove(self, workers: list[RankWorker]) -> None:
        """Retire ``workers`` (drain, SIGTERM, never restarted), then drop them from the node and /metrics."""
        cfg = self.node.cfg
        grace = cfg.shutdown_timeout_s + SHUTDOWN_EXTRA_S
        await asyncio.gather(*(w.retire(cfg.scale_down_drain_timeout_s, grace) for w in workers))
        gone = {w.spec.rank for w in workers}
        self.node.workers[:] = [w for w in self.node.workers if w.spec.rank not in gone]
        cfg.ranks[:] = [s for s in cfg.ranks if s.rank not in gone]
        for rank in gone:
            self._forget_metrics(rank)

    def _forget_metrics(self, rank: int) -> None:
        m, label = self.node.metrics, str(rank)
        for per_rank in (m.rank_ready, m.rank_restarts, m.probe_duration):
            with contextlib.suppress(KeyError):
                per_rank.remove(label)
        for state in SUPERVISED_STATES:
            with contextlib.suppress(KeyError):
                m.rank_state.remove(label, state.value)
        m.ranks.dec()

    def _set_size(self, local: int) -> None:
        cfg = self.node.cfg
        cfg.dp_size += local - cfg.dp_size_local
        cfg.dp_size_local = local

    def _finish(self, result: ScaleResult, direction: str, outcome: str) -> None:
        result.state, result.finished_at = outcome, time.time()
        self.resizes.labels(direction=direction, outcome=outcome).inc()
        log.info("resize %d -> %d %s in %.1f s", result.previous, result.target, outcome,
                 result.finished_at - (result.started_at or result.finished_at))
