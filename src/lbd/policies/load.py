"""Load-only policies: round_robin, least_load, p2c and kv_aware."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from lbd.policies.base import Decision, EndpointSnapshot, Policy, RequestFacts, queue_score, register


def _stale_note(ep: EndpointSnapshot, stale_s: float) -> str:
    return "" if ep.fresh(stale_s) else " (stale telemetry: router in-flight only)"


@register
class RoundRobin(Policy):
    name = "round_robin"
    help = "each endpoint in turn, ignoring load"
    uses_load = False

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        turn, n = self.picker.next_turn(), len(endpoints)
        return Decision(endpoints[turn % n], "round_robin", lambda: f"turn {turn} of {n}")


@register
class LeastLoad(Policy):
    name = "least_load"
    help = "lowest waiting x 4 + running (vLLM's internal-LB score) + router dispatches since the scrape"

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        pick, scores = self.least_loaded(endpoints)
        ep = endpoints[pick]
        reason = "least_load" if ep.fresh(self.stale_s) else "stale_telemetry"
        return Decision(
            ep, reason, f"score {scores[pick]:.0f}, max {max(scores):.0f}{_stale_note(ep, self.stale_s)}"
        )


@register
class PowerOfTwo(Policy):
    name = "p2c"
    help = "two endpoints at random, the less loaded of them"

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._rng = random.Random(self.seed)

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        if len(endpoints) == 1:
            return Decision(endpoints[0], "only_choice")
        i, j = self._rng.sample(range(len(endpoints)), 2)
        si, sj = queue_score(endpoints[i], self.stale_s), queue_score(endpoints[j], self.stale_s)
        pick, other = (i, sj) if si <= sj else (j, si)
        ep = endpoints[pick]
        return Decision(ep, "p2c", f"score {min(si, sj):.0f} vs {other:.0f}{_stale_note(ep, self.stale_s)}")


@register
class KvAware(Policy):
    """Queue score plus a penalty that grows from ``kv_threshold`` KV use to full; near-full ranks avoided.

    A rank close to a full KV cache preempts (recomputes) requests, so a shorter queue there is worth less.
    """

    name = "kv_aware"
    help = "queue score plus a KV-cache pressure penalty above --kv-threshold; near-full ranks avoided"

    def __init__(
        self, kv_threshold: float = 0.8, kv_weight: float = 8.0, kv_full: float = 0.98, **options: Any
    ) -> None:
        super().__init__(**options)
        self.kv_threshold, self.kv_weight, self.kv_full = kv_threshold, kv_weight, kv_full

    def pressure(self, ep: EndpointSnapshot) -> float:
        if not ep.fresh(self.stale_s) or ep.kv_usage <= self.kv_threshold:
            return 0.0
        return (ep.kv_usage - self.kv_threshold) / max(1e-9, 1.0 - self.kv_threshold)

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        roomy = [
            i for i, e in enumerate(endpoints) if not (e.fresh(self.stale_s) and e.kv_usage >= self.kv_full)
        ]
        pool = roomy or list(range(len(endpoints)))
        scores = [
            queue_score(endpoints[i], self.stale_s) + self.kv_weight * self.pressure(endpoints[i])
            for i in pool
        ]
        pick = pool[self.picker.lowest(scores)]
        ep = endpoints[pick]
        if not roomy:
            reason = "kv_all_full"
        elif self.pressure(ep) > 0:
            reason = "kv_pressure"
        else:
            reason = "kv_aware" if ep.fresh(self.stale_s) else "stale_telemetry"
        return Decision(
            ep, reason, f"kv {ep.kv_usage:.2f}, score {min(scores):.1f}{_stale_note(ep, self.stale_s)}"
        )
