"""Pure pieces of the router: upstream parsing, metrics parsing, request facts, shared counters."""

from __future__ import annotations

import dataclasses

import pytest

from lbd.policies import CHUNK_CHARS
from lbd.router.config import parse_upstream
from lbd.router.facts import BadRequest, parse_facts, path_facts
from lbd.router.messages import Headers
from lbd.router.shared import SharedCounters
from lbd.router.telemetry import parse_metrics, parse_telemetry


def test_upstream_specs_including_ipv6_and_supervisors() -> None:
    assert parse_upstream("http://[::1]:8001/").url == "http://[::1]:8001"
    sup = parse_upstream("supervisor://[fe80::1]")
    assert sup.kind == "supervisor" and sup.status_url == "http://[fe80::1]:9256/status"
    assert parse_upstream("https://example.org").url == "https://example.org:443"
    for bad in ("localhost:1", "http://:1", "gopher://x:1", "http://x:1/path"):
        with pytest.raises(ValueError):
            parse_upstream(bad)


ENGINE_TEXT = """# HELP vllm:num_requests_running x
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="3",model_name="m"} 2.0
vllm:num_requests_waiting{engine="3",model_name="m"} 5.0
vllm:kv_cache_usage_perc{engine="3",model_name="m"} 0.25
vllm:prefix_cache_queries_total{engine="3",model_name="m"} 1000.0
vllm:prefix_cache_hits_total{engine="3",model_name="m"} 400.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="3",model_name="m",num_gpu_blocks="2048"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="3",le="0.1",model_name="m"} 7.0
vllm:request_success_total{engine="3",finished_reason="stop",model_name="m"} 9.0
"""


def test_parse_engine_metrics() -> None:
    s = parse_metrics(ENGINE_TEXT)
    assert (s.running, s.waiting, s.kv_usage) == (2.0, 5.0, 0.25)
    assert (s.prefix_queries, s.prefix_hits, s.block_size, s.num_blocks) == (1000.0, 400.0, 16, 2048)
    assert s.ranks == {3} and s.models == {"m"}
    assert parse_metrics('vllm:gpu_cache_usage_perc{model_name="a \\"q\\""} 0.5\n').models == {'a "q"'}


def test_parse_engine_telemetry_json() -> None:
    body = (b'{"engine": 3, "model_names": ["m"], "num_requests_running": 2, "num_requests_waiting": 5, '
            b'"kv_cache_usage_perc": 0.25, "block_size": 16, "num_gpu_blocks": 2048, '
            b'"prefix_cache_queries_total": 1000, "prefix_cache_hits_total": 400, "prompt_tokens_total": 7, '
            b'"generation_tokens_total": 9, "server_load": 7, "age_s": 0.01}')
    same = dataclasses.replace(parse_metrics(ENGINE_TEXT), prompt_tokens=7.0, generation_tokens=9.0)
    assert parse_telemetry(body) == same
    # vLLM's /load, a proxy's error page, not an object
    for other in (b'{"server_load": 3}', b"<html>not found</html>", b"[1, 2]"):
        with pytest.raises(ValueError):
            parse_telemetry(other)


def test_old_and_new_vllm_names_are_not_counted_twice() -> None:
    both = ENGINE_TEXT + (
        'vllm:gpu_prefix_cache_queries_total{engine="3",model_name="m"} 1000.0\n'
        'vllm:gpu_prefix_cache_hits_total{engine="3",model_name="m"} 400.0\n'
        'vllm:gpu_cache_usage_perc{engine="3",model_name="m"} 0.9\n'
        'vllm:num_requests_waiting_by_reason{engine="3",model_name="m",reason="capacity"} 99.0\n'
    )
    s = parse_metrics(both)
    assert (s.prefix_queries, s.prefix_hits, s.kv_usage, s.waiting) == (1000.0, 400.0, 0.25, 5.0)
    old = parse_metrics('vllm:gpu_prefix_cache_queries_total{engine="1"} 10\n'
                        'vllm:gpu_cache_usage_perc{engine="1"} 0.5\n')
    assert (old.prefix_queries, old.kv_usage, old.ranks) == (10.0, 0.5, {1})


SGLANG_TEXT = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 3.0
sglang:num_queue_reqs{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 4.0
sglang:token_usage{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 0.5
sglang:prompt_tokens_total{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 2e3
sglang:cached_tokens_total{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 500
sglang:page_size{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 1.0
sglang:max_total_num_tokens{engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"} 8192
"""


def test_parse_sglang_metrics() -> None:
    s = parse_metrics(SGLANG_TEXT)
    assert (s.running, s.waiting, s.kv_usage) == (3.0, 4.0, 0.5)
    assert (s.prefix_queries, s.prefix_hits) == (2000.0, 500.0)
    assert (s.block_size, s.num_blocks, s.ranks, s.models) == (1, 8192, set(), {"m"})


def _headers(values: dict[str, str]) -> Headers:
    return Headers([(k.encode(), v.encode()) for k, v in values.items()])


def test_request_facts_from_completions_chat_and_token_prompts() -> None:
    h = _headers({"X-Session-ID": "s1", "X-data-parallel-rank": " 2 "})
    f = parse_facts(b'{"model": "m", "prompt": "' + b"a" * 400 + b'"}', h, "X-Session-ID")
    assert f.model == "m" and f.pinned_rank == 2 and f.session_key == "s1" and f.prompt_tokens == 101
    assert len(f.prefix_hashes) == 400 // CHUNK_CHARS
    chat = [
        {"role": "system", "content": "x" * 300},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    ]
    import orjson

    one = parse_facts(orjson.dumps({"model": "m", "messages": chat}), _headers({}), "X-Session-ID")
    two = parse_facts(
        orjson.dumps({"model": "m", "messages": [*chat, {"role": "user", "content": "y" * 300}]}),
        _headers({}),
        "X-Session-ID",
    )
    assert one.prefix_hashes and two.prefix_hashes[: len(one.prefix_hashes)] == one.prefix_hashes
    ids = parse_facts(orjson.dumps({"prompt": list(range(100)), "user": "u"}), _headers({}), "X-Session-ID")
    assert ids.prompt_tokens == 100 and len(ids.prefix_hashes) == 3 and ids.session_key == "u"
    with pytest.raises(BadRequest):
        parse_facts(b"[1, 2]", _headers({}), "X-Session-ID")
    with pytest.raises(BadRequest) as e:
        parse_facts(b"{}", _headers({"X-data-parallel-rank": "x"}), "X-Session-ID")
    assert e.value.param == "X-data-parallel-rank"


def test_request_facts_of_the_responses_api() -> None:
    import orjson

    def facts(body: dict, headers: dict | None = None):
        return parse_facts(orjson.dumps(body), _headers(headers or {}), "X-Session-ID")

    one = facts({"model": "m", "instructions": "s" * 300, "input": "a" * 300})
    two = facts({"model": "m", "instructions": "s" * 300, "input": [{"role": "user", "content": "a" * 300},
                                                                    {"role": "user", "content": "b" * 300}]})
    assert one.prefix_hashes and two.prefix_hashes[: len(one.prefix_hashes) - 1] == one.prefix_hashes[:-1]
    assert one.prompt_tokens > 150
    pinned = facts({"input": "x", "previous_response_id": "resp_r7-abc", "prompt_cache_key": "k"})
    assert (pinned.pinned_rank, pinned.session_key) == (7, "k")
    assert facts({"input": "x", "previous_response_id": "resp_abc"}).pinned_rank is None  # not lbd's
    header = facts({"input": "x", "previous_response_id": "resp_r7-abc"}, {"X-data-parallel-rank": "2"})
    assert header.pinned_rank == 2  # the header wins
    assert path_facts("/v1/responses/resp_r12-ff", _headers({})).pinned_rank == 12
    assert path_facts("/v1/models", _headers({})).pinned_rank is None


def test_shared_counters_sum_workers_and_close_out_a_dead_one() -> None:
    c = SharedCounters(workers=2, slots=8)
    a, b = c.slot("http://a:1"), c.slot("http://b:1")
    assert a != b and c.slot("http://a:1") == a
    c.dispatch(a, 100)
    c.bind_worker(1)
    c.dispatch(a, 50)
    c.start(a, 50)
    t = c.totals(a)
    assert (t.inflight, t.unstarted, t.unstarted_tokens) == (2, 1, 100)
    c.close_out(0)  # worker 0 died with its request
    t = c.totals(a)
    assert (t.inflight, t.unstarted, t.unstarted_tokens) == (1, 0, 0)
    c.finish(a)
    assert c.totals(a).inflight == 0 and c.totals(b).dispatched == 0


def test_endpoint_snapshot_follows_every_change_after_it_was_cached() -> None:
    """The policies' snapshot is one object per endpoint, copied again only after a change: each change the
    fleet records (telemetry, ejection, re-admission, the supervisor's word, models) shows in it."""
    import asyncio

    from lbd.router.config import parse_args
    from lbd.router.state import RouterState

    async def run() -> None:
        url = "http://a:1"
        state = RouterState(parse_args(["--upstreams", url, "--kv-events", "off",
                                        "--health-failure-threshold", "1"]), SharedCounters(1, 8))
        ep = state.add(url, "static")
        try:
            snap = state.snapshot(ep, now=10.0)
            assert snap.healthy and snap.rank is None and snap.age_s == float("inf")
            state.observe(ep, parse_metrics(ENGINE_TEXT), began_at=9.5)
            state.shared.dispatch(ep.slot, 10)
            assert state.snapshot(ep, now=10.0) is snap  # the same object, refreshed
            assert (snap.rank, snap.waiting, snap.running, snap.kv_usage) == (3, 5.0, 2.0, 0.25)
            assert (snap.inflight, snap.delta, snap.unstarted_tokens, snap.age_s) == (1, 1, 10, 0.5)
            state.fail(ep, "probe", "refused")  # one failure ejects (--health-failure-threshold 1)
            assert not state.snapshot(ep, now=10.0).healthy and ep.state() == "ejected"
            state.readmit(ep, "test")
            assert state.snapshot(ep, now=10.0).healthy
            state.supervise(ep, routable=True, draining=True, role="mixed", pid=7, state="draining")
            assert state.snapshot(ep, now=10.0).healthy and state.snapshot(ep, now=10.0).draining
            state.supervise(ep, routable=False, draining=False, role="mixed", pid=7, state="starting")
            assert not state.snapshot(ep, now=10.0).healthy
            state.set_models(ep, [{"id": "x"}])
            assert state.snapshot(ep, now=11.0).models == {"x"} and state.snapshot(ep, now=11.0).age_s == 1.5
        finally:
            state.remove(url)

    asyncio.run(run())


def test_client_keys_from_the_environment(monkeypatch) -> None:
    """$LBD_ROUTER_API_KEYS (one per line, how lbd serve hands its --api-key over) adds to --api-key, and
    counts as a key for the rate limits; $LBD_UPSTREAM_API_KEY is the key towards the engines."""
    from lbd.router.config import parse_args

    monkeypatch.setenv("LBD_ROUTER_API_KEYS", "env-one\n\n  env-two  \n")
    monkeypatch.setenv("LBD_UPSTREAM_API_KEY", "to-engines")
    cfg = parse_args(["--upstreams", "http://127.0.0.1:1", "--api-key", "flag-key", "--rate-limit-rps", "5"])
    assert cfg.api_keys == ["flag-key", "env-one", "env-two"] and cfg.upstream_api_key == "to-engines"
    monkeypatch.delenv("LBD_ROUTER_API_KEYS")
    assert parse_args(["--upstreams", "http://127.0.0.1:1"]).api_keys == []
