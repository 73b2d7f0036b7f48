"""A supervised TP=2 rank on ``--distributed-executor-backend ray`` with no Ray cluster running: the rank's
core starts a local one (as vLLM's ``ray.init()`` does), serves, and when one worker actor's process is
SIGKILLed the whole rank exits, the supervisor restarts it (a fresh local cluster, fresh actors) and it
serves again; after SIGTERM nothing of lbd or Ray is left.

Everything runs in a network namespace of its own (only loopback), so Ray binds 127.0.0.1 and "nothing
left" is checked as "no process left in the namespace". ``RAY_AUTH_MODE=disabled`` keeps Ray from
writing ``~/.ray/auth_token`` (see executor/test_ray_executor.py). Cost: ~100-180 s on a loaded 2-core
machine (two local Ray start-ups and two rank start-ups), hence slow.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from support.netns import Namespaces, unavailable

pytest.importorskip("ray", reason="ray is not installed (pip install 'lbd[ray]')")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")]
PORT, SUPERVISOR_PORT = 18000, 19256  # free: the namespace is new


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _until(what: str, check: Callable[[], object], timeout: float, log: Path) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; log:\n{log.read_text()[-4000:]}")


def test_killed_worker_actor_restarts_the_whole_rank(tiny_llama: Path, tmp_path: Path) -> None:
    nets = Namespaces()
    log = tmp_path / "supervisor.log"
    try:
        ns = nets.add("rr")
        sup = nets.spawn(ns, [
            sys.executable, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
            "--data-parallel-size", "1", "--model", str(tiny_llama), "--device", "cpu",
            "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray", "--host", "127.0.0.1",
            "--port", str(PORT), "--supervisor-host", "127.0.0.1", "--data-parallel-supervisor-port",
            str(SUPERVISOR_PORT), "--dp-supervisor-probe-interval-s", "1", "--kv-cache-memory-bytes", "8MiB",
        ], log, env={"RAY_AUTH_MODE": "disabled"})

        def rank() -> dict:
            try:
                return httpx.get(f"http://127.0.0.1:{SUPERVISOR_PORT}/status", timeout=5).json()["ranks"][0]
            except (httpx.HTTPError, ValueError, KeyError):
                return {}

        def ready() -> dict | None:
            r = nets.call(ns, rank)
            return r if r.get("state") == "ready" else None

        def complete() -> str:
            resp = httpx.post(f"http://127.0.0.1:{PORT}/v1/completions", timeout=60, json={
                "model": str(tiny_llama), "prompt": "hello", "max_tokens": 4, "temperature": 0})
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        def actors() -> list[int]:
            return [p for p in nets.pids(ns) if _cmdline(p).startswith("ray::WorkerHost")]

        first = _until("the rank to be ready", ready, 300, log)
        text = nets.call(ns, complete)
        workers = _until("two worker actors", lambda: len(actors()) == 2 and actors(), 30, log)
        assert all("lbd.engine.executor.worker" in _cmdline(p) for p in nets.pids(ns)
                   if "--tp-rank" in _cmdline(p))
        os.kill(workers[1], signal.SIGKILL)
        again = _until("the rank to be restarted and ready",
                       lambda: (r := ready()) and r["pid"] != first["pid"] and r, 300, log)
        assert again["restarts"] == 1
        assert "its Ray actor" in log.read_text()  # the rank said why it ended
        assert not set(workers) & set(nets.pids(ns))  # the old actors are gone (new ones have new pids)
        assert nets.call(ns, complete) == text  # same weights, greedy: the same answer
        os.killpg(sup.pid, signal.SIGTERM)
        assert sup.wait(90) == 0, log.read_text()[-3000:]
        _until("every process of the namespace (lbd and Ray) to exit", lambda: not nets.pids(ns), 60, log)
    finally:
        nets.close()
