"""Capped reads from peers (lbd.common.limits): a stand-in peer (an aiohttp server, named as such) answers
with an endless body, a huge declared one or a normal one; every reader stops at its cap (and in time)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from lbd.common.limits import (
    PEER_FILE_MAX_BYTES,
    PEER_READ_MAX_BYTES,
    PeerReadTooLarge,
    peer_read_cap,
    read_aiohttp,
    read_capped,
    read_upstream,
)
from lbd.router.upstream import UpstreamPool
from lbd.supervisor.probe import CONNECTION, Prober
from support import free_port

CHUNK = b"x" * (64 << 10)


class StandInPeer:
    """A stand-in for a rank or supervisor: /endless streams forever, /declared claims a huge length,
    /small answers a few bytes, /slow sends a byte and then nothing."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sent = 0
        self.runner: web.AppRunner | None = None

    async def endless(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        while True:
            await resp.write(CHUNK)
            self.sent += len(CHUNK)

    async def declared(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(1 << 40)})
        await resp.prepare(request)
        await resp.write(CHUNK)
        await asyncio.sleep(30)
        return resp

    async def small(self, request: web.Request) -> web.Response:
        return web.Response(body=b'{"ok":true}', content_type="application/json")

    async def slow(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"{")
        await asyncio.sleep(30)
        return resp

    async def start(self) -> StandInPeer:
        app = web.Application()
        for path, handler in (("/endless", self.endless), ("/health", self.endless), ("/small", self.small),
                              ("/declared", self.declared), ("/slow", self.slow)):
            app.router.add_get(path, handler)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self


@pytest.fixture
async def peer() -> AsyncIterator[StandInPeer]:
    p = await StandInPeer().start()
    try:
        yield p
    finally:
        assert p.runner is not None
        await p.runner.cleanup()


async def test_read_capped_stops_at_the_cap_and_at_a_declared_length() -> None:
    chunks = iter([b"ab", b"cd", b""])

    async def read() -> bytes:
        return next(chunks)

    assert await read_capped(read, 4) == b"abcd"
    with pytest.raises(PeerReadTooLarge, match="declares 9 bytes"):
        await read_capped(read, 4, declared=9)
    more = iter([b"ab", b"cde"])

    async def read_more() -> bytes:
        return next(more)

    with pytest.raises(PeerReadTooLarge, match="over the 4-byte cap"):
        await read_capped(read_more, 4)
    assert peer_read_cap("/tokenizer.json") == PEER_FILE_MAX_BYTES
    assert peer_read_cap("/metrics") == peer_read_cap("/status") == PEER_READ_MAX_BYTES


async def test_aiohttp_reads_are_capped_in_size_and_time(peer: StandInPeer) -> None:
    async with aiohttp.ClientSession() as session:
        async with session.get(peer.url + "/small") as resp:
            assert await read_aiohttp(resp) == b'{"ok":true}'
        for path in ("/endless", "/declared"):
            async with session.get(peer.url + path) as resp:
                with pytest.raises(PeerReadTooLarge):
                    await read_aiohttp(resp, max_bytes=1 << 20)
        async with session.get(peer.url + "/slow") as resp:
            with pytest.raises(TimeoutError):
                await read_aiohttp(resp, timeout_s=0.3)
    assert peer.sent < 64 << 20  # the reader hung up soon after its cap


async def test_router_client_reads_are_capped(peer: StandInPeer) -> None:
    pool = UpstreamPool(peer.url, 2.0)
    try:
        for path, cap in (("/small", 1 << 20), ("/endless", 1 << 20), ("/declared", 1 << 20)):
            resp = await pool.request("GET", path, b"", b"", 2.0)
            try:
                if path == "/small":
                    assert await read_upstream(resp, cap) == b'{"ok":true}'
                else:
                    with pytest.raises(PeerReadTooLarge):
                        await read_upstream(resp, cap, what=path)
            finally:
                resp.close()
    finally:
        pool.close()


async def test_a_supervisor_probe_of_an_endless_health_answer_fails_with_a_reason(peer: StandInPeer) -> None:
    prober = Prober(timeout_s=5.0)
    try:
        result = await prober.health(peer.url)
    finally:
        await prober.close()
    assert not result.ok and result.reason == CONNECTION and "cap" in result.detail, result
