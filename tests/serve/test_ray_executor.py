"""`--data-parallel-backend ray` with `--distributed-executor-backend ray`: the rank's placement group (placed
by the supervisor) is handed to the rank's engine, whose TP=2 workers become Ray actors in its bundles.

On the Ray cluster of tests/serve/test_ray.py (its own network namespace, 4 CPUs): the rank's group
has two CPU bundles; its host actor takes none of them, each worker actor takes one, so the rank holds
exactly two CPUs of the cluster. After SIGTERM no lbd process and no actor (host or worker) is left.
Cost: ~60-120 s on a loaded 2-core machine, hence slow.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import psutil
import pytest

from support.deploy_harness import ServeNode, complete
from support.netns import Namespaces
from support.ray_cluster import GCS_PORT, alive, cmdline, ray_cluster  # noqa: F401, F811 (the fixture)

pytest.importorskip("ray", reason="ray is not installed (pip install 'lbd[ray]')")
pytestmark = [pytest.mark.slow]


def _actors(nets: Namespaces, ns: str, kind: str) -> list[int]:
    """This cluster's actor processes of ``kind`` (those of the namespace: other clusters may run too)."""
    out = []
    for pid in nets.pids(ns):
        with contextlib.suppress(psutil.Error):
            if " ".join(cmdline(psutil.Process(pid))).startswith(f"ray::{kind}"):
                out.append(pid)
    return out


def test_ray_placed_rank_hands_its_group_to_its_ray_workers(ray_cluster: tuple[Namespaces, str],  # noqa: F811
                                                            tiny_llama: Path, tmp_path: Path) -> None:
    nets, ns = ray_cluster
    node = ServeNode(["--model", str(tiny_llama), "--device", "cpu", "--kv-cache-memory-bytes", "8MiB",
                      "--data-parallel-backend", "ray", "--data-parallel-size", "1",
                      "--tensor-parallel-size", "2", "--distributed-executor-backend", "ray"],
                     tmp_path / "serve.log", nets, ns, env={"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"})
    tree: list[int] = []
    actors: list[int] = []
    try:
        node.wait_ready(240)
        node.wait_for(lambda: node.get(node.api + "/readyz").status_code == 200, 30, "router /readyz")
        assert node.call(complete, node.api).status_code == 200
        log = node.log_text()
        assert "workers go into the rank's placement group lbd-dp-rank-0-" in log, log[-3000:]
        hosts, worker_actors = _actors(nets, ns, "RankHost"), _actors(nets, ns, "WorkerHost")
        actors = hosts + worker_actors
        workers = [c.pid for a in worker_actors for c in psutil.Process(a).children()
                   if "lbd.engine.executor.worker" in cmdline(c)]
        assert len(workers) == 2 and len(hosts) == 1  # each worker the child of its actor
        actors += workers
        tree = [p.pid for p in psutil.Process(node.proc.pid).children(recursive=True)]
    finally:
        code = node.close(60)
    assert code == 0, node.log_text()[-4000:]
    deadline = time.monotonic() + 20  # Ray reaps the job's actors once its driver (the supervisor) is gone
    while alive(tree + actors) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive(tree) == [], "lbd processes survived SIGTERM"
    assert alive(actors) == [], "Ray actors (the rank's host or its workers) survived SIGTERM"
