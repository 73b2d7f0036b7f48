"""Affinity policies: prefix_affinity (approximate prefix index), session (consistent hashing, bounded load).

Both keep affinity bounded: an endpoint that holds the prefix or owns the session is chosen only while its
load stays within a gap of the least loaded one, so a hot prefix or a hot session cannot pile onto one rank.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Sequence
from typing import Any

from lbd.policies.base import (
    Decision,
    EndpointSnapshot,
    Policy,
    RequestFacts,
    queue_score,
    queue_scores,
    register,
)
from lbd.policies.pick import within_gap
from lbd.policies.prefix import PrefixIndex


@register
class PrefixAffinity(Policy):
    name = "prefix_affinity"
    uses_prefix_hashes = True
    help = "endpoint holding the longest prefix of the request (bounded by a load gap); cold requests spread"

    def __init__(
        self, gap_abs: float = 4.0, gap_rel: float = 0.5, index_capacity: int = 65536, **options: Any
    ) -> None:
        super().__init__(**options)
        self.gap_abs, self.gap_rel = gap_abs, gap_rel
        self.index = PrefixIndex(index_capacity)

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        scores = queue_scores(endpoints, self.stale_s)
        least = min(scores)
        hashes = facts.prefix_hashes
        matches = [self.index.match(e.key, hashes) for e in endpoints] if hashes else [0] * len(endpoints)
        best = max(matches)
        picker = self.picker
        if best == 0:
            pick = picker.lowest(scores)
            score = scores[pick]
            return Decision(endpoints[pick], "cold", lambda: f"no cached prefix; score {score:.0f}")
        holders = [i for i, m in enumerate(matches) if m == best]
        holder = picker.lowest_among(holders, scores)
        holder_score = scores[holder]

        def detail() -> str:
            return f"{best}/{len(hashes)} chunks, score {holder_score:.0f} vs least {least:.0f}"

        if within_gap(scores[holder], least, self.gap_abs, self.gap_rel):
            return Decision(endpoints[holder], "prefix_hit", detail)
        return Decision(endpoints[picker.lowest(scores)], "prefix_overloaded", detail)

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.prefix_hashes:
            self.index.insert(key, facts.prefix_hashes)

    def forget(self, key: str) -> None:
        self.index.forget(key)


def _h64(text: str) -> int:
    data = text.encode("utf-8", "surrogatepass")
    return (zlib.crc32(data) << 32) | zlib.adler32(data)


class HashRing:
    """Consistent-hash ring with ``vnodes`` points per key; rebuilt only when the key set changes."""

    def __init__(self, vnodes: int = 64) -> None:
        self.vnodes = vnodes
        self._keys: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def update(self, keys: Sequence[str]) -> None:
        wanted = tuple(sorted(keys))
        if wanted == self._keys:
            return
        pairs = sorted((_h64(f"{k}#{i}"), k) for k in wanted for i in range(self.vnodes))
        self._keys, self._points, self._owners = wanted, [p for p, _ in pairs], [k for _, k in pairs]

    def walk(self, session: str) -> list[str]:
        """Distinct keys clockwise from the session's point: the owner first."""
        start = bisect.bisect_left(self._points, _h64(session))
        order: list[str] = []
        n = len(self._points)
        for step in range(n):
            key = self._owners[(start + step) % n]
            if key not in order:
                order.append(key)
                if len(order) == len(self._keys):
                    break
        return order


@register
class Session(Policy):
    """Consistent hashing with bounded loads (Mirrokni et al.): the session's owner on the ring unless its
    load would pass ``(1 + epsilon)`` times the average, then the next endpoint clockwise that has room."""

    name = "session"
    help = "consistent hashing on the session header with bounded load; no session key: least load"

    def __init__(self, epsilon: float = 0.25, vnodes: int = 64, **options: Any) -> None:
        super().__init__(**options)
        self.epsilon = epsilon
        self.ring = HashRing(vnodes)

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        if not facts.session_key:
            pick, scores = self.least_loaded(endpoints)
            return Decision(endpoints[pick], "no_session_key", f"score {scores[pick]:.0f}")
        by_key = {e.key: e for e in endpoints}
        self.ring.update(list(by_key))
        loads = {k: queue_score(e, self.stale_s) for k, e in by_key.items()}
        cap = math.ceil((1.0 + self.epsilon) * (sum(loads.values()) + 1.0) / len(loads))
        order = self.ring.walk(facts.session_key)
        for hop, key in enumerate(order):
            if loads[key] + 1.0 <= cap:
                reason = "session_owner" if hop == 0 else "session_overflow"
                return Decision(by_key[key], reason, f"hop {hop}, load {loads[key]:.0f}, cap {cap}")
        key = min(order, key=lambda k: loads[k])
        return Decision(by_key[key], "session_overflow", f"all at cap {cap}")
