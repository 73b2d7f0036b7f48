"""Joining a group on one machine (loopback): a headless node waits for a head that is not there yet (a named
reason, not an error), a router-only head (`--data-parallel-size-local 0`) serves it, and nodes that do not
fit the group are refused with exit 2 and the head's message. Once the group serves, its listening sockets:
a group that meets at 127.0.0.1 is on one machine, so registration, the health ports and the worker's ranks
stay on loopback without a token; the head's router port is the one the user asked for (the listeners check
of tests/serve/test_listeners.py, on this group rather than a second one)."""

from __future__ import annotations

from pathlib import Path

from support import free_port_run
from support.deploy_harness import SIM_FLAGS, ServeNode, complete
from support.listeners import assert_closed, listeners


def test_head_late_router_only_head_and_refused_nodes(tiny_llama: Path, tmp_path: Path) -> None:
    base = free_port_run(12)
    rpc = str(base + 11)
    group = ["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-address", "127.0.0.1",
             "--data-parallel-rpc-port", rpc, "--dp-supervisor-probe-interval-s", "0.5"]

    def headless(i: int, port: int, *flags: str) -> ServeNode:
        return ServeNode([*group, "--headless", "--port", str(port), "--data-parallel-supervisor-port",
                          str(base + 8 + i), *flags], tmp_path / f"worker{i}.log", port=port,
                         health_port=base + 8 + i)

    worker = headless(0, base, "--data-parallel-size", "2")  # ranks 0-1 on base, base+1
    head = refused = None
    try:
        worker.wait_for(lambda: "cannot reach the head at 127.0.0.1" in worker.status()["reason"], 60,
                        "a named reason while the head is missing")
        assert worker.get(worker.health + "/readyz").status_code == 503
        assert worker.status()["deployment"]["registration"]["state"] == "connecting"

        head = ServeNode([*group, "--data-parallel-size", "2", "--data-parallel-size-local", "0", "--port",
                          str(base + 2), "--data-parallel-supervisor-port", str(base + 3)],
                         tmp_path / "head.log", port=base + 2, health_port=base + 3)
        head.wait_ready(60)
        worker.wait_ready(30)
        assert [r["rank"] for r in head.status()["ranks"]] == [0, 1]
        head.wait_for(lambda: head.get(head.api + "/readyz").status_code == 200, 30, "router ready")
        assert complete(head.api).status_code == 200
        found = listeners(head.proc.pid, worker.proc.pid)
        # head: router, health, registration; worker: health, 2 ranks
        assert_closed(found, {base + 2}, expect=6)
        assert ("127.0.0.1", int(rpc)) in {(ip, port) for ip, port, _ in found}  # the registration port

        for i, flags, needle in (
            (1, ["--data-parallel-size", "4", "--data-parallel-size-local", "2", "--data-parallel-start-rank",
                 "2"], "has --data-parallel-size 4 but the head's group has 2"),
            (2, ["--data-parallel-size", "2", "--data-parallel-size-local", "1", "--data-parallel-start-rank",
                 "1"], "ranks 1 are already registered by node 127.0.0.1"),
        ):
            refused = headless(i, base + 4 + 2 * (i - 1), *flags)
            assert refused.proc.wait(60) == 2, refused.log_text()[-3000:]
            assert needle in refused.log_text()
            assert "supervisor started" not in refused.log_text()  # refused before any rank was started
            assert any(needle in r["reason"] for r in head.status()["deployment"]["group"]["rejected"])
        assert complete(head.api).status_code == 200  # the group is untouched
    finally:
        codes = [n.close() for n in (refused, worker, head) if n is not None]
    assert codes[-2:] == [0, 0]
