"""`lbd serve` deployment nodes for the tests: real processes, on loopback or inside a network namespace."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from support import metric_value, spawn, stop
from support.netns import Namespaces

# Simulated-accelerator ranks: the real front end, scheduler and metrics, no forward pass to pay for, so
# four ranks and their supervisors fit two shared cores.
SIM_FLAGS = ["--device", "sim", "--max-model-len", "512", "--log-level", "warning"]
# Fast probes: a node's hang or loss shows within interval x threshold + timeout = 2 s.
PROBE_FLAGS = ["--dp-supervisor-probe-interval-s", "0.5", "--dp-supervisor-probe-timeout-s", "1",
               "--dp-supervisor-probe-failure-threshold", "2"]
PROBE_BOUND_S = 0.5 * 2 + 1


class ServeNode:
    """`python -m lbd serve ...` (or another ``command``); ``ns``: run it, and every call to it, inside that
    network namespace."""

    def __init__(self, args: list[str], log: Path, nets: Namespaces | None = None, ns: str | None = None,
                 host: str = "127.0.0.1", port: int = 8000, health_port: int = 9256,
                 env: dict[str, str] | None = None, command: str = "serve") -> None:
        self.nets, self.ns, self.host, self.log = nets, ns, host, log
        self.port, self.health_port = port, health_port
        argv = [sys.executable, "-m", "lbd", command, *args]
        if nets is not None and ns is not None:
            self.proc = nets.spawn(ns, argv, log, env=env)
        else:
            self.proc = spawn(argv, env=env, log=log)

    @property
    def api(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def health(self) -> str:
        return f"http://{self.host}:{self.health_port}"

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` where this node's addresses are reachable (its namespace)."""
        if self.nets is not None and self.ns is not None:
            return self.nets.call(self.ns, fn, *args)
        return fn(*args)

    def get(self, url: str, timeout: float = 5.0) -> httpx.Response:
        return self.call(lambda: httpx.get(url, timeout=timeout))

    def status(self) -> dict[str, Any]:
        return self.get(self.health + "/status").json()

    def router_status(self) -> dict[str, Any]:
        return self.get(self.api + "/router/status").json()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_for(self, pred: Callable[[], bool], timeout: float, what: str) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"lbd serve exited ({self.proc.returncode}) waiting for {what}\n"
                                     + self.log_text()[-4000:])
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if pred():
                    return time.monotonic() - t0
            time.sleep(0.1)
        raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.log_text()[-4000:]}")

    def wait_ready(self, timeout: float = 120.0) -> float:
        return self.wait_for(lambda: self.get(self.health + "/readyz").status_code == 200, timeout,
                             "/readyz 200")

    def close(self, timeout: float = 30.0) -> int | None:
        return stop(self.proc, timeout)


def complete(base: str, prompt: str = "hello there", max_tokens: int = 8,
             headers: dict[str, str] | None = None, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens},
                      headers=headers or {}, timeout=timeout)


def successes(rank_url: str) -> float:
    """The rank's vllm:request_success_total (every finish reason)."""
    return metric_value(httpx.get(rank_url + "/metrics", timeout=5.0).text, "vllm:request_success_total")


def rank_urls(status: dict[str, Any]) -> dict[int, str]:
    return {r["rank"]: r["url"] for r in status["ranks"] if r.get("url")}


def router_states(node: ServeNode) -> dict[int | None, str]:
    return {e["rank"]: e["state"] for e in node.router_status()["endpoints"]}
