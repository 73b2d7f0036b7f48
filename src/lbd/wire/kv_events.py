"""KV-cache events, in vLLM's wire format: the batch every engine core publishes and every router reads.

The structs are shaped as vLLM's ``vllm.distributed.kv_events`` (0.32) declares them, so msgspec encodes them
to the same bytes: the batch is an array ``[ts, events, data_parallel_rank]``; each event is a map tagged
``"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"``; fields left at their default are omitted,
the required ones (``lora_id``, ``medium``, ``lora_name``...) are always there, even when null. Block hashes
are ints (the low 64 bits of the key) or bytes, as vLLM's ``ExternalBlockHash``.

``encode_batch`` is the producer's side; ``decode_batch`` the consumer's, tolerant of what other vLLM
versions send: unknown fields are skipped, missing optional ones read as null, the older array form of an
event (``["BlockStored", hashes, parent, token_ids, block_size, ...]``) is read too, and an event of a type
this version does not know is skipped and counted.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_GPU = "GPU"
ExternalBlockHash = bytes | int


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the three events (tagged by class name)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None


class BadPayload(ValueError):
    """A payload that is not an event batch at all (not msgpack, or not shaped as a batch)."""


_encoder = msgspec.msgpack.Encoder()
_typed = msgspec.msgpack.Decoder(KVEventBatch)
_raw = msgspec.msgpack.Decoder()


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> tuple[KVEventBatch, int]:
    """(the batch, how many of its events were of an unknown type and skipped); BadPayload when it is not
    a batch. Current payloads decode straight into the structs; anything else goes the tolerant way."""
    try:
        return _typed.decode(payload), 0
    except msgspec.ValidationError:
        pass
    except msgspec.DecodeError as e:
        raise BadPayload(f"not msgpack: {e}") from None
    raw = _raw.decode(payload)
    if isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:  # a map-encoded batch
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise BadPayload("not an event batch")
    if not isinstance(events, list):
        raise BadPayload("events is not a list")
    parsed = [_event(ev) for ev in events]
    known = [ev for ev in parsed if ev is not None]
    ts = float(ts) if isinstance(ts, int | float) else 0.0
    return KVEventBatch(ts, known, rank if isinstance(rank, int) else None), len(parsed) - len(known)


def _event(ev: Any) -> Event | None:
    if isinstance(ev, dict):
        kind = ev.get("type")
        if kind == "BlockStored":
            return BlockStored(ev.get("block_hashes") or [], ev.get("parent_block_hash"),
                               ev.get("token_ids") or [], _int(ev.get("block_size")), ev.get("lora_id"),
                               ev.get("medium"), ev.get("lora_name"), ev.get("extra_keys"))
        if kind == "BlockRemoved":
            return BlockRemoved(ev.get("block_hashes") or [], ev.get("medium"))
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
        return None
    if isinstance(ev, list | tuple) and ev:  # older vLLM: an array whose first item is the tag
        kind = ev[0]
        if kind == "BlockStored" and len(ev) >= 5:
            extra = ev[8] if len(ev) > 8 and isinstance(ev[8], list) else None
            return BlockStored(ev[1] or [], ev[2], ev[3] or [], _int(ev[4]), None, None, None, extra)
        if kind == "BlockRemoved" and len(ev) >= 2:
            return BlockRemoved(ev[1] or [], None)
        if kind == "AllBlocksCleared":
            return AllBlocksCleared()
    return None


def _int(value: object) -> int:
    return int(value) if isinstance(value, int | float) else 0
