"""The two ends of the router benchmark: a raw uvloop stub upstream that answers in microseconds, and a
closed-loop load generator (wrk when installed, else a raw-socket uvloop client in its own process).

The stub speaks the engine surface the routers need (/health, /metrics with vLLM's names, /v1/models) and
answers ``POST /v1/completions`` with a small JSON body, or, when the body asks ``"stream": true``, with an
SSE stream of ``STREAM_CHUNKS`` events in chunked encoding, one write per event, each on its own event-loop
turn (as an engine sends tokens), then ``data: [DONE]``.

    python benchmarks/http_load.py --stub PORT RANK                 # run a stub (the benchmark does this)
    python benchmarks/http_load.py --pyload URL CONC SECONDS BODYFILE   # one closed-loop run, JSON result
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STREAM_CHUNKS = 128
ANSWER = json.dumps(
    {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 0,
        "model": "stub-model",
        "choices": [{"index": 0, "text": " hello", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
).encode()


def small_body() -> bytes:
    return b'{"model": "stub-model", "prompt": "Say hello to the router benchmark.", "max_tokens": 1}'


def large_body(size: int = 16 * 1024) -> bytes:
    """A completions body of ``size`` bytes: a long prompt of ordinary words."""
    head, tail = b'{"model": "stub-model", "max_tokens": 1, "prompt": "', b'"}'
    words = b"the quick brown fox jumps over the lazy dog and keeps on running "
    fill = size - len(head) - len(tail)
    return head + (words * (fill // len(words) + 1))[:fill] + tail


def stream_body() -> bytes:
    return b'{"model": "stub-model", "prompt": "Stream to the router benchmark.", "max_tokens": 128, ' \
           b'"stream": true}'


# ---- stub upstream (raw uvloop protocol) -------------------------------------------------------------
def _stub_metrics(rank: int) -> bytes:
    lab = f'engine="{rank}",model_name="stub-model"'
    return (
        f"vllm:num_requests_running{{{lab}}} 0.0\nvllm:num_requests_waiting{{{lab}}} 0.0\n"
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.0\n"
    ).encode()


def _http(status: bytes, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_SSE_EVENTS = [_chunk(b'data: {"id":"cmpl-1","object":"text_completion","model":"stub-model","choices":'
                      b'[{"index":0,"text":" t%d","finish_reason":null}]}\n\n' % i)
               for i in range(STREAM_CHUNKS)] + [_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"]


class _StubProtocol(asyncio.Protocol):
    def __init__(self, answers: dict[bytes, bytes]) -> None:
        self.answers = answers
        self.buf = b""
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j > 0 else None]) if i >= 0 else 0
            if len(self.buf) < end + 4 + length:
                return
            path = head.split(b" ", 2)[1].split(b"?")[0]
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            if b'"stream": true' in body or b'"stream":true' in body:
                self._stream()
            else:
                self.transport.write(self.answers.get(path, self.answers[b"*"]))  # type: ignore[attr-defined]

    def _stream(self) -> None:
        self.transport.write(_SSE_HEAD)  # type: ignore[attr-defined]
        events = iter(_SSE_EVENTS)

        def send() -> None:
            if self.transport.is_closing():  # type: ignore[attr-defined]
                return
            event = next(events, None)
            if event is not None:
                self.transport.write(event)  # type: ignore[attr-defined]
                self.loop.call_soon(send)  # one event per loop turn: separate sends, like token output

        send()


def run_stub(port: int, rank: int) -> None:
    import uvloop

    answers = {
        b"/metrics": _http(b"200 OK", _stub_metrics(rank), b"text/plain"),
        b"/health": _http(b"200 OK", b""),
        b"/v1/models": _http(b"200 OK", b'{"object":"list","data":[{"id":"stub-model","object":"model"}]}'),
        b"*": _http(b"200 OK", ANSWER),
    }

    async def main() -> None:
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _StubProtocol(answers), "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    uvloop.run(main())


# ---- load generators --------------------------------------------------------------------------------
@dataclass
class Load:
    requests: int
    seconds: float
    p50_us: float
    p99_us: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def _wrk_us(text: str, pct: str) -> float:
    m = re.search(rf"^\s+{pct}%\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return float("nan")
    return float(m.group(1)) * {"us": 1.0, "ms": 1e3, "s": 1e6}[m.group(2)]


def run_wrk(url: str, conc: int, seconds: float, script: Path) -> Load:
    threads = 1 if conc == 1 else 2
    out = subprocess.run(
        ["wrk", f"-t{threads}", f"-c{conc}", f"-d{seconds:g}s", "--latency", "-s", str(script),
         url + "/v1/completions"],
        capture_output=True, text=True, timeout=seconds + 30,
    ).stdout
    n = re.search(r"(\d+) requests in ([\d.]+)(s|ms|m)", out)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    sock_err = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    err = int(errors.group(1)) if errors else 0
    if sock_err:
        err += sum(int(x) for x in sock_err.groups())
    secs = float(n.group(2)) * {"s": 1.0, "ms": 1e-3, "m": 60.0}[n.group(3)] if n else seconds
    return Load(int(n.group(1)) if n else 0, secs, _wrk_us(out, "50"), _wrk_us(out, "99"), err)


def wrk_script(tmp: Path, name: str, body: bytes) -> Path:
    (tmp / f"{name}.json").write_bytes(body)
    script = tmp / f"{name}.lua"
    script.write_text(
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        f'local f = io.open("{tmp / f"{name}.json"}", "rb")\nwrk.body = f:read("*a")\nf:close()\n'
    )
    return script


class _Client(asyncio.Protocol):
    """One keep-alive connection of a closed loop: ``request()`` gives the bytes of each next request."""

    def __init__(self, request: Callable[[], bytes], lat: list[float], stop_at: float,
                 done: asyncio.Future[None]) -> None:
        self.request, self.lat, self.stop_at, self.done = request, lat, stop_at, done
        self.buf = b""
        self.errors = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._send()

    def _send(self) -> None:
        data = self.request()
        self.t = time.perf_counter()
        self.transport.write(data)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            total = end + 4 + int(head[i + 15 : j if j > 0 else None])
            if len(self.buf) < total:
                return
        else:  # chunked
            j = self.buf.find(b"\r\n0\r\n\r\n", end)
            if j < 0:
                return
            total = j + 7
        if not head.startswith(b"http/1.1 200"):
            self.errors += 1
        self.lat.append(time.perf_counter() - self.t)
        self.buf = self.buf[total:]
        if time.perf_counter() < self.stop_at:
            self._send()
        elif not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


def closed_loop(host: str, port: int, conc: int, seconds: float,
                request: Callable[[], bytes]) -> dict[str, float]:
    """``conc`` connections, each sending ``request()`` as soon as its last answer is in, for ``seconds``."""
    import uvloop

    async def main() -> dict[str, float]:
        loop = asyncio.get_running_loop()
        lat: list[float] = []
        t0 = time.perf_counter()
        stop_at = t0 + seconds
        clients = []
        for _ in range(conc):
            done = loop.create_future()
            _, proto = await loop.create_connection(
                lambda d=done: _Client(request, lat, stop_at, d), host, port
            )
            clients.append(proto)
        await asyncio.gather(*(c.done for c in clients))
        elapsed = time.perf_counter() - t0
        lat.sort()

        def pick(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e6 if lat else float("nan")

        return {"requests": len(lat), "seconds": elapsed, "p50_us": pick(0.5), "p99_us": pick(0.99),
                "errors": sum(c.errors for c in clients)}

    return uvloop.run(main())


def post_request(host: str, port: str, path: str, body: bytes) -> bytes:
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


def run_pyload(url: str, conc: int, seconds: float, body: bytes) -> None:
    """Closed loop in this process (used via a subprocess); prints one JSON line."""
    host, port = url.split("//")[1].split(":")
    request = post_request(host, port, "/v1/completions", body)
    print(json.dumps(closed_loop(host, int(port), conc, seconds, lambda: request)))


def make_loader(seconds: float, tmp: Path, name: str, body: bytes) -> Callable[[str, int], Load]:
    """A closed-loop load function ``(url, concurrency) -> Load`` POSTing ``body``."""
    if shutil.which("wrk"):
        script = wrk_script(tmp, name, body)
        return lambda url, conc: run_wrk(url, conc, seconds, script)
    path = tmp / f"{name}.json"
    path.write_bytes(body)

    def py(url: str, conc: int) -> Load:
        out = subprocess.run(
            [sys.executable, __file__, "--pyload", url, str(conc), str(seconds), str(path)],
            capture_output=True, text=True, timeout=seconds + 60,
        )
        return Load(**json.loads(out.stdout.strip().splitlines()[-1]))

    return py


if __name__ == "__main__":
    if sys.argv[1] == "--stub":
        run_stub(int(sys.argv[2]), int(sys.argv[3]))
    elif sys.argv[1] == "--pyload":
        run_pyload(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), Path(sys.argv[5]).read_bytes())
