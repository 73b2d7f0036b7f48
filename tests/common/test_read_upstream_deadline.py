"""``read_upstream``'s timeout bounds the whole read, not each wait: a peer that trickles a byte every 50 ms
cannot hold the router's read past it (the P/D prefill stage reads its answer so)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from lbd.common.limits import read_upstream
from lbd.router.upstream import UpstreamPool
from support import free_port


async def trickle(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse()
    await resp.prepare(request)
    for _ in range(40):  # 2 s in all
        await resp.write(b"x")
        await asyncio.sleep(0.05)
    await resp.write_eof()
    return resp


@pytest.fixture
async def peer() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_get("/trickle", trickle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def test_a_trickling_answer_is_cut_at_the_total_timeout(peer: str) -> None:
    pool = UpstreamPool(peer, 2.0)
    try:
        resp = await pool.request("GET", "/trickle", b"", b"", 2.0)
        t0 = time.monotonic()
        try:
            with pytest.raises(TimeoutError):
                await read_upstream(resp, 1 << 20, timeout_s=0.5, what="/trickle")
        finally:
            resp.close()
        assert time.monotonic() - t0 < 1.5
    finally:
        pool.close()
