"""Prefill/decode disaggregation end to end: real `lbd serve` ranks, a producer and a consumer, driven with
vLLM's two-stage requests. Greedy output through the P/D path equals the colocated path's (tiny Llama and tiny
Mixtral, streamed and not, with and without a prefix already on the decode rank, where only the missing
blocks move); a producer killed before the pull leaves the decode to recompute; bad params get a 400."""

from __future__ import annotations

import os
import re
import time
import uuid

import httpx
import pytest

from lbd.engine.kv_transfer.trust import sign, transfer_key
from lbd.wire.kv_transfer import KVTransferParams, params_to_obj
from support.kv_events import subscribed, wait_for_stored_run
from support.pd import (
    BLOCK,
    assert_killed_producer_means_recompute,
    body,
    events_config,
    metric,
    moved,
    prefill,
    producer_and_consumer,
    prompt_ids,
    text_of,
)

LEASE_S = 4.0  # the producer's lease on blocks nobody pulls


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = request.getfixturevalue(f"tiny_{request.param}")
    logs = tmp_path_factory.mktemp(f"pd-{request.param}")
    with producer_and_consumer(model, logs, lease_s=LEASE_S, pull_timeout_s=2.0,
                               consumer_args=events_config(logs)) as pair:
        yield pair


@pytest.mark.parametrize("stream", [False, True])
def test_pd_equals_colocated_and_moves_only_missing_blocks(pair, stream: bool) -> None:
    producer, consumer = pair
    seed = 1 + stream
    base = prompt_ids(70, seed)  # 69 // 16 = 4 full blocks to move
    data = body(base, stream=stream)
    colocated = text_of(producer, "/v1/completions", body(base))
    pulled0, local0 = moved(consumer)
    params = prefill(producer, data)
    assert len(params["remote_block_ids"]) == len(base) // BLOCK
    assert text_of(consumer, "/v1/completions", {**data, "kv_transfer_params": params}) == colocated
    pulled1, local1 = moved(consumer)
    assert (pulled1 - pulled0, local1 - local0) == (4, 0)

    longer = base + prompt_ids(40, seed + 100)  # 109 tokens: 6 blocks, the first 4 already on the consumer
    colocated = text_of(producer, "/v1/completions", body(longer))
    params = prefill(producer, body(longer, stream=stream))
    out = text_of(consumer, "/v1/completions", body(longer, stream=stream, kv_transfer_params=params))
    assert out == colocated
    pulled2, local2 = moved(consumer)
    assert (pulled2 - pulled1, local2 - local1) == (2, 4)
    assert metric(consumer, "lbd:kv_transfer_bytes_per_token") > 0
    assert metric(consumer, "lbd:kv_transfer_bytes_total", direction="pulled") > 0


def test_vllm_proxy_two_stage_chat_field_for_field(pair) -> None:
    """The requests exactly as vLLM's disaggregated-serving toy proxy sends them (chat, streamed decode)."""
    producer, consumer = pair
    request = {"model": "tiny", "messages": [{"role": "user", "content": "proxy " * 40 + str(uuid.uuid4())}],
               "max_completion_tokens": 10, "temperature": 0, "stream": True,
               "stream_options": {"include_usage": True}}
    whole = {k: v for k, v in request.items() if k != "stream_options"}
    colocated = text_of(producer, "/v1/chat/completions", {**whole, "stream": False})
    request_id = str(uuid.uuid4())
    headers = {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}", "X-Request-Id": request_id}
    req_data = request.copy()
    req_data["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False,
                                      "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                      "remote_port": None}
    req_data["stream"] = False
    req_data["max_tokens"] = 1
    if "max_completion_tokens" in req_data:
        req_data["max_completion_tokens"] = 1
    if "stream_options" in req_data:
        del req_data["stream_options"]
    r = httpx.post(producer.base_url + "/v1/chat/completions", json=req_data, headers=headers, timeout=60)
    r.raise_for_status()
    kv_transfer_params = r.json().get("kv_transfer_params", {})
    assert set(kv_transfer_params) >= {"do_remote_decode", "do_remote_prefill", "remote_engine_id",
                                       "remote_block_ids", "remote_host", "remote_port", "remote_request_id",
                                       "tp_size"}
    decode = {**request, "kv_transfer_params": kv_transfer_params}
    pulled0, _ = moved(consumer)
    assert text_of(consumer, "/v1/chat/completions", decode) == colocated
    assert moved(consumer)[0] > pulled0


@pytest.mark.parametrize("params", [
    "yes", {"do_remote_prefill": True}, {"remote_port": "x"}, {"remote_block_ids": ["a"]},
    {"do_remote_decode": True, "do_remote_prefill": True},
])
def test_bad_kv_transfer_params_get_400(pair, params) -> None:
    producer, consumer = pair
    r = httpx.post(consumer.base_url + "/v1/completions",
                   json=body(prompt_ids(20, 5), kv_transfer_params=params), timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("kv_transfer_params", "n")


def test_unpulled_leases_are_counted_then_freed(pair) -> None:
    producer, consumer = pair
    if "mixtral" in str(consumer.log):
        pytest.skip("once is enough: a lease's expiry (the producer's timer) does not depend on the model")
    expired0 = metric(producer, "lbd:kv_transfer_expired_leases_total")
    prefill(producer, body(prompt_ids(40, 99)))
    assert metric(producer, "lbd:kv_transfer_pending_leases") >= 1
    deadline = time.monotonic() + LEASE_S + 10
    while metric(producer, "lbd:kv_transfer_pending_leases") and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(producer, "lbd:kv_transfer_pending_leases") == 0
    assert metric(producer, "lbd:kv_transfer_expired_leases_total") == expired0 + 1


def test_pulls_beyond_loopback_need_the_cluster_token(pair) -> None:
    """Even params a producer signed (here: signed with this user's local key, as a rank of this machine
    would) name a producer beyond loopback: without LBD_CLUSTER_TOKEN (CURVE) a consumer pulls only over
    loopback, and recomputes otherwise."""
    producer, consumer = pair
    base = prompt_ids(50, 4242)
    colocated = text_of(producer, "/v1/completions", body(base))
    params = KVTransferParams(do_remote_prefill=True, remote_engine_id="e", remote_block_ids=[1, 2, 3],
                              remote_host="192.0.2.1", remote_port=9, remote_request_id="r")
    key = transfer_key()
    assert key is not None
    failed0 = metric(consumer, "lbd:kv_transfer_failed_pulls_total")
    data = body(base, kv_transfer_params=params_to_obj(sign(key, params)))
    assert text_of(consumer, "/v1/completions", data) == colocated
    assert metric(consumer, "lbd:kv_transfer_failed_pulls_total") == failed0 + 1


def test_moved_blocks_are_published_as_kv_events(pair) -> None:
    """Pulled blocks enter the decode rank's prefix cache as one BlockStored run of the prompt's tokens."""
    producer, consumer = pair
    endpoint = re.search(r'"endpoint": "([^"]+)"', " ".join(consumer.proc.args)).group(1)
    with subscribed(endpoint) as sub:
        base = prompt_ids(70, 31337)  # 4 full blocks to move
        params = prefill(producer, body(base))
        text_of(consumer, "/v1/completions", body(base, kv_transfer_params=params))
        runs = wait_for_stored_run(sub, base[:4 * BLOCK])
        assert base[:4 * BLOCK] in runs


def test_a_decode_of_another_prompt_gets_no_blocks(pair) -> None:
    """Params of one prompt's prefill sent with another prompt: the producer refuses the pull (its KV was
    computed from other tokens), the consumer recomputes, and its prefix cache holds no foreign KV."""
    producer, consumer = pair
    first, other = prompt_ids(70, 555), prompt_ids(70, 556)
    params = prefill(producer, body(first))
    colocated = text_of(producer, "/v1/completions", body(other))
    pulled0, _ = moved(consumer)
    failed0 = metric(consumer, "lbd:kv_transfer_failed_pulls_total")
    assert text_of(consumer, "/v1/completions", body(other, kv_transfer_params=params)) == colocated
    assert moved(consumer)[0] == pulled0
    assert metric(consumer, "lbd:kv_transfer_failed_pulls_total") == failed0 + 1


def test_killed_producer_decode_recomputes(pair) -> None:
    """Last in the file, on the Mixtral pair (its last test: pytest runs a module's tests one parameter at a
    time, in file order): the pair's own producer prefills and is SIGKILLed, so no extra engine starts."""
    producer, consumer = pair
    if "pd-llama" in str(consumer.log):
        pytest.skip("once is enough: the recompute path does not depend on the model")
    assert_killed_producer_means_recompute(producer, consumer, doomed=producer)
