"""Flow counters every router worker shares: one slot per flow (tenant x priority class), so the queue
depths, the fair shares' virtual token counters and the served tokens are the deployment's, not a worker's.

Like ``lbd.router.shared.SharedCounters``: an anonymous shared mapping made before the workers fork; each
worker writes only its own row of monotonic counters per slot and readers sum the rows (a dead worker's row
is closed out by the parent: its held requests left the queue with it). A slot's identity (its tenant name,
class and weight) is written once, when the first worker claims it, under a lock; lookups are open
addressing over an id of (tenant, class). Slots are never freed: the table holds ``slots`` flows and slot 0
takes every flow past that (``OTHER``), so hostile tenant headers cannot grow it.

The virtual token counter (``VIRTUAL``, in thousandths of a token per unit of weight) is what the fair
queue orders a band's flows by (``lbd.router.flow.bands``): it grows by a dispatched request's prompt and
output tokens over its tenant's weight, and by the lifts that keep an idle flow from banking credit.
"""

from __future__ import annotations

import mmap
import multiprocessing
import zlib
from dataclasses import dataclass

(ENQUEUED, DEQUEUED, DISPATCHED, DISPATCHED_TOKENS, SERVED_TOKENS, WAIT_US, VIRTUAL, SHED, FULL, LATE,
 ENDED) = range(11)
FIELDS = 11
NAME_BYTES = 64
OTHER = "~other"  # slot 0: the flows past the table's size
_EMPTY = 0
_HEAD = 2  # q[0]: flows claimed; q[1]: unused


@dataclass(slots=True)
class FlowRow:
    """One flow's counters summed over the workers."""

    slot: int
    tenant: str
    priority: int
    weight: float
    queued: int
    dispatched: int
    dispatched_tokens: int
    served_tokens: int
    wait_s: float
    virtual: float  # tokens per unit of weight
    shed: int
    full: int
    late: int
    inflight: int  # let through and not ended yet


def _flow_id(tenant: str, priority: int) -> int:
    data = f"{priority}\x00{tenant}".encode()
    return ((zlib.crc32(data) << 31) ^ zlib.adler32(data)) & ((1 << 63) - 1) or 1


class FlowTable:
    """``slots`` flows: their ids, classes, weights and names, and ``workers`` rows of ``FIELDS`` counters."""

    def __init__(self, workers: int = 1, slots: int = 256) -> None:
        self.workers, self.slots = workers, slots
        ints = _HEAD + slots * 3 + workers * slots * FIELDS  # ids, priorities, weights (x1000), rows
        self._ints = ints
        self._mm = mmap.mmap(-1, 8 * ints + NAME_BYTES * slots)
        self._q = memoryview(self._mm)[: 8 * ints].cast("q")
        self._names = memoryview(self._mm)[8 * ints:]
        self._lock = multiprocessing.get_context("fork").Lock()
        self.worker = 0
        self._write_identity(0, _flow_id(OTHER, 0), OTHER, 0, 1.0)
        self._q[0] = 1

    def bind_worker(self, worker: int) -> None:
        self.worker = worker

    # ---- identity ---------------------------------------------------------------------------------------
    def claimed(self) -> int:
        """Flows seen so far, all workers (``~other`` counts once it is used)."""
        return self._q[0] - 1 + (1 if self.total(0, ENQUEUED) or self.total(0, DISPATCHED) else 0)

    def claimed_slots(self) -> int:
        """Slots 1.. claimed so far."""
        return self._q[0] - 1

    def slot(self, tenant: str, priority: int, weight: float) -> int:
        """The slot of flow (``tenant``, ``priority``), claimed on first use; 0 when the table is full."""
        want = _flow_id(tenant, priority)
        q, n = self._q, self.slots - 1
        with self._lock:
            for step in range(n):
                i = 1 + (want + step) % n
                if q[_HEAD + i] == want:
                    return i
                if q[_HEAD + i] == _EMPTY:
                    self._write_identity(i, want, tenant, priority, weight)
                    q[0] += 1
                    return i
        return 0

    def _write_identity(self, i: int, fid: int, tenant: str, priority: int, weight: float) -> None:
        raw = tenant.encode()[:NAME_BYTES]
        self._names[i * NAME_BYTES:(i + 1) * NAME_BYTES] = raw.ljust(NAME_BYTES, b"\0")
        q = self._q
        q[_HEAD + self.slots + i] = priority
        q[_HEAD + 2 * self.slots + i] = round(weight * 1000)
        q[_HEAD + i] = fid  # last: a reader that sees the id sees the rest

    def used(self) -> list[int]:
        """The claimed slots (slot 0 included once used)."""
        q = self._q
        out = [i for i in range(1, self.slots) if q[_HEAD + i] != _EMPTY]
        if self.total(0, ENQUEUED) or self.total(0, DISPATCHED):
            out.insert(0, 0)
        return out

    def tenant(self, i: int) -> str:
        return bytes(self._names[i * NAME_BYTES:(i + 1) * NAME_BYTES]).rstrip(b"\0").decode(errors="replace")

    def priority(self, i: int) -> int:
        return self._q[_HEAD + self.slots + i]

    def weight(self, i: int) -> float:
        return self._q[_HEAD + 2 * self.slots + i] / 1000

    # ---- counters ---------------------------------------------------------------------------------------
    def _base(self, worker: int, slot: int) -> int:
        return _HEAD + 3 * self.slots + (worker * self.slots + slot) * FIELDS

    def add(self, slot: int, field: int, amount: int = 1) -> None:
        self._q[self._base(self.worker, slot) + field] += amount

    def total(self, slot: int, field: int) -> int:
        """``field`` of ``slot`` summed over the workers."""
        q, step = self._q, self.slots * FIELDS
        i = self._base(0, slot) + field
        n = 0
        for _ in range(self.workers):
            n += q[i]
            i += step
        return n

    def queued(self, slot: int) -> int:
        return self.total(slot, ENQUEUED) - self.total(slot, DEQUEUED)

    def inflight(self, slot: int) -> int:
        return self.total(slot, DISPATCHED) - self.total(slot, ENDED)

    def virtual(self, slot: int) -> int:
        return self.total(slot, VIRTUAL)

    def row(self, slot: int) -> FlowRow:
        t = [self.total(slot, f) for f in range(FIELDS)]
        return FlowRow(slot, self.tenant(slot), self.priority(slot), self.weight(slot),
                       t[ENQUEUED] - t[DEQUEUED], t[DISPATCHED], t[DISPATCHED_TOKENS], t[SERVED_TOKENS],
                       t[WAIT_US] / 1e6, t[VIRTUAL] / 1000, t[SHED], t[FULL], t[LATE],
                       t[DISPATCHED] - t[ENDED])

    def close_out(self, worker: int) -> None:
        """A dead worker's requests are gone: its row's queue is emptied, its requests ended (parent side)."""
        for slot in range(self.slots):
            base = self._base(worker, slot)
            self._q[base + DEQUEUED] = self._q[base + ENQUEUED]
            self._q[base + ENDED] = self._q[base + DISPATCHED]
