"""`lbd serve` says it is up only when it serves: in every topology, its API port's /health and /v1/models
answer 503 with a reason until a request would be served, and a completion sent the moment /health turns 200
succeeds (a vLLM server's meaning of /health). The node's health port keeps its own /readyz.

Topologies: one engine (`lbd serve` with no DP flags), `--data-parallel-size 2` (a supervisor, two sim ranks
and the router on one port), and an MoE DP group (two CPU ranks of the tiny Mixtral sharing their experts).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import free_port_run
from support.deploy_harness import SIM_FLAGS, ServeNode

pytestmark = pytest.mark.slow


def poll_then_complete(node: ServeNode, timeout: float = 180.0) -> list[str]:
    """Poll /v1/models then /health from the first connection; at the first 200 send a completion at once.
    Returns the reasons of the 503s seen before."""
    reasons: list[str] = []
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=node.api, timeout=30.0) as c:
        while time.monotonic() < deadline:
            assert node.proc.poll() is None, node.log_text()[-4000:]
            try:
                models = c.get("/v1/models", timeout=2.0)
                health = c.get("/health", timeout=2.0)
            except httpx.TransportError:  # not listening yet
                time.sleep(0.02)
                continue
            if health.status_code != 200:
                # readiness only goes up during a start: /v1/models, asked first, was not ready either
                assert health.status_code == 503 and models.status_code == 503, (health.text, models.text)
                for answer in (health, models):
                    message = answer.json()["error"]["message"]
                    assert message, answer.text
                reasons.append(health.json()["error"]["message"])
                time.sleep(0.02)
                continue
            done = c.post("/v1/completions", json={"prompt": "hello there", "max_tokens": 2})
            assert done.status_code == 200, (done.text, reasons[-3:])
            listed = c.get("/v1/models")
            assert listed.status_code == 200 and listed.json()["data"], listed.text
            return reasons
    raise AssertionError(f"/health never answered 200: {reasons[-3:]}\n{node.log_text()[-4000:]}")


def _node(tmp_path: Path, *flags: str) -> ServeNode:
    base = free_port_run(4)  # API port, 2 ranks, health port
    return ServeNode(["--host", "127.0.0.1", "--port", str(base), *flags], tmp_path / "serve.log",
                     port=base, health_port=base + 3)


def test_one_engine_serves_when_its_health_says_so(tiny_llama: Path, tmp_path: Path) -> None:
    node = _node(tmp_path, "--model", str(tiny_llama), "--kv-cache-memory-bytes", "32MiB")
    try:
        poll_then_complete(node)
    finally:
        node.close()


def test_data_parallel_deployment_serves_when_its_health_says_so(tiny_llama: Path, tmp_path: Path) -> None:
    base = free_port_run(4)
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-size", "2", "--host",
                      "127.0.0.1", "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3)],
                     tmp_path / "serve.log", port=base, health_port=base + 3)
    try:
        reasons = poll_then_complete(node)
        # the router listened before its ranks served, and said why it would not serve yet
        assert reasons and all("no request would be served now" in r for r in reasons), reasons[:3]
        # shrunk through the node's health port (a loopback port, no token: open): readiness follows
        shrink = subprocess.run([sys.executable, "-m", "lbd", "scale", "--node", node.health,
                                 "--data-parallel-size", "1", "--wait"], capture_output=True, text=True,
                                timeout=120, env={k: v for k, v in os.environ.items() if "TOKEN" not in k})
        assert shrink.returncode == 0 and "2 -> 1 local ranks: done" in shrink.stdout, shrink
        status = node.status()
        assert [r["rank"] for r in status["ranks"]] == [0] and status["data_parallel_size_local"] == 1
        assert node.get(node.health + "/readyz").status_code == 200, status["reason"]
        # and the API port's (its router started with --min-ready-endpoints 2): ready with the one rank left
        deadline = time.monotonic() + 30
        while (api := node.get(node.api + "/readyz")).status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert api.status_code == 200, api.text
    finally:
        node.close()


def test_moe_group_serves_when_its_health_says_so(tiny_mixtral: Path, tmp_path: Path) -> None:
    base = free_port_run(4)
    node = ServeNode(["--model", str(tiny_mixtral), "--device", "cpu", "--data-parallel-size", "2",
                      "--enable-expert-parallel", "--max-model-len", "256", "--log-level", "warning",
                      "--host", "127.0.0.1", "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3)],
                     tmp_path / "serve.log", port=base, health_port=base + 3)
    try:
        reasons = poll_then_complete(node, timeout=300.0)
        assert reasons, "the router served before its group formed?"
    finally:
        node.close()
