"""What the supervisor reads of a rank for its autoscaling signals (``Prober.load``): lbd's JSON /telemetry of
a fleet stand-in rank whose numbers the test sets, and the /metrics fallback of an engine without /telemetry
(SGLang's names); real HTTP. How the node turns readings into signals (``NodeLoads``), pure. The node's gauges
over real ranks are in test_node.py."""

from __future__ import annotations

import asyncio
import socket
import sys
from pathlib import Path

import httpx
import pytest
from aiohttp import web

from lbd.supervisor.autoscale_signals import NodeLoads
from lbd.supervisor.probe import Prober, RankLoad
from support.procs import free_port_run, spawn, stop, wait_http

STANDIN = Path(__file__).resolve().parents[1] / "support" / "fleet_standin.py"
SGLANG = ("sglang:num_running_reqs 3\nsglang:num_queue_reqs{dp_rank=\"0\"} 5\nsglang:token_usage 0.25\n"
          "sglang:prompt_tokens_total 1200\nsglang:generation_tokens_total 300\n")


def test_load_reads_telemetry(tmp_path: Path) -> None:
    base = free_port_run(2)
    proc = spawn([sys.executable, str(STANDIN), "--ranks", "1", "--base-port", str(base), "--control-port",
                  str(base + 1), "--no-push"], log=tmp_path / "standin.log")
    try:
        wait_http(f"http://127.0.0.1:{base}/health", 30, proc)
        httpx.post(f"http://127.0.0.1:{base + 1}/standin/0/set", json={"waiting": 7, "kv_usage": 0.5},
                   timeout=5).raise_for_status()

        async def read() -> RankLoad | None:
            prober = Prober(5.0)
            try:
                return await prober.load(f"http://127.0.0.1:{base}")
            finally:
                await prober.close()

        assert asyncio.run(read()) == RankLoad(7.0, 0.5, 0.0)  # no request served yet: 0 tokens
    finally:
        stop(proc)


def test_load_falls_back_to_metrics_and_tells_none_without_either() -> None:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(text=SGLANG)

    async def run() -> tuple[object, object]:
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        prober = Prober(5.0)
        try:
            port = sock.getsockname()[1]
            return (await prober.load(f"http://127.0.0.1:{port}"),
                    await prober.load(f"http://127.0.0.1:{free_port_run(1)}"))
        finally:
            await prober.close()
            await runner.cleanup()

    assert asyncio.run(run()) == (RankLoad(5.0, 0.25, 1500.0), None)


def test_node_loads_see_a_compute_bound_rank_by_its_throughput() -> None:
    """A rank with requests waiting for 15 s at 400 tokens/s teaches the node its capacity; two ranks then
    serving 300 tokens/s each with nothing waiting read 0.75 busy (by queue and KV alone: 0.1), so the rule
    keeps both. A rank that is not read any more is forgotten; one without token counters counts by queue
    and KV."""
    node = NodeLoads()
    for i in range(61):
        node.observe({"a": RankLoad(3.0, 0.1, 100.0 * i)}, 0.25 * i)
    assert node.capacity.tokens_per_s == pytest.approx(400.0, rel=0.02)
    for i in range(61, 241):
        node.observe({"a": RankLoad(0.0, 0.1, 75.0 * i), "b": RankLoad(0.0, 0.1, 75.0 * i)}, 0.25 * i)
    report = node.report()
    assert report.signals.saturation == pytest.approx(0.75, rel=0.03)
    assert report.signals.served_tokens_per_s == pytest.approx(600.0, rel=0.02)
    assert report.signals.capacity_tokens_per_s == pytest.approx(400.0, rel=0.02)
    assert report.recommended_ranks == 2
    node.observe({"b": RankLoad(0.0, 0.1, None)}, 61.0)
    assert set(node.rates) == {"b"}
    assert node.report().signals.saturation == pytest.approx(0.1 / 0.95, rel=0.01)
