"""`lbd route --upstreams supervisor+dns://name:port`: every address of the name is a supervisor, followed as
the name's records change (a Kubernetes headless Service in front of a StatefulSet of supervisors).

Inside a network namespace whose /etc/hosts gives ``nodes.test`` two loopback addresses, each with a real
`lbd supervise` (one simulated rank); the test rewrites the record set and watches the router follow."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest

from support import metric_value
from support.netns import Namespaces, unavailable

pytestmark = pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")
ADDRS = ("127.0.0.2", "127.0.0.3")


def _supervise(nets: Namespaces, ns: str, addr: str, node_rank: int, model: Path, log: Path) -> None:
    nets.spawn(
        ns,
        [
            sys.executable,
            "-m",
            "lbd",
            "supervise",
            "--data-parallel-size",
            "2",
            "--data-parallel-size-local",
            "1",
            "--node-rank",
            str(node_rank),
            "--host",
            addr,
            "--supervisor-host",
            addr,
            "--port",
            "8000",
            "--model",
            str(model),
            "--device",
            "sim",
            "--max-model-len",
            "512",
            "--log-level",
            "warning",
            "--dp-supervisor-probe-interval-s",
            "0.5",
        ],
        log,
    )


def test_router_follows_the_records_of_a_name(tiny_llama: Path, tmp_path: Path) -> None:
    nets = Namespaces()
    try:
        ns = nets.add("d")
        nets.hosts(ns, [f"{a} nodes.test" for a in ADDRS])
        for i, addr in enumerate(ADDRS):
            _supervise(nets, ns, addr, i, tiny_llama, tmp_path / f"sup{i}.log")
        router = nets.spawn(
            ns,
            [
                sys.executable,
                "-m",
                "lbd",
                "route",
                "--host",
                "127.0.0.1",
                "--port",
                "8080",
                "--upstreams",
                "supervisor+dns://nodes.test:9256",
                "--dns-refresh-interval-s",
                "0.3",
                "--supervisor-poll-interval-s",
                "0.2",
            ],
            tmp_path / "route.log",
        )

        def ranks() -> list[tuple[int, str]]:
            eps = httpx.get("http://127.0.0.1:8080/router/status", timeout=5).json()["endpoints"]
            return [(e["rank"], e["state"]) for e in eps]

        def wait(want: list[tuple[int, str]], what: str) -> None:
            import time

            deadline = time.monotonic() + 60
            seen = None
            while time.monotonic() < deadline:
                assert router.poll() is None, (tmp_path / "route.log").read_text()[-3000:]
                try:
                    seen = nets.call(ns, ranks)
                    if seen == want:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            raise AssertionError(
                f"{what}: router sees {seen}\n" + (tmp_path / "route.log").read_text()[-3000:]
            )

        wait([(0, "ready"), (1, "ready")], "both supervisors found")

        def served() -> float:
            for _ in range(4):
                r = httpx.post(
                    "http://127.0.0.1:8080/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30
                )
                assert r.status_code == 200
            text = httpx.get("http://127.0.0.3:8000/metrics", timeout=5).text
            return metric_value(text, "vllm:request_success_total")

        assert nets.call(ns, served) > 0  # rank 1 (127.0.0.3) got traffic
        nets.hosts(ns, [f"{ADDRS[0]} nodes.test"])
        wait([(0, "ready")], "127.0.0.3 left the name")
        nets.hosts(ns, [f"{a} nodes.test" for a in ADDRS])
        wait([(0, "ready"), (1, "ready")], "127.0.0.3 back")
        assert "following http://127.0.0.3:9256" in (tmp_path / "route.log").read_text()
    finally:
        nets.close()
