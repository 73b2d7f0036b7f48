"""`lbd supervise --data-parallel-size 2 --tensor-parallel-size 2` on the CPU: two ranks of two workers.

``/status`` lists each rank's worker pids; SIGKILL of one worker takes its whole rank down (the in-flight
stream ends with an error, /health answers 503 at once) and the supervisor restarts that rank whole while
the other keeps serving, with every process of the old rank gone. Then a worker that hangs (SIGSTOP): the
next step waits at most --distributed-timeout-s and the rank is restarted the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from pathlib import Path

import httpx
import orjson
import psutil

from support.node import SupervisorNode, gone_within

TIMEOUT_S = 4  # --distributed-timeout-s: how long a step may wait on a hung worker


class Stream(threading.Thread):
    """A streaming completion read in the background; keeps every SSE payload."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.events: list[object] = []
        self.status: int | None = None
        self.first = threading.Event()

    def run(self) -> None:
        body = {"prompt": "Once upon a time", "stream": True, "ignore_eos": True, "temperature": 0,
                "max_tokens": self.max_tokens}
        with contextlib.suppress(httpx.HTTPError), \
                httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.events.append(line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]))
                    self.first.set()
        self.first.set()

    def errors(self) -> list[dict]:
        return [e for e in self.events if isinstance(e, dict) and "error" in e]


def _complete(url: str) -> int:
    body = {"prompt": "Hello", "max_tokens": 4}
    return httpx.post(url + "/v1/completions", json=body, timeout=60).status_code


def _first_non_200(url: str, timeout: float) -> tuple[float, int | None]:
    """Seconds until ``url``/health stops answering 200, and what it answered then (None: no answer)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            code = httpx.get(url + "/health", timeout=1.0).status_code
        except httpx.HTTPError:
            return time.monotonic() - t0, None
        if code != 200:
            return time.monotonic() - t0, code
        time.sleep(0.02)
    raise AssertionError(f"{url}/health still 200 after {timeout} s")


def _workers(node: SupervisorNode, rank: int) -> list[dict]:
    return node.rank(rank)["workers"]


def _kill_and_expect_restart(node: SupervisorNode, rank: int, sig: signal.Signals, bound_s: float) -> None:
    other = 1 - rank
    old, other_before = node.rank(rank), node.rank(other)
    old_tree = node.rank_tree(rank)
    stream = Stream(node.rank_url(rank), max_tokens=1000)  # seconds of decoding: in flight at the kill
    stream.start()
    assert stream.first.wait(60) and stream.status == 200 and stream.events, "the stream never started"
    # SIGSTOP: the stream's next step waits on the stopped worker, at most TIMEOUT_S
    os.kill(old["workers"][1]["pid"], sig)
    took, code = _first_non_200(node.rank_url(rank), bound_s)  # 503, or gone once the supervisor saw it
    assert code in (503, None), f"/health answered {code} {took:.1f} s after the {sig.name}"
    stream.join(30)
    assert stream.errors() and stream.errors()[0]["error"]["code"] == 503, stream.events[-3:]
    node.wait_for(lambda: node.rank(rank)["state"] == "ready"
                  and node.rank(rank)["pid"] not in (None, old["pid"]), 300, f"rank {rank} restarted")
    assert not gone_within(old_tree, 10), "processes of the old rank are left"
    assert {p.pid for p in old_tree} >= {w["pid"] for w in old["workers"]}
    new = node.rank(rank)
    assert new["last_failure"].startswith("/health answered 503"), new["last_failure"]  # what the probe saw
    old_pids, new_pids = {w["pid"] for w in old["workers"]}, {w["pid"] for w in new["workers"]}
    assert len(new_pids) == 2 and not new_pids & old_pids
    assert new["restarts"] == old["restarts"] + 1
    after = node.rank(other)  # the other rank was never touched, and it serves
    assert (after["pid"], after["workers"], after["restarts"]) == \
        (other_before["pid"], other_before["workers"], other_before["restarts"])
    assert _complete(node.rank_url(other)) == 200 and _complete(node.rank_url(rank)) == 200


def test_tp2_ranks_list_workers_and_restart_whole(slower_llama: Path, tmp_path: Path) -> None:
    node = SupervisorNode(slower_llama, 2, "--tensor-parallel-size", "2", "--max-model-len", "1024",
                          "--distributed-timeout-s", str(TIMEOUT_S), "--restart-backoff-initial-s", "0",
                          log=tmp_path / "supervisor.log")
    try:
        node.wait_ready(300)
        status = node.status()
        for r in status["ranks"]:
            tree = {p.pid for p in node.rank_tree(r["rank"])}
            assert [(w["tp_rank"], w["pp_rank"]) for w in r["workers"]] == [(0, 0), (1, 0)]
            assert {w["pid"] for w in r["workers"]} <= tree  # in the rank's own process tree
            assert r["cpus"] is not None
        assert status["ranks"][0]["cpus"] != status["ranks"][1]["cpus"] or len(os.sched_getaffinity(0)) == 1
        assert _complete(node.rank_url(0)) == 200 and _complete(node.rank_url(1)) == 200
        _kill_and_expect_restart(node, 0, signal.SIGKILL, node.detection_bound_s + 5)
        _kill_and_expect_restart(node, 1, signal.SIGSTOP, TIMEOUT_S + node.detection_bound_s + 30)
        log = node.log_text()
        assert "killed by SIGKILL: stopping the rank's other workers" in log  # the watchdog, rank 0
        # rank 1: the step (core side) or the collective (worker side) that waited on the stopped worker
        assert re.search(r"within --distributed-timeout-s 4|[Tt]imed out", log), log[-3000:]
        workers = [w["pid"] for r in node.status()["ranks"] for w in r["workers"]]
        assert node.close() == 0  # SIGTERM: every rank drains and stops its workers; the supervisor exits 0
        assert not gone_within([psutil.Process(p) for p in workers if psutil.pid_exists(p)], 10)
    finally:
        node.close()
