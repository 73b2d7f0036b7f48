"""Readiness policy `any`, admin endpoints off without a token, SIGKILL of the supervisor, and
`--on-rank-failure exit` (vLLM's behaviour), each on its own supervised node of two tiny ranks."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

from support.node import SupervisorNode, gone_within


def test_policy_any_stays_ready_and_sigkill_takes_every_rank_down(tiny_llama: Path, tmp_path: Path) -> None:
    node = SupervisorNode(tiny_llama, 2, "--ready-policy", "any", "--restart-backoff-initial-s", "30",
                          "--log-level", "info", log=tmp_path / "node.log")
    try:
        node.wait_ready()
        r = node.post("/ranks/0/drain", token="anything")
        assert r.status_code == 404 and "--admin-token" in r.json()["error"]["message"]
        assert node.post("/rolling-restart").status_code == 404
        node.signal_rank(1, signal.SIGSTOP)
        node.wait_for(lambda: node.rank(1)["state"] != "ready", 30, "rank 1 unhealthy")
        r = node.get("/readyz")
        assert r.status_code == 200 and r.text.startswith("1/2 ranks ready (policy any)"), r.text
        node.wait_for(lambda: node.rank(1)["state"] == "restarting", 30, "rank 1 waiting out its backoff")
        assert node.rank(1)["next_start_in_s"] > 20  # the 30 s initial backoff of this node
        assert node.get("/readyz").status_code == 200
        procs = node.marked_processes()
        assert len(procs) >= 3  # the supervisor, rank 0's launcher and its core
        node.proc.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        left = gone_within(procs, 2.0)
        assert not left, [(p.pid, p.cmdline()[:3]) for p in left]
        assert not node.marked_processes()
        assert time.monotonic() - t0 < 2.5
        assert "[rank 0] " in node.log_text() and "[rank 1] " in node.log_text()
    finally:
        node.close()


def test_on_rank_failure_exit_shuts_the_node_down(tiny_llama: Path, tmp_path: Path) -> None:
    node = SupervisorNode(tiny_llama, 2, "--on-rank-failure", "exit", "--shutdown-timeout", "10",
                          "--log-level", "info", log=tmp_path / "node.log")
    try:
        node.wait_ready()
        node.signal_rank(0, signal.SIGKILL)
        assert node.proc.wait(60) == 1
        log = node.log_text()
        # the rank's exit or, on a busy machine, its failed probes may be seen first: either way rank 0's
        # failure shuts the node down
        assert re.search(r"rank 0 .*: shutting the node down \(--on-rank-failure exit\)", log), log[-3000:]
        assert "[rank 1] " in log and "SIGTERM" in log  # the healthy rank was stopped, gracefully
        assert not gone_within(node.marked_processes(), 5.0)
    finally:
        node.close()


def test_engine_usage_error_stops_the_node_with_code_2(tmp_path: Path) -> None:
    """A rank that exits 2 before it was ever ready (no such model) will not do better on a restart."""
    node = SupervisorNode(tmp_path / "no-such-model", 1, log=tmp_path / "node.log")
    try:
        assert node.proc.wait(120) == 2
        log = node.log_text()
        assert "[rank 0] lbd serve: error: model" in log and "engine usage error" in log, log[-3000:]
        assert not gone_within(node.marked_processes(), 5.0)
    finally:
        node.close()
