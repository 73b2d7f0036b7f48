"""The test-support package, which the product never imports: free ports, process trees and servers
(``support.procs``, ``support.node``), tiny random checkpoints (``support.tiny``), stand-ins for outside
programs, and test-only assertions. Benchmarks use it too (they put ``tests/`` on ``sys.path``)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from support.procs import (  # noqa: F401  (re-exported for the tests)
    EngineServer,
    engine_server,
    exit_on_sigterm,
    free_port,
    free_port_run,
    kill_leftovers,
    spawn,
    stop,
    tree_usage,
    wait_http,
)
from support.tiny import (  # noqa: F401
    CHATML,
    make_tiny_deepseek_v2,
    make_tiny_llama,
    make_tiny_mixtral,
    make_tiny_qwen3,
    make_tiny_qwen3_moe,
    make_tokenizer,
)


def default_router_tokenizer():
    """The router's tokenizer for the default model (its converted folder when there is one)."""
    from lbd.engine.config.model_files import converted_path, default_gguf
    from lbd.engine.loader import resolve_model
    from lbd.router.kv.tokenize import load_local

    folder = converted_path(default_gguf())
    return load_local(str(folder if (folder / "tokenizer.json").exists() else resolve_model(None)))


def settled(read, want, timeout: float = 10.0):
    """``read()`` once it equals ``want`` (else its last value, after ``timeout`` s): the router counts a move
    when the attempt that made it returns, a moment after the client read its ``[DONE]``."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if got == want or time.monotonic() >= deadline:
            return got
        time.sleep(0.05)


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` in Prometheus text whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, labelpart = head.partition("{")
        if metric != name:
            continue
        pairs = dict(p.split("=", 1) for p in labelpart.rstrip("}").split(",") if "=" in p)
        pairs = {k: json.loads(v) for k, v in pairs.items()}
        if all(pairs.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


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


def make_certs(folder: Path, *hosts: str) -> tuple[Path, Path, Path]:
    """A test CA and a server certificate for ``hosts`` (default 127.0.0.1, localhost), made here with
    trustme: (ca.pem, cert.pem, key.pem)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*(hosts or ("127.0.0.1", "localhost")))
    folder.mkdir(parents=True, exist_ok=True)
    ca_path, cert_path, key_path = folder / "ca.pem", folder / "cert.pem", folder / "key.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    cert.cert_chain_pems[0].write_to_path(str(cert_path))
    for extra in cert.cert_chain_pems[1:]:
        with open(cert_path, "ab") as f:
            f.write(extra.bytes())
    cert.private_key_pem.write_to_path(str(key_path))
    return ca_path, cert_path, key_path


class RouterServer:
    """A real `lbd route` process on a free loopback port (synchronous helpers, for e2e tests)."""

    def __init__(self, *args: str, log: Path | None = None, env: dict[str, str] | None = None,
                 scheme: str = "http", verify: object = True) -> None:
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.log = log
        self.verify = verify
        argv = [sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = spawn(argv, env=env, log=log)

    def wait_ready(self, timeout: float = 60.0, path: str = "/readyz") -> RouterServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited {self.proc.returncode}: {self.log_text()[-3000:]}")
            try:
                if httpx.get(self.url + path, timeout=2.0, verify=self.verify).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router not ready: {self.log_text()[-3000:]}")

    def status(self, **kw) -> dict:
        return httpx.get(self.url + "/router/status", timeout=5.0, verify=self.verify, **kw).json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    def close(self) -> int | None:
        return stop(self.proc)
