"""An MoE group of DP ranks, as one node's supervisor runs it: readiness, healing, /status and metrics.

The members' expert layers span every rank, so the group serves or it does not: it is ready when the
coordinator reports the current generation formed (every member joined) and every member this node runs
answers its probes (a member whose group is re-forming answers 503 with ``X-lbd-dp-state``: alive, not
serving). Until then no member is routable and the node's /readyz is 503 with the reason.

Healing (``--on-rank-failure restart-group``): when a member dies or hangs (its probes time out), its process
tree is SIGKILLed at once (a stopped process cannot be asked to exit, and its peers wait on it), the
coordinator is told (``POST /members/{rank}/failed``) so the survivors fail their in-flight requests (503
before the first byte: a router retries them; streams already started end with an error) and wait for a new
generation, and only that member is started again. The survivors keep their processes and loaded weights and
re-join the new process group. The time from the failure to the group being ready again is kept
(``last_recovery`` in /status, ``lbd_supervisor_group_recovery_seconds``).

Resizing (``POST /scale``, ``lbd.supervisor.scale``; elastic expert parallelism, as vLLM's elastic EP): the
survivors keep their processes, weights and running requests. Growing, the new members start at the new size
beside the serving group and, once each has loaded and waits for its group, the coordinator is told
(``POST /resize``): the members leave the generation together at a wave's idle check, the survivors re-place
their experts (``lbd.engine.dp.elastic``: they read only the experts newly theirs) and the group re-forms
with the new members. Shrinking, the coordinator is told first: the leaving members cut their streams with a
retryable 503 (a router resumes them on the survivors) and are then retired by the caller. Refused with the
reason, nothing changed (``resize_refusal``): a group spanning nodes, tensor-parallel experts, fewer than 2
ranks, a size the expert count does not divide, a group not serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from lbd.supervisor.coordinator import Coordinator
from lbd.supervisor.moe import GroupSpec
from lbd.supervisor.rank import RankWorker
from lbd.wire.dp import CoordinatorStatus, DPState
from lbd.wire.states import RankState
from lbd.wire.status import GroupMember, GroupStatus, LastRecovery, RankStatus
from lbd.wire.status import Recovery as RecoveryEntry

log = logging.getLogger("lbd.supervisor")

RESIZE_POLL_S = 0.1
_RECOVERY_BUCKETS = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass(slots=True)
class Recovery:
    rank: int
    why: str
    at: float  # monotonic
    at_wall: float
    generation: int | None  # the generation in service when the member failed

    def describe(self, now: float) -> RecoveryEntry:
        return RecoveryEntry(rank=self.rank, why=self.why, failed_at=self.at_wall, generation=self.generation,
                             for_s=round(now - self.at, 3))


def with_size(argv: list[str], size: int) -> list[str]:
    """A member's command line with ``--data-parallel-size`` (and, the group being on this node only,
    ``--data-parallel-size-local``) set to ``size``."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg in ("--data-parallel-size", "--data-parallel-size-local"):
            out[i + 1] = str(size)
    return out


class GroupMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.ready = Gauge("lbd_supervisor_group_ready", "1 when the MoE group serves: the coordinator "
                           "reports its generation formed, every local member healthy.", registry=registry)
        self.generation = Gauge("lbd_supervisor_group_generation", "The group's process-group generation "
                                "(grows by one each time it re-forms).", registry=registry)
        self.wave_active = Gauge("lbd_supervisor_group_wave_active", "1 while the group runs a wave (every "
                                 "member steps, idle ones with dummy passes).", registry=registry)
        self.joined = Gauge("lbd_supervisor_group_member_joined", "1 when the member is in the current "
                            "generation.", ["rank"], registry=registry)
        self.waiting = Gauge("lbd_supervisor_group_requests_waiting", "Waiting requests of the member, as "
                             "the coordinator last heard (~100 ms old).", ["rank"], registry=registry)
        self.running = Gauge("lbd_supervisor_group_requests_running", "Running requests of the member, as "
                             "the coordinator last heard.", ["rank"], registry=registry)
        self.failures = Counter("lbd_supervisor_group_member_failures_total", "Members that died or hung and "
                                "were replaced.", ["rank"], registry=registry)
        self.recovery = Histogram("lbd_supervisor_group_recovery_seconds", "From a member's failure to the "
                                  "group being ready again.", buckets=_RECOVERY_BUCKETS, registry=registry)
        self.coordinator_up = Gauge("lbd_supervisor_coordinator_up", "1 when the coordinator's /status "
                                    "answers.", registry=registry)
        self.coordinator_restarts = Gauge("lbd_supervisor_coordinator_restarts", "Restarts of the "
                                          "coordinator process this node runs.", registry=registry)


class MoeGroup:
    def __init__(self, spec: GroupSpec, workers: list[RankWorker], registry: CollectorRegistry,
                 policy: str, log_level: str, on_fatal: Callable[[str], None]) -> None:
        self.spec = spec
        self.policy = policy
        self.members = {w.spec.rank: w for w in workers}
        self.coordinator = Coordinator(spec, log_level, on_fatal)
        self.coordinator.on_poll = self._on_poll
        self.metrics = GroupMetrics(registry)
        self.recovering: dict[int, Recovery] = {}
        self.last_recovery: LastRecovery | None = None
        self.recoveries = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping = False
        for w in workers:
            w.after_stop = self._member_stopped
        for rank in range(spec.size):
            self.metrics.joined.labels(rank=str(rank)).set(0)

    async def start(self) -> None:
        await self.coordinator.start()

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.coordinator.stop()

    # ---- failures -------------------------------------------------------------------------------------
    def member_failed(self, worker: RankWorker, why: str) -> None:
        """A member died or hangs: the group is not ready (its worker kills it, then _member_stopped)."""
        rank = worker.spec.rank
        status = self.coordinator.fresh_status()
        if rank not in self.recovering:
            self.recovering[rank] = Recovery(rank, why, time.monotonic(), time.time(),
                                             status.generation if status is not None else None)
        self.metrics.failures.labels(rank=str(rank)).inc()
        log.warning("MoE group: member %d failed (%s): the group stops serving; only rank %d restarts, the "
                    "others re-join a new generation", rank, why, rank)

    def _member_stopped(self, worker: RankWorker, why: str) -> None:
        task = asyncio.get_running_loop().create_task(self.coordinator.member_failed(worker.spec.rank, why))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- resizing ---------------------------------------------------------------------------------------
    def resize_refusal(self, size: int) -> str | None:
        """Why the group cannot re-form at ``size`` members now, or None; asks nothing, changes nothing."""
        spec, experts = self.spec, self.spec.moe.num_experts
        what = f"re-forming the MoE group ({spec.moe.describe()}) at {size} ranks"
        if len(spec.local_ranks) != spec.size or not spec.runs_coordinator:
            return f"{what}: the group spans nodes, and resizing one is not implemented: restart its nodes"
        if not spec.expert_parallel:
            return (f"{what}: its experts are split tensor-parallel (each rank holds a slice of every "
                    "expert), which a resize does not re-place: start the node with --enable-expert-parallel")
        if size < 2:
            return (f"{what}: a group has at least 2 ranks (one rank serves the model alone, without a "
                    "group): restart the node with --data-parallel-size 1")
        if experts % size:
            fits = ", ".join(str(n) for n in range(2, experts + 1) if experts % n == 0)
            return f"{what}: {experts} experts do not split evenly over {size} ranks: use one of {fits}"
        ready, why = self.readiness()
        return None if ready else f"{what}: the group does not serve now ({why}): resize once it does"

    async def grow(self, workers: list[RankWorker], timeout_s: float) -> str | None:
        """Take ``workers`` (started at the new size, ranked after ours) into the group: once each has loaded
        and waits for its group, re-form at the new size. None once the group serves at it, else why not:
        they did not load in ``timeout_s`` (the coordinator untold). Once told, the group is waited for as
        long as it takes (a member failing meanwhile is replaced and heals it; taking the new ranks away
        would leave it waiting for them), or until the node stops."""
        deadline = time.monotonic() + timeout_s
        why = await self._until(lambda: all(w.group_wait is not None or w.state is RankState.READY
                                            for w in workers), deadline, "the new ranks to load")
        size = self.spec.size + len(workers)
        why = why or await self._reform(size)
        if why is not None:
            return why
        for w in workers:
            self.members[w.spec.rank] = w
            w.after_stop = self._member_stopped
        return await self._until(lambda: self._serves(size), float("inf"),
                                 f"the group to serve at {size} ranks")

    async def shrink(self, size: int) -> str | None:
        """Re-form at ``size`` members, without the members ranked ``size`` and above (their engines cut
        their streams with a retryable 503; the caller retires them). None once the group serves at ``size``,
        else why not: refused (nothing changed), or the node stopped meanwhile."""
        why = await self._reform(size)
        if why is not None:
            return why
        for rank in [r for r in self.members if r >= size]:
            self.members.pop(rank).after_stop = None
            for family in (self.metrics.joined, self.metrics.waiting, self.metrics.running):
                with contextlib.suppress(KeyError):  # the member leaves /metrics
                    family.remove(str(rank))
        return await self._until(lambda: self._serves(size), float("inf"),
                                 f"the group to serve at {size} ranks")

    async def _reform(self, size: int) -> str | None:
        """Tell the coordinator to re-form at ``size``; None when it took it (our spec follows)."""
        problem = self.resize_refusal(size)
        spec = dataclasses.replace(self.spec, size=size, local_ranks=tuple(range(size)))
        problem = problem or await self.coordinator.resize(spec)
        if problem is not None:
            return problem
        log.info("MoE group: re-forming at %d ranks (was %d)", size, self.spec.size)
        self.spec = spec
        for w in self.members.values():  # a member that restarts later starts at the new size
            w.spec.argv = with_size(w.spec.argv, size)
        for rank in range(size):
            self.metrics.joined.labels(rank=str(rank)).set(0)
        return None

    def _serves(self, size: int) -> bool:
        status = self.coordinator.fresh_status()
        return status is not None and status.size == size and self.readiness()[0]

    async def _until(self, done: Callable[[], bool], deadline: float, what: str) -> str | None:
        """None once ``done()``, or why not at ``deadline`` or when the node stops."""
        while not done():
            if self._stopping:
                return f"the node stopped while waiting for {what}"
            if time.monotonic() >= deadline:
                return f"timed out waiting for {what}: {self.readiness()[1]}"
            await asyncio.sleep(RESIZE_POLL_S)
        return None

    # ---- readiness ------------------------------------------------------------------------------------
    def readiness(self) -> tuple[bool, str]:
        head = f"MoE group ({self.spec.moe.describe()}, {self.spec.size} ranks"
        head += ", expert parallel)" if self.spec.expert_parallel else ")"
        status = self.coordinator.fresh_status()
        if status is None:
            return False, f"{head}: the DP coordinator does not answer ({self.coordinator.error})"
        gen, state = status.generation, status.state
        if state is not DPState.READY:
            why = status.reason or "waiting for its members"
            return False, f"{head}: generation {gen} {state.value}: {why}"
        waiting = [f"rank {r} {w.state.value}" if w.state is not RankState.READY else f"rank {r} "
                   f"{w.group_wait}" for r, w in self.members.items()
                   if w.state is not RankState.READY or w.group_wait is not None]
        if waiting:
            return False, f"{head}: generation {gen} formed, but " + ", ".join(waiting)
        return True, f"{head}: generation {gen} ready"

    def _on_poll(self) -> None:
        """After each coordinator poll: metrics, and the end of a recovery."""
        status = self.coordinator.fresh_status()
        ready, _ = self.readiness()
        m = self.metrics
        m.ready.set(1 if ready else 0)
        m.coordinator_up.set(0 if status is None else 1)
        m.coordinator_restarts.set(self.coordinator.restarts)
        if status is not None:
            m.generation.set(float(status.generation))
            m.wave_active.set(1 if status.wave.active else 0)
            for member in status.members:
                rank = str(member.rank)
                m.joined.labels(rank=rank).set(1 if member.joined else 0)
                m.waiting.labels(rank=rank).set(float(member.waiting))
                m.running.labels(rank=rank).set(float(member.running))
        self._settle(ready, status)

    def _settle(self, ready: bool, status: CoordinatorStatus | None) -> None:
        """A recovery ends the first time the group is seen ready again (after a poll or on /status)."""
        if ready and self.recovering:
            m = self.metrics
            now = time.monotonic()
            first = min(self.recovering.values(), key=lambda r: r.at)
            took = now - first.at
            entry = first.describe(now)
            self.last_recovery = LastRecovery(
                rank=entry.rank, why=entry.why, failed_at=entry.failed_at, generation=entry.generation,
                for_s=entry.for_s, ready_after_s=round(took, 3), ranks=sorted(self.recovering),
                ready_generation=status.generation if status is not None else None)
            self.recoveries += 1
            m.recovery.observe(took)
            log.info("MoE group: ready again %.1f s after member %s failed (generation %s)", took,
                     first.rank, status.generation if status is not None else None)
            self.recovering.clear()

    def routable(self) -> bool:
        return self.readiness()[0]

    # ---- /status --------------------------------------------------------------------------------------
    def status(self, ranks: list[RankStatus]) -> GroupStatus:
        """The group's /status entry; ``ranks``: this node's rank entries, made unroutable while the group
        is not ready."""
        ready, reason = self.readiness()
        self._settle(ready, self.coordinator.fresh_status())
        for r in ranks:
            if r.rank in self.members:
                r.routable = bool(r.routable) and ready
                r.group = 0
            elif r.rank >= self.spec.size:  # a member a shrink removed, draining out
                r.routable = False
        status = self.coordinator.fresh_status()
        by_rank = {m.rank: m for m in status.members} if status is not None else {}
        members = []
        for rank in range(self.spec.size):
            seen = by_rank.get(rank)
            w = self.members.get(rank)
            member = GroupMember(rank=rank, local=w is not None)
            if w is not None:
                member.state, member.pid, member.group_wait = w.state, w.pid, w.group_wait
            if seen is not None:
                member.core_pid, member.joined, member.waiting, member.running = (
                    seen.pid, seen.joined, seen.waiting, seen.running)
                member.last_report_age_s, member.wave_active = seen.last_report_age_s, seen.wave_active
            members.append(member)
        now = time.monotonic()
        spec = self.spec
        return GroupStatus(
            group=0, kind="moe", model=spec.moe.architecture, num_experts=spec.moe.num_experts,
            size=spec.size, local_ranks=list(spec.local_ranks), expert_parallel=spec.expert_parallel,
            on_rank_failure=self.policy, ready=ready, reason=reason,
            generation=status.generation if status is not None else None,
            state=status.state if status is not None else None,
            wave=status.wave if status is not None else None,
            generation_aborts=status.generation_aborts if status is not None else None,
            rendezvous=spec.rendezvous(), coordinator=self.coordinator.describe(),
            members=members, recovering=[r.describe(now) for r in self.recovering.values()],
            recoveries=self.recoveries, last_recovery=self.last_recovery,
        )
