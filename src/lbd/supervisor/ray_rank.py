"""Ranks placed by Ray (``--data-parallel-backend ray``): one placement group per DP rank, the rank's engine
server a child process of a Ray actor in that group.

The supervisor keeps its whole lifecycle (probes, restarts with backoff, drains, the health port, /status):
only *where* a rank's process runs changes. Each incarnation of a rank is a fresh `RankHost` actor scheduled
into the rank's placement group; the actor starts the engine with `RankProcess` (own process group,
PR_SET_PDEATHSIG towards the actor) on a free port of its node and reports (pid, node address, port). A rank
that exits, or whose actor dies, is a rank failure like any other: the worker stops what is left (the actor
is killed through Ray) and starts a new actor after its backoff. Actors and placement groups belong to this
job (never detached), so Ray removes them when the supervisor exits, even by SIGKILL, and the engines follow
their actor through PDEATHSIG.

Placement follows vLLM's ``VLLM_RAY_DP_PACK_STRATEGY`` over Ray's live nodes, this node first: each rank
needs tensor x pipeline parallel size device bundles (GPU on CUDA, CPU otherwise) on one node
(STRICT_PACK); ``strict`` puts exactly ``--data-parallel-size-local`` ranks on each node it uses and skips
nodes with less room, ``fill`` puts that many on this node and as many as fit on the others. Bundles carry
Ray's ``node:<ip>`` resource to pin the planned node; a group that cannot be placed for ``REPLACE_AFTER_S``
(its node is gone) is created again without the pin, wherever it fits.

With ``--distributed-executor-backend ray`` the rank hands its placement over: no device leases, the host
actor takes no CPU of its own (on the CPU), and the engine gets the cluster's address and its group's name
(``LBD_RAY_PLACEMENT_GROUP``), so the engine's Ray executor starts one worker actor in each of the group's
TP x PP device bundles (``lbd.engine.executor.ray_executor``).

Only imported when that backend is chosen: nothing else in the supervisor or the router imports ray.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import Any

from lbd.supervisor.config import RankSpec, SupervisorConfig
from lbd.supervisor.process import RankProcess
from lbd.wire.status import WorkerProcess

log = logging.getLogger("lbd.supervisor")

PLACEMENT_TIMEOUT_S = 120.0  # at start: every group placed within this, or exit 2 with what is missing
REPLACE_AFTER_S = 60.0  # later: a group unplaceable this long (its node died) is re-created unpinned
ACTOR_CALL_TIMEOUT_S = 60.0  # starting an engine process inside a placed actor
FORWARDED_ENV_PREFIXES = ("LBD_", "HF_", "TRITON_", "OMP_", "PYTHON")  # driver -> every rank's engine
# --distributed-executor-backend ray: the rank's placement group, by name, for the engine's own Ray workers
# (lbd.engine.executor.ray_plan.PLACEMENT_GROUP_ENV; the supervisor does not import the engine's executor)
RAY_PLACEMENT_GROUP_ENV = "LBD_RAY_PLACEMENT_GROUP"


class PlacementError(Exception):
    """The Ray cluster cannot hold the group (or is not there): one line, exit 2."""


@dataclass(slots=True, frozen=True)
class RayNode:
    node_id: str
    ip: str
    devices: float  # this node's total of the rank's device resource (GPU or CPU)


def plan_ranks(nodes: list[RayNode], n: int, per_node: int, world: int, strategy: str,
               device_key: str) -> list[RayNode]:
    """The node of every rank 0..n-1; ``nodes[0]`` is this (the driver's) node. Raises PlacementError."""
    def room(node: RayNode) -> int:
        return int(node.devices // world)

    if not nodes:
        raise PlacementError("the Ray cluster has no live node")
    head = nodes[0]
    if room(head) < min(per_node, n):
        raise PlacementError(
            f"this Ray node ({head.ip}) has {head.devices:g} {device_key} but "
            f"--data-parallel-size-local {per_node} ranks x {world} {device_key} each need "
            f"{per_node * world}: lower --data-parallel-size-local or add {device_key}s to this node")
    plan: list[RayNode] = []
    for i, node in enumerate(nodes):
        if i == 0 or strategy == "strict":
            take = per_node if room(node) >= per_node else 0
        else:  # fill
            take = room(node)
        plan += [node] * min(take, n - len(plan))
        if len(plan) == n:
            return plan
    have = ", ".join(f"{nd.ip}: {nd.devices:g}" for nd in nodes)
    raise PlacementError(
        f"the Ray cluster has room for {len(plan)} of --data-parallel-size {n} ranks "
        f"({world} {device_key} each, --ray-dp-pack-strategy {strategy}, {device_key} per node: {have}): "
        "add nodes, lower --data-parallel-size, or use --ray-dp-pack-strategy fill")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RankHost:
    """A Ray actor (async) that runs one incarnation of a rank's engine server on the node it was put on."""

    def __init__(self) -> None:
        self.proc: RankProcess | None = None

    async def start(self, spec: RankSpec, ranks_on_node: int,
                    cuda_devices: str | None) -> tuple[int, str, int]:
        import ray

        ip = ray.util.get_node_ip_address()
        port = _free_port(ip)
        # argparse keeps the last value: this node's host and port, and its share of the node's CPU threads
        spec.argv = [sys.executable, *spec.argv[1:], "--host", ip, "--port", str(port),
                     "--data-parallel-size-local", str(ranks_on_node)]
        spec.port, spec.probe_host, spec.bind_host = port, ip, ip
        if cuda_devices is not None:
            spec.env = {**spec.env, "CUDA_VISIBLE_DEVICES": cuda_devices}
        self.proc = await RankProcess.start(spec)
        return self.proc.pid, ip, port

    async def wait(self) -> int:
        assert self.proc is not None
        return await self.proc.wait()

    async def stop(self, grace_s: float) -> int | None:
        return await self.proc.stop(grace_s) if self.proc is not None else None

    async def kill_tree(self) -> None:
        if self.proc is not None:
            await self.proc.kill_tree()


class DeviceLease:
    """Holds one GPU bundle of a rank's placement group and tells its id (the rank's engine uses it)."""

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(i) for i in ray.get_gpu_ids()]


class RayRank:
    """The supervisor's handle on a Ray-placed incarnation (the RankHandle protocol of .rank)."""

    def __init__(self, actor: Any, leases: list[Any], pid: int) -> None:
        self.actor, self.leases, self.pid = actor, leases, pid

    def workers(self) -> list[WorkerProcess]:
        """The rank's TP/PP worker processes for /status: none listed here (they run on the rank's Ray node,
        or as Ray actors with --distributed-executor-backend ray, not in this machine's process tree)."""
        return []

    async def wait(self) -> int:
        from ray.exceptions import RayActorError

        try:
            return int(await self.actor.wait.remote())
        except RayActorError as e:
            log.warning("Ray actor of pid %d died: %s", self.pid, str(e).splitlines()[0] if str(e) else e)
            return -int(signal.SIGKILL)

    async def stop(self, grace_s: float) -> int | None:
        from ray.exceptions import RayActorError

        try:
            return await asyncio.wait_for(self.actor.stop.remote(grace_s), grace_s + ACTOR_CALL_TIMEOUT_S)
        except (RayActorError, TimeoutError):
            return None
        finally:
            self._release()

    async def kill_tree(self) -> None:
        from ray.exceptions import RayActorError

        with contextlib.suppress(RayActorError, TimeoutError):
            await asyncio.wait_for(self.actor.kill_tree.remote(), ACTOR_CALL_TIMEOUT_S)
        self._release()

    def _release(self) -> None:
        import ray

        for actor in (self.actor, *self.leases):
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)


class RayPlacement:
    """The group's placement groups on the Ray cluster; `start` is the supervisor's StartRank for Ray."""

    def __init__(self, cfg: SupervisorConfig) -> None:
        self.cfg = cfg
        self.device_key = "CPU"
        self.groups: dict[int, Any] = {}  # rank -> its placement group
        self.nodes: dict[int, RayNode] = {}  # rank -> the node it was planned on
        self.pinned: dict[int, bool] = {}
        self._lock = asyncio.Lock()
        self._tag = f"{socket.gethostname()}-{os.getpid()}"

    # ---- start-up (synchronous, before the event loop: failures exit 2) ----------------------------------
    def setup(self) -> None:
        import ray

        address = os.environ.get("RAY_ADDRESS") or "auto"
        env = {k: v for k, v in os.environ.items() if k == "PYTHONPATH"}
        try:
            ray.init(address=address, namespace="lbd", log_to_driver=True, configure_logging=False,
                     runtime_env={"env_vars": env} if env else None)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise PlacementError(f"no Ray cluster at {address!r} ({str(e).splitlines()[0]}): start one with "
                                 "`ray start --head` on this node, or set RAY_ADDRESS") from None
        self.device_key = self._device_key()
        nodes = self._nodes(self.device_key)
        world = self.cfg.devices_per_rank
        plan = plan_ranks(nodes, self.cfg.dp_size, self.cfg.ranks_per_node, world,
                          self.cfg.ray_pack_strategy, self.device_key)
        for spec, node in zip(self.cfg.ranks, plan, strict=True):
            self.nodes[spec.rank] = node
            self.groups[spec.rank] = self._group(spec.rank, node)
        pending = [r for r, pg in self.groups.items() if not self._wait_ready(pg, PLACEMENT_TIMEOUT_S)]
        if pending:
            raise PlacementError(f"Ray could not place ranks {pending} within {PLACEMENT_TIMEOUT_S:g} s "
                                 f"(free: {ray.available_resources()}): free resources or add nodes")
        log.info("Ray placed %d ranks (%s, %s x %d each): %s", len(plan), self.cfg.ray_pack_strategy,
                 self.device_key, world, ", ".join(f"rank {r} on {nd.ip}" for r, nd in self.nodes.items()))

    @staticmethod
    def _nodes(key: str) -> list[RayNode]:
        """Live nodes with their total of ``key``, this (the driver's) node first."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        nodes = [RayNode(nd["NodeID"], nd["NodeManagerAddress"], float(nd.get("Resources", {}).get(key, 0.0)))
                 for nd in ray.nodes() if nd.get("Alive")]
        return sorted(nodes, key=lambda nd: nd.node_id != here)

    def _device_key(self) -> str:
        """GPU bundles on CUDA (and for --device auto on a cluster with GPUs), CPU bundles otherwise."""
        if self.cfg.device == "cuda":
            return "GPU"
        if self.cfg.device == "auto" and any(nd.devices for nd in self._nodes("GPU")):
            return "GPU"
        return "CPU"

    def _bundles(self, node: RayNode | None) -> list[dict[str, float]]:
        pin = {f"node:{node.ip}": 0.001} if node is not None else {}
        devices = [{self.device_key: 1.0, **pin} for _ in range(self.cfg.devices_per_rank)]
        if self.device_key == "GPU":  # the actor's own CPU, beside the rank's GPUs (as vLLM's engine actor)
            devices.append({"CPU": 1.0, **pin})
        return devices

    def _group(self, rank: int, node: RayNode | None) -> Any:
        from ray.util.placement_group import placement_group

        self.pinned[rank] = node is not None
        return placement_group(self._bundles(node), strategy="STRICT_PACK", name=self._group_name(rank))

    def _group_name(self, rank: int) -> str:
        """Unique per supervisor, so deployments sharing a cluster never look up each other's groups."""
        return f"lbd-dp-rank-{rank}-{self._tag}"

    @staticmethod
    def _wait_ready(pg: Any, timeout: float) -> bool:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            ray.get(pg.ready(), timeout=timeout)
            return True
        except GetTimeoutError:
            return False

    # ---- one incarnation ------------------------------------------------------------------------------
    async def start(self, spec: RankSpec) -> RayRank:
        """Start the rank in a new actor of its placement group (OSError: the worker backs off, retries)."""
        import ray
        from ray.exceptions import RayActorError
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = await self._placed(spec.rank)
        world = self.cfg.devices_per_rank
        spec.env = {**forwarded_env(dict(os.environ)), **spec.env}

        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)

        leases: list[Any] = []
        ray_workers = self.cfg.executor_backend == "ray"
        if ray_workers:  # the engine's Ray executor puts its workers into this group's device bundles
            spec.env = {**spec.env, "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
                        RAY_PLACEMENT_GROUP_ENV: self._group_name(spec.rank)}
        try:
            cuda = None
            if self.device_key == "GPU" and not ray_workers:
                leases = [ray.remote(DeviceLease).options(num_gpus=1, num_cpus=0,
                                                          scheduling_strategy=in_bundle(i)).remote()
                          for i in range(world)]
                ids = await asyncio.wait_for(asyncio.gather(*(a.gpu_ids.remote() for a in leases)),
                                             ACTOR_CALL_TIMEOUT_S)
                cuda = ",".join(i for group in ids for i in group)
            host_bundle = world if self.device_key == "GPU" else 0
            host_cpus = 0 if ray_workers and self.device_key == "CPU" else 1  # bundle 0's CPU: worker 0's
            actor = ray.remote(RankHost).options(num_cpus=host_cpus, max_restarts=0,
                                                 scheduling_strategy=in_bundle(host_bundle)).remote()
            started = await asyncio.wait_for(actor.start.remote(spec, self._ranks_on(spec.rank), cuda),
                                             ACTOR_CALL_TIMEOUT_S)
        except (RayActorError, TimeoutError) as e:
            for a in leases:
                ray.kill(a, no_restart=True)
            raise OSError(f"Ray could not start the rank's actor: {type(e).__name__}: {e}") from None
        pid, ip, port = started
        spec.port, spec.probe_host, spec.bind_host = port, ip, ip  # the actor set its own copy
        spec.devices = cuda
        return RayRank(actor, leases, pid)

    async def _placed(self, rank: int) -> Any:
        """The rank's placement group once placed; one whose node is gone is made again, unpinned."""
        async with self._lock:
            pg = self.groups[rank]
            loop = asyncio.get_running_loop()
            ready = await loop.run_in_executor(None, self._wait_ready, pg, REPLACE_AFTER_S)
            if ready:
                return pg
            from ray.util.placement_group import remove_placement_group

            node = self.nodes.get(rank)
            log.warning("rank %d: its Ray placement group (node %s) is not placeable for %.0f s; placing it "
                        "again wherever it fits", rank, node.ip if node else "?", REPLACE_AFTER_S)
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
            self.groups[rank] = pg = self._group(rank, None)
        if not await asyncio.get_running_loop().run_in_executor(None, self._wait_ready, pg, REPLACE_AFTER_S):
            raise OSError(f"Ray has no room for rank {rank} (free: {_free_resources()})")
        return pg

    def _ranks_on(self, rank: int) -> int:
        node = self.nodes.get(rank)
        if node is None or not self.pinned.get(rank):
            return 1
        return sum(1 for nd in self.nodes.values() if nd == node)

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for pg in self.groups.values():
            with contextlib.suppress(Exception):
                remove_placement_group(pg)
        with contextlib.suppress(Exception):
            ray.shutdown()


def _free_resources() -> object:
    import ray

    with contextlib.suppress(Exception):
        return ray.available_resources()
    return "unknown"


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    """Variables of the driver every rank's engine gets too (Ray workers start with the raylet's env)."""
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
