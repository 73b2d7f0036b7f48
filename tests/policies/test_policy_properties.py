"""Property tests (hypothesis) of every registered policy behind ``route``: whatever the endpoints' states
and telemetry, a decision never names an ejected, draining, excluded or model-less endpoint, honours a pin,
and keeps load bounded (each policy's own bound: the least loaded, a gap above it, or the bounded-load
cap)."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from lbd.policies import (
    Decision,
    EndpointSnapshot,
    Refusal,
    RequestFacts,
    available,
    make_policy,
    queue_score,
    route,
)
from support.hostile import PROPERTY

MODELS = ["a", "b"]
POLICIES = sorted(available())


@st.composite
def endpoints(draw: st.DrawFn) -> list[EndpointSnapshot]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        fresh = draw(st.booleans())
        out.append(EndpointSnapshot(
            key=f"http://10.0.0.{i}:8000", rank=draw(st.sampled_from([i, i, None])),
            models=frozenset(draw(st.lists(st.sampled_from(MODELS), max_size=2))),
            healthy=draw(st.sampled_from([True, True, False])),
            draining=draw(st.sampled_from([False, False, True])),
            inflight=draw(st.integers(0, 50)), delta=draw(st.integers(-5, 20)),
            unstarted=draw(st.integers(0, 5)), unstarted_tokens=draw(st.integers(0, 5000)),
            running=draw(st.floats(0, 64)), waiting=draw(st.floats(0, 64)), kv_usage=draw(st.floats(0, 1)),
            prefix_hit_rate=draw(st.floats(0, 1)), age_s=0.1 if fresh else math.inf))
    return out


facts = st.builds(RequestFacts, model=st.sampled_from([None, *MODELS, "c"]),
                  prefix_hashes=st.lists(st.integers(0, 7), max_size=4).map(tuple),
                  session_key=st.sampled_from([None, "s1", "s2", "s3"]),
                  pinned_rank=st.sampled_from([None, 0, 1, 9]), prompt_tokens=st.integers(0, 4000))


@PROPERTY
@given(st.sampled_from(POLICIES), endpoints(), facts, st.data(), st.booleans())
def test_route_never_picks_an_endpoint_it_must_not(name: str, eps: list[EndpointSnapshot], f: RequestFacts,
                                                    data: st.DataObject, fallback: bool) -> None:
    policy = make_policy(name, seed=1)
    exclude = data.draw(st.lists(st.sampled_from([e.key for e in eps]), max_size=2))
    decision = route(policy, f, eps, exclude, fallback)
    if isinstance(decision, Refusal):
        assert 400 <= decision.status < 600 and decision.message
        return
    ep = decision.endpoint
    assert ep in eps and ep.healthy and not ep.draining and ep.key not in exclude
    assert ep.serves(f.model)
    if f.pinned_rank is not None and decision.reason != "pin_fallback":
        assert ep.rank == f.pinned_rank


def _bound(name: str, policy, least: float, scores: list[float]) -> float:
    """How far above the least loaded endpoint a policy may place a request (its documented bound)."""
    if name in ("least_load", "kv_aware"):
        return least
    if name in ("prefix_affinity", "predicted_ttft"):
        return least + policy.gap_abs + policy.gap_rel * least
    if name == "session":
        return max(math.ceil((1.0 + policy.epsilon) * (sum(scores) + 1.0) / len(scores)), least)
    return math.inf  # round_robin, p2c: no load bound of their own


@PROPERTY
@given(st.sampled_from(POLICIES), st.integers(2, 5), st.lists(facts, min_size=5, max_size=60))
def test_load_stays_bounded_under_a_burst(name: str, n: int, requests: list[RequestFacts]) -> None:
    """A burst with nothing finishing, on equal fresh endpoints: each pick within the policy's bound, and the
    spread between the busiest and the idlest endpoint bounded too (round robin and p2c included)."""
    policy = make_policy(name, seed=2)
    eps = [EndpointSnapshot(key=f"http://e{i}", rank=i, models=frozenset(MODELS), age_s=0.0)
           for i in range(n)]
    for f in requests:
        f.pinned_rank, f.model = None, "a"
        d = route(policy, f, eps)
        assert isinstance(d, Decision)
        scores = [queue_score(e, policy.stale_s) for e in eps]
        assert queue_score(d.endpoint, policy.stale_s) <= _bound(name, policy, min(scores), scores) + 1e-9
        policy.on_dispatch(f, d.endpoint.key)
        d.endpoint.inflight += 1
        d.endpoint.delta += 1
    loads = [e.inflight for e in eps]
    if name in ("least_load", "kv_aware", "round_robin"):
        assert max(loads) - min(loads) <= 1, loads
    elif name != "p2c":
        assert max(loads) - min(loads) <= 8 + 0.5 * max(loads), loads
