"""The router's own HTTP server (lbd.router.server) seen from raw sockets through a real `lbd route` process:
pipelining, HTTP/1.0, HEAD, chunked uploads, 100-continue, body limits, malformed requests, chunked streams,
and a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import json
import time

from support import metric_value
from support.router_stubs import stubs

BODY = json.dumps({"model": "stub-model", "prompt": "hello there"}).encode()


def post(path: str, body: bytes, *extra: str, version: str = "1.1") -> bytes:
    head = [f"POST {path} HTTP/{version}", "Host: x", "Content-Type: application/json", *extra]
    if not any(h.lower().startswith(("content-length", "transfer-encoding")) for h in extra):
        head.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


async def read_response(r: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One response: status, headers (lower-cased names), body (sized, chunked or until EOF)."""
    head = (await r.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await r.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await r.readuntil(b"\r\n")).strip(), 16)
            body += await r.readexactly(size + 2)
            if size == 0:
                return status, headers, body[:-2]
            body = body[:-2]
    return status, headers, await r.read()


async def test_pipelined_requests_answer_in_order_on_one_connection(start_router) -> None:
    async with stubs(2) as ups:
        router = await start_router("--upstreams", ",".join(u.url for u in ups)).wait()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            w.write(
                post("/v1/completions", BODY, "X-Request-Id: one")
                + b"GET /health HTTP/1.1\r\nHost: x\r\nX-Request-Id: two\r\n\r\n"
                + post("/v1/completions", BODY, "X-Request-Id: three")
            )
            first, second, third = [await read_response(r) for _ in range(3)]
            assert first[0] == 200 and json.loads(first[2])["choices"][0]["text"] == "hi"
            assert first[1]["x-request-id"] == "one"
            assert second[0] == 200 and json.loads(second[2]) == {"status": "ok"}
            assert third[0] == 200 and third[1]["x-request-id"] == "three"
            # HEAD: the headers of the answer, no body; the connection stays usable
            w.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /readyz HTTP/1.1\r\nHost: x\r\n\r\n")
            head = (await r.readuntil(b"\r\n\r\n")).decode()
            assert head.startswith("HTTP/1.1 200") and "Content-Length: 15" in head
            status, _, body = await read_response(r)
            assert status == 200 and json.loads(body) == {"ready": True}
        finally:
            w.close()


async def test_http10_closes_and_streams_without_chunking(start_router) -> None:
    # events 20 ms apart: an answer already whole when its first byte is relayed goes out sized, in one write
    async with stubs(1, chunks=3, chunk_delay=0.02) as ups:
        router = await start_router("--upstreams", ups[0].url).wait()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        w.write(post("/v1/completions", BODY, version="1.0"))
        status, headers, body = await read_response(r)
        assert status == 200 and json.loads(body)["rank"] == 0
        assert await r.read() == b""  # HTTP/1.0 without keep-alive: closed after the answer
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        for _ in range(2):  # HTTP/1.0 asking for keep-alive is told it got it, and keeps the connection
            w.write(post("/v1/completions", BODY, "Connection: keep-alive", version="1.0"))
            status, headers, body = await asyncio.wait_for(read_response(r), 5)
            assert status == 200 and headers["connection"] == "keep-alive" and json.loads(body)["rank"] == 0
        w.close()
        stream = json.dumps({"model": "stub-model", "prompt": "x", "stream": True}).encode()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        w.write(post("/v1/completions", stream, version="1.0"))
        status, headers, body = await read_response(r)  # no length, not chunked: ends with the connection
        assert status == 200 and "transfer-encoding" not in headers and "content-length" not in headers
        assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
        w.close()
        # HTTP/1.1: a stream of unknown length is chunked, and the connection is kept
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            for _ in range(2):
                w.write(post("/v1/completions", stream))
                status, headers, body = await read_response(r)
                assert status == 200 and headers.get("transfer-encoding") == "chunked", headers
                assert body.count(b"data: ") == 4 and body.endswith(b"data: [DONE]\n\n")
        finally:
            w.close()


async def test_chunked_upload_and_expect_100_continue(start_router) -> None:
    async with stubs(1) as ups:
        router = await start_router("--upstreams", ups[0].url).wait()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            w.write(post("/v1/completions", b"", "Transfer-Encoding: chunked"))
            for i in range(0, len(BODY), 7):  # in pieces, with pauses: the router waits for the whole body
                piece = BODY[i : i + 7]
                w.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                await w.drain()
                await asyncio.sleep(0.01)
            w.write(b"0\r\n\r\n")
            status, _, body = await read_response(r)
            assert status == 200 and json.loads(body)["rank"] == 0
            assert ups[0].seen_bodies[-1] == BODY  # forwarded whole (with a Content-Length)
            # Expect: 100-continue: the interim answer comes before the body is sent
            w.write(post("/v1/completions", b"", "Expect: 100-continue", f"Content-Length: {len(BODY)}"))
            assert await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(BODY)
            status, _, body = await read_response(r)
            assert status == 200 and json.loads(body)["rank"] == 0
        finally:
            w.close()


async def test_oversized_bodies_are_413_without_reading_the_rest(start_router) -> None:
    async with stubs(1) as ups:
        router = await start_router("--upstreams", ups[0].url, "--max-request-body-bytes", "1KiB").wait()
        # Declared too large (with 100-continue: no interim answer, the 413 at once); only 10 bytes sent.
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        w.write(post("/v1/completions", b"{" * 10, "Expect: 100-continue", "Content-Length: 10000000"))
        status, headers, body = await asyncio.wait_for(read_response(r), 5)
        err = json.loads(body)["error"]
        assert status == 413 and err["code"] == 413 and "--max-request-body-bytes" in err["message"]
        assert "10000000 bytes" in err["message"] and headers["connection"] == "close"
        assert len(headers["x-request-id"]) >= 16
        assert await asyncio.wait_for(r.read(), 5) == b""  # closed: the rest of that body is never read
        w.close()
        # Chunked, no length: refused once the chunks pass the limit, before the body ends.
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        w.write(post("/v1/completions", b"", "Transfer-Encoding: chunked"))
        w.write(b"400\r\n" + b"x" * 1024 + b"\r\n" + b"10\r\n" + b"y" * 16 + b"\r\n")
        status, _, body = await asyncio.wait_for(read_response(r), 5)
        assert status == 413 and "1024-byte limit" in json.loads(body)["error"]["message"]
        w.close()
        assert ups[0].served == 0 and not ups[0].seen_bodies
        metrics = await router.metrics()
        assert metric_value(metrics, "lbd_router_requests_total", endpoint="none", status="413") == 2


async def test_malformed_requests_get_400_and_a_close(start_router) -> None:
    async with stubs(1) as ups:
        router = await start_router("--upstreams", ups[0].url).wait()
        for junk in (
            b"GARBAGE\r\n\r\n",
            b"GET /health HTTP/1.1\r\nHost x\r\n\r\n",  # a header line without a colon
            b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        ):
            r, w = await asyncio.open_connection("127.0.0.1", router.port)
            w.write(junk)
            status, headers, body = await asyncio.wait_for(read_response(r), 5)
            err = json.loads(body)["error"]
            assert status == 400 and err["type"] == "BadRequestError" and set(err) >= {"message", "code"}
            assert headers["connection"] == "close" and await asyncio.wait_for(r.read(), 5) == b""
            w.close()
        # A good request followed by junk on the same connection: the good one is answered first.
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        w.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\nNOT HTTP AT ALL\r\n\r\n")
        assert (await asyncio.wait_for(read_response(r), 5))[0] == 200
        assert (await asyncio.wait_for(read_response(r), 5))[0] == 400
        w.close()


async def test_client_leaving_mid_stream_releases_inflight_and_cancels_upstream(start_router) -> None:
    async with stubs(1, chunks=1000, chunk_delay=0.05) as ups:
        router = await start_router("--upstreams", ups[0].url).wait()
        stream = json.dumps({"model": "stub-model", "prompt": "x", "stream": True}).encode()
        writers = []
        for _ in range(5):
            r, w = await asyncio.open_connection("127.0.0.1", router.port)
            w.write(post("/v1/completions", stream))
            await r.readuntil(b"\r\n\r\n")
            await r.readuntil(b"\n\n")  # the first event arrived: streaming began
            writers.append(w)
        metrics = await router.metrics()
        assert metric_value(metrics, "lbd_router_inflight_requests", endpoint=ups[0].url) == 5
        for w in writers:
            w.transport.abort()  # a reset, as a client that crashed
        t0 = time.monotonic()
        while ups[0].inflight or ups[0].cancelled < 5:
            assert time.monotonic() - t0 < 3.0, (ups[0].inflight, ups[0].cancelled)
            await asyncio.sleep(0.05)
        metrics = await router.metrics()
        assert metric_value(metrics, "lbd_router_inflight_requests", endpoint=ups[0].url) == 0
        assert metric_value(metrics, "lbd_router_client_disconnects_total", endpoint=ups[0].url) == 5


async def test_a_stream_that_stalls_mid_way_ends_with_an_error_event(start_router) -> None:
    async with stubs(1, chunks=3, chunk_delay=2.0) as ups:
        router = await start_router("--upstreams", ups[0].url, "--stream-idle-timeout-s", "0.4").wait()
        stream = json.dumps({"model": "stub-model", "prompt": "x", "stream": True}).encode()
        r, w = await asyncio.open_connection("127.0.0.1", router.port)
        try:
            t0 = time.monotonic()
            w.write(post("/v1/completions", stream))
            status, headers, body = await asyncio.wait_for(read_response(r), 5)
            assert status == 200 and time.monotonic() - t0 < 1.5  # not waiting out the 2 s gap
            assert body.count(b'"text": "t') == 1 and b"stalled mid-stream" in body
            assert body.endswith(b"data: [DONE]\n\n")
        finally:
            w.close()
        t0 = time.monotonic()
        while ups[0].inflight:  # the upstream request was abandoned (its connection closed)
            assert time.monotonic() - t0 < 3.0
            await asyncio.sleep(0.05)
        metrics = await router.metrics()
        assert metric_value(metrics, "lbd_router_inflight_requests", endpoint=ups[0].url) == 0
        assert metric_value(metrics, "lbd_router_upstream_errors_total", kind="mid_stream") == 1



async def test_stream_writes_wait_while_the_client_does_not_read() -> None:
    """lbd.router.server directly (in process, real sockets): 16 MiB written to a client that reads
    nothing for a while; ``write`` must wait (back-pressure) rather than buffer it all, and every byte
    arrives in order."""
    from lbd.common.limits import Limits
    from lbd.router.server import HttpServer

    piece = bytes(range(256)) * 256  # 64 KiB
    seen_backed_up = []

    async def handler(request, out) -> None:
        out.start(200, [("Content-Type", "application/octet-stream")])
        for _ in range(256):
            await out.write(piece)
            seen_backed_up.append(out.backed_up)
        out.end()

    server = HttpServer(handler, Limits(max_request_body_bytes=1 << 20))
    await server.start("127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
        w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.5)
        written_while_stalled = len(seen_backed_up)
        status, headers, body = await asyncio.wait_for(read_response(r), 20)
        w.close()
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == piece * 256
        assert written_while_stalled < 256  # the handler waited for the client
    finally:
        await server.close()


async def test_a_slow_reader_gets_the_whole_stream_through_back_pressure(start_router) -> None:
    async with stubs(1, chunks=20000) as ups:  # ~1.5 MB of events, far past the socket buffers
        router = await start_router("--upstreams", ups[0].url).wait()
        stream = json.dumps({"model": "stub-model", "prompt": "x", "stream": True}).encode()
        r, w = await asyncio.open_connection("127.0.0.1", router.port, limit=1 << 16)
        try:
            w.write(post("/v1/completions", stream))
            await asyncio.sleep(1.0)  # read nothing: the router must wait for the client (write pauses)
            status, _, body = await asyncio.wait_for(read_response(r), 20)
            events = body.split(b"\n\n")
            assert status == 200 and body.endswith(b"data: [DONE]\n\n") and len(events) == 20002
            assert all(b'"text": "t%d"' % i in events[i] for i in (0, 1, 9999, 19999))
        finally:
            w.close()
        metrics = await router.metrics()
        assert metric_value(metrics, "lbd_router_inflight_requests", endpoint=ups[0].url) == 0
