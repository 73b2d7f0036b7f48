"""Server processes for tests and benchmarks: free loopback ports, spawning in a process group of its own,
waiting for readiness, stopping the whole group, a real engine rank, and CPU/RSS of a process tree.

Part of the test-support package; benchmarks use it too. No torch here (tiny checkpoints: ``support.tiny``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

_GIVEN: set[int] = set()  # ports free_port_run handed out in this process


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, below the ephemeral range (``free_port_run``): a port the kernel hands out for
    binding port 0 is one it also hands to outgoing connections, and a test's many clients took one between
    this check and a router's bind ("address 127.0.0.1:42373 is already in use", a full-suite run)."""
    return free_port_run(1, host)


def free_port_run(count: int, host: str = "127.0.0.1") -> int:
    """A port P such that P .. P+count-1 are free now (a supervisor's ranks take consecutive ports).

    Chosen below Linux's ephemeral range (32768+), so no outgoing connection can take one of them between
    this check and the server's bind; never one this process handed out before (a test that asks twice before
    it binds gets two).
    """
    for _ in range(200):
        base = random.randrange(20000, 32000 - count)
        if _GIVEN.intersection(range(base, base + count)):
            continue
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, port))
            _GIVEN.update(range(base, base + count))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no run of {count} free ports found")


def wait_http(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
              ok: tuple[int, ...] = (200,)) -> None:
    """Poll ``url`` until it answers one of ``ok``; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before {url} was ready"
                               f"{log_tail(proc)}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code in ok:
                return
            last = r.status_code
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {timeout}s (last: {last!r})")


def spawn(argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
          cwd: Path | None = None) -> subprocess.Popen:
    """Start a child in its own process group, output to ``log`` (or inherited). ``python -m`` puts its
    working directory first on sys.path, so a child that must import another source tree runs in it."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    out = open(log, "ab") if log else None  # noqa: SIM115 - closed by the OS with the child
    proc = subprocess.Popen(argv, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None,
                            start_new_session=True, cwd=cwd)
    LOGS[proc.pid] = log
    SPAWNED.append(proc)
    return proc


def log_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    """The end of the log spawn() gave ``proc``, for an error message (a CI run keeps only its output)."""
    log = LOGS.get(proc.pid)
    if log is None or not log.exists():
        return ""
    return f"; the end of its log {log}:\n" + log.read_text(errors="replace")[-chars:]


LOGS: dict[int, Path | None] = {}  # pid -> the log spawn() opened for it
SPAWNED: list[subprocess.Popen] = []  # every child spawn() started, for kill_leftovers()


def kill_leftovers() -> int:
    """SIGKILL the process group of every spawned child still running (a run cut short by a signal skips
    some teardown); returns how many there were."""
    alive = [p for p in SPAWNED if p.poll() is None]
    for p in alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
    SPAWNED.clear()
    return len(alive)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> int | None:
    """SIGTERM the child's group, then SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)
    return proc.returncode


class EngineServer:
    """A real `python -m lbd.engine` process on a free loopback port."""

    def __init__(self, model: Path | str | None, *args: str, env: dict[str, str] | None = None,
                 log: Path | None = None, ready_timeout: float = 120.0, port: int | None = None) -> None:
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "lbd.engine", "--host", "127.0.0.1", "--port", str(self.port), *args]
        if model is not None:
            argv += ["--model", str(model)]
        self.log = log
        self.proc = spawn(argv, env=env, log=log)
        try:
            wait_http(self.base_url + "/health", timeout=ready_timeout, proc=self.proc)
        except Exception:
            self.close()
            raise

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def close(self) -> int | None:
        return stop(self.proc)

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def engine_server(model: Path | str | None, *args: str, **kw) -> Iterator[EngineServer]:
    server = EngineServer(model, *args, **kw)
    try:
        yield server
    finally:
        server.close()


def tree_usage(*pids: int) -> tuple[float, int]:
    """(CPU seconds user+system, RSS bytes) so far of these processes and all their descendants."""
    import psutil

    cpu, rss = 0.0, 0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            continue
        for proc in procs:
            try:
                t = proc.cpu_times()
                cpu += t.user + t.system
                rss += proc.memory_info().rss
            except psutil.Error:
                pass
    return cpu, rss


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit so `finally` blocks stop the servers a script started."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
