"""The DP rank <-> coordinator messages (lbd.wire.dp_messages): each kind round-trips as a msgpack map under
its wire kind; a newer peer's fields are skipped and its new kinds are reported as such; anything else that
is not a message is a ValueError."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from lbd.wire.dp_messages import (
    COORDINATOR_MESSAGES,
    RANK_MESSAGES,
    Abort,
    Form,
    Join,
    Joined,
    Lost,
    Reform,
    Report,
    StartWave,
    UnknownKind,
    WaveEnded,
    WaveStarted,
    decode_from_coordinator,
    decode_from_rank,
    encode,
)

FROM_RANK = [
    (Join(rank=1, pid=4242, last_generation=3), "join"),
    (Joined(rank=1, generation=4), "joined"),
    (Lost(rank=0, generation=4, reason="all_reduce timed out"), "lost"),
    (Report(rank=1, generation=4, ready=True, waiting=2, running=5, wave_active=True), "report"),
    (WaveStarted(rank=0, generation=4, wave=7), "wave_start"),
    (WaveEnded(rank=1, generation=4, wave=7), "wave_end"),
]
FROM_COORDINATOR = [
    (Form(generation=4, size=2), "form"),
    (Abort(generation=4, reason="rank 1 failed"), "abort"),
    (StartWave(generation=4, wave=7), "wave_start"),
    (Reform(generation=4, size=8), "reform"),
]


def test_every_kind_is_covered() -> None:
    assert {type(m) for m, _ in FROM_RANK} == set(RANK_MESSAGES)
    assert {type(m) for m, _ in FROM_COORDINATOR} == set(COORDINATOR_MESSAGES)


@pytest.mark.parametrize(("msg", "kind"), FROM_RANK, ids=[k for _, k in FROM_RANK])
def test_rank_messages_round_trip(msg: msgspec.Struct, kind: str) -> None:
    data = encode(msg)
    assert msgpack.unpackb(data) == {"kind": kind, **msgspec.structs.asdict(msg)}
    assert decode_from_rank(data) == msg


@pytest.mark.parametrize(("msg", "kind"), FROM_COORDINATOR, ids=[k for _, k in FROM_COORDINATOR])
def test_coordinator_messages_round_trip(msg: msgspec.Struct, kind: str) -> None:
    data = encode(msg)
    assert msgpack.unpackb(data) == {"kind": kind, **msgspec.structs.asdict(msg)}
    assert decode_from_coordinator(data) == msg


def test_a_newer_peers_fields_are_skipped_and_missing_ones_take_defaults() -> None:
    newer = msgpack.packb({"kind": "report", "rank": 1, "generation": 2, "ready": True, "gpu_util": 0.9,
                           "extra": {"nested": [1, 2]}})
    assert decode_from_rank(newer) == Report(rank=1, generation=2, ready=True)
    form = msgpack.packb({"size": 3, "topology": "ring", "generation": 9, "kind": "form"})
    assert decode_from_coordinator(form) == Form(generation=9, size=3)
    assert decode_from_rank(msgpack.packb({"kind": "join", "rank": 0, "pid": 7})) == Join(0, pid=7)


def test_an_unknown_kind_is_reported_as_such() -> None:
    with pytest.raises(UnknownKind) as caught:
        decode_from_rank(msgpack.packb({"kind": "drain", "rank": 0, "generation": 1}))
    assert caught.value.kind == "drain" and "drain" in str(caught.value)
    # each direction knows only its own kinds: a coordinator's form is not a rank's message
    with pytest.raises(UnknownKind):
        decode_from_rank(encode(Form(generation=1, size=2)))
    with pytest.raises(UnknownKind):
        decode_from_coordinator(encode(Joined(rank=0, generation=1)))
    assert issubclass(UnknownKind, ValueError)


@pytest.mark.parametrize("data", [
    b"\xc1",  # not msgpack
    msgpack.packb([1, 2]),  # not a map
    msgpack.packb({"rank": 0, "pid": 1}),  # no kind
    msgpack.packb({"kind": 3, "rank": 0}),  # a kind that is not a string
    msgpack.packb({"kind": "join", "rank": "zero", "pid": 1}),  # a field of the wrong type
    msgpack.packb({"kind": "joined", "rank": 0}),  # a required field missing
], ids=["not-msgpack", "array", "no-kind", "int-kind", "wrong-type", "missing-field"])
def test_a_malformed_message_is_a_value_error_not_an_unknown_kind(data: bytes) -> None:
    with pytest.raises(ValueError) as caught:
        decode_from_rank(data)
    assert not isinstance(caught.value, UnknownKind)
    with pytest.raises(ValueError):
        decode_from_coordinator(data)
