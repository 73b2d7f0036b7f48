"""The events a supervisor's rank worker reacts to (``lbd.supervisor.rank``): each comes through the worker's
one queue from its exit watcher, its probe loop, its start-up timer or the admin endpoints, and carries the
generation (process incarnation) it is about, so a late event of a killed process is ignored."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class RankEventKind(enum.StrEnum):
    EXITED = "exited"  # the process ended (detail: its exit code or signal)
    UNHEALTHY = "unhealthy"  # probes failed past the threshold, or the core is dead
    STARTUP_TIMEOUT = "startup_timeout"  # not ready within --startup-timeout
    COMMAND = "command"  # an admin command (detail: drain | restart)


@dataclass(slots=True)
class RankEvent:
    generation: int | None  # None: a command, valid for whichever process is current
    kind: RankEventKind
    detail: str
