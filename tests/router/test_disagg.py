"""`lbd route --prefill URL --decode URL` in front of two real engine ranks (a KV producer and a consumer):
long prompts run in two stages (vLLM's contract) and answer what one rank alone answers, streamed and not;
short prompts, and a deployment missing a role, run colocated; the x-lbd-disagg header says which."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

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
    producer = engine(tiny_llama, "kv_producer", logs / "p.log")
    consumer = None
    routers: list[RouterServer] = []
    try:
        consumer = engine(tiny_llama, "kv_consumer", logs / "d.log")
        both = RouterServer("--prefill", producer.base_url, "--decode", consumer.base_url,
                            "--pd-min-prompt-tokens", "32", *FAST, log=logs / "route.log").wait_ready()
        routers.append(both)
        prefill_only = RouterServer("--prefill", producer.base_url, *FAST,
                                    log=logs / "route-p.log").wait_ready()
        routers.append(prefill_only)
        yield producer, consumer, both, prefill_only
    finally:
        for r in routers:
            r.close()
        if consumer is not None:
            consumer.close()
        producer.close()


def ask(url: str, prompt: str, stream: bool) -> tuple[str, str]:
    """(text, x-lbd-disagg header) of a greedy completion."""
    data = {"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "stream": stream}
    with httpx.stream("POST", url + "/v1/completions", json=data, timeout=60) as r:
        assert r.status_code == 200, r.read()
        header = r.headers.get("x-lbd-disagg", "")
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
    text, header = ask(router.url, prompt, stream)
    assert header == f"pd {producer.base_url}"
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
    no queue, so the router counts its own prefill stages (sim ranks, time dilated: a prefill takes ~1 s)."""
    sim = ("--device", "sim", "--sim-profile", "h100-llama3-8b*100", "--max-model-len", "512",
           "--served-model-name", "tiny")
    kv = [json.dumps({"kv_connector": "LbdConnector", "kv_role": r}) for r in ("kv_producer", "kv_consumer")]
    ranks: list[EngineServer] = []
    router = None
    try:
        for i, role in enumerate([kv[0], kv[0], kv[1]]):
            log = tmp_path / f"{i}.log"
            ranks.append(EngineServer(tiny_llama, *sim, "--kv-transfer-config", role, log=log))
        router = RouterServer("--prefill", ranks[0].base_url, "--prefill", ranks[1].base_url, "--decode",
                              ranks[2].base_url, "--pd-min-prompt-tokens", "32", *FAST,
                              log=tmp_path / "route.log").wait_ready()
        prompts = [f"{uuid.uuid4()} " + "numbers 0123456789 " * 40 for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            headers = [h for _, h in pool.map(lambda p: ask(router.url, p, False), prompts)]
        assert sorted(headers) == sorted(f"pd {r.base_url}" for r in ranks[:2])
    finally:
        if router is not None:
            router.close()
        for r in ranks:
            r.close()
