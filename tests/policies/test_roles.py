"""P/D's plugins: the role filter (a preference in a profile, a rule in a stage's gate) and the prefill rank's
scorer (least prefill work ahead), run through the one decision entry, ``route``."""

from __future__ import annotations

import pytest

from lbd.policies import Decision, EndpointSnapshot, Refusal, RequestFacts, make_policy, route
from lbd.policies.compose import ConfigError, parse
from lbd.policies.roles import stage_gate


def ranks(*roles: str, **fields: object) -> list[EndpointSnapshot]:
    return [EndpointSnapshot(key=f"e{i}", rank=i, role=r, age_s=0.0, **fields)  # type: ignore[arg-type]
            for i, r in enumerate(roles)]


def test_a_stage_gate_keeps_its_role_and_refuses_when_none_is_ready() -> None:
    eps = ranks("prefill", "decode", "mixed", "decode")
    policy = make_policy("round_robin")
    picks = {route(policy, RequestFacts(), eps, gate=stage_gate("decode")).endpoint.key for _ in range(4)}
    assert picks == {"e1", "e3"}
    eps[1].healthy = False
    refused = route(policy, RequestFacts(model="m"), eps, ["e3"], gate=stage_gate("decode"))
    assert isinstance(refused, Refusal) and refused.status == 503
    refused = route(policy, RequestFacts(model="m"), eps[:3], gate=stage_gate("decode"))
    assert isinstance(refused, Refusal) and (refused.status, refused.reason) == (503, "no_decode_rank")
    assert "decode rank" in refused.message and "'m'" in refused.message


def test_the_prefill_profile_picks_the_least_prefill_work_ahead() -> None:
    policy = make_policy("pd_prefill")
    eps = ranks("prefill", "prefill", "decode")
    facts = RequestFacts(prompt_tokens=1000, cached_tokens={"e0": 800})
    d = route(policy, facts, eps, gate=stage_gate("prefill"))
    assert isinstance(d, Decision) and d.endpoint.key == "e0"  # 200 uncached tokens against 1000
    assert (d.plugin, d.reason) == ("prefill_work", "least_prefill_work")
    assert d.line().startswith("least_prefill_work (prefill_work): ahead 0 tokens, prompt 1000 (800 cached)")
    assert policy.charge_tokens(facts, eps[0]) == 200.0 and policy.charge_tokens(facts, eps[1]) == 1000.0
    eps[0].unstarted_tokens = 900  # a stage of ours there has no first byte yet: 1100 ahead against 1000
    assert route(policy, facts, eps, gate=stage_gate("prefill")).endpoint.key == "e1"
    # equal work: the scraped backlog breaks the tie (fresh telemetry only), whole tokens still come first
    eps[0].unstarted_tokens, eps[0].waiting, eps[1].waiting = 800, 3, 50  # 1000 + 3/4 against 1000 + 50/51
    assert route(policy, facts, eps, gate=stage_gate("prefill")).endpoint.key == "e0"
    eps[1].age_s = 5.0  # stale: its backlog is not known
    assert route(policy, facts, eps, gate=stage_gate("prefill")).endpoint.key == "e1"
    eps[1].age_s, eps[0].unstarted_tokens = 0.0, 801  # 1001 + 3/4 against 1000 + 50/51
    assert route(policy, facts, eps, gate=stage_gate("prefill")).endpoint.key == "e1"


def test_the_role_filter_composes_as_a_preference_and_checks_its_option() -> None:
    name, _, build = parse({"name": "prefer_decode", "filters": [{"plugin": "role", "role": "decode"}],
                            "scorers": ["queue"]})
    policy = build()
    eps = ranks("prefill", "decode")
    assert route(policy, RequestFacts(), eps).endpoint.key == "e1"
    assert route(policy, RequestFacts(), eps[:1]).endpoint.key == "e0"  # none of the role: a preference
    with pytest.raises(ConfigError, match="role must be one of prefill, decode, mixed"):
        parse({"name": "bad", "filters": [{"plugin": "role", "role": "producer"}]})
