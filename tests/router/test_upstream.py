"""The proxy's upstream client (llhttp via httptools) against a raw TCP server that sends scripted bytes:
framing (chunked, sized, until close), interim 1xx, keep-alive reuse and refusal, stale pooled connections,
bad responses, early release, and back-pressure on a slow reader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import pytest

from lbd.router.upstream import UpstreamError, UpstreamPool

Script = Callable[[int], list[bytes]]  # request number on this connection -> byte pieces to write


@dataclass
class RawServer:
    """Answers each request on a connection with ``script(n)``, written piece by piece with a yield between
    (so the client sees split reads); ``close_after`` requests it closes the connection."""

    script: Script
    close_after: int | None = None
    connections: int = 0
    eofs: int = 0
    server: asyncio.AbstractServer | None = None
    requests: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.script(n):
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0)
                n += 1
                if self.close_after is not None and n >= self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            self.eofs += 1
        finally:
            writer.close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"


@pytest.fixture
async def raw() -> AsyncIterator[Callable[..., RawServer]]:
    servers: list[RawServer] = []

    async def start(script: Script, **kw: object) -> RawServer:
        s = RawServer(script, **kw)  # type: ignore[arg-type]
        s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        servers.append(s)
        return s

    yield start  # type: ignore[misc]
    for s in servers:
        assert s.server is not None
        s.server.close()


def bytewise(data: bytes) -> list[bytes]:
    return [data[i : i + 1] for i in range(len(data))]


async def test_chunked_split_anywhere_with_extensions_and_trailers_then_reuse(raw) -> None:
    answer = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
        b"X-Custom: a b\r\n\r\n5;ext=1\r\nhello\r\n7\r\n, world\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    srv = await raw(lambda n: bytewise(answer))
    pool = UpstreamPool(srv.url, 2.0)
    for _ in range(2):
        resp = await pool.request("POST", "/v1/completions", b"X-A: 1\r\n", b'{"x": 1}')
        assert resp.status == 200 and resp.chunked and resp.content_type == "text/event-stream"
        assert ("X-Custom", "a b") in resp.headers  # case and order kept
        assert await resp.read() == b"hello, world"
    assert srv.connections == 1  # kept alive and reused
    assert srv.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"X-A: 1\r\nContent-Length: 8\r\n\r\n" in srv.requests[0]
    pool.close()


async def test_interim_100_and_sized_body(raw) -> None:
    srv = await raw(
        lambda n: [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 201 Created\r\nContent-Length: 3\r\n\r\nabc"]
    )
    pool = UpstreamPool(srv.url, 2.0)
    resp = await pool.request("POST", "/x", b"", b"")
    assert (resp.status, resp.content_length, await resp.read()) == (201, 3, b"abc")
    pool.close()


async def test_body_until_close_and_connection_close_are_not_reused(raw) -> None:
    srv = await raw(lambda n: [b"HTTP/1.1 200 OK\r\n\r\n", b"part1 ", b"part2"], close_after=1)
    pool = UpstreamPool(srv.url, 2.0)
    resp = await pool.request("GET", "/", b"", b"")
    assert resp.until_close and await resp.read() == b"part1 part2"
    assert not pool.idle
    srv2 = await raw(lambda n: [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok"])
    pool2 = UpstreamPool(srv2.url, 2.0)
    for _ in range(2):
        resp = await pool2.request("GET", "/", b"", b"")
        assert await resp.read() == b"ok" and not resp.keep_alive
    assert srv2.connections == 2 and not pool2.idle


async def test_a_pooled_connection_the_upstream_closed_is_replaced_silently(raw) -> None:
    srv = await raw(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"], close_after=1)
    pool = UpstreamPool(srv.url, 2.0)
    assert await (await pool.request("GET", "/", b"", b"")).read() == b"ok"
    assert len(pool.idle) == 1  # the server said keep-alive, then hung up before the next request
    await asyncio.sleep(0.05)
    assert await (await pool.request("GET", "/", b"", b"")).read() == b"ok"
    assert srv.connections == 2
    pool.close()


async def test_bad_responses_and_cut_bodies_are_upstream_errors(raw) -> None:
    srv = await raw(lambda n: [b"HTTP/1.1 abc nonsense\r\n\r\n"])
    pool = UpstreamPool(srv.url, 2.0)
    with pytest.raises(UpstreamError) as e:
        await pool.request("GET", "/", b"", b"")
    assert not e.value.before_response and "bad response" in str(e.value)
    srv = await raw(lambda n: [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"], close_after=1)
    pool = UpstreamPool(srv.url, 2.0)
    resp = await pool.request("GET", "/", b"", b"")
    assert await resp.read_chunk() == b"abc"
    with pytest.raises(UpstreamError, match="mid-body"):
        await resp.read_chunk()
    srv = await raw(lambda n: [], close_after=1)  # closes without answering
    pool = UpstreamPool(srv.url, 2.0)
    with pytest.raises(UpstreamError) as e:
        await pool.request("GET", "/", b"", b"")
    assert e.value.before_response


async def test_head_answer_ends_at_its_headers(raw) -> None:
    srv = await raw(lambda n: [b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 18\r\n\r\n"])
    pool = UpstreamPool(srv.url, 2.0)
    resp = await asyncio.wait_for(pool.request("HEAD", "/v1/completions", b"", b""), 2.0)
    assert resp.status == 405 and await asyncio.wait_for(resp.read(), 2.0) == b""
    assert not pool.idle  # the parser still expects 18 bytes: never reuse this connection


async def test_releasing_early_closes_the_connection_so_the_upstream_sees_the_client_leave(raw) -> None:
    def script(n: int) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\none\r\n"]

    srv = await raw(script)
    pool = UpstreamPool(srv.url, 2.0)
    resp = await pool.request("POST", "/", b"", b"{}")
    assert await resp.read_chunk() == b"one"
    resp.release()
    for _ in range(100):
        if srv.eofs:
            break
        await asyncio.sleep(0.01)
    assert srv.eofs == 1 and not pool.idle


async def test_a_slow_reader_pauses_the_upstream_and_gets_every_byte(raw) -> None:
    piece = b"x" * 65536
    pieces = 64  # 4 MiB, four times the high-water mark
    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (len(piece) * pieces)
    srv = await raw(lambda n: [head] + [piece] * pieces)
    pool = UpstreamPool(srv.url, 2.0)
    resp = await pool.request("GET", "/", b"", b"")
    await asyncio.sleep(0.3)  # read nothing for a while: the buffer must stop near the high-water mark
    assert resp._paused and resp._size < 2 * (1 << 20)
    total = 0
    while chunk := await resp.read_chunk():
        total += len(chunk)
    assert total == len(piece) * pieces and resp.complete
    pool.close()
