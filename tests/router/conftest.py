from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support import free_port, spawn, stop


class RouterProc:
    """A real `lbd route` process on a free loopback port."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        argv = [sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.started = time.monotonic()
        self.proc = spawn(argv, log=log)

    async def wait(self, timeout: float = 30.0, ready: bool = True) -> RouterProc:
        """Until /health answers (and /readyz, when ``ready``)."""
        deadline = time.monotonic() + timeout
        path = "/readyz" if ready else "/health"
        async with httpx.AsyncClient(timeout=2.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"router exited {self.proc.returncode}: {self.log_text()[-2000:]}")
                try:
                    if (await c.get(self.url + path)).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.05)
        raise TimeoutError(f"router not ready: {self.log_text()[-2000:]}")

    async def metrics(self) -> str:
        async with httpx.AsyncClient(timeout=5.0) as c:
            return (await c.get(self.url + "/metrics")).text

    async def status(self) -> dict:
        async with httpx.AsyncClient(timeout=5.0) as c:
            return (await c.get(self.url + "/router/status")).json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def close(self) -> int | None:
        return stop(self.proc)


@pytest.fixture
def start_router(tmp_path: Path) -> Iterator:
    procs: list[RouterProc] = []

    def start(*args: str) -> RouterProc:
        proc = RouterProc(list(args), tmp_path / f"router-{len(procs)}.log")
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for p in procs:
            p.close()
