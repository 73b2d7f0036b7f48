"""A real Ray head in its own network namespace, for the Ray deployment tests (slow)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from support.netns import Namespaces

GCS_PORT = 26379
def alive(pids: list[int]) -> list[int]:
    """The pids that still run (zombies count as gone)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


def alive_after(pids: list[int], within_s: float) -> list[int]:
    """The pids still running ``within_s`` seconds from now; returns as soon as none is."""
    deadline = time.monotonic() + within_s
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[tuple[Namespaces, str]]:
    """A one-node Ray cluster (4 CPUs) in a network namespace of its own; no Ray process may outlive it."""
    nets = Namespaces()
    temp = tempfile.mkdtemp(prefix="lbdray")  # short: Ray's unix socket paths must fit 107 bytes
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        ns = nets.add("r")
        head = nets.spawn(ns, [ray, "start", "--head", "--block", "--temp-dir", temp, "--num-cpus", "4",
                               "--disable-usage-stats", "--include-dashboard=false", "--port", str(GCS_PORT)],
                          tmp_path / "ray.log")

        def gcs_up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", GCS_PORT)) == 0

        deadline = time.monotonic() + 90
        while not nets.call(ns, gcs_up):
            log = (tmp_path / "ray.log").read_text()[-3000:]
            assert head.poll() is None and time.monotonic() < deadline, log
            time.sleep(0.5)
        yield nets, ns
        group = [p.pid for p in psutil.process_iter() if pgid(p.pid) == head.pid]
        os.killpg(head.pid, signal.SIGTERM)
        alive_after(group, 3.0)  # a graceful stop first (it was a fixed 3 s, then 1 s: 4 s a test)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, signal.SIGKILL)
        assert alive_after(group, 1.0) == [], "Ray processes survived the cluster's teardown"
    finally:
        nets.close()
        shutil.rmtree(temp, ignore_errors=True)


def pgid(pid: int) -> int | None:
    """The process group of ``pid``, or None once it is gone."""
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def cmdline(p: psutil.Process) -> list[str]:
    """The command line of ``p``, or [] once it is gone."""
    try:
        return p.cmdline()
    except psutil.Error:
        return []
