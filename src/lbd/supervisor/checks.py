"""`lbd supervise`'s checks of its flags against each other and this machine, before anything starts: the
DP topology (mp or Ray), the rank ports, the KV-event endpoints, the model's config.json and the rank program.
Each raises SupervisorArgError with one line that names the flag and the fix.
"""

from __future__ import annotations

import argparse

from lbd.common.ports import port_in_use
from lbd.engine.config.architectures import is_moe
from lbd.engine.config.layout import parse_partition
from lbd.engine.config.parallel import (
    ParallelConfigError,
    check_model,
    dense_model_flags_problem,
    model_facts,
)
from lbd.supervisor.engines import check_executable
from lbd.supervisor.flags import SupervisorArgError


def topology(ns: argparse.Namespace) -> tuple[int, int, int, int]:
    """(DP size, ranks per node, ranks here, first rank here), for mp or for Ray (which runs the whole group
    from this supervisor; each rank's port and host come from its placement)."""
    ray = ns.data_parallel_backend == "ray"
    if not ray and ns.ray_dp_pack_strategy != "strict":
        raise SupervisorArgError(f"--ray-dp-pack-strategy {ns.ray_dp_pack_strategy} places ranks on Ray "
                                 "nodes and does nothing with --data-parallel-backend mp: add "
                                 "--data-parallel-backend ray, or drop the flag")
    if ray:
        (n, per_node), local, start = _ray_topology(ns), ns.data_parallel_size, 0
    else:
        n, local, start = _mp_topology(ns)
        per_node = local
    if ns.ready_policy not in ("all", "any") and int(ns.ready_policy) > local:
        raise SupervisorArgError(f"--ready-policy {ns.ready_policy} asks for more ready ranks than the "
                                 f"{local} of this node: use at most {local}, or all")
    return n, per_node, local, start


def _mp_topology(ns: argparse.Namespace) -> tuple[int, int, int]:
    """(N, L, S) after the DP-size checks; raises SupervisorArgError naming the flag."""
    n = ns.data_parallel_size
    local = ns.data_parallel_size_local if ns.data_parallel_size_local is not None else n
    if local <= 0:
        raise SupervisorArgError(f"--data-parallel-size-local must be a positive number, got {local}")
    if local > n:
        raise SupervisorArgError(f"--data-parallel-size-local {local} is larger than --data-parallel-size "
                                 f"{n}: a node cannot run more ranks than the whole group")
    if n % local:
        raise SupervisorArgError(f"--data-parallel-size {n} is not divisible by --data-parallel-size-local "
                                 f"{local}: every node must run the same number of ranks")
    if ns.node_rank < 0:
        raise SupervisorArgError(f"--node-rank must be >= 0, got {ns.node_rank}")
    start = ns.data_parallel_start_rank if ns.data_parallel_start_rank is not None else ns.node_rank * local
    if ns.data_parallel_start_rank is None and start + local > n:
        raise SupervisorArgError(f"--node-rank {ns.node_rank} puts this node's ranks at {start}.."
                                 f"{start + local - 1} but --data-parallel-size is {n}: use a node rank "
                                 f"below {n // local}")
    if start < 0 or start + local > n:
        raise SupervisorArgError(f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} "
                                 f"exceeds --data-parallel-size {n}: use a start rank in 0..{n - local}")
    if ns.data_parallel_rank is not None:
        raise SupervisorArgError("--data-parallel-rank is assigned to each rank by lbd supervise: drop it "
                                 "(use --data-parallel-start-rank)")
    return n, local, start


def _check_ports(ns: argparse.Namespace, local: int) -> None:
    last = ns.port + local - 1
    if last > 65535:
        raise SupervisorArgError(f"--port {ns.port} + {local} ranks runs past 65535: lower --port")
    sport = ns.data_parallel_supervisor_port
    if not 0 < sport <= 65535:
        raise SupervisorArgError(f"--data-parallel-supervisor-port {sport} is out of range: use 1..65535")
    if ns.port <= sport <= last:
        raise SupervisorArgError(f"--data-parallel-supervisor-port {sport} is inside the rank ports "
                                 f"{ns.port}..{last}: move it (or --port) out of that range")
    for i, port in enumerate(range(ns.port, last + 1)):
        problem = port_in_use(ns.host, port)
        if problem:
            raise SupervisorArgError(f"--port {ns.port}: local rank {i}'s {problem}: pick a free --port")


def check_kv_events(ns: argparse.Namespace, start: int, local: int) -> None:
    """Each rank offsets the KV-event ports by its DP rank (vLLM's rule): an endpoint that cannot be offset
    (ipc://) works for rank 0 only."""
    if ns.kv_events_config is None:
        return
    from lbd.engine.config.kv_events import offset_endpoint_port, parse_kv_events_config

    cfg = parse_kv_events_config(ns.kv_events_config)  # already validated by lbd.engine.config.args
    if not cfg.active:
        return
    for rank in range(start, start + local):
        try:
            offset_endpoint_port(cfg.endpoint, rank)
            offset_endpoint_port(cfg.replay_endpoint, rank)
        except ValueError as e:
            raise SupervisorArgError(f"--kv-events-config: {e}") from None


def _ray_topology(ns: argparse.Namespace) -> tuple[int, int]:
    """(N, ranks per Ray node): one supervisor places the whole group, so no node rank or start rank."""
    n = ns.data_parallel_size
    per_node = ns.data_parallel_size_local if ns.data_parallel_size_local is not None else n
    if not 0 < per_node <= n:
        raise SupervisorArgError(f"--data-parallel-size-local {per_node} (ranks per Ray node) must be in "
                                 f"1..{n} with --data-parallel-backend ray")
    if ns.node_rank or ns.data_parallel_start_rank:
        raise SupervisorArgError("--data-parallel-backend ray places every rank of the group from this one "
                                 "command: drop --node-rank and --data-parallel-start-rank")
    if ns.ray_dp_pack_strategy == "span":
        raise SupervisorArgError("--ray-dp-pack-strategy span (one rank's bundles over several nodes) is not "
                                 "implemented: use strict or fill; a rank that must span nodes runs without "
                                 "--data-parallel-backend ray, with --distributed-executor-backend ray")
    if ns.data_parallel_rank is not None:
        raise SupervisorArgError("--data-parallel-rank is assigned to each rank by lbd supervise: drop it")
    return n, per_node


def check_model_flags(ns: argparse.Namespace) -> None:
    """The model against the flags (TP/PP support and sizes, the KV-cache dtype), when its config.json can
    be read without converting anything (a GGUF never converted is checked by the ranks, which exit 2
    before binding their ports, and the supervisor exits 2 too)."""
    facts = model_facts(ns.model)
    if facts is not None and not is_moe(facts.architectures):
        problem = dense_model_flags_problem(ns.all2all_backend, ns.dp_idle_check_steps, facts.name)
        if problem:
            raise SupervisorArgError(problem)
    if ns.device == "sim":
        return
    if facts is not None:
        try:
            check_model(ns.tensor_parallel_size, ns.pipeline_parallel_size,
                        parse_partition(ns.pp_layer_partition), facts, ns.kv_cache_dtype)
        except ParallelConfigError as e:
            raise SupervisorArgError(str(e)) from e


def check_launch(ns: argparse.Namespace, local: int) -> None:
    """The rank ports are free (mp), Ray places lbd ranks only, and the rank program can be run."""
    if ns.data_parallel_backend != "ray":
        _check_ports(ns, local)
    elif ns.rank_engine != "lbd" or ns.rank_command is not None:
        raise SupervisorArgError("--data-parallel-backend ray places lbd engine ranks only: drop "
                                 "--rank-engine/--rank-command, or use --data-parallel-backend mp")
    problem = check_executable(ns.rank_engine, ns.rank_command)
    if problem:
        raise SupervisorArgError(problem)
