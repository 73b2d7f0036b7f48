"""predicted_ttft (the default): the endpoint with the lowest estimated time to first token.

Estimate per endpoint, in prefill-token equivalents divided by a prefill rate (tokens/s):
    tokens ahead   = the router's own requests there without a first byte yet (their uncached tokens, exact)
                   + other clients' waiting requests x the average prompt length seen
    decode drag    = running requests x ``running_tokens`` (each takes a slot of every step's token budget)
    this request   = its prompt minus the prefix that endpoint already holds: exact where the router follows
                     the endpoint's KV-cache events (``facts.cached_tokens``), else the approximate index
    KV pressure    = ``kv_penalty_tokens`` x how far KV use is past ``kv_threshold`` (near full = preemption)
The rate is a flag, or learned from observed times to first byte (EWMA) when not given.
The choice minimises the estimate plus ``reuse_weight`` x this request's uncached tokens: a token computed
again where another rank holds it delays everything queued behind it there, so between two near-equal
estimates the one that reuses the cache wins (e.g. a request whose prefix another request is computing right
now), while a rank whose queue outgrows the saving loses the request (a hot prefix spreads).
Under KV pressure the choice also pays ``evict_weight`` x the hot prefix tokens the placement would push
out of that endpoint's cache (``footprint``: other prefixes served there lately plus this prompt, past
``kv_threshold`` of its KV blocks): evicting a tenant's prefix costs its next request that prefix again, so
cold prefixes go where there is room and a busy holder spills to an endpoint with room first.
Bounded stickiness: approximate endpoints whose queue score is past the least one by a gap are not
considered, so a guessed prefix never outweighs a large load gap. Endpoints with an exact view are exempt:
their estimate already holds the queue ahead and the true cost of a miss (a gap on running requests only
broke affinity for chat sessions with long decodes). Equal estimates rotate so cold bursts spread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lbd.policies.base import Decision, EndpointSnapshot, Policy, RequestFacts, queue_score, register
from lbd.policies.footprint import ROOT_BLOCKS, Footprint, root_of
from lbd.policies.pick import gap_bound
from lbd.policies.prefix import CHUNK_CHARS, PrefixIndex

CHARS_PER_TOKEN = 4  # the router's prompt-length estimate; it never tokenizes


@register
class PredictedTtft(Policy):
    name = "predicted_ttft"
    uses_prefix_hashes = True
    exact_aware = True
    help = "lowest estimated time to first token: queue ahead + uncached prefill, KV pressure as a penalty"

    def __init__(
        self,
        prefill_tokens_per_s: float | None = None,
        running_tokens: float = 16.0,
        kv_threshold: float = 0.8,
        kv_penalty_tokens: float = 4096.0,
        gap_abs: float = 8.0,
        gap_rel: float = 0.5,
        index_capacity: int = 65536,
        learn_alpha: float = 0.1,
        reuse_weight: float = 1.0,
        exact_gap_free: bool = True,
        evict_weight: float = 1.0,
        footprint_window: int = 512,
        **options: Any,
    ) -> None:
        super().__init__(**options)
        self.learn = prefill_tokens_per_s is None
        self.rate = float(prefill_tokens_per_s or 4000.0)
        self.running_tokens, self.kv_threshold, self.kv_penalty_tokens = (
            running_tokens,
            kv_threshold,
            kv_penalty_tokens,
        )
        self.gap_abs, self.gap_rel, self.alpha = gap_abs, gap_rel, learn_alpha
        self.reuse_weight = reuse_weight
        self.exact_gap_free = exact_gap_free
        self.evict_weight = evict_weight
        self.footprint = Footprint(footprint_window)
        self.avg_prompt_tokens = 256.0
        self.index = PrefixIndex(index_capacity)

    def uncached_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> tuple[float, int]:
        """(prompt tokens ``ep`` would compute, prefix blocks or chunks it holds)."""
        exact = facts.cached_tokens
        if exact is not None:
            cached = exact.get(ep.key)
            if cached is not None:
                uncached = facts.prompt_tokens - cached
                return (uncached if uncached > 0 else 0.0), cached // ep.block_size
        if not facts.prefix_hashes:
            return float(facts.prompt_tokens), 0
        matched = self.index.match(ep.key, facts.prefix_hashes)
        uncached = facts.prompt_tokens - matched * CHUNK_CHARS / CHARS_PER_TOKEN
        return (uncached if uncached > 0.0 else 0.0), matched

    def cost(self, facts: RequestFacts, ep: EndpointSnapshot) -> tuple[float, float, int]:
        """(total prefill-token equivalents, this request's uncached tokens, matched chunks).

        Runs for every endpoint on every request: conditional expressions instead of max() calls."""
        own_running = ep.inflight - ep.unstarted
        if own_running < 0:
            own_running = 0
        if ep.age_s <= self.stale_s:  # fresh telemetry
            others_waiting = ep.waiting - ep.unstarted
            if others_waiting < 0.0:
                others_waiting = 0.0
            running = ep.running if ep.running > own_running else float(own_running)
            over = ep.kv_usage - self.kv_threshold
            over = over / (1.0 - self.kv_threshold) if over > 0.0 and self.kv_threshold < 1.0 else 0.0
        else:
            others_waiting, running, over = 0.0, float(own_running), 0.0
        uncached, matched = self.uncached_tokens(facts, ep)
        total = (
            ep.unstarted_tokens
            + others_waiting * self.avg_prompt_tokens
            + running * self.running_tokens
            + uncached
            + over * self.kv_penalty_tokens
        )
        return total, uncached, matched

    def evicted_tokens(
        self, facts: RequestFacts, ep: EndpointSnapshot, uncached: float, root: int | None
    ) -> float:
        """Hot prefix tokens of other prompts that computing ``uncached`` tokens on ``ep`` would evict."""
        if uncached <= 0.0 or ep.num_blocks <= 0:
            return 0.0
        room = self.kv_threshold * ep.num_blocks * ep.block_size
        over = self.footprint.hot_tokens(ep.key, exclude=root) + facts.prompt_tokens - room
        return 0.0 if over <= 0.0 else (over if over < uncached else uncached)

    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        stale_s = self.stale_s
        costs = [self.cost(facts, e) for e in endpoints]
        we = self.evict_weight
        root = root_of(facts)
        # a prompt routed on its head may not show its prefix's name yet: none of it is cached, so none of it
        # is hot anywhere to leave out of the charge
        if we > 0.0 and (root is not None or facts.chain_partial):
            evict = [we * self.evicted_tokens(facts, e, c[1], root)
                     for e, c in zip(endpoints, costs, strict=True)]
        else:
            evict = [0.0] * len(endpoints)
        scores = [queue_score(e, stale_s) for e in endpoints]
        bound = gap_bound(scores, self.gap_abs, self.gap_rel)  # bounded stickiness
        exact = facts.cached_tokens if self.exact_gap_free else None
        # With an exact view the estimate itself holds the queue (the endpoint's unstarted tokens and waiting
        # requests) and the true cost of a miss; the queue-score gap stays for approximate endpoints only.
        allowed = [i for i, s in enumerate(scores) if s <= bound or (exact and endpoints[i].key in exact)]
        w = self.reuse_weight
        score = [c[0] + w * c[1] + x for c, x in zip(costs, evict, strict=True)]
        pick = self.picker.lowest_among(allowed, score, eps=1e-6)
        ep = endpoints[pick]
        total, uncached, matched = costs[pick]
        if len(allowed) < len(costs) and score[pick] > min(score) + 1e-6:
            reason = "load_gap"
        elif ep.age_s > stale_s:
            reason = "stale_telemetry"
        elif matched and matched == max(c[2] for c in costs):
            reason = "prefix_hit"
        else:
            reason = "lowest_ttft"
        rate = self.rate
        exact = facts.cached_tokens is not None and ep.key in facts.cached_tokens

        def detail() -> str:
            return (
                f"est {total / rate * 1000:.1f} ms ({total:.0f} tok at {rate:.0f} tok/s, "
                f"{uncached:.0f} uncached, {matched} {'blocks' if exact else 'chunks'} cached"
                + (f", evicts ~{evict[pick] / we:.0f} hot tokens)" if evict[pick] else ")")
            )

        return Decision(ep, reason, detail, cost_tokens=total, predicted_s=total / rate)

    def charge_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> float:
        return self.uncached_tokens(facts, ep)[0]

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        if facts.prompt_tokens:
            self.avg_prompt_tokens += 0.05 * (facts.prompt_tokens - self.avg_prompt_tokens)
            if self.evict_weight > 0.0 and (root := root_of(facts)) is not None:
                self.footprint.touch(key, root, facts.prompt_tokens)
        if facts.prefix_hashes:
            self.index.insert(key, facts.prefix_hashes)

    def on_chain_known(self, facts: RequestFacts, key: str, head_blocks: int) -> None:
        # the prefix is counted once per dispatch: here when the head did not reach its name
        if self.evict_weight > 0.0 and head_blocks < ROOT_BLOCKS and (root := root_of(facts)) is not None:
            self.footprint.touch(key, root, facts.prompt_tokens)

    def on_first_byte(self, decision: Decision, ttft_s: float) -> None:
        # Tiny estimates are all overhead (HTTP, scheduling), not prefill: they would inflate the rate.
        if not self.learn or decision.cost_tokens < 64 or ttft_s <= 0.002:
            return
        sample = decision.cost_tokens / ttft_s
        self.rate = min(1e6, max(50.0, self.rate + self.alpha * (sample - self.rate)))

    def forget(self, key: str) -> None:
        self.index.forget(key)
        self.footprint.forget(key)
