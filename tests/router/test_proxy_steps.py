"""The proxy's request path one step at a time (admit -> facts -> decide -> attempt -> relay), in process, on
the router's real objects: its state, counters, policy and upstream pools, its HTTP server for the client's
side, and stub engines (stubs.StubUpstream, stand-ins for the engines) upstream."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx

from lbd.policies import Decision
from lbd.router.auth import Gate
from lbd.router.config import parse_args
from lbd.router.messages import Headers, Request, Response
from lbd.router.proxy import Proxy
from lbd.router.routed import Attempt, Failure, Refused, RoutedRequest
from lbd.router.server import HttpServer
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState
from support import free_port
from support.router_stubs import StubUpstream, stubs

BODY = {"model": "stub-model", "prompt": "hello there"}


def request(body: object = BODY, path: str = "/v1/completions", method: str = "POST",
            **headers: str) -> Request:
    """A complete request as the router's server hands it to the proxy."""
    raw = [(k.replace("_", "-").encode(), v.encode()) for k, v in headers.items()]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return Request(method, path, Headers(raw), False, data)


@contextlib.asynccontextmanager
async def router(urls: list[str], *args: str, gate: Gate | None = None) -> AsyncIterator[Proxy]:
    """A proxy over ``urls`` (rank i at urls[i]), with `lbd route` flags ``args``."""
    state = RouterState(parse_args(["--upstreams", ",".join(urls), "--kv-events", "off", *args]),
                        SharedCounters(1, 16))
    for rank, url in enumerate(urls):
        state.add(url, "static", rank)
    try:
        yield Proxy(state, gate)
    finally:
        for url in urls:
            state.remove(url)


@contextlib.asynccontextmanager
async def client_side(handler: Callable[[Request, Response], Awaitable[None]]) -> AsyncIterator[str]:
    """The router's HTTP server on loopback running ``handler``; yields its URL."""
    server = HttpServer(handler)
    port = free_port()
    await server.start("127.0.0.1", port)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.close(1.0)


def admitted(proxy: Proxy, req: Request) -> RoutedRequest:
    rr = proxy.admit(req)
    assert isinstance(rr, RoutedRequest), rr
    assert proxy.facts(rr) is None  # no exact view: nothing to wait for
    return rr


# ---- admit ----------------------------------------------------------------------------------------------
async def test_admit_parses_the_facts_and_keeps_or_makes_the_request_id() -> None:
    async with router(["http://127.0.0.1:1"]) as proxy:
        rr = proxy.admit(request(X_Request_Id="abc-1"))
        assert isinstance(rr, RoutedRequest)
        assert rr.rid_header == b"X-Request-Id: abc-1\r\n"
        assert rr.facts.model == "stub-model" and rr.facts.prompt_tokens > 0 and rr.data == BODY
        made = proxy.admit(request())
        assert isinstance(made, RoutedRequest) and len(made.rid_header) == len(b"X-Request-Id: \r\n") + 32
        pinned = proxy.admit(request(path="/v1/responses/resp_r3-abc", method="GET", body=b""))
        assert isinstance(pinned, RoutedRequest) and pinned.facts.pinned_rank == 3 and pinned.data is None


async def test_admit_refuses_oversized_unparsable_and_badly_pinned_bodies() -> None:
    async with router(["http://127.0.0.1:1"]) as proxy:
        big = request()
        big.too_large = True
        refused = proxy.admit(big)
        assert isinstance(refused, Refused) and refused.status == 413
        assert "--max-request-body-bytes" in refused.message and refused.headers.startswith(b"X-Request-Id: ")
        refused = proxy.admit(request(b"{not json"))
        assert isinstance(refused, Refused) and (refused.status, refused.type) == (400, "BadRequestError")
        refused = proxy.admit(request(X_data_parallel_rank="one"))
        assert isinstance(refused, Refused) and refused.param == "X-data-parallel-rank"


async def test_admit_applies_the_deployment_queue_limit_and_the_keys_rate_limit() -> None:
    url = "http://127.0.0.1:1"
    async with router([url], "--max-num-queued-reqs", "1") as proxy:
        assert isinstance(proxy.admit(request()), RoutedRequest)
        proxy.state.shared.dispatch(proxy.state.endpoints[url].slot, 10)  # one request in flight
        refused = proxy.admit(request())
        assert isinstance(refused, Refused) and refused.status == 503 and "busy" in refused.message
        assert isinstance(proxy.admit(request(path="/tokenize")), RoutedRequest)  # not an engine request
    gate = Gate(["sk-a"], None, rps=1.0, tps=0.0, burst_s=1.0)
    key = gate.ring.keys[0]
    async with router([url], gate=gate) as proxy:
        assert isinstance(proxy.admit(request(), key), RoutedRequest)
        refused = proxy.admit(request(), key)
        assert isinstance(refused, Refused) and refused.status == 429 and b"Retry-After: " in refused.headers


# ---- facts ----------------------------------------------------------------------------------------------
async def test_facts_forwards_the_clients_headers_with_ours_and_without_hop_headers() -> None:
    async with router(["http://127.0.0.1:1"]) as proxy:
        rr = admitted(proxy, request(X_Request_Id="r-1", Connection="keep-alive", X_Custom="yes",
                                     Authorization="Bearer sk-client"))
        assert b"X-Custom: yes\r\n" in rr.headers and b"X-Request-Id: r-1\r\n" in rr.headers
        assert b"Connection" not in rr.headers and b"sk-client" not in rr.headers  # not forwarded by default


# ---- decide ---------------------------------------------------------------------------------------------
async def test_decide_follows_the_policy_and_the_pin() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    async with router(urls, "--policy", "round_robin") as proxy:
        picks = []
        for _ in range(4):
            d = proxy.decide(admitted(proxy, request()), 0)
            assert isinstance(d, Decision) and d.reason == "round_robin"
            picks.append(d.endpoint.key)
        assert picks == [urls[0], urls[1], urls[0], urls[1]]
        d = proxy.decide(admitted(proxy, request(X_data_parallel_rank="1")), 0)
        assert isinstance(d, Decision) and (d.endpoint.key, d.reason) == (urls[1], "pinned")


async def test_decide_refuses_unknown_ranks_and_full_endpoints_and_skips_failed_ones() -> None:
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    async with router(urls, "--max-streams-per-endpoint", "1") as proxy:
        refused = proxy.decide(admitted(proxy, request(X_data_parallel_rank="7")), 0)
        assert isinstance(refused, Refused) and (refused.status, refused.type) == (400, "BadRequestError")
        assert "known ranks: [0, 1]" in refused.message
        rr = admitted(proxy, request())
        first = proxy.decide(rr, 0)
        assert isinstance(first, Decision)
        rr.exclude.append(first.endpoint.key)  # that try failed
        second = proxy.decide(rr, 1, retrying=True)
        assert isinstance(second, Decision) and second.endpoint.key != first.endpoint.key
        rr.exclude.append(second.endpoint.key)
        assert proxy.decide(rr, 2, retrying=True) is None  # every endpoint failed it: the caller may wait
        for url in urls:  # both endpoints hold --max-streams-per-endpoint requests
            proxy.state.shared.dispatch(proxy.state.endpoints[url].slot, 0)
        refused = proxy.decide(admitted(proxy, request()), 0)
        assert isinstance(refused, Refused) and refused.status == 503
        assert "--max-streams-per-endpoint" in refused.message and b"Retry-After: 1\r\n" in refused.headers


# ---- attempt and relay ----------------------------------------------------------------------------------
async def one_try(proxy: Proxy, body: object = BODY, **headers: str) -> tuple[httpx.Response, Failure | None]:
    """One client request through admit, facts, decide and attempt; a failure is answered as the proxy
    would answer it when no retry is left."""
    result: list[Failure | None] = []

    async def handler(req: Request, out: Response) -> None:
        rr = admitted(proxy, req)
        d = proxy.decide(rr, 0)
        assert isinstance(d, Decision)
        failure = await proxy.attempt(rr, out, d)
        result.append(failure)
        if failure is not None:
            out.send(failure.status, rr.rid_header, failure.body or b"")

    async with client_side(handler) as url, httpx.AsyncClient(timeout=10) as c:
        resp = await c.post(url + "/v1/completions", json=body,
                            headers={k.replace("_", "-"): v for k, v in headers.items()})
    return resp, result[0]


async def test_attempt_relays_an_answer_and_releases_the_endpoint() -> None:
    async with stubs(1) as ups, router([ups[0].url]) as proxy:
        resp, failure = await one_try(proxy, X_Request_Id="t-1")
        assert failure is None and resp.status_code == 200 and resp.json()["rank"] == 0
        assert resp.headers["x-request-id"] == "t-1" and resp.headers["x-stub"] == "1"
        assert ups[0].seen_headers[-1]["X-Request-Id"] == "t-1"
        ep = proxy.state.endpoints[ups[0].url]
        assert proxy.state.shared.totals(ep.slot).inflight == 0 and not ep.waiting
        # a 5xx is the engine's answer to this request: passed on, not a failure to retry
        resp, failure = await one_try(proxy, {**BODY, "prompt": "poison"})
        assert failure is None and resp.status_code == 500 and ep.failures == 1


async def test_attempt_fails_retryably_on_a_closed_port_and_a_503() -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    async with router([closed]) as proxy:
        resp, failure = await one_try(proxy)
        assert failure is not None and failure.retryable
        assert (failure.status, failure.kind) == (502, "connect")
        assert proxy.state.shared.totals(proxy.state.endpoints[closed].slot).inflight == 0
    async with stubs(1, answer_status=503) as ups, router([ups[0].url]) as proxy:
        resp, failure = await one_try(proxy)
        assert failure is not None and (failure.kind, failure.retryable) == ("overloaded", True)
        assert resp.status_code == 503 and resp.json()["error"]["message"] == "stub says no"  # its own body


async def test_relay_ends_a_stream_that_breaks_midway_with_an_error_event() -> None:
    up = await StubUpstream(chunks=4, die_after_chunks=2).start()
    try:
        async with router([up.url]) as proxy:
            state = proxy.state
            ep, pool = state.endpoints[up.url], state.pools[up.url]
            failures: list[Failure | None] = []

            async def handler(req: Request, out: Response) -> None:
                rr = admitted(proxy, req)
                d = Decision(state.snapshot(ep), "test")
                upstream = await pool.request("POST", req.raw_path, rr.headers, req.body, 5.0)
                a = Attempt(ep, d, 0, state.loop.time(), asyncio.current_task())
                try:
                    failures.append(await proxy.relay.relay(out, a, upstream, rr.rid_header))
                finally:
                    upstream.close()

            async with client_side(handler) as url, httpx.AsyncClient(timeout=10) as c:
                resp = await c.post(url + "/v1/chat/completions", json={**BODY, "stream": True})
            assert failures == [None]  # bytes went out: no retry
            events = [e for e in resp.text.split("\n\n") if e]
            assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == ["t0", "t1"]
            assert "mid-stream" in json.loads(events[2][6:])["error"]["message"]
            assert events[3] == "data: [DONE]"
    finally:
        await up.stop()


async def test_relay_fails_when_no_first_byte_comes_in_time() -> None:
    async with stubs(1, first_chunk_delay=1.0) as ups, \
            router([ups[0].url], "--stream-idle-timeout-s", "0.2") as proxy:
        resp, failure = await one_try(proxy, {**BODY, "stream": True})
        assert failure is not None and (failure.status, failure.kind) == (504, "stream_idle_timeout")
        assert not failure.retryable  # it may be computing there
