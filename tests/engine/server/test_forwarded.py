"""Prompt token ids sent with a request (lbd.engine.server.forwarded): a real `python -m lbd.engine`,
the tiny Llama.

- /tokenizer_info advertises the field and the fingerprint: the sha256 of the rest of that answer;
- ids with the right fingerprint are run as sent (the answer is the one the rank's own tokenization gives);
  ids with another fingerprint are ignored; a malformed field or ids outside the vocabulary are a 400;
- the first prompts are verified against the rank's own tokenization: a mismatch runs the rank's ids and
  turns forwarding off; later ones are checked in the background, one in VERIFY_EVERY.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter

from lbd.engine.metrics import FORWARD_OUTCOMES
from lbd.engine.server import forwarded
from lbd.engine.server.forwarded import FIELD, ForwardedPrompts
from support import EngineServer, metric_value

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a river."}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("forwarded") / "server.log"
    srv = EngineServer(tiny_llama, "--kv-cache-memory-bytes", "32MiB", "--served-model-name", MODEL, log=log)
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            yield c
    finally:
        srv.close()


def outcomes(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {o: metric_value(text, "lbd:forwarded_prompts_total", outcome=o) for o in FORWARD_OUTCOMES}


def chat(http: httpx.Client, extra: dict | None = None, messages: list | None = None) -> httpx.Response:
    return http.post("/v1/chat/completions",
                     json={"model": MODEL, "messages": messages or MESSAGES, **GREEDY, **(extra or {})})


def test_forwarded_ids_are_run_checked_and_verified(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    entry = info.pop("prompt_token_ids")
    assert entry["field"] == FIELD
    fp = entry["fingerprint"]
    assert fp == hashlib.sha256(orjson.dumps(info, option=orjson.OPT_SORT_KEYS)).hexdigest()
    ids = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    plain = chat(http).json()

    # right fingerprint: run as sent, same answer as the rank's own tokenization (verified: among the first)
    sent = chat(http, {FIELD: {"ids": ids, "tokenizer": fp}})
    assert sent.status_code == 200, sent.text
    assert sent.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert sent.json()["usage"]["prompt_tokens"] == len(ids)
    assert outcomes(http)["used"] == 1
    # the same ids as a text prompt's (completions)
    text = "The capital of France is"
    text_ids = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, **GREEDY,
                                           FIELD: {"ids": text_ids, "tokenizer": fp}})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(text_ids), r.text
    assert outcomes(http)["used"] == 2

    # another fingerprint: ignored, the rank tokenizes
    other = chat(http, {FIELD: {"ids": [5, 6, 7], "tokenizer": "0" * 64}})
    assert other.status_code == 200 and other.json()["usage"]["prompt_tokens"] == len(ids), other.text
    assert outcomes(http)["other_tokenizer"] == 1

    # malformed: a 400 that names the field; nothing else is harmed
    for bad in ({"ids": "1,2,3", "tokenizer": fp}, [1, 2, 3], {"ids": [1, 10**9], "tokenizer": fp},
                {"ids": [], "tokenizer": fp}, {"ids": [1, "2"], "tokenizer": fp}):
        r = chat(http, {FIELD: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == FIELD, (bad, r.text)
    assert chat(http).status_code == 200

    # a mismatch among the verified ones: the rank's own ids are run, and forwarding goes off
    wrong = chat(http, {FIELD: {"ids": ids[:-2], "tokenizer": fp}})
    assert wrong.status_code == 200 and wrong.json()["usage"]["prompt_tokens"] == len(ids), wrong.text
    assert wrong.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert outcomes(http)["mismatch"] == 1
    after = chat(http, {FIELD: {"ids": ids, "tokenizer": fp}})
    assert after.status_code == 200 and outcomes(http)["disabled"] == 1


def test_later_prompts_are_sampled_and_a_mismatch_turns_forwarding_off() -> None:
    registry = CollectorRegistry()
    c = Counter("fwd", "test", ("outcome",), registry=registry)
    fwd = ForwardedPrompts("f" * 64, 100, {o: c.labels(outcome=o) for o in FORWARD_OUTCOMES})
    checked: list[int] = []

    async def run() -> None:
        for n in range(1, forwarded.VERIFY_EVERY + 1):
            ids = [1, 2, 3] if n < forwarded.VERIFY_EVERY else [1, 2, 9]  # the sampled one is wrong

            async def own(n: int = n) -> list[int]:
                checked.append(n)
                return [1, 2, 3]

            assert fwd.take({FIELD: {"ids": ids, "tokenizer": "f" * 64}}) == ids
            assert await fwd.resolve(ids, own) == ids  # past the first few, the ids run as sent
        await asyncio.gather(*fwd._tasks)

    asyncio.run(run())
    assert checked == [*range(1, forwarded.VERIFY_FIRST + 1), forwarded.VERIFY_EVERY]
    assert not fwd.enabled and registry.get_sample_value("fwd_total", {"outcome": "mismatch"}) == 1
    assert fwd.take({FIELD: {"ids": [1], "tokenizer": "f" * 64}}) is None  # off: the rank tokenizes again
