"""Dispatch counters shared by every router worker, so N workers see the load all of them put on a rank.

Each worker writes only its own row of monotonic counters per endpoint slot (dispatched, finished, started,
and the prefill tokens of dispatched and started requests); readers sum the rows. Monotonic counters make the
between-scrape delta exact across workers: a worker notes the sums when a scrape of a rank begins, and
``(dispatched - d0) - (finished - f0)`` later is the net change that scrape cannot have seen, whichever worker
caused it. The memory is an anonymous shared mapping made before the workers fork; slots are claimed by URL
under a lock (rare: when an endpoint is first seen). A worker that dies has its row closed out by the parent
(its requests died with its connections), so the sums stay right.

Slots are freed, so a fleet that churns (pod IPs, Ray ports) never runs out: each worker marks the slots it
holds (a sixth field of its row), and ``release`` (the endpoint left this worker's table) clears its mark. A
slot no worker holds and with nothing in flight in any row is free: its counters are zeroed and its URL
becomes a tombstone (``_FREED``: lookups probe past it, claims reuse it). A slot released while requests
still run there is freed by the first claim that finds it idle. The table is open addressing over URL ids,
so a freed slot in the middle of a probe chain must not end lookups of the URLs after it: hence the
tombstone, not the empty mark.
"""

from __future__ import annotations

import mmap
import multiprocessing
import zlib
from dataclasses import dataclass

from lbd.router.shared_flows import FlowTable

DISPATCHED, FINISHED, STARTED, DISPATCHED_TOKENS, STARTED_TOKENS, HELD = range(6)
COUNTERS = 5  # the monotonic ones; HELD is 1 while this worker's table has the slot's endpoint
FIELDS = 6
_EMPTY = 0  # never used: a lookup ends here
_FREED = -1  # used, then freed: a lookup probes past it, a claim may take it


@dataclass(slots=True)
class Totals:
    dispatched: int
    finished: int
    started: int
    dispatched_tokens: int
    started_tokens: int

    @property
    def inflight(self) -> int:
        return self.dispatched - self.finished

    @property
    def unstarted(self) -> int:
        return self.dispatched - self.started

    @property
    def unstarted_tokens(self) -> int:
        return self.dispatched_tokens - self.started_tokens


def _url_id(url: str) -> int:
    """A non-zero 63-bit id for a URL (zero marks a free slot)."""
    data = url.encode()
    return ((zlib.crc32(data) << 31) ^ zlib.adler32(data)) & ((1 << 63) - 1) or 1


class SharedCounters:
    """``workers`` rows x ``slots`` endpoint slots x 6 int64 fields in one shared anonymous mapping."""

    def __init__(self, workers: int = 1, slots: int = 1024) -> None:
        self.workers, self.slots = workers, slots
        self._mm = mmap.mmap(-1, 8 * (slots + workers * slots * FIELDS))  # MAP_SHARED: survives fork
        self._q = memoryview(self._mm).cast("q")
        self._lock = multiprocessing.get_context("fork").Lock()
        self.worker = 0
        self.flows = FlowTable(workers)  # flow control's counters per tenant and class (lbd.router.flow)

    def bind_worker(self, worker: int) -> None:
        """Called in each worker after the fork: which row this process writes."""
        self.worker = worker
        self.flows.bind_worker(worker)

    def slot(self, url: str) -> int:
        """The slot of ``url``, claimed on first use and held by this worker until ``release``; -1 when every
        slot is held or busy (counts stay local)."""
        want = _url_id(url)
        start = want % self.slots
        q = self._q
        with self._lock:
            free = -1
            for step in range(self.slots):
                i = (start + step) % self.slots
                if q[i] == want:
                    q[self._base(self.worker, i) + HELD] = 1
                    return i
                if q[i] == _EMPTY:
                    free = i if free < 0 else free
                    break
                if free < 0 and (q[i] == _FREED or self._idle(i)):
                    free = i
            if free < 0:
                return -1
            if q[free] != _EMPTY:
                self._zero(free)  # a tombstone, or a released slot whose last requests have ended since
            q[free] = want
            q[self._base(self.worker, free) + HELD] = 1
            return free

    def release(self, slot: int) -> None:
        """This worker's table no longer has the endpoint of ``slot``: the slot is freed once no worker holds
        it and nothing is in flight there (now, or at a later claim that finds it so)."""
        if slot < 0:
            return
        with self._lock:
            self._q[self._base(self.worker, slot) + HELD] = 0
            if self._idle(slot):
                self._zero(slot)
                self._q[slot] = _FREED

    def _idle(self, slot: int) -> bool:
        """No worker holds ``slot`` and none has a request in flight there (under the lock)."""
        q = self._q
        for w in range(self.workers):
            base = self._base(w, slot)
            if q[base + HELD] or q[base + DISPATCHED] != q[base + FINISHED]:
                return False
        return True

    def _zero(self, slot: int) -> None:
        for w in range(self.workers):
            base = self._base(w, slot)
            for f in range(FIELDS):
                self._q[base + f] = 0

    def held(self) -> int:
        """Slots some worker holds (for tests and status)."""
        return sum(1 for i in range(self.slots) if self._q[i] not in (_EMPTY, _FREED) and not self._idle(i))

    def _base(self, worker: int, slot: int) -> int:
        return self.slots + (worker * self.slots + slot) * FIELDS

    def add(self, slot: int, field: int, amount: int = 1) -> None:
        i = self._base(self.worker, slot) + field
        self._q[i] += amount

    # dispatch/start/finish/sums run on every request: the row offset is computed inline, not via _base.
    def dispatch(self, slot: int, tokens: int) -> None:
        q, base = self._q, self.slots * (1 + self.worker * FIELDS) + slot * FIELDS
        q[base + DISPATCHED] += 1
        q[base + DISPATCHED_TOKENS] += tokens

    def start(self, slot: int, tokens: int) -> None:
        q, base = self._q, self.slots * (1 + self.worker * FIELDS) + slot * FIELDS
        q[base + STARTED] += 1
        q[base + STARTED_TOKENS] += tokens

    def finish(self, slot: int) -> None:
        self._q[self.slots * (1 + self.worker * FIELDS) + slot * FIELDS + FINISHED] += 1

    def sums(self, slot: int) -> tuple[int, int, int, int, int]:
        """(dispatched, finished, started, dispatched_tokens, started_tokens) summed over the workers."""
        q = self._q
        base = self.slots + slot * FIELDS
        if self.workers == 1:
            return q[base], q[base + 1], q[base + 2], q[base + 3], q[base + 4]
        d = f = s = dt = st = 0
        step = self.slots * FIELDS
        for _ in range(self.workers):
            d += q[base]
            f += q[base + 1]
            s += q[base + 2]
            dt += q[base + 3]
            st += q[base + 4]
            base += step
        return d, f, s, dt, st

    def totals(self, slot: int) -> Totals:
        q = self._q
        sums = [0] * COUNTERS
        for w in range(self.workers):
            base = self._base(w, slot)
            for f in range(COUNTERS):
                sums[f] += q[base + f]
        return Totals(*sums)

    def close_out(self, worker: int) -> None:
        """A dead worker's requests are gone: mark every one finished and started, and its slots not held by
        it (its successor claims what it needs again) (parent side)."""
        q = self._q
        for slot in range(self.slots):
            base = self._base(worker, slot)
            q[base + FINISHED] = q[base + DISPATCHED]
            q[base + STARTED] = q[base + DISPATCHED]
            q[base + STARTED_TOKENS] = q[base + DISPATCHED_TOKENS]
            q[base + HELD] = 0
        self.flows.close_out(worker)
