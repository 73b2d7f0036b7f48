"""Prompt token ids sent with a request (lbd.engine.server.forwarded): a real `python -m lbd.engine`,
the tiny Llama.

- /tokenizer_info advertises the field and the fingerprint: the sha256 of the rest of that answer;
- the field is taken only signed with the rank's internal key (lbd.common.internal_key) for that very body,
  fresh and once: unsigned, forged, at a rank without a key, copied beside another body, expired or replayed,
  it is a 400 that changes nothing (forwarding stays on) but its own count on /metrics
  (``lbd:forwarded_prompts_total{outcome="refused_<why>"}``);
- /tokenizer_info publishes nothing of the key: it says only whether a caller's proof of the key verified;
- ids with the right fingerprint are run as sent (the answer is the one the rank's own tokenization gives);
  ids with another fingerprint are ignored; a malformed field or ids outside the vocabulary are a 400;
- the first prompts are verified against the rank's own tokenization: a mismatch runs the rank's ids and
  turns forwarding off; later ones are checked in the background, one in VERIFY_EVERY.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter

from lbd.common.internal_key import INTERNAL_KEY_ENV, IdsSigner, body_digest
from lbd.engine.metrics import FORWARD_OUTCOMES
from lbd.engine.server import forwarded
from lbd.engine.server.errors import APIError
from lbd.engine.server.forwarded import FIELD, ForwardedPrompts
from support import EngineServer, metric_value

MODEL = "tiny"
MESSAGES = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "Name a river."}]
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
KEY = "internal-key-of-this-test"
SIGNER = IdsSigner(KEY)


def signed(ids: list[int], fp: str, signer: IdsSigner = SIGNER, body: dict | None = None,
           now: float | None = None) -> dict:
    """The field as a router holding ``signer``'s key sends it with ``body`` (the rest of the request)."""
    return {"ids": ids, "tokenizer": fp,
            "sig": signer.sign(orjson.dumps(ids), fp, body_digest(body or {}), now)}


@pytest.fixture(scope="module")
def http(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    log = tmp_path_factory.mktemp("forwarded") / "server.log"
    srv = EngineServer(tiny_llama, "--kv-cache-memory-bytes", "32MiB", "--served-model-name", MODEL, log=log,
                       env={INTERNAL_KEY_ENV: KEY})
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            yield c
    finally:
        srv.close()


def outcomes(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {o: metric_value(text, "lbd:forwarded_prompts_total", outcome=o) for o in FORWARD_OUTCOMES}


def kept(counts: dict[str, float]) -> dict[str, float]:
    """The outcomes of fields the rank took (refusals left out)."""
    return {o: v for o, v in counts.items() if not o.startswith("refused_")}


def grew(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The outcomes that changed, by how much."""
    return {o: after[o] - before[o] for o in after if after[o] != before[o]}


def chat_body(messages: list | None = None) -> dict:
    return {"model": MODEL, "messages": messages or MESSAGES, **GREEDY}


def chat(http: httpx.Client, extra: dict | None = None, messages: list | None = None) -> httpx.Response:
    return http.post("/v1/chat/completions", json={**chat_body(messages), **(extra or {})})


def ids_chat(http: httpx.Client, ids: list[int], fp: str, signer: IdsSigner = SIGNER,
             messages: list | None = None) -> httpx.Response:
    """A chat request with ``ids`` signed for it, as a router sends it."""
    body = chat_body(messages)
    return http.post("/v1/chat/completions", json={**body, FIELD: signed(ids, fp, signer, body)})


def test_forwarded_ids_are_run_checked_and_verified(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    entry = info.pop("prompt_token_ids")
    assert entry["field"] == FIELD and entry["key"] == "unproven" and "key_id" not in entry
    fp = entry["fingerprint"]
    assert fp == hashlib.sha256(orjson.dumps(info, option=orjson.OPT_SORT_KEYS)).hexdigest()
    ids = http.post("/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()["tokens"]
    plain = chat(http).json()

    # right fingerprint: run as sent, same answer as the rank's own tokenization (verified: among the first)
    body = chat_body()
    blob = signed(ids, fp, body=body)
    sent = http.post("/v1/chat/completions", json={**body, FIELD: blob})
    assert sent.status_code == 200, sent.text
    assert sent.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert sent.json()["usage"]["prompt_tokens"] == len(ids)
    assert outcomes(http)["used"] == 1
    # the same ids as a text prompt's (completions)
    text = "The capital of France is"
    text_ids = http.post("/tokenize", json={"model": MODEL, "prompt": text}).json()["tokens"]
    cbody = {"model": MODEL, "prompt": text, **GREEDY}
    r = http.post("/v1/completions", json={**cbody, FIELD: signed(text_ids, fp, body=cbody)})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(text_ids), r.text
    assert outcomes(http)["used"] == 2

    # another fingerprint: ignored, the rank tokenizes
    other = ids_chat(http, [5, 6, 7], "0" * 64)
    assert other.status_code == 200 and other.json()["usage"]["prompt_tokens"] == len(ids), other.text
    assert outcomes(http)["other_tokenizer"] == 1

    # malformed: a 400 that names the field; nothing else is harmed
    for bad in ({"ids": "1,2,3", "tokenizer": fp}, [1, 2, 3], signed([1, 10**9], fp, body=chat_body()),
                signed([], fp, body=chat_body()), {"ids": [1, "2"], "tokenizer": fp}):
        r = chat(http, {FIELD: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == FIELD, (bad, r.text)
    assert chat(http).status_code == 200

    # unsigned, forged, signed with another key, or signed for other ids: a 400 naming the field, which
    # changes nothing (wrong ids among the first verified ones: taken, they would turn forwarding off)
    before = outcomes(http)
    forged = {**signed(ids, fp, body=chat_body()), "ids": ids[:-2]}
    zeros = {**signed(ids[:-2], fp, body=chat_body()), "sig": "0" * 64}
    for bad in ({"ids": ids[:-2], "tokenizer": fp}, zeros, forged,
                signed(ids[:-2], fp, IdsSigner("a client's guess"), chat_body())):
        r = chat(http, {FIELD: bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == FIELD, (bad, r.text)
        assert "internal key" in r.json()["error"]["message"]
    assert grew(before, outcomes(http)) == {"refused_signature": 4}  # counted on /metrics, nothing else
    before = outcomes(http)
    assert ids_chat(http, ids, fp).status_code == 200 and outcomes(http)["used"] == 3

    # a blob seen on the router-to-rank hop: sent again as it is, beside another prompt or sampling setting,
    # or signed more than a minute ago, it is a 400 that changes nothing (forwarding stays on)
    other_messages = [{"role": "user", "content": "Something else entirely."}]
    for replay in ({**body, FIELD: blob}, {**chat_body(other_messages), FIELD: blob},
                   {**body, "temperature": 1.0, FIELD: blob},
                   {**body, FIELD: signed(ids, fp, body=body, now=time.time() - 120)}):
        r = http.post("/v1/chat/completions", json=replay)
        assert r.status_code == 400 and r.json()["error"]["param"] == FIELD, r.text
    assert kept(outcomes(http)) == {**kept(before), "used": 3}
    # each refusal is exported by why: the blob again, beside another body (twice), signed too long ago
    assert grew(before, outcomes(http)) == {"used": 1, "refused_replayed": 1, "refused_signature": 2,
                                            "refused_expired": 1}

    # /tokenizer_info publishes nothing of the key: a proof made with it says "match", any other "mismatch"
    def key(proof: str | None) -> object:
        params = {"key_proof": proof} if proof is not None else {}
        return http.get("/tokenizer_info", params=params).json()["prompt_token_ids"]["key"]

    assert key(SIGNER.prove()) == "match" and key(IdsSigner("a guess").prove()) == "mismatch"
    assert key("1.2.3") == "mismatch" and key(None) == "unproven"
    assert KEY not in http.get("/tokenizer_info").text

    # a mismatch among the verified ones: the rank's own ids are run, and forwarding goes off
    wrong = ids_chat(http, ids[:-2], fp)
    assert wrong.status_code == 200 and wrong.json()["usage"]["prompt_tokens"] == len(ids), wrong.text
    assert wrong.json()["choices"][0]["message"] == plain["choices"][0]["message"]
    assert outcomes(http)["mismatch"] == 1
    after = ids_chat(http, ids, fp)
    assert after.status_code == 200 and outcomes(http)["disabled"] == 1


def test_a_rank_without_an_internal_key_refuses_the_field() -> None:
    registry = CollectorRegistry()
    c = Counter("fwd", "test", ("outcome",), registry=registry)
    fwd = ForwardedPrompts("f" * 64, 100, {o: c.labels(outcome=o) for o in FORWARD_OUTCOMES})
    assert fwd.key_answer(SIGNER.prove()) is None  # /tokenizer_info says it has no key: no router sends ids
    for sent in ({"ids": [1, 2], "tokenizer": "f" * 64}, signed([1, 2], "f" * 64)):
        with pytest.raises(APIError) as e:
            fwd.take({FIELD: sent})
        assert e.value.status == 400 and e.value.param == FIELD and INTERNAL_KEY_ENV in e.value.message
    assert fwd.enabled and fwd.take({"messages": []}) is None
    assert registry.get_sample_value("fwd_total", {"outcome": "refused_no_key"}) == 2


def test_later_prompts_are_sampled_and_a_mismatch_turns_forwarding_off() -> None:
    registry = CollectorRegistry()
    c = Counter("fwd", "test", ("outcome",), registry=registry)
    fwd = ForwardedPrompts("f" * 64, 100, {o: c.labels(outcome=o) for o in FORWARD_OUTCOMES}, SIGNER)
    checked: list[int] = []

    async def run() -> None:
        for n in range(1, forwarded.VERIFY_EVERY + 1):
            ids = [1, 2, 3] if n < forwarded.VERIFY_EVERY else [1, 2, 9]  # the sampled one is wrong

            async def own(n: int = n) -> list[int]:
                checked.append(n)
                return [1, 2, 3]

            assert fwd.take({FIELD: signed(ids, "f" * 64, body={"n": n}), "n": n}) == ids
            assert await fwd.resolve(ids, own) == ids  # past the first few, the ids run as sent
        await asyncio.gather(*fwd._tasks)

    asyncio.run(run())
    assert checked == [*range(1, forwarded.VERIFY_FIRST + 1), forwarded.VERIFY_EVERY]
    assert not fwd.enabled and registry.get_sample_value("fwd_total", {"outcome": "mismatch"}) == 1
    assert fwd.take({FIELD: signed([1], "f" * 64)}) is None  # off: the rank tokenizes again
