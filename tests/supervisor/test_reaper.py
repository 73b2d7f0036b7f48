"""No process of a rank outlives its supervisor, nor its launcher, whatever the engine starts.

Each rank runs under a reaper (lbd.supervisor.reaper, a child subreaper). The engine here is the stand-in for
vLLM (tests/support/standin_engine.py, named as such: a stand-in for the outside binary), told to start a
daemon the way engines with helper processes can escape a death signal: double fork, ``setsid``, its own
process group, SIGTERM ignored. Every process the node starts carries the node's mark in its environment, so
"nothing left" is checked by walking the whole process table, wherever a process was re-parented to. Our own
engine ranks: test_policies.py (SIGKILL of the supervisor); real vLLM: test_engines_vllm.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from lbd.supervisor import reaper
from support.node import SupervisorNode, gone_within

STANDIN = Path(__file__).parents[1] / "support" / "standin_engine.py"
FLAGS = ["--device", "cuda", "--max-model-len", "512", "--max-num-seqs", "8"]


@pytest.fixture
def daemon_node(tmp_path: Path) -> tuple[SupervisorNode, Path]:
    """Two stand-in vLLM ranks under `lbd supervise`, each of which starts a daemon; ready, daemons up."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nexec {sys.executable} {STANDIN} vllm "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "LBD_STANDIN_DIR": str(records),
           "LBD_STANDIN_DAEMON": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    node = SupervisorNode("org/some-model", 2, "--rank-engine", "vllm", "--restart-backoff-initial-s", "0.2",
                          log=tmp_path / "node.log", env=env, engine_flags=FLAGS)
    try:
        node.wait_ready(60)
        node.wait_for(lambda: len(_daemons(records)) == 2, 10, "both ranks' daemons")
        yield node, records
    finally:
        node.close()


def _daemons(records: Path) -> dict[tuple[int, int], psutil.Process]:
    """(port, server pid) -> the daemon that server started, while it lives."""
    found = {}
    for f in records.glob("daemon-*.pid"):
        _, port, server = f.stem.split("-")
        try:
            found[int(port), int(server)] = psutil.Process(int(f.read_text()))
        except (ValueError, psutil.Error):
            continue
    return found


def _left(procs: list[psutil.Process]) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            out.append((p.pid, " ".join(p.cmdline()[:4])))
        except psutil.Error:
            pass
    return out


def test_sigkill_of_the_supervisor_leaves_nothing(daemon_node: tuple[SupervisorNode, Path]) -> None:
    node, records = daemon_node
    daemons = list(_daemons(records).values())
    assert all(d.ppid() != 1 for d in daemons)  # re-parented to the rank's reaper, not to init
    procs = list({p.pid: p for p in [*node.descendants(), *node.marked_processes()]}.values())
    assert set(daemons) <= set(procs) and len(procs) >= 6  # per rank: reaper, launcher, daemon
    node.proc.send_signal(signal.SIGKILL)
    left = gone_within(procs, 5.0)
    assert not left, _left(left)
    assert not node.marked_processes(), _left(node.marked_processes())


def test_sigkill_of_a_launcher_takes_its_daemon_along(daemon_node: tuple[SupervisorNode, Path]) -> None:
    node, records = daemon_node
    before = _daemons(records)
    port1 = node.base_port + 1
    (old,) = [d for (port, _), d in before.items() if port == port1]
    (other,) = [d for (port, _), d in before.items() if port != port1]
    launcher = node.signal_rank(1, signal.SIGKILL)
    assert not gone_within([old], 5.0), "rank 1's daemon outlived its launcher"
    node.wait_for(lambda: node.rank(1)["restarts"] == 1 and node.rank(1)["state"] == "ready", 30,
                  "rank 1 restarted")
    rank = node.rank(1)
    assert rank["pid"] != launcher and rank["last_exit_code"] == -signal.SIGKILL, rank  # the launcher's
    assert "killed by SIGKILL" in rank["last_failure"], rank
    node.wait_for(lambda: any(p == port1 and s == rank["pid"] for p, s in _daemons(records)), 10,
                  "the new rank 1's daemon")
    assert other.is_running() and node.rank(0)["restarts"] == 0  # rank 0 untouched


# ---- the reaper on its own: exit status, a refused command, the supervisor's end closed -------------------
_DAEMON = textwrap.dedent("""
    import os, signal, sys, time
    if os.fork() == 0:
        os.setsid()
        if os.fork():
            os._exit(0)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(sys.argv[1], "w").write(str(os.getpid()))
        while True:
            time.sleep(3600)
    time.sleep(3600)
""")


def _reaper(*launcher: str) -> tuple[subprocess.Popen[bytes], socket.socket]:
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen(reaper.argv(theirs.fileno(), list(launcher)), pass_fds=(theirs.fileno(),),
                            start_new_session=True)
    theirs.close()
    ours.settimeout(30)
    return proc, ours


def _reported(ours: socket.socket) -> bytes:
    data = b""
    while chunk := ours.recv(4096):
        data += chunk
        if data.endswith(b"\n"):
            break
    return data


@pytest.mark.parametrize(("script", "code"), [("exit 3", 3), ("kill -KILL $$", -9), ("kill -TERM $$", -15)])
def test_the_reaper_exits_as_its_launcher_did(script: str, code: int) -> None:
    proc, ours = _reaper("sh", "-c", script)
    pid = int(_reported(ours))
    assert proc.wait(30) == code and not psutil.pid_exists(pid)


def test_a_command_that_cannot_start_is_reported() -> None:
    proc, ours = _reaper("/no/such/engine")
    assert proc.wait(30) == 1
    message = ours.recv(4096)
    assert message.startswith(reaper.ERROR_PREFIX) and b"/no/such/engine" in message, message


def test_closing_the_control_socket_ends_every_descendant(tmp_path: Path) -> None:
    pid_file = tmp_path / "daemon.pid"
    proc, ours = _reaper(sys.executable, "-c", _DAEMON, str(pid_file))
    launcher = psutil.Process(int(_reported(ours)))
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.02)
    daemon = psutil.Process(int(pid_file.read_text()))
    while daemon.ppid() != proc.pid:  # re-parented to the reaper (its subreaper) once the middle one exits
        assert time.monotonic() < deadline and daemon.ppid() != 1, daemon.ppid()
        time.sleep(0.02)
    ours.close()
    assert proc.wait(10) == -signal.SIGKILL  # the launcher it killed
    assert not gone_within([launcher, daemon], 5.0)
