"""What one worker's exact KV index costs in memory, estimated from its counts, and its gauges.

Walking the index's objects (``sys.getsizeof`` over every dict entry) would cost as much as the index is big;
the estimate multiplies counts by per-item costs measured with ``tracemalloc`` (benchmarks/kv_index.py):

- an endpoint-block (one engine hash an endpoint holds): its slot in the endpoint's dict, the engine's hash
  and, where another endpoint holds the block too, its own copy of the key;
- a key (a block content held by one endpoint or more): its slots in ``held`` and ``union`` and the key, plus
  the endpoints' bitmask, as wide as the fleet's endpoint bits (one object: ``held`` and ``union`` share it);
- an endpoint: its ``EndpointBlocks`` with no block (the feed and its sockets are not counted).

Each endpoint's share is its own blocks plus the keys' cost spread over the blocks that hold them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from lbd.router.kv.index import BlockIndex

ENTRY_BYTES = 100
KEY_BYTES = 110
ENDPOINT_BYTES = 400


@lru_cache(maxsize=64)
def mask_bytes(width: int) -> float:
    """The mean size of an endpoint bitmask over ``width`` endpoint bits (masks of one bit each)."""
    if width <= 0:
        return 0.0
    return sum(sys.getsizeof(1 << b) if b > 8 else 0 for b in range(width)) / width  # 1..256 are cached


@dataclass(slots=True)
class IndexMemory:
    """The estimate: ``bytes`` in all; ``per_block`` bytes per endpoint-block, the keys' share included."""

    bytes: int
    blocks: int  # endpoint-blocks
    keys: int
    endpoints: int
    per_block: float

    def endpoint_bytes(self, blocks: int) -> int:
        return int(ENDPOINT_BYTES + blocks * self.per_block)


def estimate(index: BlockIndex) -> IndexMemory:
    """The index's memory from its counts: one ``len`` per endpoint."""
    blocks = sum(len(e) for e in index.endpoints)
    keys = len(index.held)
    key_bytes = keys * (KEY_BYTES + mask_bytes(index.width))
    total = len(index.endpoints) * ENDPOINT_BYTES + blocks * ENTRY_BYTES + key_bytes
    per_block = ENTRY_BYTES + key_bytes / blocks if blocks else float(ENTRY_BYTES)
    return IndexMemory(int(total), blocks, keys, len(index.endpoints), per_block)


class IndexCollector(Collector):
    """The index's gauges for the router's /metrics (this worker)."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        m = estimate(self.index)
        yield GaugeMetricFamily(
            "lbd_router_kv_index_bytes",
            "Estimated memory of the exact KV index (counts times measured per-item costs; this worker).",
            value=m.bytes,
        )
        yield GaugeMetricFamily(
            "lbd_router_kv_index_max_blocks",
            "The cap on endpoint-blocks over every endpoint (--kv-index-max-blocks; this worker).",
            value=self.index.max_blocks,
        )
        yield CounterMetricFamily(
            "lbd_router_kv_index_evicted_blocks",
            "Blocks the exact KV index let go of over an endpoint's cap, least recently stored first "
            "(this worker).",
            value=self.index.evicted,
        )
