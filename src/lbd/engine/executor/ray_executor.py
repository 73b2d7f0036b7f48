"""``--distributed-executor-backend ray``: the mp executor's contract, with the workers placed by Ray.

The core process joins the Ray cluster (``RAY_ADDRESS``, else a cluster started with ``ray start`` on this
node, else a local cluster it starts itself, which lives and dies with the core: what ``ray.init()`` does
for vLLM), takes a placement group of TP x PP bundles (one GPU each on CUDA, one CPU each otherwise) and
starts one ``WorkerHost`` actor per bundle (``lbd.engine.executor.ray_worker``). The group is

* the rank's own, when ``--data-parallel-backend ray`` placed the rank (the supervisor names it in
  ``LBD_RAY_PLACEMENT_GROUP``; its first TP x PP bundles are the workers', on the rank's node), or
* made here (strategy PACK: one node when one can hold it, spread over nodes when none can), removed at
  close.

Each actor starts the ordinary worker process as its child; from then on everything is the mp executor's:
one ZMQ broadcast of each step (over TCP), the replies on one PULL socket, a TCPStore in the core as the
torch.distributed rendezvous (gloo on the CPU, NCCL on CUDA). The core's sockets and store listen on
loopback when every worker is on the core's node, else on the core's node address (unauthenticated, like
vLLM's: keep the cluster's network private); the shared-memory all-reduce is used only when every worker is
on one node. Across nodes gloo picks its interface from the hostname: set ``GLOO_SOCKET_IFNAME`` (and
``NCCL_SOCKET_IFNAME``) as for vLLM if that is not the cluster's network.

Faults: a thread waits on every actor's ``wait`` call; a worker that exits or an actor that dies (SIGKILL of
its process, its node lost) fails the rank exactly as in mp: the other actors are killed through Ray (their
workers follow by PDEATHSIG) and ``on_failure`` ends the core, so the supervisor restarts the rank whole. The
actors belong to the core's Ray job, so a core that dies any other way takes them with it. Placement waits at
most ``--distributed-timeout-s``; a cluster that is too small for the rank fails at once, naming what is
missing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.placement import rank_cpus, rank_threads
from lbd.engine.executor import ray_plan as RP
from lbd.engine.executor.mp import MultiprocExecutor, WorkerFailure, worker_config

logger = logging.getLogger(__name__)

_ACTOR_CALL_S = 120.0  # an actor's start-up (a fresh Ray worker process) and its answers at start
_POLL_S = 0.5
_SHUTDOWN_S = 5.0  # room for ray.shutdown() of a local cluster (benchmarks/RESULTS.md, "Ray shutdown")


class RayExecutor(MultiprocExecutor):
    def __init__(self, args: EngineArgs, model_path: str,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self.actors: list[Any] = []
        self.sites: list[RP.ActorSite] = []
        self.pids: list[int] = []
        self._waits: dict[Any, int] = {}  # each actor's wait() reference -> its world rank
        self._pg: Any = None
        self._own_pg = False
        self._joined_ray = False  # we called ray.init, so we disconnect (and stop a cluster we started)
        self._ray_watch: RayWatchdog | None = None
        self.device_key = "CPU"
        super().__init__(args, model_path, on_failure)

    # ---- placement ---------------------------------------------------------------------------------------
    def _endpoints(self) -> tuple[str, str, str]:
        import ray

        self._join_ray()
        world = self.layout.world_size
        self._pg = self._placement_group(world)
        self.actors = [self._actor(i) for i in range(world)]
        self.sites = self._ask(ray, [a.site.remote() for a in self.actors], "reporting where it runs")
        here = ray.get_runtime_context().get_node_id()
        host = RP.endpoint_host(self.sites, here, ray.util.get_node_ip_address())
        logger.info("Ray placed the rank's %d workers: %s", world, ", ".join(
            f"worker {r} on {s.ip} (actor pid {s.pid}, GPU {','.join(s.gpu_ids) or '-'})"
            for r, s in enumerate(self.sites)))
        return f"tcp://{host}:*", f"tcp://{host}:*", host

    def _join_ray(self) -> None:
        import ray

        if ray.is_initialized():  # the caller's connection (tests, or an embedding application)
            return
        address = os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, namespace=RP.RAY_NAMESPACE, configure_logging=False)
        self._joined_ray = True

    def _placement_group(self, world: int) -> Any:
        import ray
        from ray.util.placement_group import placement_group

        name = os.environ.get(RP.PLACEMENT_GROUP_ENV)
        if name:  # --data-parallel-backend ray placed this rank: its workers take the rank's bundles
            pg = ray.util.get_placement_group(name)
            try:
                self.device_key = RP.bundle_resource(pg.bundle_specs, world)
            except ValueError as e:
                raise WorkerFailure(f"{e} ({RP.PLACEMENT_GROUP_ENV}={name})") from None
            logger.info("workers go into the rank's placement group %s", name)
        else:
            self.device_key = RP.device_resource(self.args.device, ray.cluster_resources().get("GPU", 0.0))
            have = ray.cluster_resources().get(self.device_key, 0.0)
            if have < world:
                raise WorkerFailure(
                    f"the Ray cluster has {have:g} {self.device_key} in all but --tensor-parallel-size "
                    f"{self.layout.tp_size} x --pipeline-parallel-size {self.layout.pp_size} needs {world} "
                    f"(one per worker): add nodes to the cluster or lower the sizes")
            pg = placement_group(RP.bundles(world, self.device_key), strategy="PACK",
                                 name=f"lbd-exec-{socket.gethostname()}-{os.getpid()}")
            self._own_pg = True
        self._pg = pg
        if not self._ready(pg, self.timeout_s):
            raise WorkerFailure(f"Ray could not place the rank's {world} {self.device_key} bundles within "
                                f"--distributed-timeout-s {self.timeout_s:g} (free: "
                                f"{ray.available_resources()}): free resources or add nodes")
        return pg

    @staticmethod
    def _ready(pg: Any, timeout_s: float) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(pg.ready(), timeout=timeout_s)
            return True
        except GetTimeoutError:
            return False

    def _actor(self, bundle: int) -> Any:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from lbd.engine.executor.ray_worker import WorkerHost

        gpu = self.device_key == "GPU"
        env = RP.forwarded_env(dict(os.environ))  # PYTHONPATH too: the actor imports lbd.engine.executor
        return ray.remote(WorkerHost).options(
            num_cpus=0 if gpu else 1, num_gpus=1 if gpu else 0, max_restarts=0, max_task_retries=0,
            runtime_env={"env_vars": env} if env else None,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=bundle)).remote()

    def _ask(self, ray: Any, refs: list[Any], what: str) -> list[Any]:
        from ray.exceptions import GetTimeoutError, RayActorError

        try:
            return ray.get(refs, timeout=_ACTOR_CALL_S)
        except (RayActorError, GetTimeoutError) as e:
            raise WorkerFailure(f"a worker's Ray actor failed while {what}: "
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None

    # ---- the workers ---------------------------------------------------------------------------------------
    def _worker_config(self, model_path: str, store: tuple[str, int]) -> dict[str, object]:
        device = "cuda" if self.device_key == "GPU" else "cpu"  # what Ray reserved, not what a node has
        return worker_config(dataclasses.replace(self.args, device=device), model_path, store)

    def _launch(self, bcast: str, reply: str) -> None:
        import ray

        here = ray.get_runtime_context().get_node_id()
        threads = rank_threads(self.parallel.data_parallel_size_local, self.parallel.data_parallel_size)
        launches = RP.worker_launches(self.sites, here, rank_cpus(), threads, self.device_key == "GPU")
        shm = {} if RP.one_node(self.sites) else {"LBD_SHM_ALLREDUCE": "0"}  # gloo between nodes
        calls = []
        for plan, launch, actor in zip(self.plans, launches, self.actors, strict=True):
            argv = ["--rank", str(plan.world_rank), "--tp-rank", str(plan.tp_rank), "--pp-rank",
                    str(plan.pp_rank), "--cpus", launch.cpus, "--broadcast", bcast, "--results", reply]
            env = {**RP.forwarded_env(dict(os.environ)), **shm, "OMP_NUM_THREADS": str(launch.threads)}
            if launch.cuda_visible_devices is not None:
                argv += ["--device-index", str(launch.device_index)]
                env["CUDA_VISIBLE_DEVICES"] = launch.cuda_visible_devices
            calls.append(actor.start.remote(argv, env))
        self.pids = self._ask(ray, calls, "starting its worker")
        self._waits = {actor.wait.remote(): rank for rank, actor in enumerate(self.actors)}

    def _watch(self) -> None:
        self._ray_watch = RayWatchdog(self, self._fail)
        self._ray_watch.start()

    def _stop_watch(self) -> None:
        if self._ray_watch is not None:
            self._ray_watch.stop()

    def _dead_worker(self, timeout_s: float = 0.0) -> str | None:
        import ray

        if not self._waits or not ray.is_initialized():
            return None
        done, _ = ray.wait(list(self._waits), num_returns=1, timeout=timeout_s)
        return self._describe(done[0]) if done else None

    def _describe(self, ref: Any) -> str:
        """Why the worker behind ``ref`` (its actor's finished ``wait``) is gone."""
        import ray
        from ray.exceptions import RayError

        rank = self._waits[ref]
        site, plan = self.sites[rank], self.plans[rank]
        who = (f"worker {rank} (pid {self.pids[rank] if rank < len(self.pids) else '?'}, TP rank "
               f"{plan.tp_rank}, PP rank {plan.pp_rank}, node {site.ip})")
        try:
            code = int(ray.get(ref, timeout=_POLL_S))
        except RayError as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return f"{who}: its Ray actor (pid {site.pid}) died ({type(e).__name__}: {first[:200]})"
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"{who} {how}"

    def _kill_workers(self) -> None:
        """Kill every actor (their workers follow), remove a placement group we made, and leave a Ray we
        joined: a local cluster we started stops cleanly here, also on the failure path (a core that is
        SIGKILLed takes the cluster's GCS and raylet with it, but Ray's agents then linger for minutes:
        benchmarks/RESULTS.md, "Ray shutdown")."""
        import ray

        if not ray.is_initialized():
            return
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        if self._own_pg and self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self._pg)
        if self._joined_ray:  # bounded: on the failure path the core must exit (and answer 503) promptly
            leaving = threading.Thread(target=ray.shutdown, name="ray-shutdown", daemon=True)
            leaving.start()
            leaving.join(_SHUTDOWN_S)

    def _stop_workers(self, grace_s: float) -> None:
        """After the shutdown broadcast: wait up to ``grace_s`` for the workers, then kill the rest."""
        import ray

        if self._waits and ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.wait(list(self._waits), num_returns=len(self._waits), timeout=grace_s)
        self._kill_workers()

    def worker_pids(self) -> list[int]:
        return list(self.pids)

    def actor_pids(self) -> list[int]:
        return [s.pid for s in self.sites]


class RayWatchdog(threading.Thread):
    """Waits on every actor's ``wait`` call; the first that ends (worker exit or actor death) is reported."""

    def __init__(self, executor: RayExecutor, report: Callable[[str], None]) -> None:
        super().__init__(name="ray-executor-watchdog", daemon=True)
        self.executor, self.report = executor, report
        self._stopped = threading.Event()

    def run(self) -> None:
        while not self._stopped.is_set():
            try:
                reason = self.executor._dead_worker(_POLL_S)
            except Exception as e:  # Ray itself is gone (its raylet or GCS died): the rank cannot go on
                if self._stopped.is_set():
                    return
                reason = f"lost the Ray cluster: {type(e).__name__}: {e}"
            if reason is not None and not self._stopped.is_set():
                self.report(reason)
                return

    def stop(self) -> None:
        self._stopped.set()
        if self.is_alive():
            self.join(2 * _POLL_S + 1)
