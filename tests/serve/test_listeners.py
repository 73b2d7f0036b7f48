"""Every listening socket of each topology, started on one machine: none is beyond loopback unless a flag
asked for it (the API ports). The process trees are walked with psutil once the deployment is ready, so the
DP group's store and coordinator, gloo's sockets, TP/PP rendezvous, KV events, the health ports and the
registration port are all seen.

Cost (2 shared cores): the simulated topologies ~5 s each; the MoE group ~20 CPU-s; slow: TP 2 ~15 CPU-s.
"""

from __future__ import annotations

import ipaddress
import json
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from support import free_port, free_port_run, spawn, stop, wait_http
from support.deploy_harness import SIM_FLAGS, ServeNode, complete

KV_EVENTS = ["--kv-events-config", json.dumps({"enable_kv_cache_events": True})]  # the default endpoint
CPU_FLAGS = ["--device", "cpu", "--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512",
             "--max-num-seqs", "8", "--log-level", "warning"]


def listeners(*roots: int) -> list[tuple[str, int, str]]:
    """(address, port, process) of every listening TCP socket of these process trees."""
    out = []
    for root in roots:
        top = psutil.Process(root)
        for proc in [top, *top.children(recursive=True)]:
            try:
                conns = proc.net_connections("inet")
                name = " ".join(proc.cmdline()[1:4])
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            out += [(c.laddr.ip, c.laddr.port, name) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%")[0]).is_loopback


def assert_closed(found: list[tuple[str, int, str]], asked: set[int], expect: int) -> None:
    """Only the ``asked`` ports may listen beyond loopback; at least ``expect`` sockets were seen (so a tree
    that was walked too early does not pass for a closed one)."""
    wide = [(ip, port, name) for ip, port, name in found if not _loopback(ip) and port not in asked]
    assert not wide, f"listening beyond loopback without a flag asking: {wide}\nall: {sorted(found)}"
    assert len(found) >= expect, sorted(found)


def test_internal_lb_with_kv_events(tiny_llama: Path, tmp_path: Path) -> None:
    """`lbd serve --data-parallel-size 2`: the router on --port; ranks, health port, KV events on loopback."""
    base = free_port_run(4)
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, *KV_EVENTS, "--data-parallel-size", "2",
                      "--port", str(base), "--data-parallel-supervisor-port", str(base + 3)],
                     tmp_path / "serve.log", port=base, health_port=base + 3)
    try:
        node.wait_ready(60)
        node.wait_for(lambda: node.get(node.api + "/readyz").status_code == 200, 30, "router ready")
        found = listeners(node.proc.pid)
        # router, health, 2 ranks, the supervisor's internal port, 2 KV-event publishers at least
        assert_closed(found, {base}, expect=7)
        kv = {port for ip, port, _ in found if port in (5557, 5558)}
        assert kv == {5557, 5558} and all(_loopback(ip) for ip, p, _ in found if p in kv)
        assert complete(node.api).status_code == 200
    finally:
        node.close()


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


def test_headless_head_and_worker_on_loopback(tiny_llama: Path, tmp_path: Path) -> None:
    """A group that meets at 127.0.0.1 is on one machine: registration, health ports and the worker's ranks
    stay on loopback without a token; the head's router port is the one the user asked for."""
    base = free_port_run(8)
    group = ["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-size", "2",
             "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(base + 7),
             "--dp-supervisor-probe-interval-s", "0.5"]
    head = ServeNode([*group, "--data-parallel-size-local", "1", "--port", str(base),
                      "--data-parallel-supervisor-port", str(base + 2)], tmp_path / "head.log", port=base,
                     health_port=base + 2)
    worker = ServeNode([*group, "--headless", "--data-parallel-start-rank", "1", "--data-parallel-size-local",
                        "1", "--port", str(base + 3), "--data-parallel-supervisor-port", str(base + 4)],
                       tmp_path / "worker.log", port=base + 3, health_port=base + 4)
    try:
        head.wait_ready(60)
        worker.wait_ready(30)
        found = listeners(head.proc.pid, worker.proc.pid)
        assert_closed(found, {base}, expect=7)
        assert ("127.0.0.1", base + 7) in {(ip, port) for ip, port, _ in found}  # the registration port
        head.wait_for(lambda: head.get(head.api + "/readyz").status_code == 200, 30, "router ready")
        assert complete(head.api).status_code == 200
    finally:
        codes = [n.close() for n in (worker, head)]
    assert codes == [0, 0]


def test_moe_group_on_one_machine(tiny_mixtral: Path, tmp_path: Path) -> None:
    """An MoE DP group: the coordinator's store, ZMQ and HTTP ports and gloo's pair sockets on loopback.
    With a cluster token (optional on one machine) the members join over CURVE and HTTP asks for it."""
    base = free_port_run(4)
    token = "listeners-FZW1zopkpp8h2T8H10iLUhOjb3b9tRgzvmmAWOjfgU8"
    node = ServeNode(["--model", str(tiny_mixtral), *CPU_FLAGS, "--data-parallel-size", "2",
                      "--enable-expert-parallel", "--port", str(base), "--data-parallel-supervisor-port",
                      str(base + 3)], tmp_path / "moe.log", port=base, health_port=base + 3,
                     env={"LBD_CLUSTER_TOKEN": token})
    try:
        node.wait_ready(300)
        found = listeners(node.proc.pid)
        coordinator = [(ip, port) for ip, port, name in found if "coordinator" in name]
        assert len(coordinator) == 3, found  # store, ZMQ, HTTP
        assert_closed(found, {base}, expect=9)  # + router, health, supervisor, 2 ranks, gloo's
        (group,) = node.status()["groups"]
        url = group["coordinator"]["url"]
        assert httpx.get(url + "/status", timeout=5).status_code == 401
        auth = {"Authorization": f"Bearer {token}"}
        assert httpx.get(url + "/status", headers=auth, timeout=5).json()["state"] == "ready"
        assert token not in node.log_text() and token not in node.get(node.health + "/status").text
    finally:
        node.close()


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
