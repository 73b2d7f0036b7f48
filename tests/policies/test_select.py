"""Eligibility, pinning and refusals in front of every policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lbd.policies import Decision, EndpointSnapshot, Refusal, RequestFacts, make_policy, route


def nodes() -> list[EndpointSnapshot]:
    return [EndpointSnapshot(key=f"u{i}", rank=i, models=frozenset({"m"}), age_s=0) for i in range(3)]


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "p2c", "kv_aware", "prefix_affinity", "session", "predicted_ttft"]
)
def test_no_policy_ever_picks_an_ejected_or_draining_endpoint(name: str) -> None:
    p = make_policy(name)
    e = nodes()
    e[0] = replace(e[0], healthy=False)
    e[1] = replace(e[1], draining=True, running=0)
    e[2] = replace(e[2], running=100, kv_usage=0.99)
    for i in range(20):
        d = route(p, RequestFacts(model="m", session_key=f"s{i}"), e)
        assert isinstance(d, Decision) and d.endpoint.key == "u2"


def test_unknown_model_is_404_and_models_filter_endpoints() -> None:
    e = nodes()
    e[2] = replace(e[2], models=frozenset({"other"}))
    r = route(make_policy("least_load"), RequestFacts(model="nope"), e)
    assert isinstance(r, Refusal) and r.status == 404 and r.type == "NotFoundError"
    keys = {route(make_policy("round_robin"), RequestFacts(model="other"), e).endpoint.key for _ in range(3)}
    assert keys == {"u2"}


def test_pin_routes_to_the_rank_and_unknown_rank_is_400_listing_ranks() -> None:
    p = make_policy("least_load")
    e = nodes()
    e[1] = replace(e[1], running=99)
    d = route(p, RequestFacts(model="m", pinned_rank=1), e)
    assert d.endpoint.key == "u1" and d.reason == "pinned"
    r = route(p, RequestFacts(model="m", pinned_rank=7), e)
    assert r.status == 400 and "known ranks: [0, 1, 2]" in r.message and r.param == "X-data-parallel-rank"


@pytest.mark.parametrize(("field", "state"), [("healthy", "unhealthy"), ("draining", "draining")])
def test_pinned_rank_unavailable_is_503_unless_pin_fallback(field: str, state: str) -> None:
    p = make_policy("least_load")
    e = nodes()
    e[1] = replace(e[1], **{field: field == "draining"})
    r = route(p, RequestFacts(model="m", pinned_rank=1), e)
    assert isinstance(r, Refusal) and r.status == 503 and state in r.message and "--pin-fallback" in r.message
    d = route(p, RequestFacts(model="m", pinned_rank=1), e, pin_fallback=True)
    assert isinstance(d, Decision) and d.endpoint.key != "u1" and d.reason == "pin_fallback"


def test_all_out_is_a_clear_503_and_retries_exclude_tried_endpoints() -> None:
    p = make_policy("round_robin")
    e = [replace(x, healthy=False) for x in nodes()]
    r = route(p, RequestFacts(model="m"), e)
    assert r.status == 503 and "3 ejected" in r.message
    e = nodes()
    d = route(p, RequestFacts(model="m"), e, exclude={"u0", "u1"})
    assert d.endpoint.key == "u2"
    r = route(p, RequestFacts(model="m"), e, exclude={"u0", "u1", "u2"})
    assert r.status == 503 and r.reason == "retries_exhausted"
    assert route(p, RequestFacts(model="m"), []).status == 503
