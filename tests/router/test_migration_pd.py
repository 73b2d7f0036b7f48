"""A P/D stream moves: `lbd route --prefill P --decode D1 --decode D2` runs a long prompt's prefill on P
and its decode on a decode rank; when that decode rank is SIGKILLed mid-stream, the router resumes the
stream on the other decode rank (never on the prefill rank), and the client gets exactly the unbroken
run's text, one finish reason and one ``[DONE]``. Before, the P/D stage rebuilt the body the migrator had
asked token ids in, so the decode stream carried no ids and every broken P/D stream ended as "impossible"."""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from support import RouterServer, settled
from support.pd import COMMON, kv_config
from support.procs import EngineServer
from support.tiny import make_tiny_llama

TOKENS = 120
BREAK_AT = 30
FAST = ("--scrape-interval-ms", "100", "--health-check-interval-s", "0.3", "--health-check-timeout-s", "1",
        "--health-failure-threshold", "1", "--kv-events", "off", "--debug-headers")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineServer, list[EngineServer], str]]:
    # 8 layers, 512 wide: a 120-token answer takes about a second, so the kill meets a rank still decoding
    model = make_tiny_llama(tmp_path_factory.mktemp("model"), layers=8, hidden=512, heads=8, kv_heads=2,
                            intermediate=2048, max_pos=1024)
    logs = tmp_path_factory.mktemp("pd-move")
    router = None
    with ThreadPoolExecutor(3) as pool:  # started side by side: each waits for its own /health
        futures = [pool.submit(EngineServer, model, *COMMON, "--kv-cache-memory-bytes", "64MiB",
                               "--kv-transfer-config", kv_config(role), log=logs / f"{name}.log")
                   for role, name in (("kv_producer", "p"), ("kv_consumer", "d1"), ("kv_consumer", "d2"))]
    try:
        ranks = [f.result() for f in futures]
        router = RouterServer("--prefill", ranks[0].base_url, "--decode", ranks[1].base_url, "--decode",
                              ranks[2].base_url, "--pd-min-prompt-tokens", "16", *FAST,
                              log=logs / "route.log").wait_ready()
        yield ranks[0], ranks[1:], router.url
    finally:
        if router is not None:
            router.close()
        for f in futures:
            if f.exception() is None:
                f.result().close()


def stream(url: str, prompt: str, kill: dict[str, EngineServer] | None = None) -> dict[str, Any]:
    """One streamed greedy completion through the router; with ``kill`` (url -> rank), the rank serving it
    is SIGKILLed once BREAK_AT chunks of text arrived."""
    data = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    got: dict[str, Any] = {"text": "", "finish": [], "done": 0, "errors": [], "chunks": 0, "usage": None}
    with httpx.stream("POST", url + "/v1/completions", json=data, timeout=120) as r:
        assert r.status_code == 200, r.read()
        got["disagg"], got["endpoint"] = r.headers.get("x-lbd-disagg", ""), r.headers["x-lbd-endpoint"]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                got["done"] += 1
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                got["errors"].append(ev["error"])
                continue
            got["usage"] = ev.get("usage") or got["usage"]
            for c in ev["choices"]:
                got["text"] += c.get("text") or ""
                if c.get("finish_reason"):
                    got["finish"].append(c["finish_reason"])
                if c.get("text"):
                    got["chunks"] += 1
                    if kill is not None and got["chunks"] == BREAK_AT:
                        victim = kill[got["endpoint"].rstrip("/")]
                        os.killpg(victim.proc.pid, signal.SIGKILL)
    return got


def resumed(url: str) -> int:
    moves = httpx.get(url + "/router/status", timeout=5).json()["migrations"]["moves"]
    return sum(by.get("resumed", 0) for by in moves.values())


def test_a_broken_pd_stream_resumes_on_another_decode_rank(fleet) -> None:
    producer, decoders, url = fleet
    prompt = f"{uuid.uuid4()} " + "a long shared document about numbers 0123456789 " * 6
    unbroken = stream(url, prompt)
    assert unbroken["disagg"] == f"pd {producer.base_url}"
    assert unbroken["finish"] == ["length"] and unbroken["done"] == 1 and not unbroken["errors"]
    assert unbroken["usage"]["completion_tokens"] == TOKENS

    before = resumed(url)
    by_url = {d.base_url: d for d in decoders}
    got = stream(url, prompt, kill=by_url)
    assert got["disagg"] == f"pd {producer.base_url}" and got["endpoint"].rstrip("/") in by_url
    assert not got["errors"], got["errors"]
    assert settled(lambda: resumed(url), before + 1) == before + 1, "the P/D stream was not moved"
    assert got["text"] == unbroken["text"]
    assert got["finish"] == ["length"] and got["done"] == 1
    assert got["usage"]["completion_tokens"] == TOKENS
    status = httpx.get(url + "/router/status", timeout=5).json()
    assert "impossible" not in json.dumps(status["migrations"]["moves"])
