"""Holes found by trying the router as an attacker would, each fixed and tested by name: half-sent bodies
left in CLOSE-WAIT, unbounded heads, connections that never finish, and a request that makes every engine
answer 500. Real `lbd route` processes, raw sockets, stub upstreams."""

from __future__ import annotations

import asyncio
import json
import resource
import subprocess
import sys
import time

import httpx
import psutil

from support import free_port
from support.router_stubs import stubs

BODY = json.dumps({"model": "stub-model", "prompt": "hello there"}).encode()
FAST_LIMITS = ("--header-read-timeout-s", "1", "--body-read-timeout-s", "1", "--keep-alive-timeout-s", "1.5")


def head(path: str = "/v1/completions", *extra: str, length: int | None = None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def status_of(r: asyncio.StreamReader, timeout: float = 5.0) -> tuple[int, bytes]:
    """The status of the next answer and everything until the server closes."""
    data = await asyncio.wait_for(r.read(), timeout)
    return (int(data.split(b" ", 2)[1]) if data else 0), data


def close_wait(pid: int) -> int:
    return sum(1 for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_CLOSE_WAIT)


async def test_half_sent_body_is_closed_not_close_wait(tmp_path) -> None:
    """A client that announces a body, sends part of it (or none) and half-closes: the router drops the
    request and closes. Under a low open-file limit (hard 256) it keeps accepting after 300 such clients."""
    async with stubs(1) as ups:
        port = free_port()
        log = open(tmp_path / "router.log", "wb")  # noqa: SIM115 - closed below
        low = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))  # noqa: E731
        proc = subprocess.Popen(
            [sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port), "--upstreams",
             ups[0].url, "--max-connections", "128"], stdout=log, stderr=subprocess.STDOUT, preexec_fn=low)
        try:
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(timeout=5) as c:
                for _ in range(200):
                    try:
                        if (await c.get(url + "/readyz")).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    await asyncio.sleep(0.05)
            for _ in range(10):  # 300 half-sent requests, 30 at a time: each would hold an fd forever
                conns = []
                for i in range(30):
                    r, w = await asyncio.open_connection("127.0.0.1", port)
                    w.write(head(length=1000) + (b'{"model": "stub' if i % 2 else b""))
                    await w.drain()
                    w.write_eof()
                    conns.append((r, w))
                for r, w in conns:
                    assert await asyncio.wait_for(r.read(), 5) == b"", "the router answered a half request"
                    w.close()
            deadline = time.monotonic() + 5
            while close_wait(proc.pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert close_wait(proc.pid) == 0
            assert ups[0].seen_bodies == []  # none of them was forwarded
            async with httpx.AsyncClient(timeout=5) as c:  # and it still accepts and serves
                assert (await c.post(url + "/v1/completions", content=BODY)).status_code == 200
        finally:
            proc.terminate()
            proc.wait(10)
            log.close()


async def test_router_caps_header_size(start_router) -> None:
    async with stubs(1) as ups:
        router = await start_router("--upstreams", ups[0].url).wait()
        rss0 = psutil.Process(router.proc.pid).memory_info().rss

        async def one(data: bytes) -> int:
            r, w = await asyncio.open_connection("127.0.0.1", router.port)
            try:
                w.write(data)
            except ConnectionError:
                pass
            status, _ = await status_of(r)
            w.close()
            return status

        assert await one(b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n") == 414
        assert await one(head("/v1/completions", "X-Big: " + "b" * 9000, length=len(BODY)) + BODY) == 431
        many = [f"X-H{i}: v" for i in range(150)]
        assert await one(head("/v1/completions", *many, length=len(BODY)) + BODY) == 431

        async def unterminated() -> int:
            """The attack: a header that never ends (16 MiB offered, 64 KiB at a time)."""
            r, w = await asyncio.open_connection("127.0.0.1", router.port)
            w.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Forever: ")
            try:
                for _ in range(256):
                    w.write(b"z" * 65536)
                    await w.drain()
            except ConnectionError:
                pass  # the router answered and closed
            status, _ = await status_of(r)
            w.close()
            return status

        statuses = await asyncio.gather(*(unterminated() for _ in range(8)))
        assert all(s in (431, 0) for s in statuses) and 431 in statuses, statuses
        grew = psutil.Process(router.proc.pid).memory_info().rss - rss0
        assert grew < 64 << 20, f"RSS grew by {grew >> 20} MiB"
        async with httpx.AsyncClient(timeout=5) as c:
            assert (await c.post(router.url + "/v1/completions", content=BODY)).status_code == 200
        assert all(e["state"] == "ready" for e in (await router.status())["endpoints"])


async def test_idle_connections_are_closed(start_router) -> None:
    async with stubs(1) as ups:
        router = await start_router("--upstreams", ups[0].url, *FAST_LIMITS, "--max-connections", "6").wait()

        async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection("127.0.0.1", router.port)

        t0 = time.monotonic()
        silent = await connect()  # sends nothing at all
        slow_head = await connect()  # a byte every 0.3 s, never a whole head
        slow_body = await connect()  # a whole head, then the body a byte at a time
        slow_body[1].write(head(length=100))
        kept = await connect()  # one request, then idle on a kept-alive connection
        kept[1].write(head(length=len(BODY)) + BODY)

        async def trickle(w: asyncio.StreamWriter, data: bytes) -> None:
            for byte in data:
                if w.is_closing():
                    return
                w.write(bytes([byte]))
                await asyncio.sleep(0.3)

        feeders = [asyncio.create_task(trickle(slow_head[1], head(length=2))),
                   asyncio.create_task(trickle(slow_body[1], b"x" * 100))]
        first = await asyncio.wait_for(kept[0].readuntil(b"\r\n\r\n"), 5)
        assert first.startswith(b"HTTP/1.1 200")
        for name, (r, _), want in (("silent", silent, 408), ("slow head", slow_head, 408),
                                   ("slow body", slow_body, 408)):
            status, data = await status_of(r, 6)
            assert status == want, (name, data[:200])
            assert b"timeout-s" in data, data
        assert time.monotonic() - t0 < 5  # 1 s timeouts, checked every second
        await asyncio.wait_for(kept[0].read(), 5)  # the idle keep-alive connection is closed too
        for task in feeders:
            task.cancel()
        # --max-connections 6: the 7th connection gets 503 at once
        held = [await connect() for _ in range(6)]
        extra = await connect()
        status, data = await status_of(extra[0], 5)
        assert status == 503 and b"--max-connections" in data and b"Retry-After" in data
        for _, w in [*held, extra, silent, slow_head, slow_body, kept]:
            w.close()


async def test_deterministic_500_does_not_eject_every_rank(start_router) -> None:
    """A request that makes every engine answer 500 is answered 500 once, by one rank (never replayed on the
    others), and however many such requests come, passive ejection keeps half of the ranks in service."""
    async with stubs(2) as ups:
        router = await start_router("--upstreams", ",".join(u.url for u in ups), "--policy", "round_robin",
                                    "--outlier-consecutive-5xx", "2", "--health-check-interval-s",
                                    "30").wait()
        poison = json.dumps({"model": "stub-model", "prompt": "poison"}).encode()
        async with httpx.AsyncClient(timeout=10) as c:
            for _ in range(12):
                resp = await c.post(router.url + "/v1/completions", content=poison)
                assert resp.status_code == 500 and resp.json()["error"]["code"] == 500
            served = sum(b"poison" in body for u in ups for body in u.seen_bodies)
            assert served == 12  # each bad request reached exactly one rank
            states = [e["state"] for e in (await router.status())["endpoints"]]
            assert states.count("ready") >= 1, states
            for _ in range(6):
                assert (await c.post(router.url + "/v1/completions", content=BODY)).status_code == 200


async def test_max_streams_per_endpoint_spills_over_then_503(start_router) -> None:
    """--max-streams-per-endpoint: a full endpoint is skipped; when every one is full, 503 + Retry-After."""
    async with stubs(2, header_delay=1.5) as ups:
        router = await start_router("--upstreams", ",".join(u.url for u in ups), "--policy", "least_load",
                                    "--max-streams-per-endpoint", "1").wait()
        async with httpx.AsyncClient(timeout=30) as c:
            async def one() -> httpx.Response:
                return await c.post(router.url + "/v1/completions", content=BODY)

            first = [asyncio.create_task(one()) for _ in range(2)]
            await asyncio.sleep(0.5)  # both endpoints now hold one request each
            third = await one()
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert "--max-streams-per-endpoint" in third.json()["error"]["message"]
            done = await asyncio.gather(*first)
            assert sorted(r.json()["rank"] for r in done) == [0, 1]  # the second spilled to the other one
            assert (await one()).status_code == 200  # slots released
