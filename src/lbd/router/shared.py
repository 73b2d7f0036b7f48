"""Dispatch counters shared by every router worker, so N workers see the load all of them put on a rank.

Each worker writes only its own row of monotonic counters per endpoint slot (dispatched, finished, started,
and the prefill tokens of dispatched and started requests); readers sum the rows. Monotonic counters make the
between-scrape delta exact across workers: a worker notes the sums when a scrape of a rank begins, and
``(dispatched - d0) - (finished - f0)`` later is the net change that scrape cannot have seen, whichever worker
caused it. The memory is an anonymous shared mapping made before the workers fork; slots are claimed by URL
under a lock (rare: when an endpoint is first seen). A worker that dies has its row closed out by the parent
(its requests died with its connections), so the sums stay right.
"""

from __future__ import annotations

import mmap
import multiprocessing
import zlib
from dataclasses import dataclass

DISPATCHED, FINISHED, STARTED, DISPATCHED_TOKENS, STARTED_TOKENS = range(5)
FIELDS = 5
_EMPTY = 0


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
    """``workers`` rows x ``slots`` endpoint slots x 5 int64 counters in one shared anonymous mapping."""

    def __init__(self, workers: int = 1, slots: int = 1024) -> None:
        self.workers, self.slots = workers, slots
        self._mm = mmap.mmap(-1, 8 * (slots + workers * slots * FIELDS))  # MAP_SHARED: survives fork
        self._q = memoryview(self._mm).cast("q")
        self._lock = multiprocessing.get_context("fork").Lock()
        self.worker = 0

    def bind_worker(self, worker: int) -> None:
        """Called in each worker after the fork: which row this process writes."""
        self.worker = worker

    def slot(self, url: str) -> int:
        """The slot of ``url``, claimed on first use; -1 when the table is full (counts stay local)."""
        want = _url_id(url)
        start = want % self.slots
        with self._lock:
            for step in range(self.slots):
                i = (start + step) % self.slots
                if self._q[i] == want:
                    return i
                if self._q[i] == _EMPTY:
                    self._q[i] = want
                    return i
        return -1

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
        sums = [0] * FIELDS
        for w in range(self.workers):
            base = self._base(w, slot)
            for f in range(FIELDS):
                sums[f] += q[base + f]
        return Totals(*sums)

    def close_out(self, worker: int) -> None:
        """A dead worker's requests are gone: mark every one finished and started (parent side)."""
        q = self._q
        for slot in range(self.slots):
            base = self._base(worker, slot)
            q[base + FINISHED] = q[base + DISPATCHED]
            q[base + STARTED] = q[base + DISPATCHED]
            q[base + STARTED_TOKENS] = q[base + DISPATCHED_TOKENS]
