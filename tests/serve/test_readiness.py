"""`lbd serve` says it is up only when it serves: in every topology, its API port's /health and /v1/models
answer 503 with a reason until a request would be served, and a completion sent the moment /health turns 200
succeeds (a vLLM server's meaning of /health). The node's health port keeps its own /readyz.

Topologies: one engine (`lbd serve` with no DP flags), `--data-parallel-size 2` (a supervisor, two sim ranks
and the router on one port), and an MoE DP group (two CPU ranks of the tiny Mixtral sharing their experts).
The DP and MoE deployments are also walked for their listening sockets once they serve (what
tests/serve/test_listeners.py checks of the other topologies): one start of each checks both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support import free_port_run
from support.deploy_harness import SIM_FLAGS, ServeNode, complete
from support.listeners import assert_closed, listeners, loopback

pytestmark = pytest.mark.slow
KV_EVENTS = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True})]  # the default endpoint


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
    """No --host: the router's --port listens on every interface, and only it; the ranks, the health port and
    the ranks' KV events stay on loopback (the listeners check of `lbd serve --data-parallel-size 2`)."""
    base = free_port_run(4)
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, *KV_EVENTS, "--data-parallel-size", "2",
                      "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3)],
                     tmp_path / "serve.log", port=base, health_port=base + 3)
    try:
        reasons = poll_then_complete(node)
        # the router listened before its ranks served, and said why it would not serve yet
        assert reasons and all("no request would be served now" in r for r in reasons), reasons[:3]
        node.wait_ready(60)
        found = listeners(node.proc.pid)
        # router, health, 2 ranks, the supervisor's internal port, 2 KV-event publishers at least
        assert_closed(found, {base}, expect=7)
        kv = {port for ip, port, _ in found if port in (5557, 5558)}
        assert kv == {5557, 5558} and all(loopback(ip) for ip, p, _ in found if p in kv)
        assert complete(node.api).status_code == 200
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
    """Then its listening sockets: the coordinator's store, ZMQ and HTTP ports and gloo's pair sockets on
    loopback. With a cluster token (optional on one machine) the members join over CURVE and HTTP asks for
    it."""
    base = free_port_run(4)
    token = "listeners-FZW1zopkpp8h2T8H10iLUhOjb3b9tRgzvmmAWOjfgU8"
    node = ServeNode(["--model", str(tiny_mixtral), "--device", "cpu", "--data-parallel-size", "2",
                      "--enable-expert-parallel", "--max-model-len", "256", "--log-level", "warning",
                      "--port", str(base), "--rank-port", str(base + 1),
                      "--data-parallel-supervisor-port", str(base + 3)],
                     tmp_path / "serve.log", port=base, health_port=base + 3,
                     env={"LBD_CLUSTER_TOKEN": token})
    try:
        reasons = poll_then_complete(node, timeout=300.0)
        assert reasons, "the router served before its group formed?"
        node.wait_ready(60)
        found = listeners(node.proc.pid)
        coordinator = [(ip, port) for ip, port, name in found if "coordinator" in name]
        assert len(coordinator) == 3, found  # store, ZMQ, HTTP
        assert_closed(found, {base}, expect=9)  # + router, health, supervisor, 2 ranks, gloo's
        (group,) = node.status()["groups"]
        url = group["coordinator"]["url"]
        assert httpx.get(url + "/status", timeout=5).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(url + "/status", headers=auth, timeout=5).json()["state"] == "ready"
        assert token not in node.log_text() and token not in node.get(node.health + "/status").text
    finally:
        node.close()
