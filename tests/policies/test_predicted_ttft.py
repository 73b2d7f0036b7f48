"""predicted_ttft: queueing + uncached prefill, KV penalty, bounded stickiness, cold spread, learning."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

from lbd.policies import CHUNK_CHARS, EndpointSnapshot, RequestFacts, chunk_hashes, make_policy
from lbd.policies.footprint import Footprint, root_of
from support.policies import dispatch, eps, hot


def test_cold_burst_spreads_evenly() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    e = eps(4)
    facts = RequestFacts(prompt_tokens=100)
    keys = dispatch(p, facts, e, 12)
    assert Counter(keys) == {f"http://e{i}": 3 for i in range(4)}
    assert p.choose(facts, eps(4)).reason == "lowest_ttft"


def test_cached_prefix_wins_when_loads_are_close() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    facts = hot(16)
    p.on_dispatch(facts, "http://e2")
    e = eps(3)
    e[2] = replace(e[2], running=2)  # a little busier, but holds 512 prompt tokens
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e2" and d.reason == "prefix_hit"
    assert d.predicted_s < p.choose(facts, e[:2]).predicted_s


def test_large_load_gap_overrides_a_hot_prefix() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000, gap_abs=8.0, gap_rel=0.5)
    facts = hot(16)
    p.on_dispatch(facts, "http://e0")
    e = eps(2)
    e[0] = replace(e[0], running=8)  # 8 <= 0 + 8: still allowed, cache wins
    assert p.choose(facts, e).endpoint.key == "http://e0"
    e[0] = replace(e[0], running=9)  # past the gap: excluded even though its estimate is lower
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e1" and d.reason == "load_gap"


def test_hot_prefix_burst_is_bounded() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    keys = dispatch(p, hot(16), eps(3), 60)
    counts = Counter(keys)
    assert len(counts) == 3 and max(counts.values()) - min(counts.values()) <= 10


def test_queue_ahead_counts_waiting_requests_and_router_unstarted_tokens() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    facts = RequestFacts(prompt_tokens=100)
    e = eps(2)
    e[0] = replace(e[0], waiting=1)  # another client's request of ~avg_prompt_tokens ahead
    e[1] = replace(e[1], unstarted=1, unstarted_tokens=int(p.avg_prompt_tokens) + 10, inflight=1, delta=1)
    assert p.choose(facts, e).endpoint.key == "http://e0"
    e[1] = replace(e[1], unstarted_tokens=int(p.avg_prompt_tokens) - 10)
    assert p.choose(facts, e).endpoint.key == "http://e1"


def test_kv_pressure_penalty_each_side_of_threshold() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000, kv_threshold=0.8, kv_penalty_tokens=4096)
    facts = RequestFacts(prompt_tokens=100)
    a = EndpointSnapshot(key="a", running=4, kv_usage=0.2, age_s=0)  # 4 x 16 = 64 tokens of decode drag
    b = EndpointSnapshot(key="b", running=0, kv_usage=0.8, age_s=0)
    assert p.choose(facts, [a, b]).endpoint.key == "b"
    b = replace(b, kv_usage=0.81)  # 0.05 x 4096 = 205 tokens of penalty > 64
    assert p.choose(facts, [a, b]).endpoint.key == "a"


def test_stale_telemetry_falls_back_to_router_counts() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000, stale_s=0.5)
    facts = RequestFacts(prompt_tokens=100)
    stale = EndpointSnapshot(key="a", running=50, waiting=50, kv_usage=0.99, age_s=3.0)
    fresh = EndpointSnapshot(key="b", running=1, age_s=0.1)
    d = p.choose(facts, [stale, fresh])
    assert d.endpoint.key == "a" and d.reason == "stale_telemetry"


def test_rate_is_learned_from_first_bytes_unless_fixed() -> None:
    p = make_policy("predicted_ttft")
    d = p.choose(RequestFacts(prompt_tokens=2000), eps(1))
    start = p.rate
    for _ in range(60):
        p.on_first_byte(d, ttft_s=d.cost_tokens / 500.0)  # this endpoint really does 500 tok/s
    assert abs(p.rate - 500.0) < 0.05 * start
    tiny = p.choose(RequestFacts(prompt_tokens=10), eps(1))
    before = p.rate
    p.on_first_byte(tiny, ttft_s=0.5)  # tiny prompts measure overhead, not prefill: ignored
    assert p.rate == before
    fixed = make_policy("predicted_ttft", prefill_tokens_per_s=1234)
    fixed.on_first_byte(d, ttft_s=10.0)
    assert fixed.rate == 1234


def test_uncached_part_shrinks_with_the_cached_prefix() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    text = "abcdefgh" * (CHUNK_CHARS // 8) * 10
    facts = RequestFacts(prefix_hashes=chunk_hashes(text), prompt_tokens=len(text) // 4)
    half = RequestFacts(prefix_hashes=chunk_hashes(text[: len(text) // 2]), prompt_tokens=len(text) // 8)
    p.on_dispatch(half, "http://e0")
    ep = eps(1)[0]
    assert p.charge_tokens(facts, ep) == facts.prompt_tokens - 5 * CHUNK_CHARS / 4


# ---- the exact path: cached lengths from the engines' KV events --------------------------------------------
def exact(prompt: int, cached: dict[str, int], hashes: tuple[int, ...] = ()) -> RequestFacts:
    return RequestFacts(prompt_tokens=prompt, cached_tokens=cached, prefix_hashes=hashes)


def test_exact_cached_lengths_decide_where_they_are_known() -> None:
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    e = eps(3)
    facts = exact(2000, {"http://e0": 0, "http://e1": 1984, "http://e2": 1024})
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e1" and d.reason == "prefix_hit" and "124 blocks cached" in d.explain()
    assert p.charge_tokens(facts, e[1]) == 16  # only its own uncached tokens are charged to e1's queue
    # The approximate index is not consulted for endpoints in cached_tokens, even if it remembers more...
    text_facts = hot(16)
    p.on_dispatch(text_facts, "http://e0")
    facts = exact(2000, {"http://e0": 0, "http://e1": 512}, text_facts.prefix_hashes)
    assert p.choose(facts, e[:2]).endpoint.key == "http://e1"
    # ...but is for endpoints without an exact view (here e0: its events are missing)
    facts = exact(2000, {"http://e1": 0}, text_facts.prefix_hashes)
    assert p.choose(facts, e[:2]).endpoint.key == "http://e0"


def test_exact_affinity_is_bounded_by_load() -> None:
    """With exact views the estimate carries the queue: a busy holder keeps a prefix until the work queued
    ahead there outweighs recomputing it elsewhere (reuse counted), then the prefix spreads."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    facts = exact(2000, {"http://e0": 1984, "http://e1": 0, "http://e2": 0})
    e = eps(3)
    e[0] = replace(e[0], waiting=3, running=12)  # many decodes (a queue score the text-prefix gap refuses)...
    assert p.choose(facts, e).endpoint.key == "http://e0"  # ...but nothing waits long: 16 tokens to compute
    e[0] = replace(e[0], unstarted=6, unstarted_tokens=4200, inflight=6)  # a long prefill queue ahead
    d = p.choose(facts, e)
    assert d.endpoint.key != "http://e0" and d.reason == "lowest_ttft"
    # a hot prefix under a burst: the holder takes it until its queue outweighs the saving, then it spreads
    keys = dispatch(p, facts, eps(3), 400)
    assert keys[0] == "http://e0" and len(set(keys)) == 3
    # approximate endpoints keep the queue-score gap
    text = hot(16)
    p.on_dispatch(text, "http://e0")
    e = eps(2)
    e[0] = replace(e[0], running=20)
    assert p.choose(text, e).reason == "load_gap"


def test_reuse_breaks_near_ties_toward_the_cache() -> None:
    # e0 has computed this prefix for an earlier request (held, its 2,000 tokens of others' prefills queued
    # there): the estimate is a little worse there, but recomputing the prefix on e1 wastes 2,000 tokens of
    # e1's time.
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    e = eps(2)
    e[0] = replace(e[0], inflight=1, unstarted=1, unstarted_tokens=2000, delta=1, running=1)
    facts = exact(2200, {"http://e0": 2000, "http://e1": 0})
    assert p.choose(facts, e).endpoint.key == "http://e0"
    greedy = make_policy("predicted_ttft", prefill_tokens_per_s=1000, reuse_weight=0.0)
    assert greedy.choose(facts, e).endpoint.key == "http://e1"


def test_a_prefix_still_being_computed_is_no_saving_to_wait_for() -> None:
    """Issue 42's burst: the same 2,000 tokens are only pending on e0 (an earlier request computes them there,
    no first byte and no KV event yet). A follower waits there for that whole prefill, as long as a recompute
    on idle e1 takes: the pending prefix's credit is cut by the prefill queued ahead, so it goes to e1 and
    does not stack behind the one prefill (it kept the full credit and stacked before). Once that prefill
    is done (nothing ahead), the follower takes the hit; with no endpoint idle, it waits for the prefix."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    e = eps(2)
    e[0] = replace(e[0], inflight=1, unstarted=1, unstarted_tokens=2000, delta=1, running=1)
    facts = exact(2200, {"http://e0": 2000, "http://e1": 0})
    facts.pending_tokens = {"http://e0": 2000}
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e1" and d.reason == "prefix_wait"
    old = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    next(s for s, _ in old.scorers if s.name == "reuse").wait_bound = False
    assert old.choose(facts, e).endpoint.key == "http://e0"  # the unbounded credit: stacked
    e[0] = replace(e[0], unstarted=0, unstarted_tokens=0)  # the leader's first byte: nothing queued ahead
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e0" and d.reason == "prefix_hit"
    # a short queue ahead of a pending prefix keeps most of its credit (less than the prefix's tokens)
    e[0] = replace(e[0], unstarted=1, unstarted_tokens=600)
    assert p.choose(facts, e).endpoint.key == "http://e0"
    # a long one loses it to an idle endpoint...
    e[0] = replace(e[0], unstarted_tokens=3000)
    assert p.choose(facts, e).endpoint.key == "http://e1"
    # ...but not when prefills are queued everywhere (saturated: a recompute would wait too, and evict)
    e[1] = replace(e[1], inflight=1, unstarted=1, unstarted_tokens=100, delta=1)
    assert p.choose(facts, e).endpoint.key == "http://e0"


# ---- KV pressure: the hot prefixes a placement would evict ------------------------------------------------
def tenant(t: int, prompt: int, cached: dict[str, int]) -> RequestFacts:
    """A request of tenant ``t``: its own block chain (so its own prefix name), exact cached lengths."""
    chain = [t * 1_000_003 + i for i in range(prompt // 16)]
    return RequestFacts(prompt_tokens=prompt, cached_tokens=cached, block_keys={16: chain})


def test_footprint_counts_recent_reused_prefixes_once_each() -> None:
    fp = Footprint(window=6)
    fp.touch("a", 7, 5000)  # sent once: a one-off prompt, nothing to lose by evicting it
    fp.touch("a", 1, 3000)
    fp.touch("a", 1, 3200)  # the same prefix again, a longer prompt: counted once, at its longest
    fp.touch("a", 2, 3000)
    fp.touch("a", 2, 3000)
    assert fp.hot_tokens("a") == 6200 and fp.hot_tokens("a", exclude=2) == 3200
    for _ in range(4):
        fp.touch("b", 9, 100)  # dispatches elsewhere age a's prefixes too
    assert fp.hot_tokens("a") == 3000  # prefix 1 was last sent 6 dispatches ago: cold now
    assert fp.hot_tokens("b") == 100
    fp.forget("a")
    assert fp.hot_tokens("a") == 0 and root_of(tenant(1, 3000, {})) != root_of(tenant(2, 3000, {}))
    assert root_of(RequestFacts(prompt_tokens=64, block_keys={16: [1, 2, 3, 4]})) is None


def serve(p, t: int, key: str, prompt: int = 3000) -> None:
    """Tenant ``t`` is hot on ``key``: two of its requests went there."""
    for _ in range(2):
        p.on_dispatch(tenant(t, prompt, {}), key)


def test_cold_prefix_goes_where_it_evicts_nothing() -> None:
    """Each endpoint's KV holds 10,240 tokens (8,192 under kv_threshold). e0 serves two 3,000-token tenants,
    e1 one; e0 is a little less busy, so without the charge a new tenant goes there and pushes out one of
    e0's hot prefixes; with it the new tenant goes to e1, where it fits."""
    e = eps(2, num_blocks=640)
    e[1] = replace(e[1], running=4)
    names = ("http://e0", "http://e1")
    for evict_weight, want in ((1.0, "http://e1"), (0.0, "http://e0")):
        p = make_policy("predicted_ttft", prefill_tokens_per_s=1000, evict_weight=evict_weight)
        for t, key in ((1, "http://e0"), (2, "http://e0"), (3, "http://e1")):
            serve(p, t, key)
        d = p.choose(tenant(4, 3000, dict.fromkeys(names, 0)), e)
        assert d.endpoint.key == want
    assert "evicts" not in d.explain()
    # unknown KV size (no cache_config telemetry) or a roomy cache: no charge, the old choice
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    for t in (1, 2):
        serve(p, t, "http://e0")
    for blocks in (0, 4096):
        e = eps(2, num_blocks=blocks)
        e[1] = replace(e[1], running=4)
        assert p.choose(tenant(4, 3000, dict.fromkeys(names, 0)), e).endpoint.key == "http://e0"


def test_a_busy_holder_spills_to_room_first() -> None:
    """Tenant 1's holder e0 is backlogged; e1's cache is full of two other hot tenants, e2's has room: the
    spill goes to e2 although e1 is a little less busy."""
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    e = eps(3, num_blocks=640)
    e[0] = replace(e[0], unstarted=8, unstarted_tokens=12_000, inflight=8)
    e[2] = replace(e[2], running=4)
    for t, key in ((1, "http://e0"), (2, "http://e1"), (3, "http://e1"), (5, "http://e2")):
        serve(p, t, key)
    facts = tenant(1, 3200, {"http://e0": 2992, "http://e1": 0, "http://e2": 0})
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e2"
    e[2] = replace(e[2], running=80)  # ...unless room is busier than what evicting costs
    d = p.choose(facts, e)
    assert d.endpoint.key == "http://e1" and "evicts ~" in d.explain()


def test_a_prompt_routed_on_its_head_is_charged_and_counted_once_its_chain_is_known() -> None:
    """A new prompt routed on the head of its chain (two blocks: not as far as the block naming its prefix,
    lbd.router.kv.cold) is still charged for what it would evict, and its prefix counts as served there
    once the router has its whole chain (on_chain_known): twice sent, it is hot there."""
    e = eps(2, num_blocks=640)
    e[1] = replace(e[1], running=4)
    names = ("http://e0", "http://e1")
    p = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    for t, key in ((1, "http://e0"), (2, "http://e0"), (3, "http://e1")):
        serve(p, t, key)
    whole = tenant(4, 3000, dict.fromkeys(names, 0))
    assert whole.block_keys is not None
    head = replace(whole, block_keys={16: whole.block_keys[16][:2]}, chain_partial=True)
    assert root_of(head) is None
    assert p.choose(head, e).endpoint.key == "http://e1"  # the charge, without the prefix's name
    before = p.footprint.hot_tokens("http://e1")
    for _ in range(2):
        sent = replace(head)
        p.on_dispatch(sent, "http://e1")  # no name yet: not counted at dispatch
        sent.block_keys, sent.chain_partial = whole.block_keys, False
        p.on_chain_known(sent, "http://e1", 2)
    assert p.footprint.hot_tokens("http://e1") == before + 3000
    # a head that reached the name was counted at dispatch: not again
    p.on_dispatch(whole, "http://e0")
    p.on_chain_known(whole, "http://e0", 8)
    assert p.footprint.hot_tokens("http://e0", exclude=root_of(whole)) == p.footprint.hot_tokens("http://e0")


# ---- what a request already on an endpoint costs the next one (learned, issue 42) --------------------------
def _learn_load(p, per_token_s: float, per_running_s: float, per_ahead_s: float, n: int = 400) -> None:
    """First bytes from a fleet where TTFT = 20 ms + tokens x per_token_s + running x per_running_s + requests
    ahead x per_ahead_s, over varied loads (seeded)."""
    import random

    rng = random.Random(7)
    e = eps(1)
    for _ in range(n):
        d = p.choose(RequestFacts(prompt_tokens=100), e)
        tokens, running, ahead = rng.uniform(200, 4000), float(rng.randint(0, 8)), float(rng.randint(0, 3))
        d.load = (tokens, running, ahead)
        p.on_first_byte(d, 0.02 + tokens * per_token_s + running * per_running_s + ahead * per_ahead_s)


def test_load_prices_are_learned_from_first_bytes() -> None:
    """A request ahead that costs 50 ms where a token costs 50 us is worth 1,000 prefill tokens."""
    p = make_policy("predicted_ttft")
    assert (p.running_tokens, p.request_tokens) == (16.0, 0.0)  # the settings until enough first bytes
    _learn_load(p, 50e-6, 5e-3, 50e-3)
    assert abs(p.model.request_tokens - 1000.0) < 50.0 and abs(p.model.running_tokens - 100.0) < 10.0
    p.reset()
    assert (p.model.running_tokens, p.model.request_tokens) == (16.0, 0.0)


def test_learned_prices_stop_stacking_a_prefix_behind_a_queue() -> None:
    """The holder of a long prompt's prefix with three requests queued ahead: on a fleet where each request
    ahead costs 50 ms and a token 10 us the miss elsewhere (~3,000 tokens, ~30 ms) is cheaper, so the request
    goes to an idle endpoint; with the settings' prices (a request ahead costs only its tokens) it stacked."""
    facts = hot(96)  # ~3,000 prompt tokens
    busy = replace(eps(1)[0], unstarted=3, unstarted_tokens=900, inflight=5, running=2.0)
    idle = eps(2)[1]
    settings = make_policy("predicted_ttft")
    settings.on_dispatch(facts, busy.key)
    assert settings.choose(facts, [busy, idle]).endpoint.key == busy.key
    learned = make_policy("predicted_ttft")
    learned.on_dispatch(facts, busy.key)
    _learn_load(learned, 10e-6, 2e-3, 50e-3)
    assert learned.choose(facts, [busy, idle]).endpoint.key == idle.key


def test_load_prices_stay_fixed_with_a_fixed_rate_and_within_bounds() -> None:
    fixed = make_policy("predicted_ttft", prefill_tokens_per_s=1000)
    _learn_load(fixed, 50e-6, 5e-3, 50e-3)
    assert (fixed.model.running_tokens, fixed.model.request_tokens) == (16.0, 0.0)
    assert fixed.choose(RequestFacts(prompt_tokens=100), eps(1)).load is None  # nothing to learn from
    p = make_policy("predicted_ttft", running_tokens=32.0)
    _learn_load(p, 1e-9, -1e-3, 10.0)  # free tokens, running requests that "help": clamped
    assert p.model.running_tokens == 32.0 and p.model.request_tokens == 8192.0
