"""The TP x PP core <-> worker messages (lbd.wire.executor_messages): each kind round-trips as a msgpack array
led by its kind; trailing fields of a newer peer are skipped; anything else is a ValueError."""

from __future__ import annotations

import msgpack
import msgspec
import pytest

from lbd.wire.core_messages import SamplingParams, TokenLogprobs
from lbd.wire.executor_messages import (
    Blocks,
    Counters,
    KVSize,
    NewRequest,
    Out,
    Profile,
    Ready,
    Shutdown,
    Step,
    WorkerConfig,
    WorkerError,
    decode_from_worker,
    decode_to_worker,
    encode,
)

TO_WORKER = [
    WorkerConfig(args={"model_name": "m", "seed": 0}, model_path="/m", tp=2, pp=2, partition=[3, 5],
                 store=("127.0.0.1", 4321), timeout_s=600.0, timed=None),
    KVSize(num_blocks=128),
    Step(seq=7, batch=[[1, 2, 3], [0], [3], [3], [[0, 1]], [2], 0], sample_ids=["a"],
         new=[NewRequest("a", SamplingParams(temperature=0.0, seed=3), None, [])], finished=["b"]),
    Profile(reset=False),
    Shutdown(),
]
FROM_WORKER = [
    Blocks(rank=3, num_blocks=99, facts={"block_size": 16, "device": "cpu", "eos_token_id": None}),
    Ready(rank=1, pid=4242),
    Out(rank=3, seq=7, token_ids=[5, 6], logprobs=[None, TokenLogprobs(-0.5, [6, 1], [-0.5, -1.5])]),
    Counters(rank=0, counters={"pp_rank": 0, "step_s": 0.25}),
    WorkerError(rank=2, reason="RuntimeError: boom"),
]


@pytest.mark.parametrize("msg", TO_WORKER, ids=lambda m: m.__struct_config__.tag)
def test_core_to_worker_round_trips(msg: msgspec.Struct) -> None:
    data = encode(msg)
    assert msgpack.unpackb(data)[0] == msg.__struct_config__.tag
    assert decode_to_worker(data) == msg


@pytest.mark.parametrize("msg", FROM_WORKER, ids=lambda m: m.__struct_config__.tag)
def test_worker_to_core_round_trips(msg: msgspec.Struct) -> None:
    data = encode(msg)
    assert msgpack.unpackb(data)[:2] == [msg.__struct_config__.tag, msg.rank]
    assert decode_from_worker(data) == msg


def test_trailing_fields_of_a_newer_peer_are_skipped() -> None:
    assert decode_to_worker(msgpack.packb(["kv", 8, "newer"])) == KVSize(8)
    assert decode_from_worker(msgpack.packb(["ready", 1, 77, {"x": 1}])) == Ready(1, 77)


@pytest.mark.parametrize("data", [b"\xc1", msgpack.packb({"kind": "kv"}), msgpack.packb(["resize", 3]),
                                  msgpack.packb(["kv", "many"]), msgpack.packb(["out", 0, 1])])
def test_anything_else_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode_to_worker(data)
    with pytest.raises(ValueError):
        decode_from_worker(data)
