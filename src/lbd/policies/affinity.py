"""Affinity plugins: the endpoints holding the longest prefix (approximate index), and sessions on a
consistent-hash ring with bounded loads.

Both keep affinity bounded: the prefix holders are kept only while the least loaded of them is within a gap
of the least loaded endpoint, and a session's owner only while its load stays under (1 + epsilon) times the
average, so a hot prefix or a hot session cannot pile onto one rank.
"""

from __future__ import annotations

import bisect
import math
import zlib
from collections.abc import Sequence

from lbd.policies.pick import within_gap
from lbd.policies.plugin import Context, Detail, Env, Filter, Scorer
from lbd.policies.prefix import PrefixMemory
from lbd.policies.registry import plugin


@plugin
class LongestPrefix(Filter):
    """Keep the endpoints holding the longest prefix of the request that any endpoint holds (the text-prefix
    index of what was sent where), unless the least loaded of them is past the load gap; none holds any
    ("cold") or all past the gap ("overloaded"): keep every endpoint."""

    name = "longest_prefix"
    help = "endpoints holding the request's longest cached prefix (approximate), bounded by a load gap"
    uses_prefix_hashes = True

    def __init__(self, env: Env, gap_abs: float = 4.0, gap_rel: float = 0.5,
                 index_capacity: int = 65536) -> None:
        super().__init__(env)
        self.gap_abs, self.gap_rel = gap_abs, gap_rel
        self.memory = env.state(PrefixMemory, capacity=index_capacity)

    def filter(self, ctx: Context, kept: list[int]) -> list[int]:
        hashes, pool, index = ctx.facts.prefix_hashes, ctx.pool, self.memory.index
        scores = ctx.queue()
        matches = [index.match(e.key, hashes) for e in pool] if hashes else None
        best = max(matches) if matches else 0
        if best == 0 or matches is None:
            ctx.memo[self] = None
            return kept
        holders = [i for i in kept if matches[i] == best]
        least = min(scores)
        holder = min(scores[i] for i in holders) if holders else math.inf
        hit = within_gap(holder, least, self.gap_abs, self.gap_rel)
        ctx.memo[self] = (hit, best, len(hashes), holder, least)
        if hit:
            return holders
        ctx.turns_before += 1  # (the one-block policy tried the holder first: a turn spent)
        return kept

    def reason(self, ctx: Context, pick: int) -> str:
        seen = ctx.memo[self]
        if seen is None:
            return "cold"
        return "prefix_hit" if seen[0] else "prefix_overloaded"

    def detail(self, ctx: Context, pick: int) -> Detail:
        seen = ctx.memo[self]
        if seen is None:
            score = ctx.queue()[pick]
            return lambda: f"no cached prefix; score {score:.0f}"
        _, best, n, holder, least = seen
        return lambda: f"{best}/{n} chunks, score {holder:.0f} vs least {least:.0f}"


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


def _cap(ctx: Context, epsilon: float) -> int:
    """Bounded loads (Mirrokni et al.): an endpoint takes a session's request while its load + 1 stays
    under (1 + epsilon) times the average load with this request."""
    loads = ctx.queue()
    return math.ceil((1.0 + epsilon) * (sum(loads) + 1.0) / len(loads))


@plugin
class SessionCap(Filter):
    """A request with a session key: keep the endpoints whose load + 1 fits the bounded-load cap (all past
    it: the least loaded ones). Without a key it keeps everyone."""

    name = "session_cap"
    help = "with a session key: endpoints under (1 + epsilon) x the average load"

    def __init__(self, env: Env, epsilon: float = 0.25) -> None:
        super().__init__(env)
        self.epsilon = epsilon

    def filter(self, ctx: Context, kept: list[int]) -> list[int]:
        if not ctx.facts.session_key:
            return kept
        loads = ctx.queue()
        cap = ctx.memo["session_cap"] = _cap(ctx, self.epsilon)
        out = [i for i in kept if loads[i] + 1.0 <= cap]
        ctx.memo[self] = not out
        if out:
            return out
        least = min(loads[i] for i in kept)
        return [i for i in kept if loads[i] == least]

    def reason(self, ctx: Context, pick: int) -> str | None:
        return "session_overflow" if ctx.memo.get(self) else None

    def detail(self, ctx: Context, pick: int) -> Detail:
        return f"all at cap {ctx.memo['session_cap']}"


@plugin
class Session(Scorer):
    """The hops from the session's point on a consistent-hash ring to each endpoint (the owner: 0), so
    sessions stay put and an endpoint leaving moves only its own. No session key: the queue score."""

    name = "session"
    help = "consistent hashing on the session header (hops from the owner); no session key: load"
    uses_load = False

    def __init__(self, env: Env, vnodes: int = 64) -> None:
        super().__init__(env)
        self.ring = HashRing(vnodes)

    def score(self, ctx: Context) -> list[float]:
        session = ctx.facts.session_key
        if not session:
            return ctx.queue()
        pool = ctx.pool
        self.ring.update([e.key for e in pool])
        hops = {key: float(hop) for hop, key in enumerate(self.ring.walk(session))}
        ctx.rotates = False  # the ring orders every endpoint: no ties to take turns on
        ctx.memo[self] = hops
        return [hops[e.key] for e in pool]

    def reason(self, ctx: Context, pick: int) -> str:
        if not ctx.facts.session_key:
            return "no_session_key"
        return "session_owner" if self._hop(ctx, pick) == 0 else "session_overflow"

    def _hop(self, ctx: Context, pick: int) -> int:
        return int(ctx.memo[self][ctx.pool[pick].key])

    def detail(self, ctx: Context, pick: int) -> Detail:
        load = ctx.queue()[pick]
        if not ctx.facts.session_key:
            return f"score {load:.0f}"
        hop, cap = self._hop(ctx, pick), ctx.memo.get("session_cap")
        return f"hop {hop}, load {load:.0f}" + (f", cap {cap}" if cap is not None else "")
