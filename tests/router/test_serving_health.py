"""`lbd route --serving-health` (what `lbd serve` runs on its API port): /health and /v1/models answer 503
with the reason until a request would be served, a request that arrives before then is held (within
--retry-budget-s) instead of refused, and /readyz keeps its meaning. Without the flag /health is liveness.
A real router; the upstream is an aiohttp stand-in for an engine (tests/router/stubs.py) started late."""

from __future__ import annotations

import asyncio
import time

import httpx

from support.router_stubs import StubUpstream


async def _listening(url: str, timeout: float = 30.0) -> httpx.Response:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=2.0) as c:
        while True:
            try:
                return await c.get(url + "/health")
            except httpx.TransportError:
                assert time.monotonic() < deadline, "router never listened"
                await asyncio.sleep(0.05)


async def test_health_and_models_say_503_until_a_request_would_be_served(start_router) -> None:
    stub = StubUpstream()  # not started yet
    r = start_router("--upstreams", stub.url, "--serving-health", "--retry-budget-s", "20",
                     "--health-check-interval-s", "0.2", "--kv-events", "off")
    live = start_router("--upstreams", stub.url, "--kv-events", "off")
    first = await _listening(r.url)
    assert first.status_code == 503 and "would be served" in first.json()["error"]["message"], first.text
    assert "models not known yet" in first.json()["error"]["message"]
    assert (await _listening(live.url)).status_code == 200  # without the flag: the process is alive
    async with httpx.AsyncClient(timeout=30.0) as c:
        models = await c.get(r.url + "/v1/models")
        assert models.status_code == 503 and models.json()["error"]["message"], models.text
        assert (await c.get(r.url + "/readyz")).status_code == 503
        # a request that arrives first is held until the upstream serves, then answered
        body = {"prompt": "hi", "max_tokens": 2}
        held = asyncio.ensure_future(c.post(r.url + "/v1/completions", json=body))
        await asyncio.sleep(0.5)
        assert not held.done()
        await stub.start()
        try:
            done = await held
            assert done.status_code == 200, done.text
            health = await c.get(r.url + "/health")
            assert health.status_code == 200, health.text
            listed = await c.get(r.url + "/v1/models")
            assert [m["id"] for m in listed.json()["data"]] == [stub.model]
            assert (await c.get(r.url + "/readyz")).status_code == 200
        finally:
            await stub.stop()
