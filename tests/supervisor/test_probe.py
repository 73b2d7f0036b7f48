"""Acceptance: a rank whose core alone is stopped (SIGSTOP: its front end still answers) is caught. Idle, by
the supervisor's 1-token generation probes; under traffic, by the engine's stalled-core /health, and the
router (following the supervisor) stops sending to it within the documented bound; the restart brings it
back, and no request through the router fails meanwhile."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.engine.launch import CORE_PROCESS_NAME
from support import RouterServer
from support.node import SupervisorNode

pytestmark = pytest.mark.slow
STALL_S = 2.0
GENERATE_EVERY = 5  # with the harness's 0.2 s probe interval: a generation probe every second


@pytest.fixture(scope="module")
def deployment(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[SupervisorNode, RouterServer]]:
    logs = tmp_path_factory.mktemp("wedged")
    node = SupervisorNode(tiny_llama, 2, "--health-stall-timeout-s", str(STALL_S),
                          "--dp-supervisor-probe-generate", str(GENERATE_EVERY),
                          "--restart-backoff-initial-s", "0.2", "--shutdown-timeout", "5",
                          timeout=3.0, log=logs / "node.log")  # a 1-token generation on a busy machine
    router = None
    try:
        node.wait_ready()
        router = RouterServer("--upstreams", f"supervisor://127.0.0.1:{node.sport}", "--policy",
                              "round_robin", "--outlier-first-byte-timeout-s", "3", "--debug-headers",
                              log=logs / "router.log").wait_ready()
        yield node, router
    finally:
        if router is not None:
            router.close()
        node.close()


def core_of(node: SupervisorNode, rank: int) -> int:
    cores = [p.pid for p in node.rank_tree(rank) if p.name() == CORE_PROCESS_NAME]
    assert len(cores) == 1, [(p.pid, p.name()) for p in node.rank_tree(rank)]
    return cores[0]


def router_state(router: RouterServer, url: str) -> str:
    return next(e["state"] for e in router.status()["endpoints"] if e["url"] == url)


def wait(pred, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout:.0f} s"
        time.sleep(0.05)
    return time.monotonic() - t0


def back_to_ready(node: SupervisorNode, router: RouterServer, rank: int, old_pid: int) -> None:
    url = node.rank_url(rank)
    wait(lambda: node.rank(rank)["state"] == "ready" and node.rank(rank)["pid"] != old_pid, 120,
         f"rank {rank} restarted")
    wait(lambda: router_state(router, url) == "ready", 10, f"router sends to rank {rank} again")


def test_idle_stopped_core_is_caught_by_generation_probes(deployment) -> None:
    node, router = deployment
    old_pid = node.rank(1)["pid"]
    os.kill(core_of(node, 1), signal.SIGSTOP)
    # bound, idle: the next generation probe (<= N x interval) waits on the stopped core, whose silence
    # the rank's /health reports after the stall timeout; one probe interval (+ its timeout) later it is out
    bound = GENERATE_EVERY * node.interval + STALL_S + node.interval + node.timeout
    took = wait(lambda: node.rank(1)["state"] != "ready", bound + 5, "rank 1 unhealthy")
    assert took <= bound + 3.0, (took, bound)
    wait(lambda: router_state(router, node.rank_url(1)) != "ready", 2.0, "router stops sending to rank 1")
    assert "made no progress" in (node.rank(1)["last_failure"] or "") or \
        "generation" in (node.rank(1)["last_failure"] or ""), node.rank(1)
    back_to_ready(node, router, 1, old_pid)


def test_stopped_core_under_traffic_loses_no_request(deployment, tiny_llama: Path) -> None:
    node, router = deployment
    failures: list[str] = []
    served: dict[str, int] = {}
    done = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=router.url, timeout=60) as c:
            while not done.is_set():
                try:
                    r = c.post("/v1/completions", json={"model": str(tiny_llama), "prompt": "Hello",
                                                        "max_tokens": 4, "temperature": 0})
                    if r.status_code != 200:
                        failures.append(f"{r.status_code} {r.text[:200]}")
                    else:
                        ep = r.headers["x-lbd-endpoint"]
                        served[ep] = served.get(ep, 0) + 1
                except httpx.HTTPError as e:
                    failures.append(repr(e))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        url0 = node.rank_url(0)
        wait(lambda: served.get(url0, 0) > 0, 30, "rank 0 serves the load")  # (was a fixed 2 s sleep)
        old_pid = node.rank(0)["pid"]
        os.kill(core_of(node, 0), signal.SIGSTOP)
        t0 = time.monotonic()
        # bound, with traffic: the stall timeout, one probe interval and its timeout; the router follows
        # the supervisor's /status within its 0.5 s poll (and its own outlier check fires at 3 s + 0.5 s)
        bound = STALL_S + node.interval + node.timeout + 0.5
        wait(lambda: router_state(router, url0) != "ready", bound + 4, "router stops sending to rank 0")
        took = time.monotonic() - t0
        assert took <= bound + 3.0, (took, bound)
        before = served.get(url0, 0)
        time.sleep(1.0)
        assert served.get(url0, 0) <= before + 3  # (at most those already under way when it was seen)
        back_to_ready(node, router, 0, old_pid)
        count = served.get(url0, 0)
        wait(lambda: served.get(url0, 0) > count, 20, "rank 0 serves again")
    finally:
        done.set()
        for t in threads:
            t.join(60)
    assert not failures, failures[:5]
