"""The KV-cache manager's listener: turns block registrations, evictions and resets into vLLM's event
structs, in order, until the core takes them once per step."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from lbd.wire.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

BlockKey = bytes | int  # a prefix-cache block key (lbd.engine.core.block_hash): a digest, or an int
_MASK64 = (1 << 64) - 1


def external_key_fn() -> Callable[[BlockKey], bytes | int]:
    """How block keys appear in events (vLLM's ``maybe_convert_block_hash``): with
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` (default 1) the low 64 bits of the big-endian digest as an int,
    else the digest bytes."""
    as_int = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1").strip() not in ("0", "")

    def external(key: BlockKey) -> bytes | int:
        if isinstance(key, int):
            return key & _MASK64
        return int.from_bytes(key, "big") & _MASK64 if as_int else key

    return external


class EventRecorder:
    """``lbd.engine.core.kv_cache.CacheListener``; one KV-cache group (index 0), device tier, as vLLM."""

    __slots__ = ("block_size", "events", "_external")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []
        self._external = external_key_fn()

    def stored(self, keys: list[BlockKey], parent: BlockKey | None, token_ids: Sequence[int],
               lora: tuple[int, str | None] | None = None) -> None:
        ext = self._external
        lora_id, lora_name = lora if lora is not None else (None, None)
        self.events.append(BlockStored(
            block_hashes=[ext(k) for k in keys], parent_block_hash=None if parent is None else ext(parent),
            token_ids=list(token_ids), block_size=self.block_size, lora_id=lora_id, medium=MEDIUM_GPU,
            lora_name=lora_name, group_idx=0))

    def removed(self, key: BlockKey) -> None:
        events = self.events
        if events and type(events[-1]) is BlockRemoved:  # evictions in a row: one event
            events[-1].block_hashes.append(self._external(key))
        else:
            events.append(BlockRemoved(block_hashes=[self._external(key)], medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
