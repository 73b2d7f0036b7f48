"""Raw proxy behaviour of a real `lbd route` process against stub upstreams (engine-shaped HTTP)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from support import metric_value
from support.router_stubs import StubUpstream, stubs

BODY = {"model": "stub-model", "prompt": "hello there"}


async def test_non_stream_and_stream_pass_through_with_request_id_and_no_hop_headers(start_router) -> None:
    async with stubs(2, chunks=4, chunk_delay=0.3) as ups:
        r = await start_router("--upstreams", ",".join(u.url for u in ups)).wait()
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(r.url + "/v1/completions", json=BODY, headers={"X-Request-Id": "abc-123"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "hi"
            assert resp.headers["x-request-id"] == "abc-123" and resp.headers["x-stub"] == "1"
            assert "x-lbd-endpoint" not in resp.headers  # only with --debug-headers
            seen = [h for u in ups for h in u.seen_headers]
            assert seen[-1]["X-Request-Id"] == "abc-123"
            resp = await c.post(r.url + "/v1/completions", json=BODY)
            assert len(resp.headers["x-request-id"]) >= 16  # created when the client sent none
            # Streaming: every chunk reaches the client as the upstream sends it (no buffering).
            arrivals = []
            t0 = time.monotonic()
            async with c.stream(
                "POST",
                r.url + "/v1/chat/completions",
                json={**BODY, "stream": True, "messages": [{"role": "user", "content": "x"}]},
            ) as s:
                assert s.headers["content-type"].startswith("text/event-stream")
                async for chunk in s.aiter_raw():
                    arrivals.append((time.monotonic() - t0, chunk))
            body = b"".join(c for _, c in arrivals)
            assert body.count(b"data: ") == 5 and body.endswith(b"data: [DONE]\n\n")
            assert arrivals[0][0] < 0.25  # the first event came long before the stream ended (~1.2 s)
            assert arrivals[-1][0] > 0.8


async def test_body_limits_bad_json_and_unknown_paths(start_router) -> None:
    async with stubs(1) as ups:
        r = await start_router("--upstreams", ups[0].url, "--max-request-body-bytes", "1KiB").wait()
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(r.url + "/v1/completions", json={**BODY, "prompt": "x" * 2000})
            assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
            assert "--max-request-body-bytes" in resp.json()["error"]["message"]
            resp = await c.post(
                r.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"}
            )
            err = resp.json()["error"]
            assert (
                resp.status_code == 400
                and err["type"] == "BadRequestError"
                and set(err) == {"message", "type", "param", "code"}
            )
            resp = await c.post(r.url + "/v1/completions", json={**BODY, "model": "nope"})
            assert resp.status_code == 404 and resp.json()["error"]["type"] == "NotFoundError"
            assert (await c.get(r.url + "/nothing/here")).status_code == 404
            resp = await c.post(r.url + "/tokenize", json={"model": "stub-model", "prompt": "hi"})
            assert resp.status_code == 200 and resp.json()["count"] == 3
        assert ups[0].served == 0  # none of the refused requests reached the upstream


async def test_pinning_routes_to_the_rank_and_bad_pins_are_400(start_router) -> None:
    async with stubs(3) as ups:
        r = await start_router("--upstreams", ",".join(u.url for u in ups), "--debug-headers").wait()
        async with httpx.AsyncClient(timeout=10) as c:
            for rank in (2, 0, 1, 2):
                resp = await c.post(
                    r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": str(rank)}
                )
                assert resp.status_code == 200 and resp.json()["rank"] == rank
                assert resp.headers["x-lbd-route-reason"].startswith("pinned")
                assert ups[rank].seen_headers[-1]["X-data-parallel-rank"] == str(rank)  # passed on
            resp = await c.post(r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "7"})
            assert resp.status_code == 400 and "known ranks: [0, 1, 2]" in resp.json()["error"]["message"]
            resp = await c.post(r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "one"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "X-data-parallel-rank"


async def test_pinned_rank_unhealthy_is_503_not_rerouted_unless_pin_fallback(start_router) -> None:
    async with stubs(2) as ups:
        ups[1].health_status = 500
        fast = (
            "--health-check-interval-s",
            "0.1",
            "--health-check-timeout-s",
            "0.5",
            "--health-failure-threshold",
            "2",
        )
        strict = await start_router("--upstreams", ",".join(u.url for u in ups), *fast).wait()
        loose = await start_router(
            "--upstreams", ",".join(u.url for u in ups), *fast, "--pin-fallback"
        ).wait()
        await asyncio.sleep(0.6)  # ejected after 2 failed probes
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(
                strict.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "1"}
            )
            assert resp.status_code == 503 and "pinned rank 1 is unhealthy" in resp.json()["error"]["message"]
            resp = await c.post(
                loose.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "1"}
            )
            assert resp.status_code == 200 and resp.json()["rank"] == 0


async def test_models_health_readyz_metrics_and_debug_headers(start_router) -> None:
    a, b = StubUpstream(rank=0, model="m-a"), StubUpstream(rank=1, model="m-b")
    await a.start()
    await b.start()
    try:
        r = await start_router(
            "--upstreams", f"{a.url},{b.url}", "--debug-headers", "--policy", "least_load"
        ).wait()
        async with httpx.AsyncClient(timeout=10) as c:
            await asyncio.sleep(0.3)
            ids = sorted(m["id"] for m in (await c.get(r.url + "/v1/models")).json()["data"])
            assert ids == ["m-a", "m-b"]
            for _ in range(3):  # requests go only to endpoints that serve the model
                resp = await c.post(r.url + "/v1/completions", json={**BODY, "model": "m-b"})
                assert resp.json()["rank"] == 1 and resp.headers["x-lbd-endpoint"] == b.url
                assert resp.headers["x-lbd-route-reason"].startswith("least_load")
            assert (await c.get(r.url + "/health")).json() == {"status": "ok"}
            assert (await c.get(r.url + "/readyz")).status_code == 200
        text = await r.metrics()
        assert metric_value(text, "lbd_router_requests_total", endpoint=b.url, status="200") == 3
        assert metric_value(text, "lbd_router_decisions_total", policy="least_load", reason="least_load") == 3
        assert metric_value(text, "lbd_router_inflight_requests", endpoint=b.url) == 0
        assert metric_value(text, "lbd_router_endpoint_healthy", endpoint=a.url) == 1
        assert 0 <= metric_value(text, "lbd_router_scrape_age_seconds", endpoint=a.url) < 1.0
        assert metric_value(text, "lbd_router_request_duration_seconds_count", endpoint=b.url) == 3
    finally:
        await a.stop()
        await b.stop()


async def test_retries_on_503_and_refused_connections_but_never_after_streaming_began(start_router) -> None:
    async with stubs(2, chunks=4) as ups:
        dead = StubUpstream(rank=2)  # never started: connection refused
        ups[0].answer_status = 503
        r = await start_router(
            "--upstreams",
            ",".join([ups[0].url, ups[1].url, dead.url]),
            "--policy",
            "round_robin",
            "--health-failure-threshold",
            "100",
        ).wait()
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(6):
                resp = await c.post(r.url + "/v1/completions", json=BODY)
                assert resp.status_code == 200 and resp.json()["rank"] == 1
            text = await r.metrics()
            assert metric_value(text, "lbd_router_retries_total", reason="overloaded") >= 2
            assert metric_value(text, "lbd_router_retries_total", reason="connect") >= 2
            # Every endpoint answering 503: the client gets the upstream's own 503 after the retries.
            ups[1].answer_status = 503
            resp = await c.post(r.url + "/v1/completions", json=BODY)
            assert resp.status_code == 503 and resp.json()["error"]["message"] == "stub says no"
            # Mid-stream failure: no retry, the stream ends with an error event.
            ups[1].answer_status = None
            ups[1].die_after_chunks = 2
            r2 = await start_router("--upstreams", ups[1].url).wait()
            tries_before = len(ups[1].seen_headers)
            async with c.stream("POST", r2.url + "/v1/completions", json={**BODY, "stream": True}) as s:
                body = b"".join([chunk async for chunk in s.aiter_raw()])
            assert body.count(b'"text": "t') == 2 and b"mid-stream" in body and body.endswith(b"[DONE]\n\n")
            assert len(ups[1].seen_headers) == tries_before + 1  # one try only for the broken stream


async def test_4xx_never_ejects_but_5xx_and_failed_probes_do_and_a_probe_readmits(start_router) -> None:
    async with stubs(2) as ups:
        r = await start_router(
            "--upstreams",
            ",".join(u.url for u in ups),
            "--policy",
            "round_robin",
            "--health-check-interval-s",
            "0.2",
            "--health-check-timeout-s",
            "0.3",
            "--health-failure-threshold",
            "2",
        ).wait()
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(10):  # rank 1 answers 400 to a pin naming rank 0: client errors, not failures
                await c.post(r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "0"})
                resp = await c.post(r.url + "/v1/completions", json=BODY)
                assert resp.status_code == 200
            ups[0].answer_status = 400
            for _ in range(6):
                await c.post(r.url + "/v1/completions", json=BODY)
            status = await r.status()
            assert all(e["state"] == "ready" for e in status["endpoints"])
            ups[0].answer_status = None
            ups[0].hang_health = True  # probes time out -> ejected within ~2 x (0.2 + 0.3) s
            t0 = time.monotonic()
            while (await r.status())["endpoints"][0]["state"] != "ejected":
                assert time.monotonic() - t0 < 3.0
                await asyncio.sleep(0.05)
            for _ in range(4):
                assert (await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] == 1
            ups[0].hang_health = False
            while (await r.status())["endpoints"][0]["state"] != "ready":
                assert time.monotonic() - t0 < 6.0
                await asyncio.sleep(0.05)
            ranks = {(await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] for _ in range(4)}
            assert ranks == {0, 1}
        text = await r.metrics()
        assert metric_value(text, "lbd_router_ejections_total", endpoint=ups[0].url) == 1
        assert metric_value(text, "lbd_router_readmissions_total", endpoint=ups[0].url) == 1


async def test_all_endpoints_out_is_an_immediate_clear_503(start_router) -> None:
    dead = [StubUpstream(rank=i) for i in range(2)]
    r = await start_router(
        "--upstreams",
        ",".join(u.url for u in dead),
        "--scrape-interval-ms",
        "50",
        "--scrape-timeout-ms",
        "200",
        "--health-failure-threshold",
        "2",
    ).wait(ready=False)
    await asyncio.sleep(0.5)
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(r.url + "/readyz")).status_code == 503
        t0 = time.monotonic()
        resp = await c.post(r.url + "/v1/completions", json=BODY)
        assert time.monotonic() - t0 < 0.5
        assert resp.status_code == 503 and "2 ejected" in resp.json()["error"]["message"]


async def test_client_disconnects_release_inflight_and_cancel_upstream(start_router) -> None:
    async with stubs(2, chunks=1000, chunk_delay=0.05) as ups:
        r = await start_router("--upstreams", ",".join(u.url for u in ups)).wait()

        async def walk_away() -> None:
            async with httpx.AsyncClient(timeout=10) as c:
                async with c.stream("POST", r.url + "/v1/completions", json={**BODY, "stream": True}) as s:
                    async for _ in s.aiter_raw():
                        break  # got the first event, then leave

        await asyncio.gather(*(walk_away() for _ in range(20)))
        t0 = time.monotonic()
        while sum(u.inflight for u in ups):
            assert time.monotonic() - t0 < 3.0, [u.inflight for u in ups]
            await asyncio.sleep(0.05)
        assert sum(u.cancelled for u in ups) == 20
        text = await r.metrics()
        assert sum(metric_value(text, "lbd_router_inflight_requests", endpoint=u.url) for u in ups) == 0
        assert (
            sum(metric_value(text, "lbd_router_client_disconnects_total", endpoint=u.url) for u in ups) == 20
        )


async def test_timeouts_are_clear_errors(start_router) -> None:
    async with stubs(1, header_delay=1.5) as ups:
        r = await start_router("--upstreams", ups[0].url, "--response-timeout-s", "0.3").wait()
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(r.url + "/v1/completions", json=BODY)
            assert resp.status_code == 504 and "--response-timeout-s" in resp.json()["error"]["message"]
    async with stubs(1, first_chunk_delay=1.5) as ups:
        r = await start_router("--upstreams", ups[0].url, "--stream-idle-timeout-s", "0.3").wait()
        async with httpx.AsyncClient(timeout=10) as c:
            resp = await c.post(r.url + "/v1/completions", json={**BODY, "stream": True})
            assert resp.status_code == 504 and "--stream-idle-timeout-s" in resp.json()["error"]["message"]


async def test_burst_between_scrapes_spreads_and_ipv6_upstreams_work(start_router) -> None:
    async with stubs(3, host="::1", header_delay=1.0) as ups:
        ups[0].waiting = 2  # scraped once at start: score 8 on rank 0, 0 elsewhere; no new scrape for 5 s
        r = await start_router(
            "--upstreams",
            ",".join(u.url for u in ups),
            "--policy",
            "least_load",
            "--scrape-interval-ms",
            "5000",
        ).wait()
        await asyncio.sleep(0.3)
        async with httpx.AsyncClient(timeout=10) as c:
            res = await asyncio.gather(*(c.post(r.url + "/v1/completions", json=BODY) for _ in range(30)))
        ranks = [x.json()["rank"] for x in res]
        counts = {k: ranks.count(k) for k in range(3)}
        # Without counting its own dispatches since the scrape, the router would send all 30 to ranks 1 and 2
        # (15 each). Counting them, ranks 1 and 2 take 8 each to catch up, then all three share the other 14.
        assert 3 <= counts[0] <= 6 and 12 <= counts[1] <= 14 and 12 <= counts[2] <= 14, counts


async def test_supervisor_upstream_follows_ranks_drains_and_restarts(start_router) -> None:
    from support.router_stubs import StubSupervisor

    async with stubs(2) as ups:
        sup = await StubSupervisor().start()
        sup.ranks = [{"rank": 0, "url": ups[0].url, "state": "ready", "pid": 100}]
        try:
            r = await start_router(
                "--upstreams", f"supervisor://127.0.0.1:{sup.port}", "--supervisor-poll-interval-s", "0.1"
            ).wait()
            async with httpx.AsyncClient(timeout=10) as c:
                assert (await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] == 0
                sup.ranks.append({"rank": 1, "url": ups[1].url, "state": "ready", "pid": 101})
                await asyncio.sleep(0.5)
                resp = await c.post(
                    r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "1"}
                )
                assert resp.json()["rank"] == 1
                sup.ranks[0]["state"] = "draining"
                await asyncio.sleep(0.5)
                assert {
                    (await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] for _ in range(4)
                } == {1}
                resp = await c.post(
                    r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "0"}
                )
                assert resp.status_code == 503 and "draining" in resp.json()["error"]["message"]
                sup.ranks[0].update(state="ready", pid=200)  # restarted
                await asyncio.sleep(0.5)
                resp = await c.post(
                    r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "0"}
                )
                assert resp.json()["rank"] == 0
                del sup.ranks[1]
                await asyncio.sleep(0.5)
                resp = await c.post(
                    r.url + "/v1/completions", json=BODY, headers={"X-data-parallel-rank": "1"}
                )
                assert resp.status_code == 400 and "known ranks: [0]" in resp.json()["error"]["message"]
        finally:
            await sup.stop()


async def test_upstreams_file_reloads_on_sighup(start_router, tmp_path) -> None:
    import signal

    async with stubs(2) as ups:
        f = tmp_path / "upstreams.txt"
        f.write_text(f"# rank 0 only\n{ups[0].url}\n")
        r = await start_router("--upstreams-file", str(f)).wait()
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] == 0
            f.write_text(f"{ups[1].url}\n")
            r.proc.send_signal(signal.SIGHUP)
            await asyncio.sleep(0.5)
            ranks = {(await c.post(r.url + "/v1/completions", json=BODY)).json()["rank"] for _ in range(3)}
            assert ranks == {1}


async def test_workers_take_turns_scraping(start_router) -> None:
    """An engine's /metrics costs it CPU: 4 workers read each rank as often as 1 worker would (one start-up
    scrape each, then every 4th interval each)."""
    async with stubs(1) as ups:
        r = await start_router(
            "--upstreams", ups[0].url, "--workers", "4", "--scrape-interval-ms", "100"
        ).wait()
        ups[0].scrapes = 0
        await asyncio.sleep(3.0)
        assert 15 <= ups[0].scrapes <= 40, ups[0].scrapes  # ~30 (10/s); 4 workers on their own: ~120
        assert r.proc.poll() is None


async def test_a_telemetry_path_that_fails_sends_the_router_back_to_metrics_for_good(start_router) -> None:
    """A server whose /metrics advertises X-LBD-Telemetry but has no /telemetry (say an old lbd engine, or
    vLLM behind a proxy that adds the header): the router tries the path once, then reads /metrics, and the
    endpoint stays ready. Stubs without the header (vLLM) are never asked for /telemetry."""
    async with stubs(2) as ups:
        ups[0].advertise_telemetry = True
        r = await start_router(
            "--upstreams", ",".join(u.url for u in ups), "--scrape-interval-ms", "100"
        ).wait()
        await asyncio.sleep(1.5)
        scrapes = ups[0].scrapes
        await asyncio.sleep(1.0)
        st = await r.status()
        assert [e["telemetry"] for e in st["endpoints"]] == ["/metrics", "/metrics"], st
        assert [e["state"] for e in st["endpoints"]] == ["ready", "ready"], st
        assert (ups[0].telemetry_gets, ups[1].telemetry_gets) == (1, 0)
        assert ups[0].scrapes - scrapes >= 4  # ~10 a second, on /metrics
        async with httpx.AsyncClient(timeout=10) as c:
            assert (await c.post(r.url + "/v1/completions", json=BODY)).status_code == 200


@pytest.mark.parametrize("workers", [2])
async def test_workers_share_one_port_and_their_load_view(start_router, workers: int) -> None:
    async with stubs(3, header_delay=1.0) as ups:
        ups[0].waiting = 2  # as in the burst test: rank 0 starts 8 points behind, no new scrape for 5 s
        r = await start_router(
            "--upstreams",
            ",".join(u.url for u in ups),
            "--workers",
            str(workers),
            "--policy",
            "least_load",
            "--scrape-interval-ms",
            "5000",
        ).wait()
        await asyncio.sleep(0.5)
        # Separate connections so the kernel spreads them over both workers. Each worker must count the
        # other's dispatches (shared counters): seeing only its own, each would put its first 8 on ranks 1
        # and 2, and rank 0 would get nothing from 30 requests.
        clients = [
            httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) for _ in range(30)
        ]
        try:
            res = await asyncio.gather(*(c.post(r.url + "/v1/completions", json=BODY) for c in clients))
        finally:
            for c in clients:
                await c.aclose()
        ranks = [json.loads(x.content)["rank"] for x in res]
        counts = {k: ranks.count(k) for k in range(3)}
        assert 3 <= counts[0] <= 6 and 12 <= counts[1] <= 14 and 12 <= counts[2] <= 14, counts
        # Counters from both workers are summed; each worker flushes its tally into the shared files every
        # 100 ms, so the other worker's last requests may take that long to appear.
        deadline = time.monotonic() + 2.0
        while True:
            text = await r.metrics()
            total = sum(
                metric_value(text, "lbd_router_requests_total", endpoint=u.url, status="200") for u in ups
            )
            if total == 30 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert total == 30
        assert sum(metric_value(text, "lbd_router_inflight_requests", endpoint=u.url) for u in ups) == 0
        pids = {line for line in r.log_text().splitlines() if "listening on" in line}
        assert len(pids) == workers
