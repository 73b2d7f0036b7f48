"""`lbd serve --data-parallel-backend ray`: four ranks placed on a local Ray cluster behind one port.

The Ray cluster runs inside a network namespace of its own (only loopback), so all of its traffic and the
ranks' stays there; it is torn down by process group, and the test checks that nothing of lbd or Ray is left.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
from deploy_harness import SIM_FLAGS, ServeNode, complete, rank_urls, successes

from netns import Namespaces, unavailable

pytest.importorskip("ray", reason="ray is not installed (pip install 'lbd[ray]')")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(bool(unavailable()), reason=f"no network namespaces: {unavailable()}")]
GCS_PORT = 26379


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[tuple[Namespaces, str]]:
    nets = Namespaces()
    temp = tempfile.mkdtemp(prefix="lbdray")  # short: Ray's unix socket paths must fit 107 bytes
    ray = str(Path(sys.executable).with_name("ray"))
    try:
        ns = nets.add("r")
        head = nets.spawn(ns, [ray, "start", "--head", "--block", "--temp-dir", temp, "--num-cpus", "4",
                               "--disable-usage-stats", "--include-dashboard=false", "--port", str(GCS_PORT)],
                          tmp_path / "ray.log")

        def gcs_up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", GCS_PORT)) == 0

        deadline = time.monotonic() + 90
        while not nets.call(ns, gcs_up):
            log = (tmp_path / "ray.log").read_text()[-3000:]
            assert head.poll() is None and time.monotonic() < deadline, log
            time.sleep(0.5)
        yield nets, ns
        group = [p.pid for p in psutil.process_iter() if _pgid(p.pid) == head.pid]
        os.killpg(head.pid, signal.SIGTERM)
        time.sleep(3)
        os.killpg(head.pid, signal.SIGKILL)
        time.sleep(1)
        assert _alive(group) == [], "Ray processes survived the cluster's teardown"
    finally:
        nets.close()
        shutil.rmtree(temp, ignore_errors=True)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def test_four_ranks_on_ray_behind_one_port(ray_cluster: tuple[Namespaces, str], tiny_llama: Path,
                                           tmp_path: Path) -> None:
    nets, ns = ray_cluster
    node = ServeNode(["--model", str(tiny_llama), *SIM_FLAGS, "--data-parallel-backend", "ray",
                      "--data-parallel-size", "4", "--api-server-count", "2",
                      "--dp-supervisor-probe-interval-s", "0.5", "--restart-backoff-initial-s", "0.5"],
                     tmp_path / "serve.log", nets, ns, env={"RAY_ADDRESS": f"127.0.0.1:{GCS_PORT}"})
    try:
        node.wait_ready(180)
        node.wait_for(lambda: node.get(node.api + "/readyz").status_code == 200, 30, "router /readyz")
        status = node.status()
        urls = rank_urls(status)
        assert sorted(urls) == [0, 1, 2, 3] and status["deployment"]["router"]["workers"] == 2

        def burst(n: int) -> list[int]:
            with ThreadPoolExecutor(n) as pool:
                return list(pool.map(lambda _: complete(node.api, max_tokens=16).status_code, range(n)))

        before = node.call(lambda: {r: successes(u) for r, u in urls.items()})
        assert node.call(burst, 16) == [200] * 16
        after = node.call(lambda: {r: successes(u) for r, u in urls.items()})
        assert all(after[r] > before[r] for r in urls), (before, after)

        victim = next(r for r in status["ranks"] if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGKILL)
        assert node.call(burst, 8) == [200] * 8  # the others serve (the router retries around rank 1)
        node.wait_for(lambda: (r := node.status()["ranks"][1])["restarts"] == 1 and r["state"] == "ready"
                      and r["pid"] != victim["pid"], 90, "rank 1 restarted through Ray")
        assert [r["restarts"] for r in node.status()["ranks"]] == [0, 1, 0, 0]
        node.wait_for(lambda: [e["state"] for e in node.router_status()["endpoints"]] == ["ready"] * 4, 30,
                      "the router over 4 ready ranks")
        assert node.call(burst, 8) == [200] * 8
        tree = [p.pid for p in psutil.Process(node.proc.pid).children(recursive=True)]

        def rank_hosts() -> list[int]:
            return [p.pid for p in psutil.process_iter() if "RankHost" in " ".join(_cmdline(p))]

        # ray.kill only asks the raylet to end rank 1's old actor: on a loaded host it can outlive the restart
        # by a few seconds, but it must go (a leaked actor keeps this count at 5 and fails here)
        node.wait_for(lambda: len(rank_hosts()) == 4, 30, "rank 1's old Ray actor to exit")
        actors = rank_hosts()
    finally:
        code = node.close(60)
    assert code == 0, node.log_text()[-4000:]
    time.sleep(2)  # Ray reaps the job's actors once its driver (the supervisor) is gone
    assert _alive(tree) == [], "lbd processes survived SIGTERM"
    assert _alive(actors) == [], "the job's Ray actors (and their engines) survived SIGTERM"


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []
