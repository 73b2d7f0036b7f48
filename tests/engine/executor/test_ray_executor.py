"""``--distributed-executor-backend ray``: a TP=2 rank whose workers Ray places gives TP=1's tokens, and a
worker actor killed by SIGKILL fails the rank with nothing of it (or of Ray) left behind.

The fast tests check what the executor decides from where Ray put the workers (``ray_plan``, pure). The slow
ones start a real local Ray cluster (``ray.init(address="local", num_cpus=2)``) from this process while its
main thread sits in a network namespace of its own (only loopback), so Ray binds 127.0.0.1 and no test
traffic leaves the namespace; the cluster is shut down and the namespace deleted at the end, and the test
checks no Ray process survived. Cost here: ~1 s fast; the slow module ~60-160 s on a loaded 2-core machine
(Ray's start-up dominates: 20-40 s).

``RAY_AUTH_MODE=disabled``: Ray 2.60's ``ray.init()`` otherwise writes ``~/.ray/auth_token`` when it starts
a cluster, after which every ``ray start`` on the machine turns token auth on and clients without
``RAY_AUTH_MODE=token`` are refused (other tests' clusters among them).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from lbd.engine.executor import ray_plan as RP
from lbd.engine.executor.mp import WorkerFailure
from lbd.wire.core_messages import EngineCoreRequest
from support import make_tiny_llama
from support.parity import assert_all_close, greedy, parallel_core, parallel_scenario

_CLONE_NEWNET = 0x40000000
NO_AUTH = ("RAY_AUTH_MODE", "disabled")  # see the module's docstring


def _site(node: str, pid: int, gpus: tuple[str, ...] = (),
          cpus: tuple[int, ...] = (0, 1, 2, 3)) -> RP.ActorSite:
    return RP.ActorSite(node, f"10.0.0.{ord(node[-1]) % 50}", pid, gpus, cpus)


# ---- fast: what follows from the placement ---------------------------------------------------------------
def test_one_node_keeps_loopback_and_the_mp_split() -> None:
    sites = [_site("A", 1), _site("A", 2)]
    assert RP.endpoint_host(sites, "A", "10.0.0.5") == "127.0.0.1" and RP.one_node(sites)
    launches = RP.worker_launches(sites, "A", [0, 1, 2, 3], 4, on_cuda=False)
    assert [(w.cpus, w.threads, w.cuda_visible_devices) for w in launches] == [
        ("0-1", 2, None), ("2-3", 2, None)]  # as plan_workers splits the rank's CPUs for mp


def test_spanning_nodes_uses_the_core_address_and_each_nodes_own_gpus() -> None:
    sites = [_site("A", 1, ("3",)), _site("A", 2, ("1",)), _site("B", 3, ("0",), (0, 1, 2, 3, 4, 5)),
             _site("B", 4, ("1",), (0, 1, 2, 3, 4, 5))]
    assert RP.endpoint_host(sites, "A", "10.0.0.5") == "10.0.0.5" and not RP.one_node(sites)
    launches = RP.worker_launches(sites, "A", [0, 1], 2, on_cuda=True)
    assert [(w.cuda_visible_devices, w.device_index) for w in launches] == [
        ("3,1", 0), ("3,1", 1), ("0,1", 0), ("0,1", 1)]  # each node's GPUs in world-rank order
    assert [(w.cpus, w.threads) for w in launches] == [("0", 1), ("1", 1), ("0-2", 3), ("3-5", 3)]
    # the core's node is not necessarily one of the workers': every worker then reaches its address
    assert RP.endpoint_host(sites[2:], "A", "10.0.0.5") == "10.0.0.5"


def test_bundles_follow_the_device() -> None:
    assert RP.device_resource("cuda", 0) == "GPU" and RP.device_resource("auto", 8) == "GPU"
    assert RP.device_resource("auto", 0) == "CPU" and RP.device_resource("cpu", 8) == "CPU"
    assert RP.bundles(2, "CPU") == [{"CPU": 1.0}, {"CPU": 1.0}]
    # a placement group --data-parallel-backend ray made: device bundles, then the rank host's CPU bundle
    assert RP.bundle_resource([{"GPU": 1, "node:x": 0.001}, {"GPU": 1}, {"CPU": 1}], 2) == "GPU"
    with pytest.raises(ValueError, match="has 1 bundles but TP x PP = 2"):
        RP.bundle_resource([{"CPU": 1}], 2)
    env = {"PYTHONPATH": "/x", "LBD_A": "1", "HOME": "/root", "GLOO_SOCKET_IFNAME": "e"}
    assert RP.forwarded_env(env) == {"PYTHONPATH": "/x", "LBD_A": "1", "GLOO_SOCKET_IFNAME": "e"}


# ---- slow: a real local Ray cluster -----------------------------------------------------------------------
def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, _CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), "setns failed")


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


@pytest.fixture(scope="module")
def local_ray() -> Iterator[object]:
    """A local Ray cluster of 2 CPUs started by this process inside a fresh network namespace."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'lbd[ray]')")
    from support.netns import Namespaces, unavailable

    if unavailable():
        pytest.skip(f"no network namespaces: {unavailable()}")
    auth = os.environ.get(NO_AUTH[0])
    os.environ[NO_AUTH[0]] = NO_AUTH[1]
    nets = Namespaces()
    ns = nets.add("rx")
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    try:
        with open(f"/var/run/netns/{ns}") as f:
            _setns(f.fileno())  # this thread (and what it starts: Ray's processes) sees only loopback
        ray.init(address="local", num_cpus=2, include_dashboard=False, namespace=RP.RAY_NAMESPACE,
                 configure_logging=False)
        assert ray.util.get_node_ip_address() == "127.0.0.1"
        yield ray
    finally:
        started = [p.pid for p in psutil.Process().children(recursive=True) if p.pid not in before]
        with contextlib.suppress(Exception):
            ray.shutdown()
        psutil.wait_procs([psutil.Process(p) for p in _alive(started)], timeout=15)
        left = _alive(started)
        _setns(home)
        os.close(home)
        nets.close()
        if auth is None:
            os.environ.pop(NO_AUTH[0], None)
        else:
            os.environ[NO_AUTH[0]] = auth
        assert left == [], f"Ray processes survived ray.shutdown(): {left}"


@pytest.fixture(scope="module")
def kv2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ray-exec") / "kv2", layers=4, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def ray_core(local_ray: object, kv2: Path) -> Iterator[object]:
    core = parallel_core(kv2, 2, distributed_executor_backend="ray")
    yield core
    core.close()


@pytest.mark.slow
def test_ray_tp2_tokens_equal_tp1(kv2: Path, ray_core) -> None:  # noqa: ANN001
    runner = ray_core.runner
    assert type(runner).__name__ == "RayExecutor" and len(runner.worker_pids()) == 2
    actors = [psutil.Process(p) for p in runner.actor_pids()]
    for pid, actor in zip(runner.worker_pids(), actors, strict=True):  # each worker is its actor's child
        assert psutil.Process(pid).ppid() == actor.pid
        assert "lbd.engine.executor.worker" in " ".join(psutil.Process(pid).cmdline())
    ref_core = parallel_core(kv2)
    ref = parallel_scenario(ref_core, ref_core.runner.vocab_size)
    ours = parallel_scenario(ray_core, runner.vocab_size)
    assert_all_close(ours[:-2], ref[:-2])
    assert [r.tokens for r in ours[-2:]] == [r.tokens for r in ref[-2:]]  # seeded sampling with penalties


@pytest.mark.slow
def test_sigkill_of_a_worker_actor_fails_the_rank(ray_core, local_ray) -> None:  # noqa: ANN001
    """SIGKILL of one actor's process: its worker follows (PDEATHSIG), the watchdog kills the other actor
    through Ray (its worker follows), and the next step raises. In a core process ``run_core`` exits there,
    so the supervisor restarts the rank (as for mp: tests/supervisor/test_parallel.py)."""
    runner = ray_core.runner
    pids, actors = runner.worker_pids(), runner.actor_pids()
    os.kill(actors[1], signal.SIGKILL)
    deadline = time.monotonic() + 30
    while runner.failure is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runner.failure is not None and f"pid {actors[1]}" in runner.failure, runner.failure
    assert "worker 1" in runner.failure and "Ray actor" in runner.failure
    psutil.wait_procs([psutil.Process(p) for p in _alive(pids + actors)], timeout=20)
    assert _alive(pids + actors) == []
    ray_core.add_request(EngineCoreRequest("late", [5, 6, 7], greedy(2), None, 0.0))
    with pytest.raises(WorkerFailure, match="Ray actor"):
        ray_core.step()
    ray_core.close()
    deadline = time.monotonic() + 20  # the rank's placement group is gone, its CPUs free again
    while local_ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert local_ray.available_resources().get("CPU", 0) == 2
