"""Waiting for a draining rank to go idle, for a planned restart (``Command.DRAIN``) and for a rank a shrink
retires (``lbd.supervisor.scale``). The rank is already in state ``draining``, so routers stop sending it new
requests; it keeps that state at least ``DRAIN_SETTLE_S`` (routers polling /status must see it before it
stops) and at most the drain timeout, and the wait ends early once the rank has no request in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from lbd.supervisor.probe import Prober

DRAIN_POLL_S = 0.2  # how often a draining rank's in-flight count is read
DRAIN_SETTLE_S = 1.0  # least time in `draining`, so routers polling /status see it before the restart

# waits up to the given seconds; True when the rank's process ended meanwhile (nothing left to drain)
GoneWithin = Callable[[float], Awaitable[bool]]


async def until_idle(
    prober: Prober, url: str, timeout_s: float, gone_within: GoneWithin | None = None
) -> bool:
    """True once the rank at ``url`` has no request in flight (or tells no count: its graceful SIGTERM still
    lets requests finish) after the settle time, or its process ended; False at the timeout."""
    loop = asyncio.get_running_loop()
    settle = loop.time() + DRAIN_SETTLE_S
    deadline = loop.time() + max(timeout_s, DRAIN_SETTLE_S)
    while loop.time() < deadline:
        busy = await prober.in_flight(url)
        if loop.time() >= settle and not busy:
            return True
        if gone_within is None:
            await asyncio.sleep(DRAIN_POLL_S)
        elif await gone_within(DRAIN_POLL_S):
            return True
    return False
