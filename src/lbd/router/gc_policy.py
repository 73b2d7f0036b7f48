"""Collecting what cancelled request handlers leave behind.

The router collects garbage rarely (``lbd.router.app`` freezes the start-up heap and raises the collector's
thresholds, which took a few percent of its CPU off a profile). A handler cancelled because its client left
ends in reference cycles (its CancelledError's traceback holds its frames, which hold the request and its
response), and under those thresholds the cycles reach the oldest generation and wait there: 10,000 held
clients that vanished left the router's RSS +34% (benchmarks/RESULTS.md, issue 43). One full collection
per ``EVERY`` cancellations, half a second after the one that crossed the mark (so the cancelled handlers
have run their cleanup), keeps it flat and costs nothing while clients do not leave.
"""

from __future__ import annotations

import asyncio
import gc

EVERY = 1000  # cancellations per full collection
DELAY_S = 0.5


class _Churn:
    def __init__(self) -> None:
        self.count = 0

    def cancelled(self, loop: asyncio.AbstractEventLoop) -> None:
        """A handler task was cancelled because its client left (or a held request's client closed)."""
        self.count += 1
        if self.count >= EVERY:
            self.count = 0
            loop.call_later(DELAY_S, gc.collect)


_churn = _Churn()
handler_cancelled = _churn.cancelled
