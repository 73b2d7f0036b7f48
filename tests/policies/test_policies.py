"""Unit tests per policy: deterministic edge cases on each side of every threshold."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from lbd.policies import (
    CHUNK_CHARS,
    EndpointSnapshot,
    PrefixIndex,
    RequestFacts,
    available,
    chunk_hashes,
    make_policy,
    queue_score,
)
from support.policies import dispatch, eps, hot


def test_registry_lists_every_policy_of_the_issue() -> None:
    assert set(available()) == {
        "round_robin",
        "least_load",
        "p2c",
        "kv_aware",
        "prefix_affinity",
        "session",
        "predicted_ttft",
        "pd_prefill",
    }
    with pytest.raises(KeyError, match="unknown policy 'nope'"):
        make_policy("nope")


def test_queue_score_is_vllm_internal_lb_score_plus_delta_and_trusts_only_inflight_when_stale() -> None:
    e = EndpointSnapshot(key="a", running=3, waiting=2, delta=1, inflight=1, age_s=0.1)
    assert queue_score(e, stale_s=1.0) == 4 * 2 + 3 + 1
    assert queue_score(replace(e, age_s=1.01), stale_s=1.0) == 1.0  # stale: router in-flight only
    assert queue_score(replace(e, age_s=math.inf), stale_s=1.0) == 1.0  # never scraped
    # A scrape that missed requests the router knows are there never scores below them.
    assert queue_score(replace(e, running=0, waiting=0, delta=-2, inflight=3), stale_s=1.0) == 3.0


def test_round_robin_cycles_in_order() -> None:
    p = make_policy("round_robin")
    e = eps(3, running=5)
    assert [p.choose(RequestFacts(), e).endpoint.rank for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert p.choose(RequestFacts(), e[:1]).endpoint.rank == 0


def test_least_load_weights_waiting_four_times_running() -> None:
    p = make_policy("least_load")
    waiting_one = EndpointSnapshot(key="w", waiting=1, age_s=0)
    assert (
        p.choose(RequestFacts(), [waiting_one, EndpointSnapshot(key="r", running=3, age_s=0)]).endpoint.key
        == "r"
    )
    assert (
        p.choose(RequestFacts(), [waiting_one, EndpointSnapshot(key="r", running=5, age_s=0)]).endpoint.key
        == "w"
    )


def test_least_load_burst_between_scrapes_spreads_instead_of_piling_on_the_idle_endpoint() -> None:
    p = make_policy("least_load")
    e = eps(3)
    e[0] = replace(e[0], running=0)
    e[1] = replace(e[1], running=4)
    e[2] = replace(e[2], running=4)
    keys = dispatch(p, RequestFacts(), e, 13)
    # The idle one takes the first 4 until it matches the others, then all three share the rest.
    assert keys[:4] == ["http://e0"] * 4
    assert Counter(keys[4:]) == {"http://e0": 3, "http://e1": 3, "http://e2": 3}


def test_least_load_all_equal_rotates() -> None:
    p = make_policy("least_load")
    e = eps(4, running=2)
    assert Counter(p.choose(RequestFacts(), e).endpoint.key for _ in range(8)) == {
        f"http://e{i}": 2 for i in range(4)
    }


def test_least_load_stale_telemetry_uses_router_inflight() -> None:
    p = make_policy("least_load", stale_s=0.5)
    busy_but_stale = EndpointSnapshot(key="a", running=0, inflight=5, age_s=0.6)
    fresh = EndpointSnapshot(key="b", running=3, inflight=0, age_s=0.1)
    d = p.choose(RequestFacts(), [busy_but_stale, fresh])
    assert d.endpoint.key == "b"
    d = p.choose(RequestFacts(), [replace(busy_but_stale, inflight=2), fresh])
    assert d.endpoint.key == "a" and d.reason == "stale_telemetry"


def test_p2c_is_seeded_and_never_takes_the_worse_of_its_two() -> None:
    e = eps(2)
    e[1] = replace(e[1], running=1)
    p = make_policy("p2c", seed=1)
    assert all(p.choose(RequestFacts(), e).endpoint.key == "http://e0" for _ in range(20))
    many = eps(5)
    many = [replace(x, running=i) for i, x in enumerate(many)]
    a = [make_policy("p2c", seed=7).choose(RequestFacts(), many).endpoint.key for _ in range(3)]
    p1, p2 = make_policy("p2c", seed=7), make_policy("p2c", seed=7)
    seq1 = [p1.choose(RequestFacts(), many).endpoint.key for _ in range(30)]
    assert seq1 == [p2.choose(RequestFacts(), many).endpoint.key for _ in range(30)]
    assert "http://e4" not in seq1  # the most loaded one loses to whichever it is paired with
    assert len(set(a)) == 1
    assert make_policy("p2c").choose(RequestFacts(), e[:1]).reason == "only_choice"


@pytest.mark.parametrize(("kv", "expect_penalty"), [(0.79, False), (0.81, True)])
def test_kv_aware_penalty_starts_past_the_threshold(kv: float, expect_penalty: bool) -> None:
    # a: one more running request, cool cache. b: KV at ``kv``. With weight 100, 0.01 past the threshold
    # costs 5 load units (> the 1 running request of a); 0.01 under it costs nothing.
    p = make_policy("kv_aware", kv_threshold=0.8, kv_weight=100.0)
    a = EndpointSnapshot(key="a", running=1, kv_usage=0.1, age_s=0)
    b = EndpointSnapshot(key="b", running=0, kv_usage=kv, age_s=0)
    want = "a" if expect_penalty else "b"
    assert p.choose(RequestFacts(), [a, b]).endpoint.key == want


def test_kv_aware_avoids_near_full_unless_all_are() -> None:
    p = make_policy("kv_aware", kv_full=0.98)
    full = EndpointSnapshot(key="full", running=0, kv_usage=0.99, age_s=0)
    busy = EndpointSnapshot(key="busy", running=30, kv_usage=0.5, age_s=0)
    assert p.choose(RequestFacts(), [full, busy]).endpoint.key == "busy"
    d = p.choose(RequestFacts(), [full, replace(busy, kv_usage=0.985)])
    assert d.reason == "kv_all_full" and d.endpoint.key == "full"
    # Stale KV numbers are not trusted either way.
    assert p.choose(RequestFacts(), [replace(full, age_s=5.0), busy]).endpoint.key == "full"


def test_prefix_affinity_sticks_to_the_holder_while_within_the_gap_then_spills() -> None:
    p = make_policy("prefix_affinity", gap_abs=4.0, gap_rel=0.0)
    e = eps(3)
    keys = dispatch(p, hot(), e, 12)
    # First one is cold, then sticks until its load is 5 > 0 + 4; the spill target then holds it too.
    assert keys[:5] == [keys[0]] * 5
    assert keys[5] != keys[0]
    assert len(set(keys)) == 3  # bounded: never more than the gap away from the least loaded
    loads = Counter(keys)
    assert max(loads.values()) - min(loads.values()) <= 5
    d = p.choose(hot(), e)
    assert d.reason in ("prefix_hit", "prefix_overloaded")


def test_prefix_affinity_threshold_each_side_of_the_gap() -> None:
    p = make_policy("prefix_affinity", gap_abs=4.0, gap_rel=0.5)
    e = eps(2)
    p.on_dispatch(hot(), "http://e0")
    # least load 2 -> allowed gap 4 + 1 = 5: load 7 stays, load 8 spills
    e = [replace(e[0], running=7), replace(e[1], running=2)]
    assert p.choose(hot(), e).reason == "prefix_hit"
    e[0] = replace(e[0], running=8)
    d = p.choose(hot(), e)
    assert d.reason == "prefix_overloaded" and d.endpoint.key == "http://e1"


def test_prefix_affinity_longest_match_wins_and_cold_requests_spread() -> None:
    p = make_policy("prefix_affinity")
    e = eps(3)
    base = "system prompt " * 100
    short = RequestFacts(prefix_hashes=chunk_hashes(base[: CHUNK_CHARS * 2]))
    long = RequestFacts(prefix_hashes=chunk_hashes(base[: CHUNK_CHARS * 6]))
    p.on_dispatch(short, "http://e1")
    p.on_dispatch(long, "http://e2")
    assert p.choose(long, e).endpoint.key == "http://e2"
    cold = [
        p.choose(RequestFacts(prefix_hashes=chunk_hashes(f"{i} other text " * 40)), e).endpoint.key
        for i in range(6)
    ]
    assert Counter(cold) == {"http://e0": 2, "http://e1": 2, "http://e2": 2}
    assert p.choose(RequestFacts(), e).reason == "cold"


def test_prefix_affinity_ejected_holder_is_not_chosen() -> None:
    p = make_policy("prefix_affinity")
    p.on_dispatch(hot(), "http://e0")
    others = eps(3)[1:]  # the router passes only eligible endpoints: e0 is ejected
    d = p.choose(hot(), others)
    assert d.endpoint.key != "http://e0" and d.reason == "cold"


def test_chunk_hashes_are_chained_deterministic_and_skip_a_partial_tail() -> None:
    a = chunk_hashes("x" * CHUNK_CHARS * 3 + "tail")
    assert len(a) == 3
    assert a == chunk_hashes("x" * CHUNK_CHARS * 3)
    b = chunk_hashes("y" + "x" * (CHUNK_CHARS * 3 - 1))
    assert not set(a) & set(b)  # a different first chunk changes every later hash
    assert chunk_hashes("short") == ()
    assert chunk_hashes("é" * CHUNK_CHARS) == chunk_hashes("é" * CHUNK_CHARS)


def test_prefix_index_is_bounded_lru() -> None:
    idx = PrefixIndex(capacity=4)
    idx.insert("k", [1, 2, 3])
    idx.insert("k", [1, 5, 6])  # touches 1; 2 is now the oldest and goes
    assert idx.size("k") == 4
    assert idx.match("k", [1, 2]) == 1
    assert idx.match("k", [1, 5, 6]) == 3
    idx.forget("k")
    assert idx.match("k", [1]) == 0


def test_session_is_sticky_consistent_and_bounded() -> None:
    p = make_policy("session", epsilon=0.25)
    e = eps(4)
    owners = {
        f"user-{i}": p.choose(RequestFacts(session_key=f"user-{i}"), e).endpoint.key for i in range(200)
    }
    assert all(p.choose(RequestFacts(session_key=s), e).endpoint.key == k for s, k in owners.items())
    assert len(set(owners.values())) == 4  # keys spread over the ring
    # Consistency: removing one endpoint moves only the sessions it owned.
    rest = [x for x in e if x.key != "http://e3"]
    moved = [
        s
        for s, k in owners.items()
        if k != "http://e3" and p.choose(RequestFacts(session_key=s), rest).endpoint.key != k
    ]
    assert moved == []
    # Bounded load: a hot session overflows to the next endpoint once its owner is past (1+eps) x average.
    facts = RequestFacts(session_key="hot-user")
    keys = dispatch(p, facts, e, 20)
    assert keys[0] == owners.get("hot-user", keys[0])
    assert max(Counter(keys).values()) <= math.ceil(1.25 * 20 / 4) + 1
    assert p.choose(facts, e).reason in ("session_owner", "session_overflow")
    assert p.choose(RequestFacts(), e).reason == "no_session_key"


def test_session_overflow_threshold() -> None:
    p = make_policy("session", epsilon=0.0)
    e = eps(2)
    owner = p.choose(RequestFacts(session_key="s"), e).endpoint.key
    i = [x.key for x in e].index(owner)
    # cap = ceil((load_total + 1) / 2): owner load 1, other 1 -> cap 2: owner still fits.
    e = [replace(x, running=1) for x in e]
    assert p.choose(RequestFacts(session_key="s"), e).reason == "session_owner"
    e[i] = replace(e[i], running=2)  # total 3 -> cap 2: 2 + 1 > 2 -> overflow
    d = p.choose(RequestFacts(session_key="s"), e)
    assert d.reason == "session_overflow" and d.endpoint.key != owner
