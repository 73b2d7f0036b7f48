"""One endpoint as the exact view follows it: its block set, event feed, tokenizer and counters.

Shared by ``view`` (which discovers and follows endpoints) and ``lookup`` (which reads them per request).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from lbd.router.kv.feed import EventFeed, Source
from lbd.router.kv.index import EndpointBlocks
from lbd.router.kv.tokenize import RouterTokenizer


@dataclass(slots=True)
class EndpointView:
    """``exact``: whether requests may trust this endpoint's block set now (else it is routed approximately,
    ``reason`` says why)."""

    url: str
    models: Callable[[], frozenset[str]]
    blocks: EndpointBlocks
    feed: EventFeed | None = None
    tokenizer: RouterTokenizer | None = None
    default_block_size: Callable[[], int] = lambda: 16
    reason: str = "discovering"  # why the view is approximate (when it is)
    task: asyncio.Task[None] | None = None
    source: Source | None = None
    slot: int = -1
    routed_on_head: int = 0  # requests sent here before their long new text was tokenized (lookup, cold)
    head_only: int = 0  # of those, the ones whose text was left untokenized (a flood of new prompts)
    forwarded: int = 0  # requests sent here with their prompt token ids
    takes_ids: str | None = None  # the fingerprint forwarded ids must carry here (lbd.router.kv.forward)

    @property
    def block_size(self) -> int:
        return (self.feed.stats.block_size if self.feed else 0) or self.default_block_size()

    def exact(self, stale_s: float) -> bool:
        feed = self.feed
        if feed is None or self.tokenizer is None:
            return False
        st = feed.stats
        return st.state == "disconnected" or (st.state == "live" and st.lag_s <= stale_s)
