"""The states /status reports: a rank's, a node's and a rolling restart's.

Apart from ``lbd.wire.status`` so that a program can track states from its first moment without importing
msgspec and the /status structs, which it needs only when /status is answered or read: the supervisor
imports those where it builds /status (marked "lazily, for cold start"), so it answers /health sooner.
"""

from __future__ import annotations

from lbd.wire.tolerant import TolerantEnum


class RankState(TolerantEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    RESTARTING = "restarting"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"
    MISSING = "missing"  # lbd serve's head: no node has registered this rank
    UNREACHABLE = "unreachable"  # lbd serve's head: the rank's node missed its heartbeats
    UNKNOWN = "unknown"  # not told, or a state a newer peer sent


class NodePhase(TolerantEnum):
    RUNNING = "running"
    STOPPING = "stopping"  # after SIGTERM
    FAILED = "failed"  # gave up (--on-rank-failure exit, a usage error)
    UNKNOWN = "unknown"


class RollingState(TolerantEnum):
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    UNKNOWN = "unknown"
