"""Flow control's entry on the request path (``FlowControl.enter``, then ``leave``), its dispatcher and its
status.

``enter`` (after the facts step, before decide) classifies the request (``lbd.router.flow.identity``) and
either lets it through at once (nothing of its band or a more important one is held, here or in another
worker, and the pool has room: ``lbd.router.flow.saturation``) or holds it (``lbd.router.flow.bands``)
until the dispatcher releases it. Instead of holding, it answers:
- 503 + Retry-After: a sheddable class (``--flow-sheddable-priority`` N: N or a higher number) while the
  pool is saturated;
- 503 + Retry-After: a ``x-lbd-ttft-deadline-ms`` the wait cannot meet (estimated from the queue ahead and
  the recent release rate; at once when the estimate says so, else when the deadline comes while held),
  and a request held ``--flow-max-wait-s``;
- 429 + Retry-After: the queue is full (``--flow-max-queued``, ``--flow-max-queued-per-tenant``).
A held request whose client goes away (its handler is cancelled) leaves the queue at once.

The dispatcher runs while requests are held: whenever a request of this worker ends and every
``--flow-poll-ms``, it releases heads of the most important band, fair within it, while the pool has room,
one at a time: a released request reaches decide and its dispatch (the shared counters the saturation rule
reads) before the next is weighed. Every worker charges the same shared counters (``FlowTable``), and a
worker does not release a band while another worker holds a more important one.

Tokens are charged to the flow's virtual counter as they are known: the prompt at release, the output as it
reaches the client (the answer's ``Meter``, read while requests are held) and at the end.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lbd.common.auth import ApiKey
from lbd.policies import EndpointSnapshot
from lbd.router import shared_flows as T
from lbd.router.flow.bands import Bands, Held
from lbd.router.flow.identity import DEADLINE_HEADER, Who, classify
from lbd.router.flow.saturation import crowded, saturated
from lbd.router.flow.settings import FlowSettings
from lbd.router.gc_policy import handler_cancelled
from lbd.router.messages import Response
from lbd.router.metering import Meter
from lbd.router.routed import Refused, RoutedRequest
from lbd.router.shared_flows import FlowTable

_RATE_WINDOW_S = 5.0  # releases this recent estimate the drain rate
_STUCK_S = 1.0  # held requests and no release for this long: the wait is unbounded
_SWEEP_S = 0.1  # while requests are held: how often output is charged and closed clients looked for
_UNAVAILABLE = "ServiceUnavailableError"
_AFTER_1 = b"Retry-After: 1\r\n"


@dataclass(slots=True, eq=False)
class Ticket:
    """A request flow control let through: what ``leave`` settles."""

    slot: int
    weight: float
    tokens: int  # its prompt's
    meter: Meter | None
    priority: int = 0
    rr: RoutedRequest | None = None  # (where it went: ``rr.sent_to``)
    charged_out: int = 0  # output tokens charged to the flow's counter so far


class FlowControl:
    """One worker's flow control (see the module's docstring)."""

    def __init__(self, snapshots: Callable[[], list[EndpointSnapshot]], stale_s: float,
                 settings: FlowSettings, table: FlowTable) -> None:
        self.snapshots = snapshots  # the pool now (lbd.router.state.RouterState.snapshots)
        self.stale_s = stale_s  # --stale-after-ms
        self.s = settings
        self.table = table
        self.loop = asyncio.get_running_loop()
        self.bands = Bands()
        self._slots: dict[tuple[str, int], int] = {}
        self._known: dict[int, tuple[str, int]] = {}  # slot -> (tenant, priority), claimed by any worker
        self._engaged = settings.mode == "on"
        self._active: set[Ticket] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._releases: deque[float] = deque(maxlen=256)
        self._progress = 0.0  # the last release, or when holding began
        self._sweep_at = 0.0
        self.why: str | None = None  # the last saturation reason the dispatcher saw

    # ---- the entry ---------------------------------------------------------------------------------------
    async def enter(self, rr: RoutedRequest, out: Response, key: ApiKey | None) -> Ticket | Refused | None:
        """Let ``rr`` through (its ticket; None: flow control is not engaged yet), after holding it if the
        pool is saturated; or its refusal."""
        req = rr.request
        if req.method != "POST" or not req.path.startswith("/v1/"):  # (not /tokenize: no engine queue)
            return None
        who = classify(req.headers, rr.data, key)
        if isinstance(who, Refused):
            who.headers = rr.reply_headers
            return who
        slot = self._slot(who)
        if not self.engaged():
            return None
        tokens = max(1, rr.facts.prompt_tokens)
        if not self.bands.holds_before(who.priority) and not self._held_elsewhere(who.priority, True):
            why = self._saturated()
            if why is None:
                return self._let(slot, who, tokens, out, rr)
            if self._preempts(who.priority):  # its engine makes room: not to a rank full of its peers
                if rr.facts.pinned_rank is None:
                    rr.facts.avoid = frozenset(crowded(self.snapshots(), self._placed(who.priority)))
                return self._let(slot, who, tokens, out, rr)
        else:
            why = "requests ahead are held"
        refused = self._refusal(rr, who, slot, why)
        if refused is not None:
            return refused
        return await self._hold(rr, who, slot, tokens, out)

    def _refusal(self, rr: RoutedRequest, who: Who, slot: int, why: str) -> Refused | None:
        """The answer instead of holding, if any: sheddable, a deadline it cannot meet, a full queue."""
        if self.s.sheddable(who.priority):
            self.table.add(slot, T.SHED)
            return Refused(503, f"the pool is saturated ({why}) and priority {who.priority} is sheddable "
                           f"(--flow-sheddable-priority {self.s.sheddable_priority}): retry later",
                           _UNAVAILABLE, None, rr.reply_headers + _AFTER_1)
        if who.deadline_s is not None:
            left = rr.t0 + who.deadline_s - self.loop.time()
            if self._wait_estimate(who.priority) > left:
                self.table.add(slot, T.LATE)
                return self._late(rr, who, "cannot be met: the requests ahead of it in the router would "
                                  "take longer")
        queued, mine = self._queued(who.tenant)
        if queued >= self.s.max_queued or mine >= self.s.max_queued_per_tenant:
            self.table.add(slot, T.FULL)
            which = (f"{queued} requests held (--flow-max-queued)" if queued >= self.s.max_queued
                     else f"tenant {who.tenant} has {mine} requests held (--flow-max-queued-per-tenant)")
            after = max(1, math.ceil(min(60.0, self._wait_estimate(who.priority, whole=True))))
            return Refused(429, f"flow control's queue is full: {which}; retry in {after} s",
                           "RateLimitError", None, rr.reply_headers + b"Retry-After: %d\r\n" % after)
        return None

    def _late(self, rr: RoutedRequest, who: Who, why: str) -> Refused:
        ms = round((who.deadline_s or 0.0) * 1000)
        return Refused(503, f"the time-to-first-token deadline of {ms} ms ({DEADLINE_HEADER}) {why}",
                       _UNAVAILABLE, DEADLINE_HEADER, rr.reply_headers + _AFTER_1)

    async def _hold(self, rr: RoutedRequest, who: Who, slot: int, tokens: int,
                    out: Response) -> Ticket | Refused:
        """Wait for the dispatcher (or the deadline, or --flow-max-wait-s); a cancelled wait (the client
        went away) leaves the queue at once."""
        now = self.loop.time()
        h = Held(slot, who.priority, who.tenant, tokens, now, self.loop.create_future(),
                 asyncio.current_task(), out)
        if not self.bands.count:
            self._progress = now
        if self.table.queued(slot) == 0:  # its flow starts waiting (in any worker)
            self._lift(slot, who.priority)
        self.bands.push(h)
        self.table.add(slot, T.ENQUEUED)
        self._kick()
        until = now + self.s.max_wait_s
        if who.deadline_s is not None:
            until = min(until, rr.t0 + who.deadline_s)
        timer = self.loop.call_at(until, self._expire, h)
        try:
            released = await h.future
        finally:
            timer.cancel()
            if not h.future.done() or h.future.cancelled():  # cancelled: the client went away
                self._drop(h)
            h.task = h.out = None  # (no cycle through a cancelled task's traceback: freed at once)
        if released:
            return self._let(slot, who, tokens, out, rr)
        self.table.add(slot, T.LATE)
        if who.deadline_s is not None and self.loop.time() >= rr.t0 + who.deadline_s - 1e-3:
            return self._late(rr, who, "passed while it was held (the pool stayed saturated)")
        return Refused(503, f"held {self.s.max_wait_s:g} s (--flow-max-wait-s) while the pool stayed "
                       "saturated", _UNAVAILABLE, None, rr.reply_headers + _AFTER_1)

    def _expire(self, h: Held) -> None:
        if not h.future.done():
            self._drop(h)
            h.future.set_result(False)

    def _drop(self, h: Held) -> None:
        """``h`` leaves the queue without being released."""
        if self.bands.remove(h):
            self.table.add(h.slot, T.DEQUEUED)
            self.table.add(h.slot, T.WAIT_US, int((self.loop.time() - h.since) * 1e6))

    def _let(self, slot: int, who: Who, tokens: int, out: Response, rr: RoutedRequest) -> Ticket:
        t = self.table
        t.add(slot, T.DISPATCHED)
        t.add(slot, T.DISPATCHED_TOKENS, tokens)
        t.add(slot, T.VIRTUAL, round(tokens * 1000 / who.weight))
        if out.meter is None:
            out.meter = Meter()  # counts the output that reaches the client (lbd.router.metering)
        ticket = Ticket(slot, who.weight, tokens, out.meter, who.priority, rr)  # type: ignore[arg-type]
        self._active.add(ticket)
        return ticket

    def leave(self, ticket: Ticket | None, move: Any = None) -> None:
        """The request ``ticket`` let through ended, however: its tokens are served and charged."""
        if ticket is None:
            return
        self._active.discard(ticket)
        produced = ticket.meter.produced if ticket.meter is not None else 0
        if move is not None:
            produced = max(produced, len(move.out_ids))
        self.table.add(ticket.slot, T.SERVED_TOKENS, ticket.tokens + produced)
        self.table.add(ticket.slot, T.ENDED)
        self._charge(ticket, produced)
        if self.bands.count:
            self._wake.set()

    def _charge(self, ticket: Ticket, produced: int) -> None:
        more = produced - ticket.charged_out
        if more > 0:
            ticket.charged_out = produced
            self.table.add(ticket.slot, T.VIRTUAL, round(more * 1000 / ticket.weight))

    def _saturated(self) -> str | None:
        return saturated(self.snapshots(), self.s, self.stale_s)

    def _saturated_for(self, priority: int) -> str | None:
        """Why a request of ``priority`` must wait, or None."""
        why = self._saturated()
        return None if why is not None and self._preempts(priority) else why

    def _preempts(self, priority: int) -> bool:
        """With --flow-engine-preemption a request is not held while less important ones run (every
        worker's): its engine preempts one of them for it."""
        return self.s.engine_preemption and any(p > priority and self.table.inflight(i) > 0
                                                for i, (_, p) in self._flows().items())

    def _placed(self, priority: int) -> list[str | None]:
        """Where this worker's requests of class ``priority`` or a more important one in flight went."""
        return [t.rr.sent_to for t in self._active if t.priority <= priority and t.rr is not None]

    # ---- flows --------------------------------------------------------------------------------------------
    def engaged(self) -> bool:
        """On, or auto and more than one flow seen (by any worker)."""
        if not self._engaged and self.s.mode == "auto" and self.table.claimed() > 1:
            self._engaged = True
        return self._engaged

    def _slot(self, who: Who) -> int:
        key = (who.tenant, who.priority)
        slot = self._slots.get(key)
        if slot is None:
            slot = self.table.slot(who.tenant, who.priority, who.weight)
            if slot:  # (the flows past the table's size are not remembered: tenant headers are the client's)
                self._slots[key] = slot
        return slot

    def _flows(self) -> dict[int, tuple[str, int]]:
        """Every claimed slot's (tenant, priority), slot 0 left out (its requests are of any class)."""
        if len(self._known) != self.table.claimed_slots():
            for i in self.table.used():
                if i and i not in self._known:
                    self._known[i] = (self.table.tenant(i), self.table.priority(i))
        return self._known

    def _queued(self, tenant: str) -> tuple[int, int]:
        """Requests held by every worker: all, and ``tenant``'s."""
        total = mine = 0
        for i in [0, *self._flows()]:
            n = self.table.queued(i)
            total += n
            if n and (i == 0 or self._known[i][0] == tenant):
                mine += n
        return total, mine

    def _held_elsewhere(self, priority: int, same_band: bool) -> bool:
        """Another worker holds a request of a more important band (or, with ``same_band``, of this one)."""
        if self.table.workers == 1:
            return False
        limit = priority if same_band else priority - 1
        shared = sum(self.table.queued(i) for i, (_, p) in self._flows().items() if p <= limit)
        return shared > self.bands.ahead(limit)

    def _smaller_elsewhere(self, band: int, slot: int) -> bool:
        """Another worker holds a request of a flow of ``band`` with a smaller counter than ``slot``'s: that
        worker releases it first (every worker obeys the same shares)."""
        table = self.table
        mine = table.virtual(slot)
        for i, (_, p) in self._flows().items():
            if (p == band and i != slot and table.virtual(i) < mine
                    and table.queued(i) > self.bands.held_in(p, i)):
                return True
        return False

    def _lift(self, slot: int, priority: int) -> None:
        """A flow starts waiting: its counter rises to the smallest of the band's waiting flows (else the
        largest of the band's), so time spent idle is not credit."""
        others = [i for i, (_, p) in self._flows().items() if p == priority and i != slot]
        waiting = [self.table.virtual(i) for i in others if self.table.queued(i) > 0]
        if waiting:
            ref = min(waiting)
        elif others:
            ref = max(self.table.virtual(i) for i in others)
        else:
            return
        mine = self.table.virtual(slot)
        if ref > mine:
            self.table.add(slot, T.VIRTUAL, ref - mine)

    def _wait_estimate(self, priority: int, whole: bool = False) -> float:
        """Seconds until a request of ``priority`` arriving now would be released: the requests held ahead
        of it (all workers) over the recent release rate (this worker's, times the workers); 0 when nothing
        is known yet, inf when requests are held and none was released for a while."""
        now = self.loop.time()
        releases = self._releases
        while releases and now - releases[0] > _RATE_WINDOW_S:
            releases.popleft()
        if whole:
            ahead = sum(self.table.queued(i) for i in [0, *self._flows()])
        else:
            ahead = sum(self.table.queued(i) for i, (_, p) in self._flows().items() if p <= priority)
        if not ahead:
            return 0.0
        if self.bands.count and now - self._progress > _STUCK_S:
            return math.inf  # held here, and none released for a while
        if len(releases) < 2:
            return 0.0
        rate = len(releases) / max(1e-3, now - releases[0]) * self.table.workers
        return (ahead + 1) / rate

    # ---- the dispatcher -----------------------------------------------------------------------------------
    def _kick(self) -> None:
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run(), name="flow-dispatcher")

    async def _run(self) -> None:
        """Release held requests while the pool has room; sleep while nothing is held."""
        while True:
            if not self.bands.count:
                self._wake.clear()
                await self._wake.wait()
                continue
            now = self.loop.time()
            if now >= self._sweep_at:  # every _SWEEP_S: output as known (before the fair order reads the
                self._sweep_at = now + _SWEEP_S  # counters), held clients that closed
                for ticket in self._active:
                    if ticket.meter is not None:
                        self._charge(ticket, ticket.meter.produced)
                self._sweep()
            await self._release()
            self._wake.clear()
            try:
                async with asyncio.timeout(self.s.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass

    async def _release(self) -> None:
        """Release heads of the most important band, one at a time, while the pool has room."""
        table = self.table
        while (band := self.bands.head_band()) is not None:
            if self._held_elsewhere(band, False):
                self.why = "a more important band is held by another worker"
                return
            self.why = self._saturated_for(band)
            if self.why is not None:
                return
            slot = self.bands.next_flow(band, table.virtual)
            if slot is None:
                return
            if table.workers > 1 and self._smaller_elsewhere(band, slot):
                self.why = "a flow with a smaller share waits in another worker"
                return
            h = self.bands.pop(band, slot)
            now = self.loop.time()
            table.add(h.slot, T.DEQUEUED)
            table.add(h.slot, T.WAIT_US, int((now - h.since) * 1e6))
            self._releases.append(now)
            self._progress = now
            h.future.set_result(True)
            await asyncio.sleep(0)  # it runs to its dispatch (shared counters) before the next is weighed

    def _sweep(self) -> None:
        """Cancel the handlers of held requests whose clients closed their connection: a held request writes
        nothing, so its socket cannot show the client gone (the cancelled wait leaves the queue)."""
        for h in [h for h in self.bands if h.out is not None and h.out.client_eof]:
            if h.task is not None:
                h.task.cancel()
                handler_cancelled(self.loop)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    # ---- what it shows ----------------------------------------------------------------------------------
    def rows(self) -> list[T.FlowRow]:
        return [self.table.row(i) for i in self.table.used()]

    def status(self) -> dict[str, object]:
        """/router/status's ``flow`` section: every flow's counters (all workers) and this worker's view."""
        return {
            "mode": self.s.mode,
            "engaged": self.engaged(),
            "saturated": self._saturated(),
            "held_here": self.bands.count,
            "flows": [{"tenant": r.tenant, "priority": r.priority, "weight": r.weight, "queued": r.queued,
                       "wait_s_mean": round(r.wait_s / r.dispatched, 4) if r.dispatched else 0.0,
                       "dispatched": r.dispatched, "dispatched_tokens": r.dispatched_tokens,
                       "served_tokens": r.served_tokens, "virtual_tokens": round(r.virtual, 1),
                       "shed": {"sheddable": r.shed, "queue_full": r.full, "late": r.late}}
                      for r in self.rows()],
        }
