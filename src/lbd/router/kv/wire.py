"""Decode one KV-event payload into plain tuples, whatever vLLM version encoded it.

vLLM 0.32 (and lbd's engine) encode the batch as an array ``[ts, events, data_parallel_rank]`` and each event
as a map tagged ``"type"``; older vLLM encoded events as arrays whose first item is the tag. Both are read.
Events come out as ``("stored", hashes, parent, token_ids, block_size, extra_keys)``, ``("removed", hashes)``
or ``("cleared",)``; anything else is skipped (counted by the caller as unknown).
"""

from __future__ import annotations

from typing import Any

import msgspec

Event = tuple[Any, ...]
_decode = msgspec.msgpack.Decoder().decode


class BadPayload(ValueError):
    pass


def decode_batch(payload: bytes) -> tuple[float, list[Event], int | None, int]:
    """(ts, events, data_parallel_rank, unknown events) of one payload; BadPayload when it is not a batch."""
    try:
        raw = _decode(payload)
    except msgspec.DecodeError as e:
        raise BadPayload(f"not msgpack: {e}") from None
    if isinstance(raw, list | tuple) and len(raw) >= 2:
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict) and "events" in raw:
        ts, events, rank = raw.get("ts", 0.0), raw["events"], raw.get("data_parallel_rank")
    else:
        raise BadPayload("not an event batch")
    if not isinstance(events, list):
        raise BadPayload("events is not a list")
    out: list[Event] = []
    unknown = 0
    for ev in events:
        parsed = _event(ev)
        if parsed is None:
            unknown += 1
        else:
            out.append(parsed)
    return float(ts or 0.0), out, rank if isinstance(rank, int) else None, unknown


def _event(ev: Any) -> Event | None:
    if isinstance(ev, dict):
        kind = ev.get("type")
        if kind == "BlockStored":
            return (
                "stored",
                ev.get("block_hashes") or [],
                ev.get("parent_block_hash"),
                ev.get("token_ids") or [],
                int(ev.get("block_size") or 0),
                ev.get("extra_keys"),
            )
        if kind == "BlockRemoved":
            return ("removed", ev.get("block_hashes") or [])
        if kind == "AllBlocksCleared":
            return ("cleared",)
        return None
    if isinstance(ev, list | tuple) and ev:
        kind = ev[0]
        if kind == "BlockStored" and len(ev) >= 5:
            extra = ev[8] if len(ev) > 8 and isinstance(ev[8], list) else None
            return ("stored", ev[1] or [], ev[2], ev[3] or [], int(ev[4] or 0), extra)
        if kind == "BlockRemoved" and len(ev) >= 2:
            return ("removed", ev[1] or [])
        if kind == "AllBlocksCleared":
            return ("cleared",)
    return None
