"""One TP=2 rank whose two workers Ray puts on two different nodes (`--distributed-executor-backend ray`).

Two network namespaces joined by a veth pair are two Ray nodes of one CPU each (`ray start --head` in one,
`ray start --address` in the other), so a placement group of two CPU bundles can only be placed across
both: the core (in the head's namespace) then binds its broadcast, reply socket and rendezvous on the head's
address instead of loopback, and the workers' TP all-reduce goes through gloo over the veth link instead of
shared memory. Each namespace's /etc/hosts maps the hostname to its own address, which is where gloo
listens. The rank's greedy answer must equal a TP=1 engine's on the same weights. After SIGTERM nothing is
left in either namespace. ``RAY_AUTH_MODE=disabled``: see tests/engine/executor/test_ray_executor.py.
Cost: ~90-150 s on a loaded 2-core machine (two Ray nodes, two engines), hence slow.
"""

from __future__ import annotations

import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from support.netns import Namespaces, unavailable

pytest.importorskip("ray", reason="ray is not installed (pip install 'lbd[ray]')")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")]
HEAD, OTHER = "10.78.0.1", "10.78.0.2"
GCS_PORT, RAY_PORT, REF_PORT = 6379, 8000, 8001
ENV = {"RAY_AUTH_MODE": "disabled"}


def _until(what: str, check: Callable[[], object], timeout: float, logs: list[Path]) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except (httpx.HTTPError, OSError, ValueError, KeyError):
            value = None
        if value:
            return value
        time.sleep(0.5)
    tails = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def test_tp2_rank_across_two_ray_nodes(tiny_llama: Path, tmp_path: Path) -> None:
    nets = Namespaces()
    temps = [tempfile.mkdtemp(prefix="lbdr") for _ in range(2)]  # short: Ray's socket paths
    ray = str(Path(sys.executable).with_name("ray"))
    logs = [tmp_path / n for n in ("head.log", "node.log", "rank.log", "ref.log")]
    try:
        a, b = nets.add("na"), nets.add("nb")
        nets.link(a, HEAD, b, OTHER)
        host = socket.gethostname()
        nets.hosts(a, ["127.0.0.1 localhost", f"{HEAD} {host}", f"{OTHER} lbd-other-node"])
        nets.hosts(b, ["127.0.0.1 localhost", f"{OTHER} {host}", f"{HEAD} lbd-head-node"])
        common = ["--block", "--num-cpus", "1", "--disable-usage-stats"]
        nets.spawn(a, [ray, "start", "--head", "--node-ip-address", HEAD, "--port", str(GCS_PORT),
                       "--temp-dir", temps[0], "--include-dashboard=false", *common], logs[0], env=ENV)

        def gcs_up() -> bool:
            with socket.socket() as s:
                return s.connect_ex((HEAD, GCS_PORT)) == 0

        _until("the head's GCS", lambda: nets.call(a, gcs_up), 120, logs)
        nets.spawn(b, [ray, "start", "--address", f"{HEAD}:{GCS_PORT}", "--node-ip-address", OTHER,
                       "--temp-dir", temps[1], *common], logs[1], env=ENV)
        _until("the second node", lambda: "Ray runtime started" in logs[1].read_text(), 120, logs)
        model = ["--model", str(tiny_llama), "--device", "cpu", "--kv-cache-memory-bytes", "8MiB", "--host",
                 HEAD, "--log-level", "info"]
        rank = nets.spawn(a, [sys.executable, "-m", "lbd.engine", *model, "--port", str(RAY_PORT),
                              "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
                          logs[2], env={**ENV, "RAY_ADDRESS": f"{HEAD}:{GCS_PORT}"})
        ref = nets.spawn(a, [sys.executable, "-m", "lbd.engine", *model, "--port", str(REF_PORT)], logs[3])

        def ready(port: int) -> bool:
            return httpx.get(f"http://{HEAD}:{port}/health", timeout=5).status_code == 200

        for port in (REF_PORT, RAY_PORT):
            _until(f"the engine on :{port}", lambda p=port: nets.call(a, ready, p), 300, logs)
        placed = logs[2].read_text()
        assert f"worker 0 on {HEAD}" in placed and f"worker 1 on {OTHER}" in placed or \
            f"worker 0 on {OTHER}" in placed and f"worker 1 on {HEAD}" in placed, placed[-3000:]

        def answer(port: int, prompt: list[int]) -> str:
            resp = httpx.post(f"http://{HEAD}:{port}/v1/completions", timeout=120, json={
                "model": str(tiny_llama), "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "ignore_eos": True})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        for prompt in ([5, 6, 7, 8, 9, 10], list(range(20, 60))):
            assert nets.call(a, answer, RAY_PORT, prompt) == nets.call(a, answer, REF_PORT, prompt)
        for proc in (rank, ref):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0, logs[2].read_text()[-3000:]
        # the rank's Ray job is over: no worker actor or worker process is left on either node
        _until("the rank's actors and workers to exit", lambda: not [
            p for ns in (a, b) for p in nets.pids(ns)
            if b"WorkerHost" in Path(f"/proc/{p}/cmdline").read_bytes()
            or b"lbd.engine.executor.worker" in Path(f"/proc/{p}/cmdline").read_bytes()], 60, logs)
    finally:
        nets.close()  # the Ray nodes go with the namespaces
        for t in temps:
            shutil.rmtree(t, ignore_errors=True)
