"""`lbd supervise`'s flags validated, and the launch spec of every local rank (the flags: ``flags``; their
checks against each other and this machine: ``checks``).

Everything here runs before anything is started: a bad command line exits 2 with one line that names the
flag and the fix, binds no port and spawns nothing. Engine flags come from `lbd.engine.config.args`: each
engine flag is accepted, validated and passed through to each rank; the TP/PP flags are checked against the
model's config.json and the devices with `lbd.engine.config.parallel` / `.placement` (json and the standard
library only: the supervisor imports no torch).

Placement: on CUDA each rank gets TP x PP devices of the inherited CUDA_VISIBLE_DEVICES; on the CPU each rank
gets a contiguous slice of the supervisor's CPUs in ``LBD_RANK_CPUS`` (one CPU each, round robin, when there
are more ranks than CPUs), which the rank pins itself to and splits again between its TP x PP workers.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from lbd.common.auth import engine_secrets
from lbd.common.cluster import (
    LOOPBACK,
    ClusterTokenError,
    is_loopback,
    read_cluster_token,
    read_strong_internal_key,
    read_strong_token,
)
from lbd.common.internal_key import INTERNAL_KEY_ENV
from lbd.common.limits import Limits, limits_from
from lbd.engine.config.args import engine_args_from_namespace, validate
from lbd.engine.config.placement import format_cpus, split_cpus, visible_cuda_devices
from lbd.supervisor.checks import check_kv_events, check_launch, check_model_flags, topology
from lbd.supervisor.engines import (
    EngineFlagError,
    Placement,
    key_env,
    rank_command,
    translate,
)
from lbd.supervisor.flags import (
    ADMIN_TOKEN_ENV,
    PROG,
    OneLineParser,
    SupervisorArgError,
    changed_engine_options,
    engine_flags,
    make_parser,
)
from lbd.supervisor.moe import GroupFlagError, GroupSpec, plan_group
from lbd.supervisor.roles import RoleError, plan_roles, role_flags

WILDCARD_HOSTS = {None, "", "0.0.0.0", "::"}


@dataclass(slots=True)
class RankSpec:
    """How to start one local rank: its identity, its port and its command line."""

    rank: int
    local_rank: int
    port: int
    argv: list[str]
    env: dict[str, str]  # overrides on top of the supervisor's environment
    devices: str | None  # CUDA_VISIBLE_DEVICES of this rank, None when not on CUDA
    cpus: str | None  # the CPU slice the rank is held to (CPU ranks; see .engines), None on CUDA
    probe_host: str  # where the supervisor reaches the rank (loopback for wildcard binds)
    bind_host: str | None  # the engine's --host (None: all interfaces)
    engine: str = "lbd"  # --rank-engine ("command" for --rank-command)
    scheme: str = "http"  # https when the ranks serve TLS (--ssl-certfile)
    role: str = "mixed"  # lbd.wire.roles.RankRole's value (lbd.supervisor.roles)

    @property
    def probe_url(self) -> str:
        return f"{self.scheme}://{_url_host(self.probe_host)}:{self.port}"

    def url(self, wildcard_host: str) -> str:
        """The rank's base URL for others: its bind address, or ``wildcard_host`` when it binds them all."""
        host = wildcard_host if self.bind_host in WILDCARD_HOSTS else _url_host(self.bind_host or "")
        return f"{self.scheme}://{host}:{self.port}"


@dataclass(slots=True)
class SupervisorConfig:
    dp_size: int
    dp_size_local: int
    dp_start_rank: int
    node_rank: int
    base_port: int
    supervisor_host: str
    supervisor_port: int
    probe_interval_s: float
    probe_timeout_s: float
    probe_failure_threshold: int
    startup_timeout_s: float
    ready_policy: str  # "all", "any" or a positive integer as text
    on_rank_failure: str  # restart-rank | restart-group | exit (resolved from the model when not given)
    admin_token: str | None
    shutdown_timeout_s: float
    drain_timeout_s: float
    backoff_initial_s: float
    backoff_max_s: float
    backoff_reset_s: float
    ranks: list[RankSpec] = field(default_factory=list)
    backend: str = "mp"  # mp: ranks are local processes; ray: Ray places each rank (lbd.supervisor.ray_rank)
    ray_pack_strategy: str = "strict"
    ranks_per_node: int = 0  # ray: --data-parallel-size-local, the ranks each Ray node takes
    device: str = "auto"
    devices_per_rank: int = 1  # tensor x pipeline parallel size
    group: GroupSpec | None = None  # the MoE group of the ranks (None: independent dense ranks)
    log_level: str = "info"
    probe_generate_every: int = 0  # every Nth probe is a 1-token generation (0: never)
    model_name: str = ""  # what a generation probe asks for
    api_keys: list[str] = field(default_factory=list)  # the ranks' keys (a generation probe sends the first)
    limits: Limits = field(default_factory=Limits)  # of the health port (the ranks get the same flags)
    ssl_certfile: str | None = None  # the health port and the ranks serve TLS with it
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # verifies the ranks' certificates (and client certificates)
    ssl_cert_reqs: int = 0
    executor_backend: str = "mp"  # ray: the rank's workers are Ray actors (lbd.engine.executor.ray_executor)
    # every local rank's spec for a node of another size (DP size, local size), by the rules above; raises
    # SupervisorArgError when the node cannot have it (lbd.supervisor.scale). None: not resizable (Ray).
    respec: Callable[[int, int], list[RankSpec]] | None = None
    cluster_token: str | None = None  # $LBD_CLUSTER_TOKEN / --cluster-token-file: also admits POST /scale
    scale_down_drain_timeout_s: float = 30.0  # a removed rank's longest drain (--scale-down-drain-timeout-s)

    @property
    def ready_needed(self) -> int:
        """How many ready ranks make the node ready under --ready-policy."""
        if self.ready_policy == "all":
            return self.dp_size_local
        if self.ready_policy == "any":
            return 1
        return int(self.ready_policy)

    @property
    def hang_detection_bound_s(self) -> float:
        return self.probe_interval_s * self.probe_failure_threshold + self.probe_timeout_s


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def probe_host_for(bind_host: str | None) -> str:
    """Where to reach a server bound to ``bind_host`` from this machine."""
    if bind_host in (None, "", "0.0.0.0"):
        return "127.0.0.1"
    if bind_host == "::":
        return "::1"
    return bind_host


def bind_health_socket(host: str, port: int) -> socket.socket:
    """Bind and listen on the health port now, so nothing can take it between validation and serving."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(128)
        sock.setblocking(False)
    except OSError as e:
        sock.close()
        raise SupervisorArgError(f"--data-parallel-supervisor-port {port} on {host} is already in use "
                                 f"({e.strerror}): pick a free port") from e
    return sock


def _device_slices(ns: argparse.Namespace, local: int, env: dict[str, str]) -> list[str | None]:
    per_rank = ns.tensor_parallel_size * ns.pipeline_parallel_size
    ids = visible_cuda_devices(env, ns.device)
    if ids is None or ns.distributed_executor_backend == "ray":  # Ray gives the workers their devices
        return [None] * local
    need = local * per_rank
    if len(ids) < need:
        raise SupervisorArgError(
            f"--data-parallel-size-local {local} x --tensor-parallel-size {ns.tensor_parallel_size} x "
            f"--pipeline-parallel-size {ns.pipeline_parallel_size} needs {need} CUDA devices but {len(ids)} "
            f"are visible (CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '<unset>')}): "
            "lower the sizes or expose more devices")
    return [",".join(ids[i * per_rank:(i + 1) * per_rank]) for i in range(local)]


def _cpu_slices(local: int, cuda: bool) -> list[str | None]:
    if cuda:
        return [None] * local
    return [format_cpus(part) for part in split_cpus(sorted(os.sched_getaffinity(0)), local)]


def rank_specs(ns: argparse.Namespace, passthrough: list[str], n: int, local: int, start: int,
               env: dict[str, str], local_devices: bool = True,
               changed: dict[str, object] | None = None, group: GroupSpec | None = None) -> list[RankSpec]:
    """``local_devices`` False: Ray gives each rank its devices (and host), not this machine's slicing
    (its devices nor its CPUs). ``group``: the ranks' MoE group (its rank 0's address and port; its
    environment: the cluster token, from which the members' CURVE keys come)."""
    slices = _device_slices(ns, local, env) if local_devices else [None] * local
    keys = engine_secrets(ns.api_key, env)  # all of them: a Ray-placed rank inherits nothing of ours
    visible = visible_cuda_devices(env, ns.device) if local_devices else None
    cpus = _cpu_slices(local, visible is not None) if local_devices else [None] * local
    changed = {} if changed is None else changed
    try:
        flags = translate(ns.rank_engine, changed, passthrough) if ns.rank_command is None else []
        secrets = key_env(ns.rank_engine, ns.rank_command, keys)
    except EngineFlagError as e:
        raise SupervisorArgError(str(e)) from None
    try:
        roles = plan_roles(ns, local)
    except RoleError as e:
        raise SupervisorArgError(str(e)) from None
    try:  # signs the router's forwarded ids: 256 bits or more, as the cluster token
        internal_key = read_strong_internal_key(env)
    except ClusterTokenError as e:
        raise SupervisorArgError(str(e)) from None
    specs = []
    for i in range(local):
        devices = slices[i].split(",") if slices[i] is not None else None
        place = Placement(start + i, i, ns.port + i, n, local, devices, visible, cpus[i],
                          (group.address, group.rpc_port) if group is not None else None)
        try:
            argv, child_env = rank_command(ns.rank_engine, ns.rank_command, ns, flags, place, changed)
        except EngineFlagError as e:
            raise SupervisorArgError(str(e)) from None
        child_env.update(secrets)
        argv = argv + role_flags(roles[i])
        if ns.rank_engine == "lbd" and ns.rank_command is None and internal_key:
            child_env[INTERNAL_KEY_ENV] = internal_key  # a Ray-placed rank inherits nothing of ours
        child_env.update(group.child_env() if group is not None else {})
        specs.append(RankSpec(rank=start + i, local_rank=i, port=ns.port + i, argv=argv, env=child_env,
                              devices=slices[i], cpus=place.pinned_cpus(ns.rank_engine, ns.rank_command),
                              probe_host=probe_host_for(ns.host), bind_host=ns.host,
                              engine="command" if ns.rank_command else ns.rank_engine,
                              scheme="https" if ns.ssl_certfile else "http", role=roles[i].value))
    return specs


def _plan_group(ns: argparse.Namespace, n: int, local: int, start: int,
                env: dict[str, str]) -> tuple[GroupSpec | None, str]:
    """The MoE group (lbd.supervisor.moe.plan_group), with the cluster token it needs across machines. The
    token, wherever it is given, is refused below 256 bits (lbd.common.cluster.read_strong_token): the ranks
    inherit it and derive CURVE and KV-transfer keys from it."""
    try:
        token = read_strong_token(ns.cluster_token_file, env)
    except ClusterTokenError as e:
        raise SupervisorArgError(str(e)) from None
    group, policy = plan_group(ns, n, local, start, token)
    if group is None:
        for flag, given in (("--cluster-token-file", ns.cluster_token_file is not None),
                            ("--insecure-cluster", ns.insecure_cluster)):
            if given:
                raise SupervisorArgError(f"{flag} applies to the wires of an MoE group, and these ranks are "
                                         "independent: drop it")
    return group, policy


def health_host(flag: str | None, rank_host: str | None) -> str:
    """The health port's bind address: ``--supervisor-host`` as given, else where the ranks listen (loopback
    ranks: loopback; otherwise every interface, as a cluster router and the orchestrator read it)."""
    if flag is not None:
        return flag
    return LOOPBACK if is_loopback(rank_host) else "0.0.0.0"


def parse_args(argv: list[str], env: dict[str, str] | None = None, prog: str = PROG) -> SupervisorConfig:
    """Parse and validate; exits 2 with one line on any problem. Binds and spawns nothing."""
    env = dict(os.environ) if env is None else env
    parser, engine_dests = make_parser(prog)
    ns = _parse(parser, argv)
    try:
        n, per_node, local, start = topology(ns)
        check_model_flags(ns)
        group, on_failure = _plan_group(ns, n, local, start, env)
        check_launch(ns, local)
        check_kv_events(ns, start, local)
        passthrough = engine_flags(parser, ns, engine_dests) + (group.rank_flags() if group else [])
        specs = rank_specs(ns, passthrough, n, local, start, env, ns.data_parallel_backend != "ray",
                           changed_engine_options(parser, ns, engine_dests), group)
        if group is not None and (ns.rank_engine != "lbd" or ns.rank_command is not None):
            # vLLM's rank 0 coordinates its own group (SGLang's ranks are independent): no lbd coordinator
            group, on_failure = None, ("restart-rank" if on_failure == "restart-group" else on_failure)
    except (SupervisorArgError, GroupFlagError) as e:
        parser.error(str(e))
    cfg = _config(ns, env, (n, per_node, local, start), specs, group, on_failure)
    if ns.data_parallel_backend != "ray":
        cfg.respec = _respec(ns, passthrough, changed_engine_options(parser, ns, engine_dests), env, start,
                             group)
    return cfg


def _respec(ns: argparse.Namespace, passthrough: list[str], changed: dict[str, object], env: dict[str, str],
            start: int, group: GroupSpec | None) -> Callable[[int, int], list[RankSpec]]:
    """The specs of every local rank of this node at DP size ``n`` with ``local`` ranks here: the devices,
    CPU slices, ports and roles the start-up rules give a node of that size (the rank ports' availability
    is the caller's to check: the current ranks hold theirs)."""
    def specs(n: int, local: int) -> list[RankSpec]:
        check_kv_events(ns, start, local)
        return rank_specs(ns, passthrough, n, local, start, env, True, changed, group)
    return specs


def _parse(parser: OneLineParser, argv: list[str]) -> argparse.Namespace:
    """The flags, the engine's own checks included; unknown flags refused."""
    ns, extra = parser.parse_known_args(argv)
    if extra:
        parser.error(f"unknown flag {extra[0]!r}: not an engine or supervisor flag (lbd supervise --help "
                     "lists them)")
    # the rendezvous flags are the supervisor's to check (lbd.supervisor.moe: a port alone is fine here, the
    # address defaults); each rank validates the pair it is given
    validate(engine_args_from_namespace(argparse.Namespace(
        **{**vars(ns), "data_parallel_address": None, "data_parallel_rpc_port": None})), parser)
    if ns.dp_supervisor_probe_generate < 0:
        parser.error("--dp-supervisor-probe-generate must be >= 0 (0: never)")
    return ns


def _config(ns: argparse.Namespace, env: dict[str, str], topology: tuple[int, int, int, int],
            specs: list[RankSpec], group: GroupSpec | None, on_failure: str) -> SupervisorConfig:
    n, per_node, local, start = topology
    return SupervisorConfig(
        dp_size=n, dp_size_local=local, dp_start_rank=start, node_rank=ns.node_rank, base_port=ns.port,
        supervisor_host=health_host(ns.supervisor_host, ns.host),
        supervisor_port=ns.data_parallel_supervisor_port,
        probe_interval_s=ns.dp_supervisor_probe_interval_s, probe_timeout_s=ns.dp_supervisor_probe_timeout_s,
        probe_failure_threshold=ns.dp_supervisor_probe_failure_threshold,
        startup_timeout_s=ns.dp_supervisor_startup_timeout_s, ready_policy=ns.ready_policy,
        on_rank_failure=on_failure, admin_token=ns.admin_token or env.get(ADMIN_TOKEN_ENV) or None,
        shutdown_timeout_s=ns.shutdown_timeout,
        drain_timeout_s=ns.drain_timeout_s if ns.drain_timeout_s is not None else ns.shutdown_timeout,
        backoff_initial_s=ns.restart_backoff_initial_s, backoff_max_s=ns.restart_backoff_max_s,
        backoff_reset_s=ns.restart_backoff_reset_s, ranks=specs, backend=ns.data_parallel_backend,
        ray_pack_strategy=ns.ray_dp_pack_strategy, ranks_per_node=per_node, device=ns.device,
        devices_per_rank=ns.tensor_parallel_size * ns.pipeline_parallel_size,
        probe_generate_every=ns.dp_supervisor_probe_generate,
        model_name=engine_args_from_namespace(ns).model_name,
        api_keys=engine_secrets(ns.api_key, env), limits=limits_from(ns),
        ssl_certfile=ns.ssl_certfile, ssl_keyfile=ns.ssl_keyfile, ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs, executor_backend=ns.distributed_executor_backend, group=group,
        log_level=ns.log_level, cluster_token=read_cluster_token(ns.cluster_token_file, env),
        scale_down_drain_timeout_s=ns.scale_down_drain_timeout_s)
