"""A real `lbd supervise` process on free loopback ports, for the supervisor's tests and its benchmark."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from support.procs import free_port_run, spawn, stop

# Small engines: two ranks share two cores with everyone else's tests.
ENGINE_FLAGS = ["--device", "cpu", "--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512",
                "--max-num-seqs", "8", "--log-level", "warning"]


MARK_ENV = "LBD_TEST_SUPERVISOR_NODE"


class SupervisorNode:
    """`lbd supervise` with ``ranks`` ranks of ``model``; close() leaves no process behind."""

    def __init__(self, model: Path | str, ranks: int = 2, *extra: str, interval: float = 0.2,
                 timeout: float = 1.0, threshold: int = 2, log: Path | None = None,
                 env: dict[str, str] | None = None, engine_flags: list[str] | None = None,
                 scheme: str = "http", verify: object = True) -> None:
        self.ranks = ranks
        self.base_port = free_port_run(ranks + 1)
        self.sport = self.base_port + ranks
        self.interval, self.timeout, self.threshold = interval, timeout, threshold
        self.argv = [sys.executable, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
                     "--data-parallel-size", str(ranks), "--data-parallel-size-local", str(ranks),
                     "--host", "127.0.0.1", "--port", str(self.base_port), "--supervisor-host", "127.0.0.1",
                     "--data-parallel-supervisor-port", str(self.sport),
                     "--dp-supervisor-probe-interval-s", str(interval), "--dp-supervisor-probe-timeout-s",
                     str(timeout), "--dp-supervisor-probe-failure-threshold", str(threshold),
                     "--model", str(model), *(ENGINE_FLAGS if engine_flags is None else engine_flags), *extra]
        self.log = log
        self.scheme = scheme
        self.url = f"{scheme}://127.0.0.1:{self.sport}"
        self.client = httpx.Client(base_url=self.url, timeout=5.0, verify=verify)
        self.seen: dict[int, psutil.Process] = {}  # every descendant ever seen, for the final sweep
        self.started = time.monotonic()
        # Inherited by every process of the node, so a sweep finds even orphans (see marked_processes).
        self.mark = uuid.uuid4().hex
        self.proc = spawn(self.argv, env={**(env or {}), MARK_ENV: self.mark}, log=log)

    @property
    def detection_bound_s(self) -> float:
        return self.interval * self.threshold + self.timeout

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.client.get(path, **kw)

    def post(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        return self.client.post(path, headers=headers)

    def status(self) -> dict[str, Any]:
        return self.get("/status").json()

    def rank(self, rank: int) -> dict[str, Any]:
        return next(r for r in self.status()["ranks"] if r["rank"] == rank)

    def rank_url(self, rank: int) -> str:
        return f"{self.scheme}://127.0.0.1:{self.base_port + rank}"

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> float:
        """Poll ``pred`` until true; returns the seconds it took. Fails early if the supervisor exits."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"supervisor exited ({self.proc.returncode}) waiting for {what}\n"
                                     + self.log_text()[-4000:])
            with contextlib.suppress(httpx.HTTPError):
                if pred():
                    return time.monotonic() - t0
            time.sleep(interval)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}; status: "
                             f"{self._safe_status()}\n{self.log_text()[-4000:]}")

    def _safe_status(self) -> object:
        with contextlib.suppress(Exception):
            return self.status()
        return None

    def wait_ready(self, timeout: float = 240.0) -> float:
        return self.wait_for(lambda: self.get("/readyz").status_code == 200
                             and self.status()["ready_ranks"] == self.ranks, timeout, "all ranks ready")

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.Error):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                self.seen.setdefault(p.pid, p)
        return [p for p in self.seen.values() if _alive(p)]

    def rank_tree(self, rank: int) -> list[psutil.Process]:
        """The rank's launcher and every process under it."""
        root = psutil.Process(self.rank(rank)["pid"])
        return [root, *root.children(recursive=True)]

    def signal_rank(self, rank: int, sig: signal.Signals) -> int:
        pid = self.rank(rank)["pid"]
        assert pid, f"rank {rank} has no process"
        self.descendants()
        psutil.Process(pid).send_signal(sig)
        return pid

    def marked_processes(self) -> list[psutil.Process]:
        """Every live process started by this node, wherever it was reparented to (the supervisor too)."""
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.pid != os.getpid() and p.environ().get(MARK_ENV) == self.mark and _alive(p):
                    found.append(p)
        return found

    def close(self) -> int | None:
        self.descendants()
        code = stop(self.proc, timeout=40.0)
        for p in [*self.descendants(), *self.marked_processes()]:
            with contextlib.suppress(psutil.Error):
                p.kill()
        self.client.close()
        return code


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def gone_within(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes of ``procs`` still alive after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _alive(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if _alive(p)]
    return alive
