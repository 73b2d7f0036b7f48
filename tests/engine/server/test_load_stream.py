"""A `--device sim` engine pushes its load state (lbd.engine.server.load_stream): advertised in /telemetry,
heartbeats with consecutive sequence numbers, the same numbers as /telemetry after a request; off with
--load-heartbeat-s 0; a bad value exits 2 naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import zmq

from lbd.engine.server.load_stream import stream_host
from lbd.wire.load_state import TOPIC, LoadState, decode_state
from support.procs import engine_server

HEARTBEAT_S = 0.2


@pytest.fixture(scope="module")
def engine(tiny_llama: Path) -> Iterator[str]:
    with engine_server(tiny_llama, "--device", "sim", "--max-model-len", "512", "--load-heartbeat-s",
                       str(HEARTBEAT_S), "--log-level", "warning") as e:
        yield e.base_url


def _messages(sock: zmq.Socket, seconds: float) -> list[LoadState]:
    out, deadline = [], time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(50):
            topic, payload = sock.recv_multipart()
            assert topic == TOPIC
            out.append(decode_state(payload))
    return out


def test_heartbeats_and_changes_match_telemetry(engine: str) -> None:
    tel = httpx.get(engine + "/telemetry", timeout=5).json()
    adv = tel["load_stream"]
    assert adv["endpoint"].startswith("tcp://127.0.0.1:") and adv["curve"] is False
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sock.connect(adv["endpoint"])
    try:
        idle = _messages(sock, 5 * HEARTBEAT_S)
        assert len(idle) >= 2 and {m.instance for m in idle} == {adv["instance"]}
        assert [m.seq for m in idle] == list(range(idle[0].seq, idle[0].seq + len(idle)))
        model = tel["model_names"][0]
        r = httpx.post(engine + "/v1/completions", timeout=60,
                       json={"model": model, "prompt": "hello " * 40, "max_tokens": 8})
        assert r.status_code == 200
        last = _messages(sock, 3 * HEARTBEAT_S)[-1]
        now = httpx.get(engine + "/telemetry", timeout=5).json()
        assert (last.running, last.waiting, last.kv_usage) == (
            now["num_requests_running"], now["num_requests_waiting"], now["kv_cache_usage_perc"])
        assert last.prompt_tokens == now["prompt_tokens_total"] > 0
        assert last.generation_tokens == now["generation_tokens_total"]
        assert last.stream == adv["endpoint"] and last.heartbeat_s == HEARTBEAT_S
    finally:
        sock.close(linger=0)
        ctx.term()


def test_off_advertises_nothing(tiny_llama: Path) -> None:
    with engine_server(tiny_llama, "--device", "sim", "--max-model-len", "512", "--load-heartbeat-s", "0",
                       "--log-level", "warning") as e:
        assert httpx.get(e.base_url + "/telemetry", timeout=5).json()["load_stream"] is None


def test_bad_heartbeat_exits_2_naming_the_flag(tiny_llama: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "lbd.engine", "--model", str(tiny_llama), "--device", "sim",
                          "--load-heartbeat-s", "0.001"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--load-heartbeat-s" in out.stderr


def test_stream_stays_on_loopback_without_a_token() -> None:
    assert stream_host(None, None) == ("127.0.0.1", False)
    assert stream_host("0.0.0.0", None) == ("127.0.0.1", False)
    assert stream_host("127.0.0.1", "secret") == ("127.0.0.1", False)
    # serving every interface with the token (lbd serve's ranks across machines): CURVE on every interface
    assert stream_host(None, "secret") == ("0.0.0.0", True) == stream_host("0.0.0.0", "secret")
    assert stream_host("::", "secret") == ("::", True)
    assert stream_host("10.1.2.3", None) == ("127.0.0.1", False)
    assert stream_host("10.1.2.3", "secret") == ("10.1.2.3", True)
