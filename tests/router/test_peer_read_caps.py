"""Every answer the router reads from a peer is capped (lbd.common.limits): a real `lbd route` in front of a
stand-in rank whose /metrics never ends and a stand-in supervisor whose /status never ends (aiohttp servers
in this process, named as such). The router's memory stays bounded (psutil RSS of its process) and the rank
is ejected with the reason in /router/status."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import psutil
import pytest
from aiohttp import web

from lbd.common.limits import PEER_READ_MAX_BYTES
from support import free_port

CHUNK = b"# HELP x y\n" * 6000  # ~66 KB of text a write, at loopback speed
RSS_GROWTH_BOUND = 96 << 20  # the cap (8 MiB) a read, buffering, allocator slack; unbounded: gigabytes


class StandIn:
    """A stand-in for a rank (/health, /v1/models answer; /metrics streams forever) or a supervisor
    (/status streams forever)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sent = 0
        self.endless_reads = 0
        self.runner: web.AppRunner | None = None

    async def endless(self, request: web.Request) -> web.StreamResponse:
        self.endless_reads += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        while True:
            await resp.write(CHUNK)
            self.sent += len(CHUNK)

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "stand-in", "object": "model"}]})

    async def start(self) -> StandIn:
        app = web.Application()
        app.router.add_get("/metrics", self.endless)
        app.router.add_get("/status", self.endless)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self


@pytest.fixture
async def stand_ins() -> AsyncIterator[tuple[StandIn, StandIn]]:
    rank, supervisor = await StandIn().start(), await StandIn().start()
    try:
        yield rank, supervisor
    finally:
        for s in (rank, supervisor):
            assert s.runner is not None
            await s.runner.cleanup()


async def test_endless_metrics_and_status_leave_the_router_bounded_and_the_rank_ejected(
        stand_ins: tuple[StandIn, StandIn], start_router) -> None:
    rank, supervisor = stand_ins
    r = start_router("--upstreams", rank.url, "--upstreams", f"supervisor://127.0.0.1:{supervisor.port}",
                     "--scrape-interval-ms", "100", "--health-check-interval-s", "60",
                     "--supervisor-poll-interval-s", "0.2", "--kv-events", "off")
    await r.wait(timeout=30, ready=False)
    proc = psutil.Process(r.proc.pid)
    base = proc.memory_info().rss
    peak = base
    deadline = time.monotonic() + 30
    st: dict = {}
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        peak = max(peak, proc.memory_info().rss)
        st = await r.status()
        ep = next(e for e in st["endpoints"] if e["url"] == rank.url)
        if ep["state"] == "ejected" and supervisor.endless_reads >= 5:
            break
    ep = next(e for e in st["endpoints"] if e["url"] == rank.url)
    assert ep["state"] == "ejected", st  # three failed scrapes (--health-failure-threshold)
    assert "cap" in (ep["last_error"] or "") and str(PEER_READ_MAX_BYTES) in ep["last_error"], ep
    for _ in range(10):  # a few more endless /status reads after the ejection
        await asyncio.sleep(0.1)
        peak = max(peak, proc.memory_info().rss)
    assert rank.endless_reads >= 3 and supervisor.endless_reads >= 5
    assert peak - base < RSS_GROWTH_BOUND, (peak - base, rank.sent, supervisor.sent)
    assert r.proc.poll() is None
    assert "unreachable" in r.log_text() and "cap" in r.log_text()  # the supervisor's, logged once


async def test_an_oversized_kv_event_message_drops_the_publisher_unread(tmp_path) -> None:
    """A stand-in publisher sends one message over PEER_MESSAGE_MAX_BYTES: ZMQ drops the connection before
    the message is buffered, so the feed sees a disconnection (the endpoint's cache is taken as empty),
    never the payload."""
    import zmq
    import zmq.asyncio

    from lbd.common.limits import PEER_MESSAGE_MAX_BYTES
    from lbd.router.kv.feed import EventFeed, Source
    from lbd.router.kv.index import BlockIndex

    ctx = zmq.asyncio.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/stand-in-pub")
    feed = EventFeed("stand-in", Source(f"ipc://{tmp_path}/stand-in-pub", None), BlockIndex().endpoint())
    feed.start()
    try:
        deadline = time.monotonic() + 10
        while feed.stats.state != "live":
            assert time.monotonic() < deadline, feed.stats
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.2)  # the subscription reaches the publisher
        await pub.send_multipart([b"", (0).to_bytes(8, "big"), b"\0" * (PEER_MESSAGE_MAX_BYTES + 1)])
        while feed.stats.state != "disconnected":
            assert time.monotonic() < deadline + 10, feed.stats
            await asyncio.sleep(0.02)
        assert feed.stats.batches == 0 and not feed.stats.error, feed.stats  # the payload was never read
    finally:
        await feed.close()
        pub.close(linger=0)
