"""The pushed load state's wire (lbd.wire.load_state): the encoding other engines implement."""

from __future__ import annotations

import msgspec
import pytest

from lbd.wire.load_state import BadLoadState, LoadState, decode_advertised, decode_state, encode_state


def test_round_trip_is_a_positional_msgpack_array() -> None:
    state = LoadState("ab12", 7, 1.5, rank=3, running=2, waiting=1, kv_usage=0.25, num_blocks=100,
                      block_size=16, prefix_queries=10, prefix_hits=4, prompt_tokens=10, generation_tokens=5,
                      heartbeat_s=0.5, stream="tcp://127.0.0.1:5")
    payload = encode_state(state)
    assert msgspec.msgpack.decode(payload)[:4] == ["ab12", 7, 1.5, 3]  # the documented field order
    assert decode_state(payload) == state


def test_a_newer_publishers_extra_fields_are_ignored() -> None:
    raw = msgspec.msgpack.decode(encode_state(LoadState("x", 1, 2.0, running=4)))
    decoded = decode_state(msgspec.msgpack.encode([*raw, "future", 1]))
    assert decoded.running == 4 and decoded.instance == "x"


def test_an_older_publishers_short_array_takes_defaults() -> None:
    decoded = decode_state(msgspec.msgpack.encode(["x", 1, 2.0, 0, 3]))
    assert decoded.running == 3 and decoded.waiting == 0 and decoded.heartbeat_s == 1.0


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"instance": "x"}),
                                     msgspec.msgpack.encode(["x", "not a seq", 1.0]), b""])
def test_bad_payloads_raise_bad_load_state(payload: bytes) -> None:
    with pytest.raises(BadLoadState):
        decode_state(payload)


def test_advertisement() -> None:
    adv = decode_advertised({"endpoint": "tcp://127.0.0.1:9", "instance": "i", "heartbeat_s": 1.0, "x": 1})
    assert adv is not None and adv.topic == "lbd.load" and not adv.curve
    assert decode_advertised(None) is None
    assert decode_advertised({"endpoint": 5}) is None
