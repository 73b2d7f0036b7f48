"""Pending prefixes shared by every router worker (``--workers N``).

Each worker follows the KV events itself, but a block only appears in the events once an engine has
computed it; until then only the worker that dispatched the request knows the prefix is on its way. Two
requests sharing a new prefix that land on two workers would otherwise both compute it, on two ranks. So a
worker also writes, for each request it sends, *checkpoints* of the blocks the rank will compute (every 8th
block of the chain and the last) into this table in shared memory, and removes them after the first byte;
the other workers read them. A checkpoint at chain position p on endpoint slot s means s will hold the
chain's first p + 1 blocks.

Layout: an open-addressing table of ``capacity`` entries of four int64 (key, slot + 1, count, expiry in
monotonic ms) in an anonymous shared mapping made before the workers fork; writers take one lock per
request, readers take none (a torn read can only misroute one request). Entries expire after ``ttl_s``, so a
dead worker's entries go away by themselves; 2^17 entries (4 MiB) hold ~8,000 requests in prefill at once.
"""

from __future__ import annotations

import mmap
import multiprocessing
import time
from collections.abc import Sequence

EVERY = 8  # checkpoint spacing, in blocks
MAX_PROBE = 128  # a key is looked for this far from its home entry (a crowded table drops new entries)
_EMPTY, _TOMB = 0, -1
_FIELDS = 4


def checkpoints(start: int, n: int) -> list[int]:
    """Chain positions among ``start .. n-1`` that carry a checkpoint."""
    out = [p for p in range(start, n) if (p + 1) % EVERY == 0]
    if n > start and (not out or out[-1] != n - 1):
        out.append(n - 1)
    return out


class SharedPending:
    def __init__(self, capacity: int = 1 << 17, ttl_s: float = 60.0) -> None:
        self.capacity = capacity
        self.ttl_ms = int(ttl_s * 1000)
        self._mm = mmap.mmap(-1, 8 * _FIELDS * capacity)
        self._q = memoryview(self._mm).cast("q")
        self._lock = multiprocessing.get_context("fork").Lock()

    @staticmethod
    def _now() -> int:
        return int(time.monotonic() * 1000)

    def _home(self, key: int) -> int:
        return (key * 0x9E3779B1 & 0x7FFFFFFF) % self.capacity

    def add(self, keys: Sequence[int], slot: int) -> None:
        q, cap, now = self._q, self.capacity, self._now()
        with self._lock:
            for key in keys:
                key = key or 1  # 0 marks an empty entry
                i, free = self._home(key), -1
                for _ in range(min(cap, MAX_PROBE)):
                    base = i * _FIELDS
                    k = q[base]
                    if k == key and q[base + 1] == slot + 1:
                        q[base + 2] += 1
                        q[base + 3] = now + self.ttl_ms
                        break
                    if free < 0 and (k == _TOMB or (k != _EMPTY and q[base + 3] < now)):
                        free = i
                    if k == _EMPTY:
                        free = i if free < 0 else free
                        self._put(free, key, slot, now)
                        break
                    i = (i + 1) % cap
                else:
                    if free >= 0:
                        self._put(free, key, slot, now)

    def _put(self, i: int, key: int, slot: int, now: int) -> None:
        q, base = self._q, i * _FIELDS
        q[base + 1], q[base + 2], q[base + 3] = slot + 1, 1, now + self.ttl_ms
        q[base] = key

    def remove(self, keys: Sequence[int], slot: int) -> None:
        q, cap = self._q, self.capacity
        with self._lock:
            for key in keys:
                key = key or 1
                i = self._home(key)
                for _ in range(min(cap, MAX_PROBE)):
                    base = i * _FIELDS
                    k = q[base]
                    if k == _EMPTY:
                        break
                    if k == key and q[base + 1] == slot + 1:
                        q[base + 2] -= 1
                        if q[base + 2] <= 0:
                            q[base] = _TOMB
                        break
                    i = (i + 1) % cap

    def slots(self, key: int) -> list[int]:
        """Endpoint slots with ``key`` pending now."""
        q, cap, now = self._q, self.capacity, self._now()
        key = key or 1
        i, out = self._home(key), []
        for _ in range(min(cap, MAX_PROBE)):
            base = i * _FIELDS
            k = q[base]
            if k == _EMPTY:
                break
            if k == key and q[base + 2] > 0 and q[base + 3] >= now:
                out.append(q[base + 1] - 1)
            i = (i + 1) % cap
        return out
