"""A node's registration, its heartbeat and the head's answer round-trip; newer peers' fields are skipped;
a bad field is a ValueError that names it."""

from __future__ import annotations

import msgspec
import pytest

from lbd.wire.registration import (
    NodeRegistration,
    RegistrationAnswer,
    decode_answer,
    decode_error,
    decode_heartbeat,
    decode_registration,
)
from lbd.wire.states import RankState
from lbd.wire.status import RankStatus, RegistryRendezvous


def _registration() -> NodeRegistration:
    return NodeRegistration(node_id="n1", address="10.0.0.2", data_parallel_size=4,
                            data_parallel_start_rank=2, data_parallel_size_local=2,
                            health_url="http://10.0.0.2:9256", hostname="h",
                            models=["m"], ranks=[RankStatus(rank=2, url="http://10.0.0.2:8002",
                                                            state=RankState.READY, routable=True)])


def test_registration_round_trips_and_its_ranks_are_typed() -> None:
    reg = _registration()
    back = decode_registration(msgspec.json.encode(reg))
    assert back == reg
    assert back.ranks[0].state is RankState.READY
    assert decode_heartbeat(msgspec.json.encode(reg)).ranks == reg.ranks  # a heartbeat is read from it


def test_fields_of_a_newer_peer_are_skipped() -> None:
    body = msgspec.json.decode(msgspec.json.encode(_registration()))
    body["gpu_model"] = "future"
    body["ranks"][0]["new_field"] = 1
    assert decode_registration(msgspec.json.encode(body)) == _registration()
    answer = {"accepted": True, "node_id": "n1", "lease_s": 20.0, "extra": [1],
              "rendezvous": {"address": "10.0.0.1", "registry_port": 29550, "more": True}}
    got = decode_answer(msgspec.json.encode(answer))
    assert got.lease_s == 20.0
    assert got.rendezvous == RegistryRendezvous(address="10.0.0.1", registry_port=29550)


def test_a_bad_or_missing_field_names_itself() -> None:
    body = msgspec.json.decode(msgspec.json.encode(_registration()))
    body["data_parallel_size"] = "four"
    with pytest.raises(ValueError, match="data_parallel_size"):
        decode_registration(msgspec.json.encode(body))
    del body["node_id"]
    with pytest.raises(ValueError, match="node_id"):
        decode_registration(b'{"address": "a", "data_parallel_size": 1, "data_parallel_start_rank": 0, '
                            b'"data_parallel_size_local": 1}')


def test_answer_defaults_and_errors() -> None:
    assert decode_answer(b"{}") == RegistrationAnswer()
    err = decode_error(b'{"error": {"message": "taken", "type": "ConflictError", "param": "node_id", '
                       b'"code": 409}}')
    assert (err.message, err.param, err.code) == ("taken", "node_id", 409)
    assert decode_error(b"not json").message == ""
