"""Authenticated cluster wires: a head (or node, or MoE group) beyond loopback refuses to start without the
cluster token, and any `lbd serve` refuses a weak one; a registered node's ranks cannot be taken over (401
without the token, 409 for another node id while its lease lives); the DP coordinator checks the token on
HTTP and ZMQ (CURVE); bodies are capped."""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import zmq

from lbd.common.cluster import (
    CLUSTER_TOKEN_ENV,
    MIN_TOKEN_BITS,
    derive,
    read_cluster_token,
    secure_zmq_client,
    token_bits,
)
from lbd.engine.dp.coordinator import ZMQ_PURPOSE
from lbd.serve.group import Group
from lbd.serve.plan import parse
from lbd.serve.registry import MAX_BODY_BYTES, Registry
from lbd.supervisor.config import parse_args
from lbd.wire.dp_messages import CoordinatorMessage, Form, Join, decode_from_coordinator, encode
from support import free_port_run, spawn, stop, wait_http

TOKEN = "cluster-token-ODG03F0Jyu3LF8aTASnhv4rlnFw1Q9SfN4h0qOziHr8"  # strong enough: 256 bits or more
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GROUP = ["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--device", "sim"]
ADDR = ["--data-parallel-address", "10.0.0.1"]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != CLUSTER_TOKEN_ENV}


def _ports() -> list[str]:
    base = free_port_run(5)
    return ["--port", str(base), "--data-parallel-supervisor-port", str(base + 4)]


# ---- refusing to start -------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", [[], ["--headless", "--data-parallel-start-rank", "2"]])
def test_a_group_beyond_loopback_needs_the_token(role: list[str]) -> None:
    """A real `lbd serve` process: exit 2 before anything starts, naming both ways to give the token."""
    proc = subprocess.run([sys.executable, "-m", "lbd", "serve", *_ports(), *GROUP, *ADDR, *role],
                          env=_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert CLUSTER_TOKEN_ENV in proc.stderr and "--cluster-token-file" in proc.stderr
    assert "--insecure-cluster" in proc.stderr


def test_token_file_insecure_flag_and_loopback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    plan = parse([*_ports(), *GROUP, *ADDR, "--cluster-token-file", str(token_file)], {})
    assert plan is not None and plan.cluster_token == TOKEN
    assert not any(TOKEN in a or "token" in a for a in plan.supervise_argv + (plan.route_argv or []))
    insecure = parse([*_ports(), *GROUP, *ADDR, "--insecure-cluster"], {})
    assert insecure is not None and insecure.cluster_token is None and insecure.insecure_cluster
    local = parse([*_ports(), *GROUP, "--data-parallel-address", "127.0.0.1"], {})
    assert local is not None and local.cluster_token is None  # loopback: the machine is the boundary
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SystemExit) as e:
        parse([*_ports(), *GROUP, *ADDR, "--cluster-token-file", str(empty)], {})
    assert e.value.code == 2 and "--cluster-token-file" in capsys.readouterr().err
    assert read_cluster_token(None, {CLUSTER_TOKEN_ENV: "x"}) == "x" and read_cluster_token(None, {}) is None


def test_a_weak_cluster_token_is_refused_at_start_up(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Keys derive from the token (the internal key, CURVE pairs): below 256 bits, a real `lbd serve` exits 2
    before anything starts, naming where the token came from and how to make one."""
    for weak in ("s3cret-cluster-token", "a" * 64, "abc" * 40, "0123456789abcdef0123456789abcdef"):
        assert token_bits(weak) < MIN_TOKEN_BITS, weak
    for _ in range(50):  # what the usual generators make passes
        for strong in (secrets.token_urlsafe(32), secrets.token_hex(32),
                       base64.b64encode(secrets.token_bytes(32)).decode()):
            assert token_bits(strong) >= MIN_TOKEN_BITS, strong
    proc = subprocess.run([sys.executable, "-m", "lbd", "serve", *_ports(), *GROUP, *ADDR],
                          env={**_env(), CLUSTER_TOKEN_ENV: "s3cret-cluster-token"}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert CLUSTER_TOKEN_ENV in proc.stderr and "secrets.token_urlsafe(32)" in proc.stderr
    assert "s3cret-cluster-token" not in proc.stderr
    weak_file = tmp_path / "weak"
    weak_file.write_text("short\n")
    with pytest.raises(SystemExit) as e:
        parse([*_ports(), *GROUP, *ADDR, "--cluster-token-file", str(weak_file)], {})
    assert e.value.code == 2 and f"--cluster-token-file {weak_file}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a given internal key too: its HMACs travel with every request
        parse([*_ports(), "--data-parallel-size", "2"], {"LBD_INTERNAL_KEY": "my-internal-key"})
    assert e.value.code == 2 and "LBD_INTERNAL_KEY" in capsys.readouterr().err


def test_the_router_gets_the_token_by_environment_only() -> None:
    """The router follows the ranks' CURVE-secured load streams with the token (else it scrapes every remote
    rank): it gets it as the supervisor does, in its environment, never on its command line."""
    from lbd.serve.node import key_env

    plan = parse([*_ports(), *GROUP, *ADDR], {CLUSTER_TOKEN_ENV: TOKEN})
    assert plan is not None and plan.route_argv is not None
    router, supervisor = key_env(plan, "router"), key_env(plan, "supervisor")
    assert router[CLUSTER_TOKEN_ENV] == supervisor[CLUSTER_TOKEN_ENV] == TOKEN
    assert not any(TOKEN in a for a in plan.route_argv + plan.supervise_argv)
    keyed = parse([*_ports(), *GROUP, *ADDR, "--api-key", "k"], {CLUSTER_TOKEN_ENV: TOKEN})
    assert keyed is not None and key_env(keyed, "router")[CLUSTER_TOKEN_ENV] == TOKEN


def test_an_moe_group_across_nodes_needs_the_token(tiny_mixtral: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    base = free_port_run(5)
    argv = ["--model", str(tiny_mixtral), "--host", "127.0.0.1", "--port", str(base),
            "--data-parallel-supervisor-port", str(base + 4), "--data-parallel-size", "4",
            "--data-parallel-size-local", "2", "--data-parallel-start-rank", "2", *ADDR]
    with pytest.raises(SystemExit) as e:
        parse_args(argv, env={})
    err = capsys.readouterr().err
    assert e.value.code == 2 and CLUSTER_TOKEN_ENV in err and "--cluster-token-file" in err
    cfg = parse_args(argv, env={CLUSTER_TOKEN_ENV: TOKEN})
    assert cfg.group is not None and cfg.group.token == TOKEN and TOKEN not in repr(cfg.group)
    for spec in cfg.ranks:  # the members get it in their environment, never on their command line
        assert spec.env[CLUSTER_TOKEN_ENV] == TOKEN and not any(TOKEN in a for a in spec.argv)


# ---- takeovers at the head ---------------------------------------------------------------------------------
def _reg(node: str, address: str = "10.0.0.2", start: int = 2) -> dict[str, Any]:
    return {"node_id": node, "address": address, "hostname": "h", "health_url": f"http://{address}:9256",
            "data_parallel_size": 4, "data_parallel_start_rank": start, "data_parallel_size_local": 2,
            "models": ["m"],
            "ranks": [{"rank": r, "url": f"http://{address}:{8001 + r}", "state": "ready", "routable": True}
                      for r in range(start, start + 2)]}


@pytest.fixture
async def head() -> AsyncIterator[tuple[Registry, str]]:
    group = Group(4, ["m"], range(0, 2), lease_s=1.0)
    reg = Registry(group, "127.0.0.1", 29550, 0.2, TOKEN,
                   lambda: {"ranks": group.ranks([], time.monotonic())})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    await reg.start(sock)
    try:
        yield reg, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await reg.stop()


async def test_takeovers_are_refused(head: tuple[Registry, str]) -> None:
    reg, base = head
    async with httpx.AsyncClient(base_url=base, timeout=5.0) as c:
        assert (await c.post("/v1/nodes", json=_reg("victim"), headers=AUTH)).status_code == 200
        # no token: neither a registration with the victim's health URL nor its heartbeat nor its leave
        assert (await c.post("/v1/nodes", json=_reg("thief"))).status_code == 401
        hijack = _reg("victim", address="10.6.6.6")
        assert (await c.put("/v1/nodes/victim", json=hijack)).status_code == 401
        assert (await c.delete("/v1/nodes/victim")).status_code == 401
        wrong = {"Authorization": "Bearer not-the-token"}
        assert (await c.post("/v1/nodes", json=_reg("thief"), headers=wrong)).status_code == 401
        # another node id claiming the victim's health URL while its lease lives
        clash = await c.post("/v1/nodes", json=_reg("thief"), headers=AUTH)
        assert clash.status_code == 409 and clash.json()["error"]["param"] == "node_id"
        # or its ranks from another address
        other = await c.post("/v1/nodes", json=_reg("thief", address="10.6.6.6"), headers=AUTH)
        assert other.status_code == 409
        # the lease lapses: still nothing without the token
        await asyncio.sleep(1.5)
        assert reg.group.members["victim"].ranks[0].url == "http://10.0.0.2:8003"
        assert (await c.post("/v1/nodes", json=_reg("thief", address="10.6.6.6"))).status_code == 401
        assert (await c.put("/v1/nodes/victim", json=hijack)).status_code == 401
        assert (await c.get("/v1/group")).status_code == 401  # node ids are not for outsiders either
        urls = [r.url for m in reg.group.members.values() for r in m.ranks]
        assert urls == ["http://10.0.0.2:8003", "http://10.0.0.2:8004"]
        assert (await c.get("/health")).status_code == 200


async def test_registration_bodies_are_capped(head: tuple[Registry, str]) -> None:
    reg, base = head
    async with httpx.AsyncClient(base_url=base, timeout=10.0, headers=AUTH) as c:
        big = await c.post("/v1/nodes", content=b"x" * (MAX_BODY_BYTES + 1),
                           headers={"Content-Type": "application/json"})
        assert big.status_code == 413

        async def chunks() -> AsyncIterator[bytes]:
            for _ in range(MAX_BODY_BYTES // 4096 + 2):
                yield b" " * 4096

        chunked = await c.post("/v1/nodes", content=chunks())  # no length to check first
        assert chunked.status_code == 413
    reg.limits = type(reg.limits)(**{**{f: getattr(reg.limits, f) for f in reg.limits.__dataclass_fields__},
                                     "body_read_timeout_s": 0.5})
    port = int(base.rpartition(":")[2])
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /v1/nodes HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOKEN.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
    await w.drain()
    answer = await asyncio.wait_for(r.read(4096), 10.0)
    w.close()
    assert answer.startswith(b"HTTP/1.1 408")


# ---- the DP coordinator -----------------------------------------------------------------------------------
def test_the_coordinator_checks_the_token(tmp_path: Path) -> None:
    """HTTP needs the bearer token; ZMQ is CURVE with keys derived from it: a member without them is never
    heard, one with them forms the group. An address beyond loopback without a token is refused."""
    refused = subprocess.run([sys.executable, "-m", "lbd.engine.dp.coordinator", "--data-parallel-size", "1",
                              "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "29550"],
                             env=_env(), capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and CLUSTER_TOKEN_ENV in refused.stderr
    rpc = free_port_run(4) - 1
    proc = spawn([sys.executable, "-m", "lbd.engine.dp.coordinator", "--data-parallel-size", "1",
                  "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(rpc)],
                 env={**_env(), CLUSTER_TOKEN_ENV: TOKEN}, log=tmp_path / "coordinator.log")
    ctx = zmq.Context()
    try:
        url = f"http://127.0.0.1:{rpc + 3}"
        wait_http(url + "/status", timeout=60, proc=proc, ok=(401,))
        assert httpx.get(url + "/status").status_code == 401
        assert httpx.post(url + "/members/0/failed").status_code == 401
        assert httpx.get(url + "/status", headers=AUTH).json()["members"][0]["pid"] is None
        assert _form(ctx, rpc, None) is None  # no CURVE keys: the handshake never completes
        assert httpx.get(url + "/status", headers=AUTH).json()["members"][0]["pid"] is None
        assert _form(ctx, rpc, "wrong") is None
        form = _form(ctx, rpc, TOKEN)
        assert isinstance(form, Form) and form.size == 1
        assert TOKEN not in (tmp_path / "coordinator.log").read_text()
    finally:
        ctx.term()
        stop(proc)
    assert derive(TOKEN, "a") != derive(TOKEN, "b")


def _form(ctx: zmq.Context, rpc: int, token: str | None) -> CoordinatorMessage | None:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 1500)
    secure_zmq_client(sock, token, ZMQ_PURPOSE)
    sock.connect(f"tcp://127.0.0.1:{rpc + 2}")
    try:
        sock.send(encode(Join(rank=0, pid=os.getpid())))
        return decode_from_coordinator(sock.recv())
    except zmq.Again:
        return None
    finally:
        sock.close(linger=0)


# ---- a real group with the token ---------------------------------------------------------------------------
def test_nodes_with_and_without_the_token(tiny_llama: Path, tmp_path: Path) -> None:
    """A head and a headless node that share the token form the group; a node with another token is refused
    (exit 2, the head's 401); the token shows in no log, command line or health port."""
    from support.deploy_harness import SIM_FLAGS, ServeNode

    base = free_port_run(10)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    group = ["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-size", "2",
             "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(base + 9),
             "--dp-supervisor-probe-interval-s", "0.5"]

    def worker(i: int, env: dict[str, str], *flags: str) -> ServeNode:
        port, health = base + 3 + 2 * i, base + 4 + 2 * i
        return ServeNode([*group, "--headless", "--data-parallel-start-rank", "1",
                          "--data-parallel-size-local", "1", "--port", str(port),
                          "--data-parallel-supervisor-port", str(health), *flags],
                         tmp_path / f"worker{i}.log", port=port, health_port=health, env=env)

    head = ServeNode([*group, "--data-parallel-size-local", "1", "--port", str(base),
                      "--data-parallel-supervisor-port", str(base + 2), "--cluster-token-file",
                      str(token_file)],
                     tmp_path / "head.log", port=base, health_port=base + 2, env=_env())
    good = worker(0, {CLUSTER_TOKEN_ENV: TOKEN})
    bad = None
    try:
        head.wait_ready(60)
        good.wait_ready(30)
        bad = worker(1, {CLUSTER_TOKEN_ENV: "FZW1zopkpp8h2T8H10iLUhOjb3b9tRgzvmmAWOjfgU8"})
        assert bad.proc.wait(60) == 2
        assert "missing or wrong cluster token" in bad.log_text()
        seen = [head.get(head.health + "/status").text, good.get(good.health + "/status").text,
                head.get(head.health + "/metrics").text]
        procs = [psutil.Process(n.proc.pid) for n in (head, good)]
        seen += [" ".join(p.cmdline()) for proc in procs for p in [proc, *proc.children(recursive=True)]]
        seen += [n.log_text() for n in (head, good, bad)]
        assert not [text[:200] for text in seen if TOKEN in text]
    finally:
        codes = [n.close() for n in (bad, good, head) if n is not None]
    assert codes[-2:] == [0, 0]


def test_cluster_flags_that_would_do_nothing_are_refused(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    for flags in (["--cluster-token-file", str(token_file)], ["--insecure-cluster"]):
        with pytest.raises(SystemExit) as e:
            parse([*_ports(), "--data-parallel-size", "2", "--device", "sim", *flags], {})
        assert e.value.code == 2 and f"{flags[0]} does nothing here" in capsys.readouterr().err
        base = free_port_run(3)
        with pytest.raises(SystemExit) as e:
            parse_args(["--port", str(base), "--data-parallel-supervisor-port", str(base + 2),
                        "--data-parallel-size", "2", "--device", "sim", *flags], env={})
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{flags[0]} applies to the wires of an MoE group" in err
    # a headless node's supervisor is not handed either: its ranks are dense
    worker = parse([*_ports(), *GROUP, *ADDR, "--headless", "--data-parallel-start-rank", "2",
                    "--insecure-cluster"], {})
    assert worker is not None and "--insecure-cluster" not in worker.supervise_argv
