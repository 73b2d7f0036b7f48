"""DP group types (lbd.wire.dp): the state enum decodes unknown states tolerantly; a rank's DP status and
the coordinator's /status round-trip."""

from __future__ import annotations

import dataclasses

import msgpack
import msgspec
import orjson

from lbd.wire.dp import (
    CoordinatorMember,
    CoordinatorStatus,
    DPState,
    DPStatus,
    Wave,
    decode_coordinator_status,
    dp_status,
)


def test_state_is_its_wire_string_and_tolerates_new_ones() -> None:
    assert DPState.READY == "ready" and DPState("reforming") is DPState.REFORMING
    assert DPState("split-brain") is DPState.UNKNOWN


def test_rank_dp_status_round_trips_through_the_core_message() -> None:
    status = DPStatus(state=DPState.READY, generation=3, reason=None, expert_parallel=True)
    body = dataclasses.asdict(status)
    body.update(wave_active=True, waves=2, steps=10, dummy_steps=4)  # as the core sends it
    message = msgpack.unpackb(msgpack.packb(body))
    expected = dataclasses.replace(status, wave_active=True, waves=2, steps=10, dummy_steps=4)
    assert dp_status(message) == expected
    assert dp_status({**message, "state": "new", "extra": 1}).state is DPState.UNKNOWN
    forming = DPStatus(state=DPState.FORMING, reason="waiting")
    assert forming.unavailable == "data-parallel group is forming: waiting"
    reforming = DPStatus(state=DPState.REFORMING, reason=None)
    assert reforming.unavailable.startswith("data-parallel group is re-forming")


def test_coordinator_status_round_trips() -> None:
    status = CoordinatorStatus(size=2, generation=4, state=DPState.REFORMING, reason="waiting for ranks [1]",
                               wave=Wave(False, 0, 2), generation_aborts=3,
                               members=[CoordinatorMember(rank=0, pid=9, joined=True, waiting=1, running=2,
                                                          last_report_age_s=0.05)])
    body = msgspec.json.encode(status)
    assert orjson.loads(body)["state"] == "reforming"
    assert decode_coordinator_status(body) == status
    newer = decode_coordinator_status(b'{"size": 2, "state": "paused", "members": [{"rank": 0, "x": 1}], '
                                      b'"y": 2}')
    assert newer.state is DPState.UNKNOWN and newer.members == [CoordinatorMember(rank=0)]
