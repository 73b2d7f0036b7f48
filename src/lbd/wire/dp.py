"""The DP group of an MoE model, on its wires: the group's state, a rank's DP status (core -> front end ->
the engine's /status) and the DP coordinator's /status (read by every node's supervisor).

A group's generation g is ``forming`` until all N ranks joined and formed its process group, ``ready`` while
it serves, and ``reforming`` after a member failed (g+1 is being formed). The engine answers 503 with the
state in ``X-lbd-dp-state`` while not ready; the supervisor makes no member routable until ``ready``.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from lbd.wire.codec import json_decoder
from lbd.wire.tolerant import TolerantEnum


class DPState(TolerantEnum):
    FORMING = "forming"
    READY = "ready"
    REFORMING = "reforming"
    UNKNOWN = "unknown"  # a state a newer peer sent


@dataclass(slots=True)
class DPStatus:
    """One rank's view of its group (the core sends it to its front ends on every change; /status shows it
    as ``dp``). A slots dataclass: the core's loop updates it in place; the wave counters are the core's
    wave bookkeeping, filled in as it sends the status."""

    state: DPState = DPState.FORMING
    generation: int = 0  # the generation this rank is in (ready) or last was in
    reason: str | None = "waiting for the coordinator to form generation 1"
    expert_parallel: bool = False
    all2all_backend: str = "alltoall"
    wave_active: bool = False
    waves: int = 0  # waves this rank ran
    steps: int = 0  # steps it ran in waves
    dummy_steps: int = 0  # of which dummy passes (idle in a wave)

    @property
    def unavailable(self) -> str:
        """The 503 message while the group does not serve."""
        verb = "forming" if self.state == DPState.FORMING else "re-forming"
        return f"data-parallel group is {verb}: {self.reason or 'waiting for every rank'}"


def dp_status(value: object) -> DPStatus:
    """A rank's DP status from its decoded message (unknown fields skipped, an unknown state ``unknown``)."""
    return msgspec.convert(value, DPStatus)


class Wave(msgspec.Struct):
    """The group's current wave (every member steps while one is active, idle ones with dummy passes)."""

    active: bool = False
    id: int = 0
    count: int = 0  # waves started in this generation


class CoordinatorMember(msgspec.Struct):
    """A member as the coordinator last heard from it."""

    rank: int
    pid: int | None = None  # its core process
    joined: bool = False  # in the current generation's process group
    waiting: int = 0
    running: int = 0
    wave_active: bool = False
    last_report_age_s: float | None = None


class CoordinatorStatus(msgspec.Struct):
    """``GET /status`` of ``python -m lbd.engine.dp.coordinator``."""

    size: int = 0
    generation: int = 0
    state: DPState = DPState.UNKNOWN
    reason: str | None = None  # why it is not ready
    wave: Wave = msgspec.field(default_factory=Wave)
    generation_aborts: int = 0
    members: list[CoordinatorMember] = msgspec.field(default_factory=list)




def decode_coordinator_status(body: bytes) -> CoordinatorStatus:
    """Raises ValueError (msgspec's errors are ValueErrors) when ``body`` is not a coordinator status."""
    return json_decoder(CoordinatorStatus).decode(body)
