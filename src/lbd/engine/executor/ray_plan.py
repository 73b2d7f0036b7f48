"""What the Ray executor decides from where Ray put a rank's workers. Pure: no ray, no torch.

Ray places one worker actor per bundle of the rank's placement group; each actor reports an ``ActorSite``
(its node, pid, GPU ids, CPUs). From those sites:

* the rank's endpoints (the broadcast, the reply socket and the TCPStore rendezvous, all in the core) are on
  loopback when every worker shares the core's node, else on the core's node address;
* the shared-memory all-reduce is kept only when every worker shares one node (gloo's TCP otherwise);
* each worker's CPUs and threads split its node's CPUs between the rank's workers there (on the core's node
  exactly as the mp executor splits the rank's CPUs);
* on CUDA each worker sees every GPU Ray gave the rank's workers on its node, in world-rank order, and picks
  its own by index (vLLM's Ray executor does the same, so NCCL can use peer-to-peer between them).
"""

from __future__ import annotations

from dataclasses import dataclass

from lbd.engine.config.placement import format_cpus, split_cpus

PLACEMENT_GROUP_ENV = "LBD_RAY_PLACEMENT_GROUP"  # set by --data-parallel-backend ray: the rank's group's name
RAY_NAMESPACE = "lbd"  # the supervisor's namespace too: named placement groups are looked up inside it
FORWARDED_ENV_PREFIXES = ("LBD_", "HF_", "TRITON_", "PYTHON", "NCCL_", "GLOO_", "TORCH_")


@dataclass(frozen=True, slots=True)
class ActorSite:
    """Where one worker actor runs (reported by the actor itself)."""

    node_id: str
    ip: str
    pid: int
    gpu_ids: tuple[str, ...]
    cpus: tuple[int, ...]  # the actor's CPU affinity (its node's CPUs)


@dataclass(frozen=True, slots=True)
class WorkerLaunch:
    """How one actor starts its worker process."""

    cpus: str
    threads: int
    cuda_visible_devices: str | None
    device_index: int | None


def device_resource(device: str, cluster_gpus: float) -> str:
    """The Ray resource of one worker's bundle: GPU on CUDA (and for ``--device auto`` on a cluster with
    GPUs), CPU otherwise."""
    if device == "cuda" or (device == "auto" and cluster_gpus >= 1):
        return "GPU"
    return "CPU"


def bundles(world: int, key: str) -> list[dict[str, float]]:
    return [{key: 1.0} for _ in range(world)]


def bundle_resource(specs: list[dict[str, float]], world: int) -> str:
    """The device resource of a placement group made elsewhere (by ``--data-parallel-backend ray``): its
    first ``world`` bundles must each hold one GPU, or one CPU. Raises ValueError."""
    if len(specs) < world:
        raise ValueError(f"the rank's placement group has {len(specs)} bundles but TP x PP = {world} workers "
                         "need one each")
    for key in ("GPU", "CPU"):
        if all(spec.get(key, 0) >= 1 for spec in specs[:world]):
            return key
    raise ValueError(f"the rank's placement group bundles {specs[:world]} hold neither one GPU nor one CPU "
                     "each")


def one_node(sites: list[ActorSite]) -> bool:
    return len({s.node_id for s in sites}) == 1


def endpoint_host(sites: list[ActorSite], core_node: str, core_ip: str) -> str:
    """Loopback when every worker is on the core's node (nothing is exposed), else the core's node address."""
    return "127.0.0.1" if all(s.node_id == core_node for s in sites) else core_ip


def worker_launches(sites: list[ActorSite], core_node: str, rank_cpus: list[int], rank_threads: int,
                    on_cuda: bool) -> list[WorkerLaunch]:
    """One launch per worker (world-rank order). The workers on the core's node split the rank's CPUs and
    threads; those on another node split the CPUs their actors may use there."""
    by_node: dict[str, list[int]] = {}
    for rank, site in enumerate(sites):
        by_node.setdefault(site.node_id, []).append(rank)
    launches: list[WorkerLaunch | None] = [None] * len(sites)
    for node, members in by_node.items():
        here = node == core_node
        pool = rank_cpus if here else list(sites[members[0]].cpus)
        threads = max(1, (rank_threads if here else len(pool)) // len(members))
        gpus = [gpu for rank in members for gpu in sites[rank].gpu_ids] if on_cuda else []
        visible = ",".join(gpus) if on_cuda else None
        for rank, cpus in zip(members, split_cpus(pool, len(members)), strict=True):
            index = gpus.index(sites[rank].gpu_ids[0]) if on_cuda and sites[rank].gpu_ids else None
            launches[rank] = WorkerLaunch(format_cpus(cpus), threads, visible, index)
    return [launch for launch in launches if launch is not None]


def forwarded_env(env: dict[str, str]) -> dict[str, str]:
    """The core's variables every worker gets too (Ray starts actors with the raylet's environment)."""
    return {k: v for k, v in env.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
