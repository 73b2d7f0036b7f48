"""One router worker's held requests: strict order across priority bands, a virtual-token-counter fair
queue within one.

A band is a priority class (lower is more important, as vLLM's ``priority``): the dispatcher always takes
from the most important band that holds a request. Within a band each flow (a tenant) has a FIFO, and the
next request comes from the flow with the smallest virtual token counter (``FlowTable.VIRTUAL``: tokens
served over the tenant's weight, shared by every worker), so over time each backlogged tenant is served
tokens in proportion to its weight, whatever the length of its prompts and answers (Sheng et al., "Fairness
in Serving Large Language Models", OSDI 2024). A flow that starts waiting is lifted to the smallest counter
among the band's waiting flows (else the largest of the band's), so time spent idle is not credit.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, eq=False)
class Held:
    """One request waiting in the router."""

    slot: int  # its flow's slot in the FlowTable
    priority: int
    tenant: str
    tokens: int  # prompt tokens (the admission estimate, or exact)
    since: float  # loop time it started waiting
    future: asyncio.Future[bool]  # True: released; False: its deadline or --flow-max-wait-s came
    task: asyncio.Task[Any] | None = None  # its handler (cancelled when its client closes the connection)
    out: Any = None  # its answer (lbd.router.messages.Response), to see the client close


class Bands:
    """The held requests of one worker, by band, then by flow (slot)."""

    def __init__(self) -> None:
        self._bands: dict[int, dict[int, deque[Held]]] = {}
        self._order: list[int] = []  # the bands that hold requests, most important first
        self.count = 0

    def push(self, h: Held) -> None:
        """Hold ``h`` (at the end of its flow's FIFO)."""
        band = self._bands.get(h.priority)
        if band is None:
            band = self._bands[h.priority] = {}
            bisect.insort(self._order, h.priority)
        flow = band.get(h.slot)
        if flow is None:
            flow = band[h.slot] = deque()
        flow.append(h)
        self.count += 1

    def remove(self, h: Held) -> bool:
        """Take ``h`` out (its client left, its deadline passed); False if it is not held."""
        band = self._bands.get(h.priority)
        flow = band.get(h.slot) if band is not None else None
        if flow is None:
            return False
        try:
            flow.remove(h)
        except ValueError:
            return False
        self._taken(h, band, flow)  # type: ignore[arg-type]
        return True

    def _taken(self, h: Held, band: dict[int, deque[Held]], flow: deque[Held]) -> None:
        self.count -= 1
        if not flow:
            del band[h.slot]
            if not band:
                del self._bands[h.priority]
                self._order.remove(h.priority)

    def __iter__(self) -> Iterator[Held]:
        for band in self._bands.values():
            for flow in band.values():
                yield from flow

    def head_band(self) -> int | None:
        """The most important band that holds a request."""
        return self._order[0] if self._order else None

    def ahead(self, priority: int) -> int:
        """Requests held here in ``priority``'s band and the more important ones."""
        n = 0
        for p in self._order:
            if p > priority:
                break
            n += sum(len(f) for f in self._bands[p].values())
        return n

    def holds_before(self, priority: int) -> bool:
        """Something is held here in ``priority``'s band or a more important one."""
        return bool(self._order) and self._order[0] <= priority

    def held_in(self, priority: int, slot: int) -> int:
        """Requests of flow ``slot`` held here in band ``priority``."""
        band = self._bands.get(priority)
        flow = band.get(slot) if band else None
        return len(flow) if flow else 0

    def next_flow(self, priority: int, counter: Callable[[int], float]) -> int | None:
        """The flow band ``priority`` serves next: the one with the smallest counter."""
        band = self._bands.get(priority)
        return min(band, key=counter) if band else None

    def pop(self, priority: int, slot: int) -> Held:
        """The head of flow ``slot`` in band ``priority`` (it holds one: ``next_flow``)."""
        band = self._bands[priority]
        flow = band[slot]
        h = flow.popleft()
        self._taken(h, band, flow)
        return h
