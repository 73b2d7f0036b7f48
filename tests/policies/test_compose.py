"""Profiles composed from a routing config (a filter and weighted scorers, no code), a scorer added by a
module of its own, learned state reset in one call, and the plugin that decided named in the decision."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lbd.policies import (
    Context,
    Decision,
    EndpointSnapshot,
    RequestFacts,
    Scorer,
    make_policy,
    plugin,
    route,
)
from lbd.policies.compose import ConfigError, parse
from lbd.policies.registry import prefill_profile, unregister_profile
from lbd.router.config import parse_args


@plugin
class HighRank(Scorer):
    """A scorer added by this test module alone: prefers higher ranks (nothing in lbd changes for it)."""

    name = "test_high_rank"
    help = "higher ranks first (a test's scorer)"

    def score(self, ctx: Context) -> list[float]:
        return [-float(e.rank or 0) for e in ctx.pool]

    def reason(self, ctx: Context, pick: int) -> str:
        return "high_rank"


def endpoints() -> list[EndpointSnapshot]:
    """e0: idle but its KV cache full; e1: two waiting, cool cache; e2: idle, KV at 0.8."""
    return [
        EndpointSnapshot(key="e0", rank=0, kv_usage=0.95, age_s=0.0),
        EndpointSnapshot(key="e1", rank=1, waiting=2, age_s=0.0),
        EndpointSnapshot(key="e2", rank=2, kv_usage=0.8, age_s=0.0),
    ]


def profile_file(tmp_path: Path, kv_weight: float, name: str = "kv_mix") -> Path:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "name": name,
        "filters": [{"plugin": "kv_room", "kv_full": 0.9}],
        "scorers": [{"plugin": "queue", "weight": 1},
                    {"plugin": "kv_pressure", "kv_threshold": 0.5, "weight": kv_weight}],
    }))
    return path


def from_file(path: Path):
    _, _, build = parse(json.loads(path.read_text()))
    return build(stale_s=1.0)


def test_a_profile_from_a_file_routes_by_its_filter_and_weighted_scorers(tmp_path: Path) -> None:
    # weight 10: e2 scores 0 + 10 x 0.6 = 6 against e1's 8 (queue): the queue decided
    light = from_file(profile_file(tmp_path, 10.0))
    d = route(light, RequestFacts(), endpoints())
    assert isinstance(d, Decision) and d.endpoint.key == "e2"
    assert (d.plugin, d.reason) == ("queue", "least_load") and d.line().startswith("least_load (queue): ")
    # weight 20: e2 scores 12 > 8: KV pressure decided
    heavy = from_file(profile_file(tmp_path, 20.0))
    d = route(heavy, RequestFacts(), endpoints())
    assert d.endpoint.key == "e1" and d.plugin == "kv_pressure"
    assert d.line().startswith("kv_aware (kv_pressure): kv 0.00, score 8.0")
    # the filter: e0 (idle, KV 0.95) wins once its pressure costs nothing, unless kv_room drops it
    cheap = from_file(profile_file(tmp_path, 0.0))
    assert {route(cheap, RequestFacts(), endpoints()).endpoint.key for _ in range(4)} == {"e2"}
    _, _, unfiltered = parse({"name": "unfiltered", "scorers": ["queue"]})
    no_filter = unfiltered()
    assert {route(no_filter, RequestFacts(), endpoints()).endpoint.key for _ in range(4)} == {"e0", "e2"}
    assert cheap.describe()["filters"] == ["kv_room"] and cheap.describe()["scorers"] == [
        {"plugin": "queue", "weight": 1.0}]  # weight 0: off
    assert heavy.describe()["decided"] == {"kv_pressure/kv_aware": 1}


def test_a_scorer_registered_by_its_own_module_composes_like_a_built_in_one() -> None:
    _, _, build = parse({"name": "ranked", "filters": ["kv_room"],
                         "scorers": [{"plugin": "test_high_rank", "weight": 2}, "queue"]})
    d = route(build(), RequestFacts(), endpoints())  # e2: -2 x 2 + 0; e0: 0 + 0; e1: -1 x 2 + 8
    assert (d.endpoint.key, d.plugin, d.reason) == ("e2", "test_high_rank", "high_rank")


def test_the_exact_prefix_overlap_scorer_weighs_cached_tokens_against_load() -> None:
    gap = {"plugin": "load_gap", "gap_abs": 4, "gap_rel": 0, "exact_exempt": False}
    _, _, build = parse({"name": "overlap", "filters": [gap],
                         "scorers": [{"plugin": "queue"}, {"plugin": "prefix_overlap", "weight": 8}]})
    p = build()
    eps = [EndpointSnapshot(key=f"e{i}", rank=i, running=r, age_s=0.0) for i, r in enumerate((0, 3, 6))]
    facts = RequestFacts(prompt_tokens=1000, cached_tokens={"e1": 1000, "e2": 1000})
    d = route(p, facts, eps)  # e1 holds it all: 3 + 0 against e0's 0 + 8
    assert (d.endpoint.key, d.plugin, d.reason) == ("e1", "prefix_overlap", "prefix_overlap")
    assert d.explain() == "1000 of 1000 prompt tokens cached"
    # e2 holds it too, but is past the load gap (6 > 0 + 4)
    assert route(p, RequestFacts(prompt_tokens=1000, cached_tokens={"e2": 1000}), eps).endpoint.key == "e0"


@pytest.mark.parametrize(("config", "words"), [
    ([], ["JSON object"]),
    ({"name": "x", "scorer": []}, ["unknown key 'scorer'", "scorers"]),
    ({"name": "least_load"}, ["built-in", "--policy least_load"]),
    ({"name": "x", "scorers": ["nope"]}, ["scorer 'nope' is not registered", "queue", "prefix_overlap"]),
    ({"name": "x", "filters": ["ready"]}, ["filter 'ready'", "gate", "leave it out"]),
    ({"name": "x", "scorers": [{"plugin": "queue", "gap": 1}]}, ["'queue' has no option 'gap'", "label"]),
    ({"name": "x", "scorers": [{"plugin": "queue", "weight": -1}]}, ["scorer 'queue'", "weight", ">= 0"]),
    ({"name": "x", "filters": [{"plugin": "kv_room", "kv_full": "high"}]}, ["kv_room", "kv_full", "number"]),
    ({"name": "x", "picker": "best"}, ["picker 'best' is not registered", "lowest", "p2c"]),
])
def test_an_invalid_config_names_the_plugin_and_the_fix(config: object, words: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        parse(config)
    assert all(w in str(e.value) for w in words), e.value


def test_routing_config_flag_registers_the_profile_and_bad_files_exit_2(tmp_path: Path, capsys) -> None:
    up = ["--upstreams", "http://127.0.0.1:1"]
    try:
        cfg = parse_args([*up, "--routing-config", str(profile_file(tmp_path, 10.0, "flag_mix"))])
        assert cfg.policy == "flag_mix" and make_policy("flag_mix").describe()["filters"] == ["kv_room"]
    finally:
        unregister_profile("flag_mix")
    bad = tmp_path / "bad.json"
    for text, words in ((json.dumps({"name": "b", "scorers": ["nope"]}), "scorer 'nope' is not registered"),
                        ("{not json", "not JSON")):
        bad.write_text(text)
        with pytest.raises(SystemExit) as e:
            parse_args([*up, "--routing-config", str(bad)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "--routing-config" in err and words in err, err
    with pytest.raises(SystemExit):
        parse_args([*up, "--routing-config", str(tmp_path / "missing.json")])
    assert "--routing-config" in capsys.readouterr().err


def test_a_routing_config_names_the_prefill_profile_of_pd(tmp_path: Path) -> None:
    """``prefill``: a composed profile (registered beside the policy) or a policy's name; else pd_prefill."""
    config = {"name": "pd_mix", "scorers": ["queue"],
              "prefill": {"name": "pd_mix_prefill", "filters": [{"plugin": "role", "role": "prefill"}],
                          "scorers": ["prefill_work", {"plugin": "queue", "weight": 100}]}}
    path = tmp_path / "pd.json"
    path.write_text(json.dumps(config))
    try:
        up = ["--upstreams", "http://127.0.0.1:1"]
        assert parse_args([*up, "--routing-config", str(path)]).policy == "pd_mix"
        assert prefill_profile("pd_mix") == "pd_mix_prefill"
        described = make_policy("pd_mix_prefill").describe()
        assert described["filters"] == ["role"]
        assert [s["plugin"] for s in described["scorers"]] == ["prefill_work", "queue"]
        parse_args([*up, "--routing-config", str(profile_file(tmp_path, 1.0, "pd_mix"))])  # again, no prefill
        assert prefill_profile("pd_mix") == "pd_prefill"
    finally:
        unregister_profile("pd_mix")
        unregister_profile("pd_mix_prefill")
    for prefill, words in (("nope", "'prefill': 'nope' is not a registered policy"),
                           ({"name": "x"}, "a name of its own"), (3, "a profile object")):
        with pytest.raises(ConfigError, match=words):
            parse({"name": "x", "prefill": prefill})


def test_reset_forgets_what_every_plugin_learned() -> None:
    p = make_policy("predicted_ttft")
    facts = RequestFacts(prefix_hashes=(1, 2, 3), prompt_tokens=3000, block_keys={16: list(range(10))})
    eps = [EndpointSnapshot(key=f"e{i}", rank=i, age_s=0.0, num_blocks=100) for i in range(3)]
    for _ in range(3):
        d = p.choose(facts, eps)
        p.on_dispatch(facts, d.endpoint.key)
        p.on_first_byte(d, 0.5)
    assert p.rate != 4000.0 and p.index.size(d.endpoint.key) == 3 and p.footprint.hot_tokens(d.endpoint.key)
    p.reset()
    assert p.rate == 4000.0 and p.avg_prompt_tokens == 256.0 and p.picker.turn == 0
    assert p.index.size(d.endpoint.key) == 0 and p.footprint.hot_tokens(d.endpoint.key) == 0
    assert p.describe()["decided"] == {}
    assert sorted(p.describe()["learned"]) == ["Footprint", "Placements", "PrefixMemory", "TtftModel"]


def test_every_decision_names_the_plugin_that_decided() -> None:
    eps = [EndpointSnapshot(key=f"e{i}", rank=i, age_s=0.0) for i in range(2)]
    expect = {"round_robin": "round_robin", "least_load": "queue", "p2c": "p2c", "kv_aware": "kv_pressure",
              "prefix_affinity": "longest_prefix", "session": "session", "predicted_ttft": "ttft"}
    for name, plugin_name in expect.items():
        d = route(make_policy(name), RequestFacts(session_key="s"), eps)
        assert d.plugin == plugin_name and d.line().startswith(f"{d.reason} ({plugin_name})"), (name, d)
    pinned = route(make_policy("least_load"), RequestFacts(pinned_rank=1), eps)
    assert (pinned.plugin, pinned.reason) == ("pinned_rank", "pinned")


def test_the_gate_passes_over_what_a_request_should_avoid_while_another_is_left() -> None:
    policy = make_policy("least_load")
    eps = [EndpointSnapshot(key=f"e{i}", running=i, age_s=0) for i in range(3)]
    assert route(policy, RequestFacts(), eps).endpoint.key == "e0"
    assert route(policy, RequestFacts(avoid=frozenset({"e0"})), eps).endpoint.key == "e1"
    # avoiding every endpoint is a preference that cannot be met, not a refusal
    assert route(policy, RequestFacts(avoid=frozenset({"e0", "e1", "e2"})), eps).endpoint.key == "e0"
