"""The adapters of one rank: registry, host-memory cache (loaded in a thread), device slots, the scheduler's
gate and telemetry.

- Registry: name -> ``Adapter`` (a positive id, its folder, its parent model name). ``--lora-modules`` are
  loaded before the core starts (a bad one stops start-up with the reason); ``/v1/load_lora_adapter``
  registers and loads in the background, and the front end hears the outcome when the thread is done.
- Host cache (``--max-cpu-loras``): loaded adapters, least recently used dropped first, but never one that a
  request in the core still needs (the cache may hold more while all are needed).
- Device slots (``--max-loras``): an adapter is copied into a slot when a waiting request of it is admitted;
  the least recently used slot that no running request uses is taken over; with none, the request waits.
- The gate (vLLM's structured outputs wait the same way for their grammar): a request whose adapter is not
  in host memory waits in ``waiting`` (not in the scheduler's queue) until its load is done; a failed load
  rejects it with the reason. Nothing here blocks the step loop: reading safetensors and building tensors
  happen in the loader thread, the step only copies a loaded adapter into a slot.

Requests are duck-typed (``lora_id``, ``lora_slot``, ``request_id``): this package does not import the core.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from lbd.engine.config.lora import LoraFlags, LoraModule
from lbd.engine.lora.peft import AdapterError, AdapterWeights, ModuleShapes, load_weights, read_spec
from lbd.engine.lora.slot_book import SlotBook
from lbd.engine.lora.slots import LoraDevice
from lbd.wire.core_messages import LoraState

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Load:
    """A load in the loader thread: ``token`` is whom to answer (None: a reload for a queued request)."""

    future: Future
    token: Any
    start: float


@dataclass(slots=True)
class Adapter:
    name: str
    lora_id: int
    path: str
    base_model_name: str | None = None
    load_seconds: float | None = None  # the last load's time (read + check + tensors)


class LoraManager(SlotBook):
    def __init__(self, flags: LoraFlags, device: LoraDevice, shapes: ModuleShapes, num_layers: int,
                 dtype: torch.dtype) -> None:
        SlotBook.__init__(self, flags.max_loras)
        self.flags = flags
        self.device = device
        self.shapes, self.num_layers, self.dtype = shapes, num_layers, dtype
        self.adapters: dict[str, Adapter] = {}
        self.by_id: dict[int, Adapter] = {}
        self._next_id = 1
        self.cpu: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora_id -> weights, LRU first
        self.refs: Counter[int] = Counter()  # requests in the core per adapter
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-load")
        self._loading: dict[int, _Load] = {}
        self._failed: dict[int, AdapterError] = {}
        self._answers: list[tuple[Any, int, str]] = []  # (token, status, message) of finished loads
        self._wake = threading.Event()
        for module in flags.modules:
            adapter = self._register(module)
            try:
                self._store(adapter, self._read(adapter))
            except AdapterError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None

    # ---- registry -------------------------------------------------------------------------------------
    def _register(self, module: LoraModule) -> Adapter:
        adapter = Adapter(module.name, self._next_id, module.path, module.base_model_name)
        self._next_id += 1
        self.adapters[adapter.name] = self.by_id[adapter.lora_id] = adapter
        return adapter

    def _read(self, adapter: Adapter) -> AdapterWeights:
        spec = read_spec(adapter.path, self.flags.max_lora_rank)
        return load_weights(adapter.path, spec, self.shapes, self.num_layers, self.dtype)

    def load(self, module: LoraModule, token: Any) -> None:
        """Register ``module`` and load it in the background; its answer (``take_answers``) carries ``token``.
        A name already registered is loaded again in place (a new id: no block of the old weights is
        reused)."""
        old = self.adapters.get(module.name)
        if old is not None:
            self.remove(module.name)
        self._start_load(self._register(module), token)

    def _start_load(self, adapter: Adapter, token: Any) -> None:
        future = self._pool.submit(self._read, adapter)
        future.add_done_callback(lambda _: self._wake.set())
        self._loading[adapter.lora_id] = _Load(future, token, time.monotonic())

    def remove(self, name: str) -> bool:
        """Unregister ``name`` (False when unknown); requests already in the core finish with it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            return False
        if not self.refs[adapter.lora_id]:
            self._forget(adapter.lora_id)
        return True

    def _forget(self, lora_id: int) -> None:
        self.by_id.pop(lora_id, None)
        self.cpu.pop(lora_id, None)
        slot = self.slot_lru.pop(lora_id, None)
        if slot is not None:
            self.slots[slot] = None

    def lookup(self, name: str) -> Adapter | None:
        return self.adapters.get(name)

    @property
    def busy(self) -> bool:
        return bool(self._loading or self._answers or self.waiting)

    # ---- loads in flight ------------------------------------------------------------------------------
    def poll(self) -> None:
        """Take finished loads into the host cache (or note their failure); queue their answers."""
        if not self._loading:
            return
        self._wake.clear()
        for lora_id, load in list(self._loading.items()):
            if not load.future.done():
                continue
            del self._loading[lora_id]
            adapter = self.by_id.get(lora_id)
            exc = load.future.exception()
            if adapter is None:  # unloaded while it was loading
                exc = AdapterError("the adapter was unloaded while it was loading", 404)
            if exc is None:
                adapter.load_seconds = time.monotonic() - load.start
                self.reads += 1
                self._store(adapter, load.future.result())
                self._failed.pop(lora_id, None)
                if load.token is not None:
                    self._answers.append((load.token, 200,
                                          f"Success: LoRA adapter '{adapter.name}' added successfully."))
                continue
            err = exc if isinstance(exc, AdapterError) else AdapterError(f"loading failed: {exc}", 500)
            self._failed[lora_id] = err  # its queued requests are refused with the reason
            if load.token is not None:  # a refused runtime load is not registered
                if adapter is not None and self.adapters.get(adapter.name) is adapter:
                    del self.adapters[adapter.name]
                self._answers.append((load.token, err.status, err.message))

    def take_answers(self) -> list[tuple[Any, int, str]]:
        self.poll()
        answers, self._answers = self._answers, []
        return answers

    def _store(self, adapter: Adapter, weights: AdapterWeights) -> None:
        if adapter.load_seconds is None:
            adapter.load_seconds = 0.0
        self.cpu[adapter.lora_id] = weights
        self.cpu.move_to_end(adapter.lora_id)
        for lora_id in list(self.cpu):
            if len(self.cpu) <= self.flags.cpu_slots:
                break
            if not self.refs[lora_id] and lora_id not in self.slot_lru:
                del self.cpu[lora_id]

    # ---- the scheduler's gate -------------------------------------------------------------------------
    def hold(self, req: Any) -> None:
        """A request of this adapter entered the core; start its load if the adapter is not in memory."""
        lora_id = req.lora_id
        self.refs[lora_id] += 1
        if lora_id not in self.cpu and lora_id not in self._loading and lora_id in self.by_id:
            self._start_load(self.by_id[lora_id], None)

    def drop(self, req: Any) -> None:
        """A request of this adapter left the core."""
        lora_id = req.lora_id
        self.refs[lora_id] -= 1
        if self.refs[lora_id] <= 0:
            del self.refs[lora_id]
            if lora_id not in {a.lora_id for a in self.adapters.values()}:
                self._forget(lora_id)  # unloaded while it was in use

    def needs_wait(self, req: Any) -> bool:
        return req.lora_id not in self.cpu

    def take_ready(self, idle: bool) -> tuple[list[Any], list[tuple[Any, str, int]]]:
        """Waiting requests whose adapter is loaded, and those whose load failed (request, message,
        status). ``idle``: nothing else to run, so wait a moment for a load rather than spin."""
        if idle and self._loading:
            self._wake.wait(0.005)
        self.poll()
        return self._split_waiting(self.cpu, self._loading, self._failure)

    def _failure(self, lora_id: int) -> tuple[str, int]:
        err = self._failed.get(lora_id) or AdapterError("the adapter was unloaded", 404)
        return f"LoRA adapter could not be loaded: {err.message}", err.status

    def acquire(self, req: Any) -> bool:
        """A device slot for a waiting request's adapter (reused, free, or the least recently used one no
        running request uses, overwritten); False when every slot is in use."""
        lora_id = req.lora_id
        slot = self.slot_lru.get(lora_id)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            weights = self.cpu.get(lora_id)
            if weights is None:
                return False
            self.device.write(slot, weights)
            self.fills += 1
            self.slots[slot] = lora_id
            self.slot_lru[lora_id] = slot
        self.slot_lru.move_to_end(lora_id)
        self.cpu.move_to_end(lora_id)
        return True

    # ---- telemetry ------------------------------------------------------------------------------------
    def state(self, running: list[Any], waiting: list[Any]) -> LoraState:
        """What the stats (/telemetry, /metrics) say: vLLM's running/waiting adapter names plus where each
        adapter is resident, free slots and load times."""
        return self.residency(self.adapters.values(), self.cpu, running, waiting)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
