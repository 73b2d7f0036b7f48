"""`lbd route --prefill URL --decode URL` in front of two real engine ranks (a KV producer and a consumer):
long prompts run in two stages (vLLM's contract) and answer what one rank alone answers, streamed and not;
short prompts, and a deployment missing a role, run colocated; the x-lbd-disagg header says which, and
--debug-headers name the plugin that decided each stage."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import orjson
import pytest

from lbd.router.disagg import with_params
from support import RouterServer, metric_value
from support.procs import EngineServer

COMMON = ("--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512", "--served-model-name", "tiny")
FAST = ("--scrape-interval-ms", "100", "--health-check-interval-s", "0.5")


def engine(model: Path, role: str, log: Path) -> EngineServer:
    cfg = json.dumps({"kv_connector": "LbdConnector", "kv_role": role})
    return EngineServer(model, *COMMON, "--kv-transfer-config", cfg, log=log)


@pytest.fixture(scope="module")
def pd(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple]:
    logs = tmp_path_factory.mktemp("route-pd")
    routers: list[RouterServer] = []
    with ThreadPoolExecutor(2) as pool:  # started side by side: each waits for its own /health
        futures = [pool.submit(engine, tiny_llama, role, logs / f"{name}.log")
                   for role, name in (("kv_producer", "p"), ("kv_consumer", "d"))]
    try:
        producer, consumer = (f.result() for f in futures)
        both = RouterServer("--prefill", producer.base_url, "--decode", consumer.base_url,
                            "--pd-min-prompt-tokens", "32", "--debug-headers", *FAST,
                            log=logs / "route.log").wait_ready()
        routers.append(both)
        prefill_only = RouterServer("--prefill", producer.base_url, *FAST,
                                    log=logs / "route-p.log").wait_ready()
        routers.append(prefill_only)
        yield producer, consumer, both, prefill_only
    finally:
        for r in routers:
            r.close()
        for f in futures:
            if f.exception() is None:
                f.result().close()


def ask(url: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(text, x-lbd-disagg header) of a greedy completion."""
    text, headers = ask_headers(url, prompt, stream)
    return text, headers.get("x-lbd-disagg", "")


def ask_headers(url: str, prompt: str, stream: bool) -> tuple[str, httpx.Headers]:
    """(text, the answer's headers) of a greedy completion."""
    data = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=data, timeout=60) as r:
        assert r.status_code == 200, r.read()
        header = r.headers
        if not stream:
            return json.loads(r.read())["choices"][0]["text"], header
        out = []
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.extend(c["text"] for c in json.loads(line[6:])["choices"])
        return "".join(out), header


def pulled(server: EngineServer) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    return metric_value(text, "lbd:kv_transfer_blocks_total", direction="pulled")


@pytest.mark.parametrize("stream", [False, True])
def test_long_prompts_run_in_two_stages_with_the_colocated_answer(pd, stream: bool) -> None:
    producer, consumer, router, _ = pd
    prompt = f"{uuid.uuid4()} " + "a long shared document about numbers 0123456789 " * 8
    alone, _ = ask(producer.base_url, prompt, False)
    before = pulled(consumer)
    text, headers = ask_headers(router.url, prompt, stream)
    assert headers["x-lbd-disagg"] == f"pd {producer.base_url}"
    # each stage names the plugin that decided it: prefill_work for the prefill, the policy's for the decode
    assert headers["x-lbd-prefill-endpoint"] == producer.base_url
    reason = headers["x-lbd-prefill-route-reason"]
    assert reason.startswith("least_prefill_work (prefill_work): ahead 0 tokens"), reason
    assert headers["x-lbd-endpoint"] == consumer.base_url and " (ttft)" in headers["x-lbd-route-reason"]
    prefill_profile = httpx.get(router.url + "/router/status", timeout=10).json()["prefill_profile"]
    assert prefill_profile["name"] == "pd_prefill"
    assert prefill_profile["decided"]["prefill_work/least_prefill_work"] >= 1, prefill_profile
    assert text == alone
    assert pulled(consumer) > before


def test_short_prompts_and_a_missing_role_run_colocated(pd) -> None:
    producer, _, router, prefill_only = pd
    done = "vllm:request_success_total"
    before = metric_value(httpx.get(pd[1].base_url + "/metrics", timeout=10).text, done)
    text, header = ask(router.url, "hi", False)
    assert header == "colocated (short_prompt)"
    assert text == ask(producer.base_url, "hi", False)[0]
    after = metric_value(httpx.get(pd[1].base_url + "/metrics", timeout=10).text, done)
    assert after == before + 1  # it ran on the decode rank
    long = "numbers 0123456789 " * 20
    text, header = ask(prefill_only.url, long, True)
    assert header == "colocated (no_decode_rank)"
    assert text == ask(producer.base_url, long, False)[0]


@pytest.mark.parametrize("flags, needle", [
    (["--prefill", "supervisor://127.0.0.1:9256"], "--prefill"),
    (["--decode", "nonsense"], "--decode"),
    (["--prefill", "http://127.0.0.1:1", "--pd-min-prompt-tokens", "-1"], "--pd-min-prompt-tokens"),
])
def test_bad_pd_flags_exit_2(flags: list[str], needle: str) -> None:
    out = subprocess.run([sys.executable, "-m", "lbd", "route", *flags], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and needle in out.stderr, out.stderr


def test_concurrent_long_prompts_spread_over_prefill_ranks(tiny_llama: Path, tmp_path: Path) -> None:
    """Two long prompts at once go to two prefill ranks: a rank in the middle of a long prefill step reports
    no queue, so the router counts its own prefill stages (sim ranks, time dilated: a prefill takes ~1 s).
    One producer lends no blocks (its lease cap is 1 byte): its request says so (colocated (no_lease)) and
    runs whole on the decode rank."""
    sim = ("--device", "sim", "--sim-profile", "h100-llama3-8b*100", "--max-model-len", "512",
           "--served-model-name", "tiny")
    kv = [json.dumps({"kv_connector": "LbdConnector", "kv_role": "kv_producer"}),
          json.dumps({"kv_connector": "LbdConnector", "kv_role": "kv_producer",
                      "kv_connector_extra_config": {"max_lease_bytes": 1}}),
          json.dumps({"kv_connector": "LbdConnector", "kv_role": "kv_consumer"})]
    router = None
    with ThreadPoolExecutor(3) as pool:  # started side by side: each waits for its own /health
        futures = [pool.submit(EngineServer, tiny_llama, *sim, "--kv-transfer-config", role,
                               log=tmp_path / f"{i}.log") for i, role in enumerate(kv)]
    try:
        ranks = [f.result() for f in futures]
        router = RouterServer("--prefill", ranks[0].base_url, "--prefill", ranks[1].base_url, "--decode",
                              ranks[2].base_url, "--pd-min-prompt-tokens", "32", "--debug-headers", *FAST,
                              log=tmp_path / "route.log").wait_ready()
        prompts = [f"{uuid.uuid4()} " + "numbers 0123456789 " * 40 for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            answers = [h for _, h in pool.map(lambda p: ask_headers(router.url, p, False), prompts)]
        said = {h["x-lbd-prefill-endpoint"]: h["x-lbd-disagg"] for h in answers}
        lent, capped = ranks[0].base_url, ranks[1].base_url
        assert said == {lent: f"pd {lent}", capped: "colocated (no_lease)"}
        assert all(h["x-lbd-endpoint"] == ranks[2].base_url for h in answers)
    finally:
        if router is not None:
            router.close()
        for f in futures:
            if f.exception() is None:
                f.result().close()


@pytest.mark.parametrize("params", [
    {"do_remote_decode": True},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0, 1],
     "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "r"},
    {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [0],
     "remote_host": "lbd.invalid", "remote_port": 9, "remote_request_id": "r"},
])
def test_a_clients_kv_transfer_params_are_refused(pd, params: dict) -> None:
    """kv_transfer_params are the router's own: a client's get a 400 naming the field, and reach no rank
    (no lease held on the producer, no pull or name lookup on the consumer)."""
    producer, consumer, router, _ = pd
    prefilled0 = metric_value(httpx.get(producer.base_url + "/metrics", timeout=10).text,
                              "vllm:request_success_total")
    decoded0 = metric_value(httpx.get(consumer.base_url + "/metrics", timeout=10).text,
                            "vllm:request_success_total")
    data = {"model": "tiny", "prompt": "numbers 0123456789 " * 10, "max_tokens": 1,
            "kv_transfer_params": params}
    r = httpx.post(router.url + "/v1/completions", json=data, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "kv_transfer_params"
    assert metric_value(httpx.get(producer.base_url + "/metrics", timeout=10).text,
                        "vllm:request_success_total") == prefilled0
    assert metric_value(httpx.get(consumer.base_url + "/metrics", timeout=10).text,
                        "vllm:request_success_total") == decoded0


def test_the_decode_body_keeps_what_earlier_steps_added() -> None:
    """The P/D stage splices its params into the body bytes: the migrator's return_token_ids stays."""
    body = b'{"prompt": "x", "stream": true, "return_token_ids":true}\n'
    out = orjson.loads(with_params(body, {"do_remote_prefill": True}))
    assert out == {"prompt": "x", "stream": True, "return_token_ids": True,
                   "kv_transfer_params": {"do_remote_prefill": True}}
    assert orjson.loads(with_params(b"{ }", {"a": 1})) == {"kv_transfer_params": {"a": 1}}
