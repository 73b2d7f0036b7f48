"""Two nodes in two network namespaces joined by a veth pair: vLLM's multi-node DP commands on lbd.

Head (10.77.0.1): `lbd serve --data-parallel-size 4 --data-parallel-size-local 2 --data-parallel-address ...`;
worker (10.77.0.2): `lbd serve --headless ... --data-parallel-start-rank 2`. Then the hybrid topology on the
same two nodes. Ranks run on the simulated accelerator (real front end, scheduler and metrics).
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from support import make_certs
from support.deploy_harness import (
    PROBE_BOUND_S,
    PROBE_FLAGS,
    SIM_FLAGS,
    ServeNode,
    complete,
    rank_urls,
    router_states,
)
from support.deploy_harness import successes as rank_successes
from support.netns import Namespaces, unavailable

HEAD, WORKER = "10.77.0.1", "10.77.0.2"
RPC = "29550"
# a group beyond loopback needs one (of 256 bits or more)
CLUSTER = {"LBD_CLUSTER_TOKEN": "multinode-DRoFUGsUQM4FrTLI1DCI__IekjFmmeVehqRRr_dcLTA"}

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")


@pytest.fixture
def nodes() -> Iterator[tuple[Namespaces, str, str, str]]:
    nets = Namespaces()
    try:
        head, worker = nets.add("h"), nets.add("w")
        _, worker_dev = nets.link(head, HEAD, worker, WORKER)
        yield nets, head, worker, worker_dev
    finally:
        nets.close()


def _group_flags(tiny_llama: Path) -> list[str]:
    return ["--model", str(tiny_llama), *SIM_FLAGS, *PROBE_FLAGS, "--data-parallel-size", "4",
            "--data-parallel-size-local", "2", "--data-parallel-address", HEAD,
            "--data-parallel-rpc-port", RPC]


def _burst(node: ServeNode, base: str, n: int, headers: dict[str, str] | None = None) -> list[int]:
    def one(_: int) -> int:
        return complete(base, max_tokens=16, headers=headers).status_code

    def run() -> list[int]:
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(one, range(n)))

    return node.call(run)


def _successes(node: ServeNode, urls: dict[int, str]) -> dict[int, float]:
    return node.call(lambda: {r: rank_successes(u) for r, u in urls.items()})


def test_headless_node_joins_leaves_and_comes_back(nodes: tuple[Namespaces, str, str, str], tiny_llama: Path,
                                                   tmp_path: Path) -> None:
    nets, head_ns, worker_ns, worker_dev = nodes
    flags = _group_flags(tiny_llama)
    head = ServeNode(flags, tmp_path / "head.log", nets, head_ns, host=HEAD, env=CLUSTER)
    worker = ServeNode([*flags, "--headless", "--data-parallel-start-rank", "2"], tmp_path / "worker.log",
                       nets, worker_ns, host=WORKER, env=CLUSTER)
    try:
        head.wait_ready()
        status = head.status()
        assert [r["rank"] for r in status["ranks"]] == [0, 1, 2, 3]
        assert status["deployment"]["group"]["nodes"][0]["address"] == WORKER
        assert status["deployment"]["rendezvous"]["store_port"] == int(RPC) + 1
        assert worker.status()["deployment"]["registration"]["state"] == "registered"
        urls = rank_urls(status)
        assert urls[2].startswith(f"http://{WORKER}:") and urls[0].startswith(f"http://{HEAD}:")
        pids = {r["rank"]: r["pid"] for r in status["ranks"]}
        head.wait_for(lambda: list(router_states(head).values()) == ["ready"] * 4, 30, "router sees 4 ranks")

        before = _successes(head, urls)
        assert _burst(head, head.api, 16) == [200] * 16
        after = _successes(head, urls)
        assert all(after[r] > before[r] for r in range(4)), (before, after)

        # The worker's link goes down: ranks 2-3 leave the rotation within the probe bound; 0-1 serve on.
        nets.set_link(worker_ns, worker_dev, up=False)
        t0 = time.monotonic()
        head.wait_for(lambda: all(router_states(head)[r] != "ready" for r in (2, 3)), 30, "ranks 2-3 ejected")
        ejected_after = time.monotonic() - t0
        # probe bound plus the router's status poll (0.5 s) and slack for a loaded two-core machine
        assert ejected_after <= PROBE_BOUND_S + 0.5 + 3.0, ejected_after
        assert [router_states(head)[r] for r in (0, 1)] == ["ready", "ready"]
        assert _burst(head, head.api, 8) == [200] * 8
        assert head.get(head.health + "/readyz").status_code == 503
        lost = {r["rank"]: r["state"] for r in head.status()["ranks"]}
        assert lost[2] == lost[3] == "unreachable"

        # Restored: the same processes come back into the rotation, nothing restarted.
        nets.set_link(worker_ns, worker_dev, up=True)
        head.wait_for(lambda: list(router_states(head).values()) == ["ready"] * 4, 30, "ranks 2-3 back")
        head.wait_ready(30)
        back = head.status()
        assert {r["rank"]: r["pid"] for r in back["ranks"]} == pids
        assert all(r["restarts"] == 0 for r in back["ranks"])
        before = _successes(head, urls)
        assert _burst(head, head.api, 16) == [200] * 16
        after = _successes(head, urls)
        assert all(after[r] > before[r] for r in (2, 3)), (before, after)
    finally:
        codes = worker.close(), head.close()
    assert codes == (0, 0), head.log_text()[-3000:] + worker.log_text()[-3000:]
    assert nets.pids(head_ns) == [] and nets.pids(worker_ns) == []


def test_hybrid_nodes_balance_their_own_ranks(nodes: tuple[Namespaces, str, str, str], tiny_llama: Path,
                                              tmp_path: Path) -> None:
    nets, a_ns, b_ns, _ = nodes
    flags = [*_group_flags(tiny_llama), "--data-parallel-hybrid-lb"]
    a = ServeNode(flags, tmp_path / "a.log", nets, a_ns, host=HEAD, env=CLUSTER)
    b = ServeNode([*flags, "--data-parallel-start-rank", "2"], tmp_path / "b.log", nets, b_ns, host=WORKER,
                  env=CLUSTER)
    cluster = None
    try:
        a.wait_ready()
        b.wait_ready()
        assert [r["rank"] for r in a.status()["ranks"]] == [0, 1]
        assert [r["rank"] for r in b.status()["ranks"]] == [2, 3]
        auth = {"Authorization": f"Bearer {CLUSTER['LBD_CLUSTER_TOKEN']}"}  # the registry wants the token
        assert a.get(f"http://{HEAD}:{RPC}/status").status_code == 401
        group = a.call(lambda: httpx.get(f"http://{HEAD}:{RPC}/status", headers=auth, timeout=5.0).json())
        urls = rank_urls(group)
        assert sorted(urls) == [0, 1, 2, 3]
        for node, own in ((a, (0, 1)), (b, (2, 3))):
            node.wait_for(lambda n=node: len(router_states(n)) == 2, 30, "node router over its 2 ranks")
            before = _successes(a, urls)
            assert _burst(a, node.api, 8) == [200] * 8
            after = _successes(a, urls)
            grew = {r for r in urls if after[r] > before[r]}
            assert grew == set(own), (node.host, before, after)
        # An outer router spreads clients over the two node routers.
        cluster = ServeNode(["--host", HEAD, "--port", "8080", "--upstreams",
                             f"http://{HEAD}:8000,http://{WORKER}:8000"], tmp_path / "cluster.log", nets,
                            a_ns, host=HEAD, port=8080, command="route")
        cluster.wait_for(lambda: cluster.get(cluster.api + "/readyz").status_code == 200, 30,
                         "cluster router")
        before = _successes(a, urls)
        assert _burst(a, cluster.api, 16) == [200] * 16
        after = _successes(a, urls)
        grew = {r for r in urls if after[r] > before[r]}
        assert grew & {0, 1} and grew & {2, 3}, (before, after)
    finally:
        if cluster is not None:
            cluster.close()
        codes = b.close(), a.close()
    assert codes == (0, 0)



def test_tls_group_across_nodes(nodes: tuple[Namespaces, str, str, str], tiny_llama: Path,
                                tmp_path: Path) -> None:
    """Where the public ports serve TLS, so do the links between nodes: registration with the head, the
    head's router to the remote ranks, every health port; each verified against --ssl-ca-certs."""
    nets, head_ns, worker_ns, _ = nodes
    ca, cert, key = make_certs(tmp_path / "tls", HEAD, WORKER, "127.0.0.1", "localhost")
    flags = [*_group_flags(tiny_llama), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
             "--ssl-ca-certs", str(ca)]
    head = ServeNode(flags, tmp_path / "head.log", nets, head_ns, host=HEAD, env=CLUSTER)
    worker = ServeNode([*flags, "--headless", "--data-parallel-start-rank", "2"], tmp_path / "worker.log",
                       nets, worker_ns, host=WORKER, env=CLUSTER)
    trust = ssl.create_default_context(cafile=str(ca))
    auth = {"Authorization": f"Bearer {CLUSTER['LBD_CLUSTER_TOKEN']}"}

    def get(node: ServeNode, url: str, **kw: Any) -> httpx.Response:
        return node.call(lambda: httpx.get(url, verify=trust, timeout=5.0, **kw))

    try:
        head.wait_for(lambda: get(head, f"https://{HEAD}:9256/readyz").status_code == 200, 120, "TLS group")
        group = get(head, f"https://{HEAD}:{RPC}/status", headers=auth).json()
        assert [r["url"].split(":")[0] for r in group["ranks"]] == ["https"] * 4
        assert rank_urls(group)[2].startswith(f"https://{WORKER}:")
        node = get(head, f"https://{HEAD}:{RPC}/v1/group", headers=auth).json()["nodes"][0]
        assert node["health_url"] == f"https://{WORKER}:9256"
        assert get(head, f"https://{HEAD}:{RPC}/v1/group").status_code == 401
        with pytest.raises(httpx.HTTPError):  # no plain HTTP on the registration port
            head.get(f"http://{HEAD}:{RPC}/health")
        head.wait_for(lambda: list(router_states_tls(head, trust).values()) == ["ready"] * 4, 30,
                      "router over 4 TLS ranks")
        body = {"prompt": "hi", "max_tokens": 4}
        answers = head.call(lambda: [httpx.post(f"https://{HEAD}:8000/v1/completions", verify=trust,
                                                json=body, timeout=60).status_code for _ in range(8)])
        assert answers == [200] * 8
    finally:
        codes = worker.close(), head.close()
    assert codes == (0, 0), head.log_text()[-3000:] + worker.log_text()[-3000:]


def router_states_tls(node: ServeNode, trust: ssl.SSLContext) -> dict[int | None, str]:
    status = node.call(lambda: httpx.get(f"https://{node.host}:{node.port}/router/status", verify=trust,
                                         timeout=5.0).json())
    return {e["rank"]: e["state"] for e in status["endpoints"]}
