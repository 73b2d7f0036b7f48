"""When the pool is saturated: the rule flow control holds requests by.

An endpoint that takes traffic has room while all three hold:
- its queued prefill, the prompt tokens of the router's requests there that have not answered a first byte
  (exact, every worker's: ``EndpointSnapshot.unstarted_tokens``), is below
  ``--flow-max-prefill-tokens-per-rank``;
- the waiting requests its engine reports are below ``--flow-max-waiting-per-rank``;
- its KV-cache use is below ``--flow-max-kv-usage``.
The engine's numbers count only while fresh (``--stale-after-ms``); stale, the router's own count decides.
The pool is saturated while no endpoint has room (an empty pool is not: decide answers that request).
The router's count moves the moment a request is dispatched, so a burst cannot overshoot by the telemetry's
age; the engine's numbers catch what the router cannot see (other routers, long prompts in prefill).

Saturated, a request let through because its engine preempts a less important one for it
(--flow-engine-preemption) must reach an endpoint where a less important request holds a seat: at one whose
seats its peers fill (its class or more important ones) it waits like any other. The policy cannot tell
(every saturated endpoint looks alike to it), so ``crowded`` names the endpoints it should pass over: those
with more requests of its class or a more important one in flight than the least such one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from lbd.policies import EndpointSnapshot
from lbd.router.flow.settings import FlowSettings


def room(snap: EndpointSnapshot, s: FlowSettings, stale_s: float) -> str | None:
    """None when ``snap`` has room; else why not (a short label)."""
    if snap.unstarted_tokens >= s.max_prefill_tokens_per_rank:
        return "queued_prefill_tokens"
    if snap.fresh(stale_s):
        if snap.waiting >= s.max_waiting_per_rank:
            return "waiting_requests"
        if snap.kv_usage >= s.max_kv_usage:
            return "kv_usage"
    return None


def saturated(snaps: Iterable[EndpointSnapshot], s: FlowSettings, stale_s: float) -> str | None:
    """None while some endpoint that takes traffic has room (or none takes traffic); else the reason of the
    first one (every one is full)."""
    why = None
    for snap in snaps:
        if not snap.healthy or snap.draining:
            continue
        reason = room(snap, s, stale_s)
        if reason is None:
            return None
        why = why or reason
    return why


def crowded(snaps: Iterable[EndpointSnapshot], placed: Iterable[str | None]) -> list[str]:
    """The endpoints that take traffic and hold more of ``placed`` (the endpoint of each request in flight
    of the class or a more important one) than the one that holds fewest."""
    keys = [snap.key for snap in snaps if snap.healthy and not snap.draining]
    if not keys:
        return []
    counts = Counter(placed)
    low = min(counts[k] for k in keys)
    return [k for k in keys if counts[k] > low]
