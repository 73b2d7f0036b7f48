"""KV-event batches (lbd.wire.kv_events): the encoder's bytes, the decoder's tolerance. Byte compatibility
with vLLM's own payloads is checked against recorded vLLM output in tests/router/test_kv_vllm_interop.py."""

from __future__ import annotations

import msgspec
import pytest

from lbd.wire.kv_events import (
    AllBlocksCleared,
    BadPayload,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)


def _stored(**extra: object) -> BlockStored:
    return BlockStored(block_hashes=[1, b"\x02" * 32], parent_block_hash=None, token_ids=[1, 2, 3, 4],
                       block_size=4, lora_id=None, medium="GPU", lora_name=None, **extra)


def test_round_trip_and_wire_shape() -> None:
    batch = KVEventBatch(ts=1.5, events=[_stored(group_idx=0), BlockRemoved([1], "GPU"), AllBlocksCleared()],
                         data_parallel_rank=3)
    payload = encode_batch(batch)
    assert decode_batch(payload) == (batch, 0)
    raw = msgspec.msgpack.decode(payload)
    assert raw[0] == 1.5 and raw[2] == 3  # an array: [ts, events, data_parallel_rank]
    stored = raw[1][0]
    assert stored["type"] == "BlockStored" and stored["group_idx"] == 0
    assert {"lora_id", "medium", "lora_name"} <= set(stored) and "extra_keys" not in stored  # required: kept
    assert raw[1][2] == {"type": "AllBlocksCleared"}


def test_tolerant_decoding() -> None:
    newer = msgspec.msgpack.encode([2.0, [
        {"type": "BlockStored", "block_hashes": [5], "parent_block_hash": 4, "token_ids": [9] * 4,
         "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "brand_new": 1},
        {"type": "BlockMoved", "block_hashes": [5]},  # a type this version does not know: skipped, counted
        {"type": "BlockRemoved", "block_hashes": [5]},  # an older one: no medium
    ]])
    batch, unknown = decode_batch(newer)
    assert unknown == 1 and batch.data_parallel_rank is None and batch.ts == 2.0
    assert batch.events[0].block_hashes == [5] and batch.events[0].parent_block_hash == 4
    assert batch.events[1] == BlockRemoved([5], None)
    old = msgspec.msgpack.encode([1.0, [["BlockStored", [7], None, [1, 2], 2, None], ["AllBlocksCleared"]],
                                  0])
    batch, unknown = decode_batch(old)
    assert unknown == 0 and batch.events == [BlockStored([7], None, [1, 2], 2, None, None, None),
                                             AllBlocksCleared()]


@pytest.mark.parametrize("payload", [b"\xc1", msgspec.msgpack.encode({"nope": 1}),
                                     msgspec.msgpack.encode([1]), msgspec.msgpack.encode([1.0, "x"])])
def test_not_a_batch(payload: bytes) -> None:
    with pytest.raises(BadPayload):
        decode_batch(payload)
