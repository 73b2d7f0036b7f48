"""What a rank worker (``lbd.supervisor.rank``) and the node agree on: the handle on a started rank, how a
rank is started, the node's verdict on a failure, the admin commands, the restart backoff."""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from lbd.supervisor.config import RankSpec
from lbd.wire.states import RankState


class RankHandle(Protocol):
    """A started rank, wherever it runs: a local process (RankProcess) or one Ray placed (ray_rank). A handle
    may also keep ``stderr_tail`` (last lines, redacted) and ``error_line()`` for /status; a local process
    does."""

    pid: int

    async def wait(self) -> int: ...
    async def stop(self, grace_s: float) -> int | None: ...
    async def kill_tree(self) -> None: ...


StartRank = Callable[[RankSpec], Awaitable[RankHandle]]


# the states a supervisor puts its ranks in (lbd.wire.status.RankState also names lbd serve's placeholders)
SUPERVISED_STATES = (RankState.STARTING, RankState.READY, RankState.UNHEALTHY, RankState.RESTARTING,
                     RankState.DRAINING, RankState.STOPPED, RankState.FAILED)


class FailureAction(enum.StrEnum):
    """What the node decides when a rank fails (see Supervisor.on_rank_failure)."""

    RESTART_RANK = "restart"  # this rank alone, after its backoff; the others keep serving
    EXIT = "exit"  # the node shuts down and exits non-zero (vLLM's behaviour)
    # A member of an MoE group: SIGKILLed at once (its peers wait on it), the group told (``after_stop``),
    # then started again after its backoff while the survivors re-join a new process group (.group).
    REPLACE_MEMBER = "replace_member"


class Command(enum.StrEnum):
    RESTART = "restart"  # graceful stop (SIGTERM; the engine finishes its requests), then start again
    DRAIN = "drain"  # routers stop sending, wait for zero in-flight requests, then restart


@dataclass(slots=True)
class Backoff:
    """Restart delays: initial, doubling up to maximum; back to initial after `reset_after` s of health."""

    initial: float
    maximum: float
    reset_after: float
    _next: float = -1.0

    def next_delay(self, healthy_for_s: float) -> float:
        if self._next < 0 or healthy_for_s >= self.reset_after:
            self._next = self.initial
        delay = self._next
        self._next = min(max(self._next * 2, self.initial), self.maximum)
        return min(delay, self.maximum)
