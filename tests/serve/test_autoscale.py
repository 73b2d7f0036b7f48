"""`lbd serve --autoscale MIN:MAX` (lbd.serve.autoscale), end to end on ``--device sim`` ranks: a burst that
saturates the one rank (one sequence at a time, six clients: five wait, past flow control's four) makes the
planner add a second rank, which the router then serves from; once the load stops, the planner goes back to
one rank after --autoscale-down-after-s. Bad --autoscale values exit 2 naming the flag."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest

from lbd.serve.plan import parse
from support.deploy_harness import PROBE_FLAGS, ServeNode
from support.procs import free_port_run

SIM = ["--device", "sim", "--sim-profile", "a100-llama3-8b", "--max-model-len", "512", "--log-level",
       "warning", "--max-num-seqs", "1"]
CLIENTS = 6


@pytest.mark.parametrize(("args", "says"), [
    (["--autoscale", "2:1"], "1 <= MIN <= MAX"), (["--autoscale", "0:2"], "1 <= MIN <= MAX"),
    (["--autoscale", "3"], "MIN:MAX"),
    (["--autoscale", "1:2", "--autoscale-target-utilization", "1.5"], "--autoscale-target-utilization")])
def test_bad_autoscale_exits_2_naming_the_flag(args: list[str], says: str,
                                               capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as done:
        parse(["--device", "sim", *args], env={})
    err = capsys.readouterr().err
    assert done.value.code == 2 and "--autoscale" in err and says in err, err


def test_the_ttft_target_and_the_utilization_reach_the_router_and_the_planner() -> None:
    plan = parse(["--device", "sim", "--autoscale", "1:3", "--ttft-target-ms", "500",
                  "--autoscale-target-utilization", "0.85", "--port", str(free_port_run(2))], env={})
    assert plan is not None and plan.autoscale is not None and plan.autoscale.max_ranks == 3
    assert plan.autoscale.target_utilization == 0.85
    assert plan.route_argv is not None
    assert plan.route_argv[-4:] == ["--ttft-target-ms", "500.0", "--autoscale-target-utilization", "0.85"]
    assert plan.dp_size_local == 1 and "--min-ready-endpoints" in plan.route_argv


def _load(url: str, stop: threading.Event, codes: list[int]) -> None:
    with httpx.Client(timeout=60) as client:
        while not stop.is_set():
            r = client.post(url + "/v1/completions", json={"prompt": "count with me", "max_tokens": 60,
                                                            "ignore_eos": True})
            codes.append(r.status_code)


@pytest.mark.slow
def test_a_burst_adds_a_rank_and_the_quiet_removes_it(tiny_llama: Path, tmp_path: Path) -> None:
    base = free_port_run(4)  # the API, the health port, the ranks' (rank 1's once it grows)
    node = ServeNode(["--model", str(tiny_llama), *SIM, *PROBE_FLAGS, "--port", str(base),
                      "--data-parallel-supervisor-port", str(base + 1), "--rank-port", str(base + 2),
                      "--shutdown-timeout", "1", "--scale-down-drain-timeout-s", "0.5",
                      "--autoscale", "1:2", "--autoscale-interval-s", "0.3", "--autoscale-up-after-s", "0.5",
                      "--autoscale-down-after-s", "3", "--autoscale-cooldown-s", "1"],
                     tmp_path / "serve.log", port=base, health_port=base + 1)
    stop, codes = threading.Event(), []
    threads = [threading.Thread(target=_load, args=(node.api, stop, codes), daemon=True)
               for _ in range(CLIENTS)]
    try:
        node.wait_ready()
        assert node.status()["deployment"]["autoscale"]["min_ranks"] == 1
        assert len(node.status()["ranks"]) == 1
        for t in threads:
            t.start()
        node.wait_for(lambda: len(node.status()["ranks"]) == 2, 60, "a second rank added under load")
        node.wait_for(lambda: sorted(e["rank"] for e in node.router_status()["endpoints"]
                                     if e["state"] == "ready") == [0, 1], 60, "the router serving rank 1")
        state = node.status()["deployment"]["autoscale"]
        assert state["decisions"] >= 1 and "1 -> 2 ranks" in state["last_decision"], state
        t0 = time.monotonic()  # the load stops: the clients send nothing more, their last answers run on
        stop.set()
        for t in threads:
            t.join(60)
        node.wait_for(lambda: [r["rank"] for r in node.status()["ranks"]] == [0], 60, "back to one rank")
        assert time.monotonic() - t0 >= 3.0 - 1.0  # not before the down delay (less the last interval)
        assert "2 -> 1 ranks" in node.status()["deployment"]["autoscale"]["last_decision"]
        assert codes and set(codes) == {200}, sorted(set(codes))
        log = node.log_text()
        assert "autoscale: 1 -> 2 ranks" in log and "autoscale: 2 -> 1 ranks" in log, log[-3000:]
    finally:
        stop.set()
        code = node.close()
    assert code == 0, node.log_text()[-3000:]
