"""A client cannot feed a rank prompt ids (lbd.router.kv.forward, lbd.engine.server.forwarded): a real
`lbd route` in front of a real `python -m lbd.engine` (the tiny Llama, KV events on), sharing an internal key.

Wrong ids sent by a client, through the router (which strips them and sends its own, signed) or straight to
the rank (a 400 naming the field), are never run and never verified, so forwarding stays on for everyone,
and another client's identical request reads the same prompt and gets the same answer afterwards.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.common.internal_key import INTERNAL_KEY_ENV
from lbd.engine.metrics import FORWARD_OUTCOMES
from lbd.engine.server import forwarded
from lbd.engine.server.forwarded import FIELD
from support import metric_value
from support.procs import EngineServer

MODEL = "tiny"
KEY = secrets.token_urlsafe(32)  # routers refuse a weak internal key
EVENTS = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:0",
                     "replay_endpoint": "tcp://*:0"})
MESSAGES = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Name a lake."}]
CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def rank(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("strip") / "rank.log"
    srv = EngineServer(tiny_llama, "--kv-cache-memory-bytes", "32MiB", "--served-model-name", MODEL,
                       "--kv-events-config", EVENTS, log=log, env={INTERNAL_KEY_ENV: KEY})
    try:
        yield srv
    finally:
        srv.close()


def outcomes(rank: EngineServer) -> dict[str, float]:
    text = httpx.get(rank.base_url + "/metrics").text
    return {o: metric_value(text, "lbd:forwarded_prompts_total", outcome=o) for o in FORWARD_OUTCOMES}


async def test_client_ids_never_reach_the_rank_nor_turn_forwarding_off(
        rank: EngineServer, start_router, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERNAL_KEY_ENV, KEY)  # the router's environment
    r = start_router("--upstreams", rank.base_url, "--scrape-interval-ms", "100")
    await r.wait(timeout=60)
    deadline = time.monotonic() + 30
    while not all(e["kv_events"].get("tokenizer") and e["kv_events"]["mode"] == "exact"
                  for e in (await r.status())["endpoints"]):
        assert time.monotonic() < deadline, await r.status()
        await asyncio.sleep(0.05)
    info = httpx.get(rank.base_url + "/tokenizer_info").json()
    fp = info["prompt_token_ids"]["fingerprint"]
    tokenized = httpx.post(rank.base_url + "/tokenize", json={"model": MODEL, "messages": MESSAGES})
    ids = tokenized.json()["tokens"]
    wrong = ids[:-3] + [5, 6, 7]

    async with httpx.AsyncClient(timeout=60) as c:
        first = await c.post(r.url + "/v1/chat/completions", json=CHAT)
        assert first.status_code == 200, first.text
        assert outcomes(rank)["used"] == 1  # the router's own ids, taken (and verified: the first one)
        answer = first.json()["choices"][0]["message"]

        # more wrong prompts than the rank verifies up front: had one been taken, forwarding would be off
        attacks = [{FIELD: {"ids": wrong, "tokenizer": fp}},
                   {FIELD: {"ids": wrong, "tokenizer": fp, "sig": "0" * 64}},
                   {FIELD: {"ids": wrong, "tokenizer": fp}, "tool_choice": "none", "tools": [
                       {"type": "function", "function": {"name": "f", "parameters": {}}}]}]
        for n in range(forwarded.VERIFY_FIRST + 2):
            extra = attacks[n % len(attacks)]
            routed = await c.post(r.url + "/v1/chat/completions", json={**CHAT, **extra})
            assert routed.status_code == 200, routed.text  # stripped: the rank never saw the client's copy
            if "tools" not in extra:  # the prompt the rank ran is the true one
                assert routed.json()["usage"]["prompt_tokens"] == len(ids)
                assert routed.json()["choices"][0]["message"] == answer
            direct = await c.post(rank.base_url + "/v1/chat/completions", json={**CHAT, **extra})
            assert direct.status_code == 400 and direct.json()["error"]["param"] == FIELD, direct.text
        text = {"model": MODEL, "prompt": "The lake is", "max_tokens": 2,
                FIELD: {"ids": [5, 6, 7], "tokenizer": fp}}
        assert (await c.post(r.url + "/v1/completions", json=text)).status_code == 200
        assert (await c.post(rank.base_url + "/v1/completions", json=text)).status_code == 400

        seen = outcomes(rank)
        assert seen["mismatch"] == 0 and seen["disabled"] == 0, seen
        # another client's plain request afterwards: the router's ids are still taken, the answer the same
        used = seen["used"]
        after = await c.post(r.url + "/v1/chat/completions", json=CHAT)
        assert after.status_code == 200 and after.json()["choices"][0]["message"] == answer
        assert outcomes(rank)["used"] == used + 1
    assert sum(e["kv_events"]["forwarded_ids"] for e in (await r.status())["endpoints"]) == used + 1
