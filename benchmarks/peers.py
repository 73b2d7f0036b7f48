"""Command lines of the routers the benchmarks compare: ours and the peers of scripts/setup-peers.sh."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

PEERS = Path(__file__).resolve().parents[1] / ".venv-peers" / "bin"
PEER_KINDS = ("vllm-router", "sglang-router")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lbd_route_argv(port: int, upstreams: str, *extra: str) -> tuple[list[str], str]:
    """`lbd route` on 127.0.0.1:port and the path that says it is ready."""
    argv = [sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
            "--upstreams", upstreams, "--log-level", "warning", *extra]
    return argv, "/readyz"


def peer_installed(kind: str) -> bool:
    return (PEERS / kind).exists()


def peer_argv(kind: str, port: int, worker_urls: list[str], policy: str) -> tuple[list[str], str]:
    """vllm-router or sglang-router on 127.0.0.1:port over ``worker_urls``, and its readiness path."""
    if kind not in PEER_KINDS:
        raise ValueError(f"unknown peer router {kind!r}")
    launch = ["launch"] if kind == "sglang-router" else []
    level = "warn" if kind == "sglang-router" else "warning"
    argv = [str(PEERS / kind), *launch, "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--log-level", level,
            "--prometheus-port", str(_free_port())]
    return argv, "/health"
