"""The sim device's adapter slots (lbd.engine.core.sim_lora): LRU among idle slots, a running adapter's slot
never taken, a miss owed to the step (a copy when the CPU cache holds it, else a read), telemetry (which
adapter a load would evict); and a read
from disk off the step loop: the request waits for it, the step is not charged."""

from __future__ import annotations

import time
from types import SimpleNamespace

from lbd.engine.config.lora import LoraFlags
from lbd.engine.core.sim_lora import SimLoras


def _req(loras: SimLoras, name: str) -> SimpleNamespace:
    return SimpleNamespace(lora_id=loras.lookup(name).lora_id, lora_slot=-1)


def test_slots_lru_pins_and_load_time() -> None:
    flags = LoraFlags(enable_lora=True, max_loras=2, max_cpu_loras=3,
                      lora_modules=["a=/x/a", "b=/x/b", "c=/x/c"])
    loras = SimLoras(flags, load_s=0.08, copy_s=0.004)
    a, b, c = (_req(loras, n) for n in "abc")
    assert loras.acquire(a) and loras.acquire(b) and loras.take_owed() == 0.16  # two reads
    assert loras.state([], []).evicts == "a"  # the next load takes the least recently used idle slot
    loras.pin(a)
    loras.pin(b)
    assert loras.state([a, b], []).evicts == ""  # every slot in use
    assert not loras.acquire(c)  # both slots run: c waits
    loras.unpin(a)
    assert loras.acquire(c) and loras.take_owed() == 0.08  # a's idle slot taken
    state = loras.state([b, c], [])
    assert (state.device, state.cpu, state.free_slots, state.running) == (["b", "c"], ["a", "b", "c"], 0,
                                                                          ["b", "c"])
    assert state.evicts == "c"  # b runs: its slot is not taken
    loras.unpin(b)
    assert loras.acquire(a) and loras.take_owed() == 0.004  # back from the CPU cache: a copy
    assert (loras.reads, loras.copies, loras.fills) == (3, 1, 4)
    assert loras.acquire(a) and loras.take_owed() == 0.0  # resident: free


def test_a_read_from_disk_keeps_the_request_waiting_not_the_step() -> None:
    flags = LoraFlags(enable_lora=True, max_loras=1, max_cpu_loras=1, lora_modules=["a=/x/a", "b=/x/b"])
    loras = SimLoras(flags, load_s=0.05, copy_s=0.004)
    a, b = _req(loras, "a"), _req(loras, "b")
    for req in (a, b):
        loras.hold(req)
        assert loras.needs_wait(req)
        loras.waiting.append(req)
    assert loras.take_ready(idle=False) == ([], []) and loras.reads == 2  # both reads under way
    assert loras.unwait(b) and loras.take_ready(idle=False) == ([], [])  # b's client went away
    time.sleep(0.06)
    assert loras.take_ready(idle=True) == ([a], []) and not loras.waiting
    assert loras.acquire(a) and loras.take_owed() == 0.004  # the step pays the copy only
    assert loras.state([a], []).load_seconds["a"] == 0.05
    loras.hold(a)  # in host memory now: no second read
    assert not loras.needs_wait(a) and loras.reads == 2
