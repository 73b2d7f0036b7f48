"""Passive outlier detection (lbd.router.outlier) against stub upstreams: an endpoint whose requests get no
first byte while the other one answers is ejected within the bound, its waiting requests are retried
elsewhere, and it comes back through a half-open trial request once it answers again."""

from __future__ import annotations

import asyncio
import time

import httpx

from support import metric_value
from support.router_stubs import stubs

BODY = {"model": "stub-model", "prompt": "hello there"}
T = 1.5  # --outlier-first-byte-timeout-s


def post(c: httpx.AsyncClient, router) -> object:
    return c.post(router.url + "/v1/completions", json=BODY)


async def state_of(router, url: str) -> str:
    return next(e for e in (await router.status())["endpoints"] if e["url"] == url)["state"]


async def test_wedged_endpoint_is_ejected_its_requests_retried_and_readmitted_half_open(start_router) -> None:
    async with stubs(2) as ups:
        wedged, good = ups
        router = await start_router(
            "--upstreams", ",".join(u.url for u in ups), "--policy", "round_robin",
            "--outlier-first-byte-timeout-s", str(T), "--outlier-ejection-s", "1",
            "--health-check-interval-s", "0.2",  # probes pass (the front end answers): they must not re-admit
        ).wait()
        wedged.header_delay = 3600.0  # takes requests, never answers; /health and /metrics still fine
        async with httpx.AsyncClient(timeout=30) as c:
            t0 = time.monotonic()
            replies = await asyncio.gather(*(post(c, router) for _ in range(8)))
            took = time.monotonic() - t0
            assert [r.status_code for r in replies] == [200] * 8  # the stuck ones were retried on the other
            assert all(r.json()["rank"] == 1 for r in replies)
            assert took < T + 0.5 + 3.0, took  # bound: T + the 0.5 s check interval (+ a busy machine)
            assert await state_of(router, wedged.url) in ("ejected", "half_open")
            assert wedged.cancelled >= 1  # the router closed its requests there (the engine aborts them)
            # still wedged when it turns half-open: the trial gets no first byte within T, is retried
            # elsewhere, and the endpoint is ejected again (for twice as long)
            deadline = time.monotonic() + 10
            while await state_of(router, wedged.url) != "half_open":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            trial = await c.post(router.url + "/v1/completions", json=BODY)
            assert trial.status_code == 200 and trial.json()["rank"] == 1
            assert await state_of(router, wedged.url) == "ejected"
            wedged.header_delay = 0.0  # it recovers (SIGCONT): the next trial re-admits it
            deadline = time.monotonic() + 15
            while await state_of(router, wedged.url) != "half_open":
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            trial = await c.post(router.url + "/v1/completions", json=BODY)
            assert trial.status_code == 200 and trial.json()["rank"] == 0  # the trial went to it
            assert await state_of(router, wedged.url) == "ready"
            ranks = {(await post(c, router)).json()["rank"] for _ in range(4)}
            assert ranks == {0, 1}
        text = await router.metrics()
        assert metric_value(text, "lbd_router_retries_total", reason="outlier") >= 1
        assert metric_value(text, "lbd_router_ejections_total", endpoint=wedged.url) >= 1


async def test_a_slow_fleet_is_not_ejected(start_router) -> None:
    """Both endpoints slower than T: nobody answers, so nobody is an outlier (no mass ejection)."""
    async with stubs(2, header_delay=T + 1.0) as ups:
        router = await start_router("--upstreams", ",".join(u.url for u in ups), "--policy", "round_robin",
                                    "--outlier-first-byte-timeout-s", str(T)).wait()
        async with httpx.AsyncClient(timeout=30) as c:
            replies = await asyncio.gather(*(post(c, router) for _ in range(4)))
        assert [r.status_code for r in replies] == [200] * 4
        assert [e["state"] for e in (await router.status())["endpoints"]] == ["ready", "ready"]
        assert sum(u.served for u in ups) == 4 and sum(u.cancelled for u in ups) == 0
