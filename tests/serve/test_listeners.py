"""Every listening socket of each topology, started on one machine: none is beyond loopback unless a flag
asked for it (the API ports). The process trees are walked with psutil once the deployment is ready, so the
DP group's store and coordinator, gloo's sockets, TP/PP rendezvous, KV events, the health ports and the
registration port are all seen.

Topologies other tests start anyway are walked there (support.listeners), not started a second time here:
`lbd serve --data-parallel-size 2` with KV events and the MoE group with a cluster token in
tests/serve/test_readiness.py, a headless node and its head on loopback in tests/serve/test_join.py.

Cost (2 shared cores): `lbd supervise` + `lbd route` ~5 s; slow: TP 2 ~15 CPU-s.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx
import pytest

from support import free_port, free_port_run, spawn, stop, wait_http
from support.deploy_harness import SIM_FLAGS
from support.listeners import assert_closed, listeners

KV_EVENTS = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True})]  # the default endpoint
CPU_FLAGS = ["--device", "cpu", "--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512",
             "--max-num-seqs", "8", "--log-level", "warning"]


def test_supervise_with_a_router_and_kv_events(tiny_llama: Path, tmp_path: Path) -> None:
    """`lbd supervise --host 127.0.0.1` + `lbd route`: the health port and the KV events follow the ranks'
    --host; the router's own port is the only one beyond loopback (its --host defaults to every interface)."""
    base = free_port_run(3)
    sport, rport = base + 2, free_port()
    sup = spawn([sys.executable, "-m", "lbd", "supervise", "--model", str(tiny_llama), *SIM_FLAGS, *KV_EVENTS,
                 "--data-parallel-size", "2", "--host", "127.0.0.1", "--port", str(base),
                 "--data-parallel-supervisor-port", str(sport), "--dp-supervisor-probe-interval-s", "0.5"],
                log=tmp_path / "supervise.log")
    router = None
    try:
        wait_http(f"http://127.0.0.1:{sport}/readyz", 60, sup)
        router = spawn([sys.executable, "-m", "lbd", "route", "--port", str(rport), "--upstreams",
                        f"supervisor://127.0.0.1:{sport}"], log=tmp_path / "route.log")
        wait_http(f"http://127.0.0.1:{rport}/readyz", 60, router)
        found = listeners(sup.pid, router.pid)
        assert_closed(found, {rport}, expect=6)
        assert any(port == sport and ip == "127.0.0.1" for ip, port, _ in found)
        assert httpx.get(f"http://127.0.0.1:{rport}/router/status", timeout=5).status_code == 200
    finally:
        for proc in (router, sup):
            if proc is not None:
                stop(proc)


@pytest.mark.slow
def test_tensor_parallel_rendezvous(tiny_llama: Path, tmp_path: Path) -> None:
    """One rank with TP 2: the executor's TCPStore (torch's server alone would take every interface) and
    the workers' gloo sockets on loopback; the API port listens where --host (unset: everywhere) says."""
    port = free_port()
    proc = spawn([sys.executable, "-m", "lbd", "serve", "--model", str(tiny_llama), *CPU_FLAGS,
                  "--tensor-parallel-size", "2", "--port", str(port)], log=tmp_path / "tp.log")
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300, proc)
        found = listeners(proc.pid)
        assert_closed(found, {port}, expect=3)
    finally:
        stop(proc)
