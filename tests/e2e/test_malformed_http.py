"""Malformed and hostile HTTP against every server port we run: the router (httptools), an engine rank and a
supervisor's health port (aiohttp). Each case must get a clean 4xx or a close within its bound, never a crash,
a stuck worker, a leaked slot or a request forwarded twice; after each case the server still answers.
Limits are set low (1 s head and body timeouts) so the suite stays a few seconds per server; the cases that
wait on those timeouts run at once."""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import struct
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
from aiohttp import web

from support import EngineServer, RouterServer, free_port
from support.node import SupervisorNode

KEY = "malformed-suite-key"
LIMITS = ["--header-read-timeout-s", "1", "--body-read-timeout-s", "1", "--keep-alive-timeout-s", "2",
          "--max-headers", "50", "--max-header-bytes", "4096", "--max-request-line-bytes", "4096"]
BOUND_S = 4.0  # 1 s timeouts, swept every second, on a busy machine


class Target:
    def __init__(self, name: str, port: int, pid: int, post_path: str, slots: Callable[[], int],
                 forwarded: Callable[[], int] | None = None) -> None:
        self.name, self.port, self.pid, self.post_path = name, port, pid, post_path
        self.slots = slots  # requests the server still holds (must return to 0)
        self.forwarded = forwarded  # requests that reached an upstream (router only)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def broken_model(tiny_llama: Path, folder: Path) -> Path:
    """The tiny model with weights that cannot load: its rank fails at start-up (a crash loop)."""
    shutil.copytree(tiny_llama, folder)
    (folder / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
    return folder


@pytest.fixture(scope="module")
def targets(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Target]]:
    logs = tmp_path_factory.mktemp("malformed")
    seen: list[bytes] = []  # a plain upstream behind the router that counts what reaches it
    port = free_port()
    ready = threading.Event()
    loop = asyncio.new_event_loop()

    async def upstream() -> None:
        async def complete(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            seen.append(body)
            if b'"stream": true' in body:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                for i in range(200):
                    await resp.write(b'data: {"i": %d}\n\n' % i)
                    await asyncio.sleep(0.02)
                return resp
            return web.json_response({"choices": [{"text": "ok"}]})

        async def ok(request: web.Request) -> web.Response:
            return web.Response(text="")

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"data": [{"id": "m"}]})

        app = web.Application()
        app.router.add_post("/v1/completions", complete)
        app.router.add_get("/health", ok)
        app.router.add_get("/metrics", ok)
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(upstream()), loop.run_forever()),
                              daemon=True)
    thread.start()
    ready.wait(10)
    engine = EngineServer(tiny_llama, "--kv-cache-memory-bytes", "32MiB", "--api-key", KEY, *LIMITS,
                          log=logs / "engine.log")
    router = RouterServer("--upstreams", f"http://127.0.0.1:{port}", "--api-key", KEY, *LIMITS,
                          log=logs / "router.log").wait_ready()
    node = SupervisorNode(broken_model(tiny_llama, logs / "broken"), 1, "--admin-token", KEY,
                          "--restart-backoff-initial-s", "60", *LIMITS, log=logs / "node.log")
    node.wait_for(lambda: node.get("/health").status_code == 200, 60, "supervisor health port")

    def router_slots() -> int:
        status = httpx.get(router.url + "/router/status", headers={"Authorization": f"Bearer {KEY}"}).json()
        return sum(e["inflight"] for e in status["endpoints"])

    def engine_slots() -> int:
        return httpx.get(engine.base_url + "/load").json()["server_load"]

    try:
        yield {
            "router": Target("router", router.port, router.proc.pid, "/v1/completions", router_slots,
                             lambda: len(seen)),
            "engine": Target("engine", engine.port, engine.proc.pid, "/v1/completions", engine_slots),
            "supervisor": Target("supervisor", node.sport, node.proc.pid, "/rolling-restart", lambda: 0),
        }
    finally:
        node.close()
        router.close()
        engine.close()
        loop.call_soon_threadsafe(loop.stop)


SERVERS = ["router", "engine", "supervisor"]
BODY = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 2}).encode()


def conn(t: Target) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", t.port), timeout=10)
    s.settimeout(BOUND_S + 2)
    return s


def read_all(s: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def status(data: bytes) -> int:
    return int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/") else 0


def post_head(t: Target, *extra: str, length: int | None = None, auth: bool = True) -> bytes:
    lines = [f"POST {t.post_path} HTTP/1.1", "Host: x", "Content-Type: application/json",
             *([f"Authorization: Bearer {KEY}"] if auth else []), *extra]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def still_serves(t: Target) -> None:
    assert psutil.pid_exists(t.pid)
    r = httpx.get(t.url + "/health", timeout=10)
    assert r.status_code == 200, (t.name, r.status_code)
    deadline = time.monotonic() + 10
    while t.slots() != 0:
        assert time.monotonic() < deadline, f"{t.name} holds a slot"
        time.sleep(0.1)


def refused_or_closed(data: bytes, statuses: tuple[int, ...]) -> None:
    assert data == b"" or status(data) in statuses, data[:300]


def slowloris_head_is_cut(t: Target) -> None:
    s = conn(t)
    t0 = time.monotonic()
    head = post_head(t, length=2)
    try:
        for byte in head[:-4]:  # never the blank line
            s.send(bytes([byte]))
            time.sleep(0.2)
            if time.monotonic() - t0 > BOUND_S + 2:
                break
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = read_all(s)
    s.close()
    assert time.monotonic() - t0 < BOUND_S + 3
    refused_or_closed(data, (408,))
    still_serves(t)


def slowloris_body_is_cut(t: Target) -> None:
    name = t.name
    before = t.forwarded() if t.forwarded else 0
    s = conn(t)
    t0 = time.monotonic()
    # (the supervisor's admin paths take no body: they answer at once, here 401, and drop the rest)
    s.sendall(post_head(t, length=1000, auth=name != "supervisor"))
    try:
        for _ in range(40):
            s.send(b" ")
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = read_all(s)
    s.close()
    assert time.monotonic() - t0 < 40 * 0.2 + BOUND_S
    assert status(data) in (401, 408), data[:300]  # the supervisor answers its admin path at once (401)
    if t.forwarded is not None:
        assert t.forwarded() == before  # nothing half-read was forwarded
    still_serves(t)


@pytest.mark.parametrize("name", SERVERS)
@pytest.mark.parametrize("case", ["request_line", "header_line", "header_count", "whole_head"])
def test_oversized_heads_are_refused(targets: dict[str, Target], name: str, case: str) -> None:
    t = targets[name]
    heads = {
        "request_line": f"GET /{'a' * 8000} HTTP/1.1\r\nHost: x\r\n\r\n".encode(),
        "header_line": post_head(t, "X-Big: " + "b" * 8000, length=0),
        "header_count": post_head(t, *[f"X-H{i}: v" for i in range(80)], length=0),
        "whole_head": post_head(t, *[f"X-H{i}: {'c' * 3000}" for i in range(30)], length=0),
    }
    s = conn(t)
    try:
        s.sendall(heads[case])
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = read_all(s)
    s.close()
    refused_or_closed(data, (400, 414, 431))
    assert data, f"{name} closed without an answer"
    still_serves(t)


SMUGGLING = {
    "invalid_chunk_size": ("Transfer-Encoding: chunked", b"zz\r\nhello\r\n0\r\n\r\n"),
    "chunk_without_crlf": ("Transfer-Encoding: chunked", b"5\r\nhelloXX0\r\n\r\n"),
    "cl_and_te": ("Transfer-Encoding: chunked\r\nContent-Length: 4",
                  b"0\r\n\r\nPOST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}"),
    "two_lengths": ("Content-Length: 2\r\nContent-Length: 40", b"{}"),
    "te_not_last_chunked": ("Transfer-Encoding: chunked, identity", b"2\r\n{}\r\n0\r\n\r\n"),
    "negative_length": ("Content-Length: -1", b"{}"),
}


@pytest.mark.parametrize("name", SERVERS)
@pytest.mark.parametrize("case", sorted(SMUGGLING))
def test_bad_framing_is_400_and_never_forwarded(targets: dict[str, Target], name: str, case: str) -> None:
    t = targets[name]
    before = t.forwarded() if t.forwarded else 0
    extra, body = SMUGGLING[case]
    s = conn(t)
    try:
        s.sendall(post_head(t, extra) + body)
    except (BrokenPipeError, ConnectionResetError):
        pass
    data = read_all(s)
    s.close()
    assert status(data) == 400 and data.count(b"HTTP/1.") == 1, data[:300]  # one answer: nothing smuggled
    if t.forwarded is not None:
        assert t.forwarded() == before
    still_serves(t)


@pytest.mark.parametrize("name", SERVERS)
def test_http10_and_pipelining(targets: dict[str, Target], name: str) -> None:
    t = targets[name]
    s = conn(t)
    s.sendall(b"GET /health HTTP/1.0\r\n\r\n")
    data = read_all(s)  # answered, then closed (no keep-alive asked)
    s.close()
    assert data.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200")), data[:200]
    s = conn(t)
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * 3 + b"GET /health HTTP/1.1\r\nHost: x\r\n"
              b"Connection: close\r\n\r\n")
    data = read_all(s)
    s.close()
    assert data.count(b" 200 ") == 4, data[:500]
    still_serves(t)


def reset(s: socket.socket) -> None:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.mark.parametrize("name", SERVERS)
def test_reset_mid_body(targets: dict[str, Target], name: str) -> None:
    t = targets[name]
    before = t.forwarded() if t.forwarded else 0
    s = conn(t)
    s.sendall(post_head(t, length=len(BODY)) + BODY[:10])
    time.sleep(0.2)
    reset(s)
    time.sleep(0.3)
    if t.forwarded is not None:
        assert t.forwarded() == before
    still_serves(t)


@pytest.mark.parametrize("name", ["router", "engine"])
def test_reset_mid_stream(targets: dict[str, Target], name: str) -> None:
    t = targets[name]
    before = t.forwarded() if t.forwarded else 0
    body = json.dumps({"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    s = conn(t)
    s.sendall(post_head(t, length=len(body)) + body)
    assert s.recv(4096).startswith(b"HTTP/1.1 200")
    busy = t.slots()
    reset(s)
    assert busy >= 1 or name == "engine"  # (the engine may already be done with such a tiny model)
    if t.forwarded is not None:
        assert t.forwarded() == before + 1  # once, and not retried after the client left
    still_serves(t)  # the slot is released and the engine aborted the request


def test_non_utf8_authorization_is_401_not_500(targets: dict[str, Target]) -> None:
    for t in targets.values():
        s = conn(t)
        body = b"{}"
        s.sendall(f"POST {t.post_path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n".encode()
                  + b"Authorization: Bearer \xff\xfe\xc3\x28 \x80\r\nConnection: close\r\n\r\n" + body)
        data = read_all(s)
        s.close()
        assert status(data) == 401, (t.name, data[:300])
        assert b"Traceback" not in data
        still_serves(t)


def idle_connections_are_closed(t: Target) -> None:
    """A connection that never sends a request gets 408; an idle kept-alive one is closed (2 s here)."""
    silent = conn(t)
    kept = conn(t)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept.recv(4096).startswith(b"HTTP/1.1 200")
    t0 = time.monotonic()
    data = read_all(silent)
    assert status(data) == 408 and time.monotonic() - t0 < BOUND_S + 1, data[:200]
    kept.settimeout(2 + BOUND_S)
    assert read_all(kept) == b""  # closed by the server, nothing more sent
    assert time.monotonic() - t0 < 2 + BOUND_S + 1
    silent.close()
    kept.close()
    still_serves(t)


def test_slow_and_idle_clients_are_cut(targets: dict[str, Target]) -> None:
    """A slowloris head, a slowloris body and idle connections against every server, all nine at once: each
    waits on a server's 1-2 s timeouts, not on the CPU, so together they take as long as the slowest one
    (they took the sum, one after another). Each keeps its own time bound and its server's still_serves."""
    cases = [(check, name) for check in (slowloris_head_is_cut, slowloris_body_is_cut,
                                         idle_connections_are_closed) for name in SERVERS]
    with ThreadPoolExecutor(len(cases)) as pool:
        running = {pool.submit(check, targets[name]): f"{check.__name__}[{name}]" for check, name in cases}
    failed = {case: "".join(traceback.format_exception(f.exception())) for f, case in running.items()
              if f.exception() is not None}
    assert not failed, "\n".join(f"{case}:\n{trace}" for case, trace in failed.items())
