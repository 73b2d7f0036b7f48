"""The KV-cache manager's listener: turns block registrations, evictions and resets into vLLM's event
structs, in order, until the core takes them once per step."""

from __future__ import annotations

from collections.abc import Sequence

from lbd.engine.core.block_hash import BlockKey, external_key_fn
from lbd.wire.kv_events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


class EventRecorder:
    """``lbd.engine.core.kv_cache.CacheListener``; one KV-cache group (index 0), device tier, as vLLM."""

    __slots__ = ("block_size", "events", "_external")

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list[KVCacheEvent] = []
        self._external = external_key_fn()

    def stored(self, keys: list[BlockKey], parent: BlockKey | None, token_ids: Sequence[int]) -> None:
        ext = self._external
        self.events.append(BlockStored(
            block_hashes=[ext(k) for k in keys], parent_block_hash=None if parent is None else ext(parent),
            token_ids=list(token_ids), block_size=self.block_size, lora_id=None, medium=MEDIUM_GPU,
            lora_name=None, group_idx=0))

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
