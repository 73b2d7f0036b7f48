"""The bookkeeping of a rank's device slots for adapters, shared by the real adapters (``manager``) and the
simulated ones (``lbd.engine.core.sim_lora``), so both evict alike: which adapter holds each slot, the slots
in least recently used order, and how many running requests use each adapter (a slot in use is never taken
over), and the requests waiting for their adapter to reach host memory (the scheduler's gate). Requests are
duck-typed (``lora_id``, ``lora_slot``)."""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Container, Iterable
from typing import Any

from lbd.wire.core_messages import LoraState


class SlotBook:
    def __init__(self, max_loras: int) -> None:
        self.slots: list[int | None] = [None] * max_loras  # slot -> lora_id
        self.slot_lru: OrderedDict[int, int] = OrderedDict()  # lora_id -> slot, least recently used first
        self.users: Counter[int] = Counter()  # running requests per adapter
        self.waiting: list[Any] = []  # requests waiting for their adapter to reach host memory
        self.reads = 0  # adapters read from disk into host memory, since the rank started
        self.fills = 0  # adapters copied into a device slot (slot misses), since the rank started

    def _free_slot(self) -> int | None:
        """An empty slot, else the least recently used one no running request uses (emptied), else None."""
        for slot, owner in enumerate(self.slots):
            if owner is None:
                return slot
        for lora_id, slot in self.slot_lru.items():
            if not self.users[lora_id]:
                del self.slot_lru[lora_id]
                self.slots[slot] = None
                return slot
        return None

    def victim(self) -> int | None:
        """The adapter the next load would take a slot from: the least recently used one no running request
        uses; None when a slot is free or every slot is in use."""
        if None in self.slots:
            return None
        return next((lora_id for lora_id in self.slot_lru if not self.users[lora_id]), None)

    def unwait(self, req: Any) -> bool:
        """Take a waiting request out (its client went away); False if it was not waiting here."""
        if req in self.waiting:
            self.waiting.remove(req)
            return True
        return False

    def _split_waiting(self, in_memory: Container[int], loading: Container[int],
                       failure: Callable[[int], tuple[str, int]]
                       ) -> tuple[list[Any], list[tuple[Any, str, int]]]:
        """The waiting requests whose adapter is ``in_memory`` (ready) and those whose adapter is neither
        there nor ``loading`` (request, ``failure(lora_id)``'s message and status); the rest keep waiting."""
        ready, failed, still = [], [], []
        for req in self.waiting:
            if req.lora_id in in_memory:
                ready.append(req)
            elif req.lora_id in loading:
                still.append(req)
            else:
                failed.append((req, *failure(req.lora_id)))
        self.waiting = still
        return ready, failed

    def pin(self, req: Any) -> None:
        """The request runs: its adapter keeps its slot until ``unpin``."""
        self.users[req.lora_id] += 1
        req.lora_slot = self.slot_lru[req.lora_id]

    def unpin(self, req: Any) -> None:
        if req.lora_slot >= 0:
            req.lora_slot = -1
            self.users[req.lora_id] -= 1
            if self.users[req.lora_id] <= 0:
                del self.users[req.lora_id]

    def residency(self, adapters: Iterable[Any], cpu: Iterable[int], running: list[Any],
                  waiting: list[Any]) -> LoraState:
        """What the stats (/telemetry, /metrics) say: vLLM's running/waiting adapter names plus where each
        registered adapter (``name``, ``lora_id``, ``load_seconds``) is resident, free slots and load times;
        ``cpu``: the ids in host memory."""
        adapters = list(adapters)
        names = {a.lora_id: a.name for a in adapters}
        return LoraState(
            max_lora=len(self.slots),
            running=sorted({names.get(r.lora_id, "") for r in running if r.lora_id} - {""}),
            waiting=sorted({names.get(r.lora_id, "") for r in waiting if r.lora_id} - {""}),
            device=sorted(names[i] for i in self.slot_lru if i in names),
            cpu=sorted(names[i] for i in cpu if i in names),
            free_slots=sum(1 for s in self.slots if s is None),
            evicts=names.get(self.victim(), ""),
            load_seconds={a.name: round(a.load_seconds, 6) for a in adapters if a.load_seconds is not None},
            reads=self.reads, slot_fills=self.fills)
