"""Resizing a supervised node at run time (lbd.supervisor.scale, `lbd scale`): one real `lbd supervise` with
``--device sim`` ranks, shared by the tests of this module in order. The refusals leave it as it was; then it
grows 1 -> 2 (a router following its /status serves from the new rank) and shrinks 2 -> 1 while a stream
runs on the rank that leaves: the router resumes it on the rank that stays, and the client sees one whole
stream."""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from support import RouterServer, metric_value
from support.node import SupervisorNode, gone_within
from support.procs import free_port_run

ADMIN = "scale-admin-token"
CLUSTER = secrets.token_urlsafe(32)
SIM = ["--device", "sim", "--sim-profile", "a100-llama3-8b", "--max-model-len", "512",
       "--log-level", "warning"]
STREAM_TOKENS = 400  # ~4 s of a100 decode: the shrink cuts it about a second in


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    port = free_port_run(2)  # the ranks' ports: rank 0's, and rank 1's once it grows
    n = SupervisorNode(tiny_llama, 1, "--port", str(port), "--admin-token", ADMIN, "--shutdown-timeout", "1",
                       "--scale-down-drain-timeout-s", "0", engine_flags=SIM,
                       env={"LBD_CLUSTER_TOKEN": CLUSTER}, log=tmp_path_factory.mktemp("scale") / "node.log")
    n.rank_port = port  # type: ignore[attr-defined]
    try:
        n.wait_ready()
        yield n
    finally:
        n.close()


def scale(node: SupervisorNode, body: object, token: str | None = ADMIN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return node.client.post("/scale", json=body, headers=headers)


def lbd_scale(node: SupervisorNode, *args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lbd", "scale", "--node", node.url, *args], env=env,
                          capture_output=True, text=True, timeout=120)


def test_refused_resizes_leave_the_node_as_it_was(node: SupervisorNode) -> None:
    before = node.status()
    assert scale(node, {"data_parallel_size_local": 2}, token=None).status_code == 401
    assert scale(node, {"data_parallel_size_local": 2}, token="wrong").status_code == 401
    for body in ({"data_parallel_size_local": "2"}, {"data_parallel_size_local": 0}, {"size": 2}, [2]):
        r = scale(node, body, token=CLUSTER)  # the cluster token admits a resize too
        assert r.status_code == 400, (body, r.text)
        assert "data_parallel_size_local" in r.json()["error"]["message"]
    r = node.client.post("/scale", content=b"{", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]
    with socket.socket() as taken:  # rank 1's port held by someone else: no room for it
        taken.bind(("127.0.0.1", node.rank_port + 1))  # type: ignore[attr-defined]
        taken.listen()
        r = scale(node, {"data_parallel_size_local": 2})
        assert r.status_code == 409 and "already in use" in r.json()["error"]["message"], r.text
        cli = lbd_scale(node, "--data-parallel-size", "2", env={"LBD_CLUSTER_TOKEN": CLUSTER})
        assert cli.returncode == 1 and "409" in cli.stderr and "already in use" in cli.stderr, cli
    r = scale(node, {"data_parallel_size_local": 1})
    assert r.status_code == 200 and r.json()["state"] == "done" and r.json()["added"] == []
    bad = lbd_scale(node, "--data-parallel-size", "x", env={})
    assert bad.returncode == 2 and "--data-parallel-size" in bad.stderr, bad
    after = node.status()
    assert [(r["rank"], r["pid"]) for r in after["ranks"]] == [(r["rank"], r["pid"]) for r in before["ranks"]]
    assert after["data_parallel_size_local"] == 1 and after["scaling"] is None
    metrics = node.get("/metrics").text
    assert metric_value(metrics, "lbd_supervisor_resizes_total", direction="grow", outcome="refused") == 2
    assert metric_value(metrics, "lbd_supervisor_ranks") == 1


def _stream(url: str, model: str, out: dict[str, object], started: threading.Event) -> None:
    body = {"model": model, "prompt": "Hello there", "max_tokens": STREAM_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    text = ""
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120,
                          headers={"X-data-parallel-rank": "1"}) as r:
            out["status"] = r.status_code
            for chunk in r.iter_text():
                text += chunk
                if text.count("data: ") >= 5:
                    started.set()
    except httpx.HTTPError as e:
        out["error"] = repr(e)
    finally:
        out["text"] = text
        started.set()


def test_grow_then_shrink_under_a_stream(node: SupervisorNode, tiny_llama: Path, tmp_path: Path) -> None:
    router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--migrate-pinned",
                          "--supervisor-poll-interval-s", "0.1", log=tmp_path / "router.log").wait_ready()
    try:
        grown = lbd_scale(node, "--data-parallel-size", "2", "--wait", env={"LBD_ADMIN_TOKEN": ADMIN})
        assert grown.returncode == 0 and "1 -> 2 local ranks: done" in grown.stdout, grown
        status = node.status()
        assert status["data_parallel_size_local"] == 2 and status["scaling"]["added"] == [1]
        new = status["ranks"][1]
        assert (new["rank"], new["port"], new["state"]) == (1, node.rank_port + 1, "ready")  # type: ignore
        body = {"model": str(tiny_llama), "prompt": "hi", "max_tokens": 2}
        node.wait_for(lambda: httpx.post(router.url + "/v1/completions", json=body, timeout=30,
                                         headers={"X-data-parallel-rank": "1"}).status_code == 200,
                      30, "the router to serve from the new rank")

        out: dict[str, object] = {}
        started = threading.Event()
        reader = threading.Thread(target=_stream, args=(router.url, str(tiny_llama), out, started))
        reader.start()
        assert started.wait(60)
        leaving = psutil.Process(new["pid"])
        r = scale(node, {"data_parallel_size_local": 1})
        assert r.status_code == 202 and r.json()["removing"] == [1], r.text
        assert node.rank(1)["state"] == "draining" and not node.rank(1)["routable"]
        reader.join(120)
        text = str(out.get("text", ""))
        assert out.get("status") == 200 and "error" not in out, out
        assert text.endswith("data: [DONE]\n\n") and '"error"' not in text, text[-500:]
        assert f'"completion_tokens":{STREAM_TOKENS}' in text.replace(" ", ""), text[-500:]
        node.wait_for(lambda: node.status()["scaling"]["state"] == "done", 60, "the shrink")
        status = node.status()
        assert [r["rank"] for r in status["ranks"]] == [0] and status["data_parallel_size_local"] == 1
        assert not gone_within([leaving], 5.0)  # the removed rank's process is gone, and not restarted
        moved = metric_value(httpx.get(router.url + "/metrics").text, "lbd_router_migrations_total",
                             reason="error_event", outcome="resumed")
        assert moved >= 1  # the leaving rank ended the stream with a retryable 503, resumed on rank 0
        assert metric_value(node.get("/metrics").text, "lbd_supervisor_ranks") == 1
    finally:
        router.close()


STANDIN = Path(__file__).parents[1] / "support" / "standin_engine.py"


def test_added_ranks_get_the_next_cuda_devices_and_too_few_are_refused(tmp_path: Path) -> None:
    """Stand-in vLLM ranks (tests/support/standin_engine.py) on two CUDA device ids: a node of 1 grows to 2
    with device 1 for the new rank, and 3 is refused (the devices do not suffice), the node unchanged. No
    token is set and the health port is loopback only: the endpoint is open."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} vllm "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LBD_STANDIN_DIR": str(tmp_path),
           "CUDA_VISIBLE_DEVICES": "0,1", "LBD_ADMIN_TOKEN": "", "LBD_CLUSTER_TOKEN": ""}
    port = free_port_run(3)
    node = SupervisorNode("org/some-model", 1, "--port", str(port), "--rank-engine", "vllm", env=env,
                          engine_flags=["--device", "cuda", "--max-model-len", "512"],
                          log=tmp_path / "node.log")
    try:
        node.wait_ready(60)
        r = scale(node, {"data_parallel_size_local": 3}, token=None)
        assert r.status_code == 409 and "needs 3 CUDA devices but 2 are visible" in r.text, r.text
        assert len(node.status()["ranks"]) == 1 and node.status()["scaling"] is None
        r = scale(node, {"data_parallel_size_local": 2}, token=None)
        assert r.status_code == 202 and r.json()["added"] == [1], r.text
        node.wait_for(lambda: node.status()["scaling"]["state"] == "done", 60, "the grow")
        assert [(r["port"], r["devices"]) for r in node.status()["ranks"]] == [(port, "0"), (port + 1, "1")]
    finally:
        node.close()


def test_an_added_rank_that_cannot_start_is_removed_again(tmp_path: Path) -> None:
    """A rank command that starts local rank 0 (a stand-in vLLM) and fails every start of any other: the grow
    is accepted, its rank fails three starts in a row, the resize fails with the reason and the node is as
    it was (one rank, its size, no restart of the one that serves)."""
    script = tmp_path / "rank.sh"
    script.write_text(f'#!/bin/sh\n[ "$1" = 0 ] || {{ echo "rank $1: no room here" >&2; exit 1; }}\n'
                      f'exec {sys.executable} {STANDIN} vllm serve "$2" --port "$3"\n')
    script.chmod(0o755)
    env = {"LBD_STANDIN_DIR": str(tmp_path), "LBD_ADMIN_TOKEN": "", "LBD_CLUSTER_TOKEN": ""}
    port = free_port_run(2)
    node = SupervisorNode("org/some-model", 1, "--port", str(port), "--rank-command",
                          f"{script} {{local_rank}} {{model}} {{port}}", "--restart-backoff-initial-s", "0.1",
                          env=env, engine_flags=["--device", "cpu"], log=tmp_path / "node.log")
    try:
        node.wait_ready(60)
        before = node.rank(0)
        assert scale(node, {"data_parallel_size_local": 2}, token=None).status_code == 202
        node.wait_for(lambda: node.status()["scaling"]["state"] != "running", 60, "the grow to fail")
        status = node.status()
        assert status["scaling"]["state"] == "failed", status["scaling"]
        assert "failed 3 starts in a row" in status["scaling"]["error"], status["scaling"]
        assert "no room here" in node.log_text()
        assert [(r["rank"], r["pid"], r["restarts"]) for r in status["ranks"]] == [(0, before["pid"], 0)]
        assert status["data_parallel_size_local"] == 1
        assert metric_value(node.get("/metrics").text, "lbd_supervisor_resizes_total", direction="grow",
                            outcome="failed") == 1
    finally:
        node.close()
