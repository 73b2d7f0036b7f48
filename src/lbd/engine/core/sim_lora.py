"""LoRA adapters on the simulated device (``--device sim --enable-lora``): slots, a CPU cache and load time,
without weights, so adapter placement can be measured on many sim ranks (benchmarks/lora_routing.py).

The same interface as ``lbd.engine.lora.manager.LoraManager`` (the core and scheduler call it alike), and the
same telemetry (``LoraState``: device, cpu, free slots, load seconds), so routers see a sim rank's adapters as
they see a real one's. What it models, as lbd's engine does it:
- ``--max-loras`` device slots, least recently used taken over (never one a running request uses: the request
  waits, as on a real rank);
- a CPU cache of ``--max-cpu-loras`` adapters (LRU; an adapter in a slot stays in it, and so does one that
  requests wait for);
- a read from disk off the step loop: a request whose adapter is not in the CPU cache waits
  ``SimProfile.lora_load_s`` in ``waiting`` while the other requests run (the real manager reads in a
  thread), then joins the queue;
- the copy into a slot, charged to the step that admits the request (``SimRunner.execute`` sleeps it):
  ``SimProfile.lora_copy_s`` (``lora_load_s`` if the adapter left the CPU cache in between).
Adapters named by ``--lora-modules`` or loaded at run time are registered by name; their folders are not read.
Each read and each copy is logged at INFO (``sim lora: read``, ``sim lora: copy``) and counted like a real
rank's (``reads``, ``fills``: ``lbd:lora_reads_total``, ``lbd:lora_slot_fills_total``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from lbd.engine.config.lora import LoraModule
from lbd.engine.lora.slot_book import SlotBook
from lbd.wire.core_messages import LoraState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SimAdapter:
    name: str
    lora_id: int
    path: str
    base_model_name: str | None = None
    load_seconds: float | None = None


class SimLoras(SlotBook):
    """A sim rank's adapters: registry, CPU LRU, device slots and the load time owed to the next step."""

    def __init__(self, flags: Any, load_s: float, copy_s: float) -> None:
        SlotBook.__init__(self, flags.max_loras)
        self.flags, self.load_s, self.copy_s = flags, load_s, copy_s
        self.adapters: dict[str, SimAdapter] = {}
        self.by_id: dict[int, SimAdapter] = {}
        self._next_id = 1
        self.cpu: OrderedDict[int, None] = OrderedDict()  # lora_id, least recently used first
        self.reading: dict[int, float] = {}  # lora_id -> when its read from disk is done (monotonic)
        self.owed_s = 0.0  # load time the next step sleeps
        self.copies = 0
        self._answers: list[tuple[Any, int, str]] = []
        for module in flags.modules:
            self._register(module)

    def _register(self, module: LoraModule) -> SimAdapter:
        adapter = SimAdapter(module.name, self._next_id, module.path, module.base_model_name)
        self._next_id += 1
        self.adapters[adapter.name] = self.by_id[adapter.lora_id] = adapter
        return adapter

    # ---- the registry (/v1/load_lora_adapter, /v1/unload_lora_adapter) ----------------------------------
    def lookup(self, name: str) -> SimAdapter | None:
        return self.adapters.get(name)

    def load(self, module: LoraModule, token: Any) -> None:
        """Register ``module`` (its load is charged when a request first needs it) and answer at once."""
        if module.name in self.adapters:
            self.remove(module.name)
        self._register(module)
        self._answers.append((token, 200, f"Success: LoRA adapter '{module.name}' added successfully."))

    def remove(self, name: str) -> bool:
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return False
        self.by_id.pop(adapter.lora_id, None)
        self.cpu.pop(adapter.lora_id, None)
        self.reading.pop(adapter.lora_id, None)
        if not self.users[adapter.lora_id]:
            slot = self.slot_lru.pop(adapter.lora_id, None)
            if slot is not None:
                self.slots[slot] = None
        return True

    @property
    def busy(self) -> bool:
        return bool(self._answers)

    def take_answers(self) -> list[tuple[Any, int, str]]:
        answers, self._answers = self._answers, []
        return answers

    # ---- the scheduler's gate ---------------------------------------------------------------------------
    def hold(self, req: Any) -> None:
        """A request of this adapter entered the core: start its read if it is not in host memory."""
        lora_id = req.lora_id
        adapter = self.by_id.get(lora_id)
        if lora_id not in self.cpu and lora_id not in self.reading and adapter is not None:
            self.reading[lora_id] = time.monotonic() + self.load_s
            self.reads += 1
            logger.info("sim lora: read %s from disk (%.3f s, off the step loop; %d reads)", adapter.name,
                        self.load_s, self.reads)

    def drop(self, req: Any) -> None:
        pass

    def needs_wait(self, req: Any) -> bool:
        return req.lora_id not in self.cpu

    def take_ready(self, idle: bool) -> tuple[list[Any], list[tuple[Any, str, int]]]:
        """Waiting requests whose adapter's read is done, and those whose adapter was unloaded meanwhile
        (request, message, status). ``idle``: nothing else to run, so wait a moment rather than spin."""
        now = time.monotonic()
        if idle and self.reading:
            time.sleep(min(0.005, max(0.0, min(self.reading.values()) - now)))
            now = time.monotonic()
        for lora_id, done_at in list(self.reading.items()):
            if done_at <= now:
                del self.reading[lora_id]
                self._cache(lora_id)
                adapter = self.by_id.get(lora_id)
                if adapter is not None:
                    adapter.load_seconds = self.load_s
        return self._split_waiting(self.cpu, self.reading, _unloaded)

    def acquire(self, req: Any) -> bool:
        """A slot for the request's adapter: held, free, or the least recently used idle one (its load time
        owed to this step); False when every slot is in use."""
        lora_id = req.lora_id
        if lora_id not in self.slot_lru:
            slot = self._free_slot()
            if slot is None:
                return False
            self._fill(slot, lora_id)
        self.slot_lru.move_to_end(lora_id)
        return True

    def _fill(self, slot: int, lora_id: int) -> None:
        """Put ``lora_id`` into ``slot``: a copy from host memory, owed to this step (a read too if it left
        the CPU cache since its requests were let in)."""
        adapter = self.by_id.get(lora_id)
        name = adapter.name if adapter is not None else str(lora_id)
        if lora_id in self.cpu:
            cost = self.copy_s
            self.copies += 1
            logger.info("sim lora: copy %s into slot %d (%.3f s in the step; %d copies)", name, slot, cost,
                        self.copies)
        else:
            cost = self.load_s
            self.reads += 1
            if adapter is not None:
                adapter.load_seconds = cost
            logger.info("sim lora: read %s into slot %d (%.3f s in the step; %d reads)", name, slot, cost,
                        self.reads)
        self.owed_s += cost
        self.fills += 1
        self.slots[slot] = lora_id
        self.slot_lru[lora_id] = slot
        self._cache(lora_id)

    def _cache(self, lora_id: int) -> None:
        """``lora_id`` is in host memory (most recently used); the least recently used adapters leave it past
        ``--max-cpu-loras``, except those in a slot or waited for."""
        self.cpu[lora_id] = None
        self.cpu.move_to_end(lora_id)
        wanted = {r.lora_id for r in self.waiting}
        for old in list(self.cpu):
            if len(self.cpu) <= max(self.flags.cpu_slots, len(self.slot_lru)):
                break
            if old not in self.slot_lru and old not in wanted:
                del self.cpu[old]

    def take_owed(self) -> float:
        """The load time the step that admitted new adapters sleeps (and forget it)."""
        owed, self.owed_s = self.owed_s, 0.0
        return owed

    # ---- telemetry --------------------------------------------------------------------------------------
    def state(self, running: list[Any], waiting: list[Any]) -> LoraState:
        return self.residency(self.adapters.values(), self.cpu, running, waiting)

    def close(self) -> None:
        pass


def _unloaded(lora_id: int) -> tuple[str, int]:
    return "LoRA adapter could not be loaded: the adapter was unloaded", 404
