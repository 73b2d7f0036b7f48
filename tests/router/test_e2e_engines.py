"""`lbd route` in front of `lbd supervise` with three real engine ranks of the tiny model.

One node serves the whole module (starting engines is the slow part); each test starts its own router.
Faults (SIGKILL, SIGSTOP) run last since they make the supervisor restart a rank.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from support import metric_value
from support.node import SupervisorNode

pytestmark = pytest.mark.slow
MODEL = "tiny"
RANKS = 3
FAST = (
    "--scrape-interval-ms",
    "100",
    "--scrape-timeout-ms",
    "500",
    "--health-check-interval-s",
    "0.5",
    "--health-check-timeout-s",
    "1",
    "--health-failure-threshold",
    "3",
    "--supervisor-poll-interval-s",
    "0.2",
)


@pytest.fixture(scope="module")
def node(slower_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    # the 4-layer model: a 300-token answer must still be running half a second after it was sent
    log = tmp_path_factory.mktemp("node") / "supervise.log"
    n = SupervisorNode(
        slower_llama, RANKS, "--served-model-name", MODEL, interval=0.5, timeout=2.0, threshold=3, log=log
    )
    try:
        n.wait_ready(timeout=240)
        yield n
    finally:
        n.close()


def engine_metric(node: SupervisorNode, rank: int, name: str, **labels: str) -> float:
    text = httpx.get(node.rank_url(rank) + "/metrics", timeout=10).text
    return metric_value(text, name, engine=str(rank), **labels)


def successes(node: SupervisorNode, rank: int) -> float:
    return engine_metric(node, rank, "vllm:request_success_total")


async def router_for(node: SupervisorNode, start_router, *extra: str):
    r = start_router("--upstreams", f"supervisor://127.0.0.1:{node.sport}", *FAST, *extra)
    await r.wait(timeout=60)
    t0 = time.monotonic()
    while len([e for e in (await r.status())["endpoints"] if e["state"] == "ready" and e["models"]]) < RANKS:
        assert time.monotonic() - t0 < 30, await r.status()
        await asyncio.sleep(0.1)
    return r


async def test_openai_sdk_streams_and_non_streams_through_the_router(node, start_router) -> None:
    r = await router_for(node, start_router)
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    chat = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    assert chat.choices[0].message.content is not None and chat.usage.completion_tokens >= 1
    done = await client.completions.create(model=MODEL, prompt="Hello world", max_tokens=4, temperature=0)
    assert done.choices[0].finish_reason in ("length", "stop")
    stream = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    assert len(pieces) >= 2
    models = await client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    await client.close()


async def test_responses_api_through_the_router(node, start_router) -> None:
    """client.responses.create, stream and not; previous_response_id and GET land on the rank that stored
    the response (its id names it); unpinned responses are balanced like any request."""
    r = await router_for(node, start_router, "--debug-headers")
    client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="none", max_retries=0, timeout=60)
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input="Say hello.", instructions="You are terse.", max_output_tokens=6, temperature=0)
    first = raw.parse()
    rank = int(first.id.split("-")[0].removeprefix("resp_r"))
    assert raw.headers["x-lbd-endpoint"] == node.rank_url(rank)
    assert first.object == "response" and first.status in ("completed", "incomplete") and first.output_text
    assert first.usage.output_tokens >= 1 and first.instructions == "You are terse."
    raw = await client.responses.with_raw_response.create(
        model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Again."}]}],
        previous_response_id=first.id, max_output_tokens=4)
    second = raw.parse()
    assert raw.headers["x-lbd-endpoint"] == node.rank_url(rank)
    assert second.previous_response_id == first.id and second.id.startswith(f"resp_r{rank}-")
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the history
    assert (await client.responses.retrieve(first.id)).output_text == first.output_text
    stream = await client.responses.create(model=MODEL, input="Count.", max_output_tokens=5, stream=True)
    kinds = [event.type async for event in stream]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert "response.output_text.delta" in kinds and kinds[-1] == "response.completed"
    async with client.responses.stream(model=MODEL, input="More.", max_output_tokens=5) as events:
        async for _ in events:
            pass
        done = await events.get_final_response()
    assert done.output_text and done.usage.output_tokens >= 1
    ids = [(await client.responses.create(model=MODEL, input=f"topic {i}", max_output_tokens=2)).id
           for i in range(9)]
    assert len({i.split("-")[0] for i in ids}) >= 2, ids  # balanced over ranks
    with pytest.raises(openai.NotFoundError):
        await client.responses.create(model=MODEL, input="x", previous_response_id="resp_r1-missing")
    await client.close()


async def test_pinning_sends_each_request_to_the_named_rank(node, start_router) -> None:
    r = await router_for(node, start_router)
    before = [successes(node, k) for k in range(RANKS)]
    async with httpx.AsyncClient(timeout=60) as c:
        for rank, count in ((0, 1), (1, 2), (2, 3)):
            for _ in range(count):
                resp = await c.post(
                    r.url + "/v1/completions",
                    headers={"X-data-parallel-rank": str(rank)},
                    json={"model": MODEL, "prompt": "pin me", "max_tokens": 2},
                )
                assert resp.status_code == 200, resp.text
        after = [successes(node, k) for k in range(RANKS)]
        assert [a - b for a, b in zip(after, before, strict=True)] == [1, 2, 3]
        resp = await c.post(
            r.url + "/v1/completions",
            headers={"X-data-parallel-rank": "5"},
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert resp.status_code == 400 and "known ranks: [0, 1, 2]" in resp.json()["error"]["message"]
        resp = await c.post(
            r.url + "/v1/completions",
            headers={"X-data-parallel-rank": "zero"},
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-data-parallel-rank"


async def test_unpinned_load_spreads_over_every_rank(node, start_router) -> None:
    r = await router_for(node, start_router)
    before = [successes(node, k) for k in range(RANKS)]
    async with httpx.AsyncClient(timeout=120) as c:
        prompts = [f"request number {i} about a different topic" for i in range(12)]
        res = await asyncio.gather(
            *(
                c.post(r.url + "/v1/completions", json={"model": MODEL, "prompt": p, "max_tokens": 8})
                for p in prompts
            )
        )
    assert all(x.status_code == 200 for x in res)
    gained = [successes(node, k) - b for k, b in enumerate(before)]
    assert sum(gained) == 12 and min(gained) >= 2, gained


async def test_client_disconnects_free_router_slots_and_engine_requests(node, start_router) -> None:
    r = await router_for(node, start_router)
    body = {
        "model": MODEL,
        "prompt": "tell me a long story",
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }

    async def walk_away(c: httpx.AsyncClient) -> None:
        async with c.stream("POST", r.url + "/v1/completions", json=body) as s:
            assert s.status_code == 200
            async for _ in s.aiter_raw():
                break

    for _ in range(10):  # 100 disconnects, 10 at a time
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(walk_away(c) for _ in range(10)))
    t0 = time.monotonic()
    while True:
        text = await r.metrics()
        router_inflight = metric_value(text, "lbd_router_inflight_requests")
        running = sum(engine_metric(node, k, "vllm:num_requests_running") for k in range(RANKS))
        waiting = sum(engine_metric(node, k, "vllm:num_requests_waiting") for k in range(RANKS))
        if router_inflight == 0 and running == 0 and waiting == 0:
            break
        assert time.monotonic() - t0 < 20, (router_inflight, running, waiting)
        await asyncio.sleep(0.2)
    assert metric_value(text, "lbd_router_client_disconnects_total") >= 100


def _steady_load(url: str, stop: threading.Event, results: list[tuple[bool, int, str]], stream: bool) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            started = False
            try:
                if stream:
                    with c.stream(
                        "POST",
                        url + "/v1/completions",
                        json={"model": MODEL, "prompt": "steady", "max_tokens": 12, "stream": True},
                    ) as s:
                        status = s.status_code
                        body = b""
                        for chunk in s.iter_raw():
                            started = True
                            body += chunk
                    ok = status == 200 and body.endswith(b"data: [DONE]\n\n") and b'"error"' not in body
                else:
                    resp = c.post(
                        url + "/v1/completions", json={"model": MODEL, "prompt": "steady", "max_tokens": 6}
                    )
                    status, ok = resp.status_code, resp.status_code == 200
                results.append((started, status, "" if ok else "failed"))
            except httpx.HTTPError as e:
                results.append((started, 0, repr(e)))


async def test_sigstop_one_rank_is_ejected_within_the_probe_bound_and_traffic_flows(
    node, start_router
) -> None:
    r = await router_for(node, start_router)
    victim = node.rank(2)
    url = victim["url"]
    os.killpg(victim["pid"], signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        # bound: 3 consecutive failed scrapes (0.5 s timeout each, 0.1 s apart) or probes
        while next(e for e in (await r.status())["endpoints"] if e["url"] == url)["state"] != "ejected":
            assert time.monotonic() - t0 < 4.0
            await asyncio.sleep(0.05)
        ejected_after = time.monotonic() - t0
        async with httpx.AsyncClient(timeout=60) as c:
            res = await asyncio.gather(
                *(
                    c.post(
                        r.url + "/v1/completions",
                        headers={"x-debug": "1"},
                        json={"model": MODEL, "prompt": f"go {i}", "max_tokens": 3},
                    )
                    for i in range(8)
                )
            )
        assert all(x.status_code == 200 for x in res), [x.text for x in res if x.status_code != 200]
        print(f"ejected after {ejected_after:.2f} s")
    finally:
        os.killpg(victim["pid"], signal.SIGCONT)


async def test_sigkill_one_of_three_ranks_under_steady_load_fails_no_unstarted_request(
    node, start_router
) -> None:
    node.wait_ready(timeout=120)  # the previous test may have made the supervisor restart a rank
    r = await router_for(node, start_router)
    # A round-robin router sends one of three concurrent long answers to rank 1 for sure: that one is in
    # flight, nothing sent to its client yet, when rank 1 dies, so it must be retried elsewhere and succeed.
    rr = await router_for(node, start_router, "--policy", "round_robin")
    long_body = {"model": MODEL, "prompt": "long answer", "max_tokens": 300, "ignore_eos": True}
    stop = threading.Event()
    results: list[tuple[bool, int, str]] = []
    threads = [
        threading.Thread(target=_steady_load, args=(r.url, stop, results, i % 2 == 0)) for i in range(4)
    ]
    for t in threads:
        t.start()
    try:
        async with httpx.AsyncClient(timeout=120) as c:
            await asyncio.sleep(1.0)
            longs = [
                asyncio.ensure_future(c.post(rr.url + "/v1/completions", json=long_body)) for _ in range(3)
            ]
            await asyncio.sleep(0.5)
            victim = node.rank(1)
            os.killpg(victim["pid"], signal.SIGKILL)
            long_results = await asyncio.gather(*longs)
            await asyncio.sleep(2.0)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert [x.status_code for x in long_results] == [200, 200, 200], [x.text for x in long_results]
    assert metric_value(await rr.metrics(), "lbd_router_retries_total") >= 1
    unstarted_failures = [x for x in results if x[2] and not x[0]]
    text = await r.metrics()
    failed = sum(bool(x[2]) for x in results)
    retries = metric_value(text, "lbd_router_retries_total")
    print(f"{len(results)} requests, {failed} failed after streaming began, {retries:.0f} retries")
    assert len(results) >= 10 and unstarted_failures == [], unstarted_failures
