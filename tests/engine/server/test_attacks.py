"""Holes found by trying the engine as an attacker would, each fixed and tested by name: a 30 MB prompt that
stalled /health, inputs that made the engine answer 500, and an X-data-parallel-rank rule that differed from
the router's. One real engine (a sim rank of the tiny model, rank 1 of 2, an API key) and a real router in
front of it."""

from __future__ import annotations

import asyncio
import gzip
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from support import EngineServer, free_port, spawn, stop, wait_http

KEY = "engine-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
RANK = 1


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("attacks") / "engine.log"
    # a sim rank: every hole here is in the front end (which validates before the core sees a request), and
    # it starts without torch; 1GiB holds its profile's (Llama-3-8B) KV blocks for 512 tokens
    sim = ("--device", "sim", "--kv-cache-memory-bytes", "1GiB", "--max-model-len", "512")
    srv = EngineServer(tiny_llama, *sim, "--data-parallel-rank", str(RANK), "--data-parallel-size", "2",
                       "--api-key", KEY, log=log)
    try:
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def http(engine: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=engine.base_url, timeout=60, headers=AUTH) as c:
        yield c


class HealthWatch(threading.Thread):
    """Polls /health every 50 ms and keeps the slowest answer (a stalled loop shows here)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.worst, self.count, self.done = url, 0.0, 0, threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self.done.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.worst = max(self.worst, time.perf_counter() - t0)
                self.count += 1
                time.sleep(0.05)


def test_30mb_prompt_does_not_stall_health(engine: EngineServer, http: httpx.Client) -> None:
    watch = HealthWatch(engine.base_url)
    watch.start()
    try:
        huge = "All work and no play makes Jack a dull boy. " * (30_000_000 // 44)
        t0 = time.monotonic()
        r = http.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
        assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text[:300]
        r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": huge}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        r = http.post("/tokenize", json={"prompt": huge})
        assert r.status_code == 400
        took = time.monotonic() - t0
    finally:
        watch.done.set()
        watch.join(30)
    assert watch.count >= 3
    # the issue measured 17.6 s; what is left is reading and parsing 30 MB of JSON (tens of ms)
    assert watch.worst < 2.0, (watch.worst, took)
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


async def test_long_tokenizing_runs_off_the_event_loop(tiny_llama: Path) -> None:
    """The worker process encodes what would hold the loop (HF tokenizers keeps the GIL while it encodes)."""
    from lbd.engine.server.offload import INLINE_CHARS, Offload
    from lbd.engine.tokenizer import Tokenizer

    tok = Tokenizer(tiny_llama)
    offload = Offload(tok)
    try:
        await offload.warm()
        text = "The capital of France is Paris, and numbers 0123456789 count. " * 20_000  # 1.2 MB
        assert len(text) > INLINE_CHARS
        loop = asyncio.get_running_loop()
        gaps: list[float] = []

        async def tick() -> None:
            last = loop.time()
            while True:
                await asyncio.sleep(0.005)
                now = loop.time()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        t0 = time.perf_counter()
        ids = await offload.encode(text, True)
        took = time.perf_counter() - t0
        ticker.cancel()
        assert ids == tok.encode(text, True)
        assert len(gaps) >= 3 and max(gaps) < max(0.25, took / 3), (max(gaps), took)
        assert await offload.decode(ids) == tok.decode(ids)
    finally:
        offload.close()


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "hi", "top_k": 2**64}, "top_k"),
    ({"prompt": "hi", "top_k": 2**40}, "top_k"),
    ({"prompt": "hi", "min_tokens": 2**70}, "min_tokens"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),
    ({"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ({"prompt": "hi", "n": 10**6}, "n"),
    ({"prompt": [2**64]}, "prompt"),
    ({"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"prompt": "hi", "logprobs": 2**63}, None),
])
def test_out_of_range_numbers_are_400_not_500(http: httpx.Client, body: dict, param: str | None) -> None:
    r = http.post("/v1/completions", json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param, r.text


# mtime=0: gzip stamps the time into its header, and a parameter's bytes name the test (xdist's workers
# must collect the same names)
@pytest.mark.parametrize(("encoding", "data"), [
    ("gzip", b"this is not gzip"),
    ("deflate", b"\x00\x01 not deflate either"),
    ("br", b"not brotli"),
    ("gzip", gzip.compress(b"{not json", mtime=0)),
], ids=["gzip-garbage", "deflate-garbage", "br-garbage", "gzip-of-bad-json"])
def test_undecodable_bodies_are_400_not_500(http: httpx.Client, encoding: str, data: bytes) -> None:
    r = http.post("/v1/completions", content=data, headers={"Content-Encoding": encoding,
                                                            "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2}).status_code == 200


def raw_status(port: int, header_lines: list[str], body: bytes) -> int:
    """POST with exactly these header lines (repeats and spaces as given) over a raw socket."""
    head = ["POST /v1/completions HTTP/1.1", "Host: x", "Content-Type: application/json", f"Authorization: "
            f"Bearer {KEY}", f"Content-Length: {len(body)}", "Connection: close", *header_lines]
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


RANK_CASES = [  # (header lines, accepted): the one rule of lbd.common.rank_header
    ([f"X-data-parallel-rank: {RANK}"], True),
    ([f"X-data-parallel-rank:   {RANK} \t"], True),  # spaces around are HTTP whitespace
    ([f"X-data-parallel-rank: 0{RANK}"], False),
    ([f"X-data-parallel-rank: +{RANK}"], False),
    (["X-data-parallel-rank: -1"], False),
    (["X-data-parallel-rank: 1.0"], False),
    (["X-data-parallel-rank: 0x1"], False),
    (["X-data-parallel-rank: \u0661"], False),  # ARABIC-INDIC DIGIT ONE: a digit, not ASCII
    (["X-data-parallel-rank: one"], False),
    (["X-data-parallel-rank: "], False),
    (["X-data-parallel-rank: 1, 1"], False),
    ([f"X-data-parallel-rank: {RANK}", f"X-data-parallel-rank: {RANK}"], False),  # repeated
    (["X-data-parallel-rank: 99999999999999999999"], False),
]


def test_rank_header_one_rule(engine: EngineServer, tmp_path: Path) -> None:
    """The engine and a router in front of it accept and refuse exactly the same X-data-parallel-rank."""
    port = free_port()
    router = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                    "--upstreams", engine.base_url, "--upstream-api-key", KEY, "--api-key", KEY],
                   log=tmp_path / "router.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", timeout=60, proc=router)
        body = b'{"prompt": "Hi", "max_tokens": 1}'
        for lines, accepted in RANK_CASES:
            want = 200 if accepted else 400
            assert raw_status(engine.port, lines, body) == want, ("engine", lines)
            assert raw_status(port, lines, body) == want, ("router", lines)
        # a well-formed rank that is not this engine's: 400 from the engine, 400 from the router (unknown)
        assert raw_status(engine.port, ["X-data-parallel-rank: 0"], body) == 400
        assert raw_status(port, ["X-data-parallel-rank: 0"], body) == 400
    finally:
        stop(router)
