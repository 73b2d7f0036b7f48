"""The head's registration service over real HTTP: who may join the group, leases, and what the group says."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from lbd.serve.group import Group, span
from lbd.serve.registry import Registry
from lbd.wire.states import RankState
from lbd.wire.status import RankStatus, SupervisorStatus


def _reg(
    start: int,
    count: int = 2,
    size: int = 4,
    address: str = "10.0.0.2",
    node: str = "n1",
    models: tuple[str, ...] = ("m",),
) -> dict[str, Any]:
    return {
        "node_id": node,
        "address": address,
        "hostname": "h",
        "health_url": f"http://{address}:9256",
        "data_parallel_size": size,
        "data_parallel_start_rank": start,
        "data_parallel_size_local": count,
        "models": list(models),
        "ranks": [
            {
                "rank": r,
                "url": f"http://{address}:{8001 + r - start}",
                "state": "ready",
                "routable": True,
                "pid": 100 + r,
            }
            for r in range(start, start + count)
        ],
    }


@pytest.fixture
async def registry() -> AsyncIterator[tuple[Registry, str]]:
    group = Group(4, ["m"], range(0, 2), lease_s=1.5)
    head = [RankStatus(rank=r, url=f"http://10.0.0.1:{8001 + r}", state=RankState.READY) for r in (0, 1)]
    reg = Registry(group, "10.0.0.1", 29550, 0.2, "tok",
                   lambda: SupervisorStatus(ranks=group.ranks(head, _now())))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    await reg.start(sock)
    try:
        yield reg, f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await reg.stop()


def _now() -> float:
    import time

    return time.monotonic()


AUTH = {"Authorization": "Bearer tok"}


async def _post(base: str, body: dict[str, Any], headers: dict[str, str] = AUTH) -> httpx.Response:
    async with httpx.AsyncClient(timeout=5.0) as c:
        return await c.post(base + "/v1/nodes", json=body, headers=headers)


@pytest.mark.parametrize(
    ("body", "needle", "param"),
    [
        (_reg(2, size=8), "has --data-parallel-size 8 but the head's group has 4", "data_parallel_size"),
        (_reg(1), "ranks 1 are the head's own", "data_parallel_start_rank"),
        (_reg(3), "outside the group's 0..3", "data_parallel_start_rank"),
        (_reg(2, models=("other",)), "serves ['other'] but the head serves ['m']", "model"),
    ],
)
async def test_refusals_name_the_flag(
    registry: tuple[Registry, str], body: dict[str, Any], needle: str, param: str
) -> None:
    reg, base = registry
    r = await _post(base, body)
    assert r.status_code == 409
    error = r.json()["error"]
    assert needle in error["message"] and error["param"] == param and error["code"] == 409
    assert reg.group.rejected[-1].reason == error["message"]


async def test_token_join_overlap_lease_and_takeover(registry: tuple[Registry, str]) -> None:
    reg, base = registry
    assert (await _post(base, _reg(2), headers={})).status_code == 401
    ok = await _post(base, _reg(2))
    assert ok.status_code == 200
    answer = ok.json()
    assert answer["lease_s"] == 1.5 and answer["rendezvous"] == {
        "address": "10.0.0.1",
        "registry_port": 29550,
        "store_port": 29551,
        "coordinator_port": 29552,
        "coordinator_http_port": 29553,
    }
    async with httpx.AsyncClient(timeout=5.0, headers=AUTH) as c:
        group = (await c.get(base + "/v1/group")).json()
        assert group["missing_ranks"] == [] and group["nodes"][0]["ranks"] == [2, 3]
        status = (await c.get(base + "/status")).json()
        assert [(r["rank"], r["state"]) for r in status["ranks"]] == [
            (0, "ready"),
            (1, "ready"),
            (2, "ready"),
            (3, "ready"),
        ]
        # another node on another address may not take live ranks
        clash = await _post(base, _reg(2, node="n2", address="10.0.0.3"))
        assert (
            clash.status_code == 409
            and "already registered by node 10.0.0.2" in clash.json()["error"]["message"]
        )
        # the lease runs out: the ranks stay listed, not routable
        await asyncio.sleep(2.0)
        lost = (await c.get(base + "/status")).json()["ranks"]
        assert [(r["state"], r["routable"]) for r in lost[2:]] == [("unreachable", False)] * 2
        # a heartbeat brings them back as they were
        assert (await c.put(base + "/v1/nodes/n1", json=_reg(2))).status_code == 200
        assert [r["state"] for r in (await c.get(base + "/status")).json()["ranks"]] == ["ready"] * 4
        await asyncio.sleep(2.0)
        # a lost node's range can be taken over by a new node
        assert (await _post(base, _reg(2, node="n3", address="10.0.0.4"))).status_code == 200
        assert (await c.put(base + "/v1/nodes/n1", json=_reg(2))).status_code == 404  # register again
        assert (await c.delete(base + "/v1/nodes/n3")).status_code == 200
        gone = (await c.get(base + "/v1/group")).json()
        assert gone["missing_ranks"] == [2, 3]
        status = (await c.get(base + "/status")).json()["ranks"]
        assert [(r["rank"], r["state"], r["url"]) for r in status[2:]] == [
            (2, "missing", ""),
            (3, "missing", ""),
        ]
        assert (await c.post(base + "/v1/nodes", content=b"{not json")).status_code == 400


async def test_a_restarted_node_takes_its_ranks_back_once_the_old_lease_lapses(
    registry: tuple[Registry, str],
) -> None:
    """A new node id on a registered health URL is refused while that lease lives (tests/serve/
    test_cluster_auth.py tries it as a takeover), admitted once it lapsed."""
    _, base = registry
    assert (await _post(base, _reg(2, node="old"))).status_code == 200
    early = await _post(base, _reg(2, node="new"))
    assert early.status_code == 409 and early.json()["error"]["param"] == "node_id"
    await asyncio.sleep(2.0)
    assert (await _post(base, _reg(2, node="new"))).status_code == 200


def test_span() -> None:
    assert span([5, 2, 3]) == "2-3, 5" and span([0]) == "0" and span([1, 2, 3, 7, 8]) == "1-3, 7-8"
