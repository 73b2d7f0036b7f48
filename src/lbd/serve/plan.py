"""`lbd serve` flags -> what this node runs (a `Plan`), or None for the single-rank engine.

Every check runs before anything starts: a bad combination exits 2 with one line naming the flag and the fix.
The children's command lines (``lbd.serve.child_argv``) are rebuilt from the parsed flags (only those changed
from their defaults), with the flags this layer consumes (the router's port and workers, the group's address,
the deployment-wide queue limits) taken out and the node's own values put in.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from dataclasses import dataclass, field

from lbd.common.auth import engine_secrets
from lbd.common.cluster import LOOPBACK, ClusterTokenError, is_loopback, read_strong_internal_key
from lbd.common.internal_key import derive_key
from lbd.common.limits import Limits, limits_from
from lbd.common.ports import port_in_use
from lbd.engine.config.args import engine_args_from_namespace, validate
from lbd.serve.autoscale import AutoscaleSettings, add_autoscale_arguments, autoscale_plan
from lbd.serve.child_argv import group_argv, route_argv, supervise_argv
from lbd.serve.security import check_cluster_auth, check_tls, cluster_token
from lbd.supervisor.config import parse_args
from lbd.supervisor.flags import (
    ADMIN_TOKEN_ENV,
    OneLineParser,
    SupervisorArgError,
    add_supervisor_arguments,
    make_parser,
)
from lbd.supervisor.moe import model_moe
from lbd.wire.roles import NodeRole

PROG = "lbd serve"
DEFAULT_RPC_PORT = 29550  # vLLM's --data-parallel-rpc-port default


@dataclass(slots=True)
class Plan:
    role: NodeRole  # head (runs a router) | headless (ranks only) | hybrid (its own router)
    dp_size: int
    dp_size_local: int  # ranks this node's supervisor runs (all N with Ray)
    dp_start_rank: int
    address: str | None  # the head's --data-parallel-address
    rpc_port: int
    registry: bool  # this node serves the registration service (the group's head)
    member: bool  # this node registers its ranks with the head
    advertise: str | None  # how others reach this node's ranks (None: derived from the route to the head)
    rank_host: str | None  # the ranks' bind address (None: all interfaces)
    health_host: str
    health_port: int
    ready_policy: str
    ready_needed: int  # ready ranks that make this node's view ready
    view_size: int  # ranks in this node's view: the whole group on an internal head, its own otherwise
    probe_interval_s: float
    probe_timeout_s: float
    probe_failure_threshold: int
    shutdown_timeout_s: float
    models: list[str]
    cluster_token: str | None
    supervise_argv: list[str]  # `lbd supervise` flags, less the internal health port (chosen at start)
    route_argv: list[str] | None  # `lbd route` flags, less --upstreams (the health port's /status)
    router_host: str = "0.0.0.0"
    router_port: int = 8000
    router_workers: int = 1
    # --api-key values, $VLLM_API_KEY and $LBD_API_KEYS: handed to the supervisor (its ranks) and the router
    # (its clients' keys, and the one it authenticates to the ranks with) in their environments
    api_keys: list[str] = field(default_factory=list, repr=False)
    # signs the router's forwarded prompt ids for the ranks (lbd.common.internal_key): $LBD_INTERNAL_KEY, else
    # derived from the cluster token (every node alike), else this node's own
    internal_key: str = field(default="", repr=False)
    limits: Limits = field(default_factory=Limits)  # of the node's health port, as of every server of ours
    ssl_certfile: str | None = None  # TLS on every port of the node (one-node deployments only)
    ssl_keyfile: str | None = None
    ssl_ca_certs: str | None = None  # how the node's parts verify each other (else the system's store)
    insecure_cluster: bool = False  # --insecure-cluster: registration beyond loopback without a token
    autoscale: AutoscaleSettings | None = None  # --autoscale MIN:MAX (lbd.serve.autoscale)

    @property
    def admin_token(self) -> str | None:
        """The supervisor child's admin token (it takes POST /scale and the admin endpoints with it): its
        --admin-token, else $LBD_ADMIN_TOKEN, which it inherits."""
        argv = self.supervise_argv
        for i, arg in enumerate(argv):
            if arg.startswith("--admin-token="):
                return arg.split("=", 1)[1] or None
            if arg == "--admin-token" and i + 1 < len(argv):
                return argv[i + 1]
        return os.environ.get(ADMIN_TOKEN_ENV) or None

    @property
    def view_is_group(self) -> bool:
        """The health port lists the whole group (an internal-LB head) rather than this node's ranks."""
        return self.role == NodeRole.HEAD


def add_deploy_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data-parallel deployment (lbd serve --data-parallel-size N, no "
                                  "--data-parallel-rank)")
    g.add_argument("--headless", action="store_true",
                   help="run this node's ranks without an API server; they register with the head at "
                        "--data-parallel-address:--data-parallel-rpc-port, whose router sends them traffic")
    g.add_argument("--data-parallel-hybrid-lb", action="store_true",
                   help="every node balances its own ranks on its own --port (an outer balancer spreads "
                        "clients over the nodes); nodes register with rank 0's node")
    g.add_argument("--data-parallel-advertise-address", default=None,
                   help="address the head uses to reach this node's ranks (default: the head's own "
                        "--data-parallel-address on the head; on other nodes the address of the interface "
                        "that routes to the head)")
    g.add_argument("--rank-port", type=int, default=None,
                   help="first rank's port, rank i on +i (default: --port + 1 where this node runs a "
                        "router, --port on a --headless node)")
    g.add_argument("--route-policy", default=None,
                   help="the router's --policy (default: lbd route's); lbd route --help lists them")
    add_autoscale_arguments(parser)


def make_deploy_parser() -> tuple[OneLineParser, set[str], set[str]]:
    """The parser of `lbd serve`, the dests passed on to the supervisor, and this layer's own dests."""
    parser, engine_dests = make_parser(PROG)
    parser.description = ("Serve a model over an OpenAI-compatible API. One rank with --data-parallel-rank "
                          "or --data-parallel-size 1; otherwise vLLM's data-parallel deployment built from "
                          "lbd supervise (the ranks) and lbd route (the API port): internal load "
                          "balancing, multi-node with --headless, --data-parallel-hybrid-lb, "
                          "--data-parallel-backend ray.")
    before = {a.dest for a in parser._actions}
    add_deploy_arguments(parser)
    own = {a.dest for a in parser._actions} - before
    for action in parser._actions:
        if action.dest == "api_server_count":
            action.help = ("one rank: front-end processes sharing its port (SO_REUSEPORT); a DP deployment: "
                           "the router's --workers (processes sharing --port), each rank then has one")
    probe = argparse.ArgumentParser(add_help=False)
    add_supervisor_arguments(probe)
    passed = (engine_dests | {a.dest for a in probe._actions}) - own
    return parser, passed, own


def _fail(parser: argparse.ArgumentParser, message: str) -> None:
    parser.error(message)


def is_single_rank(ns: argparse.Namespace, parser: argparse.ArgumentParser, own: set[str]) -> bool:
    """One engine (today's `lbd serve`): a rank of an external load balancer, or --data-parallel-size 1."""
    deployment = (ns.headless or ns.data_parallel_hybrid_lb or ns.data_parallel_backend != "mp"
                  or ns.data_parallel_size_local == 0 or ns.autoscale is not None)
    if ns.data_parallel_rank is not None:
        if deployment:
            flag = ("--headless" if ns.headless else "--data-parallel-hybrid-lb" if ns.data_parallel_hybrid_lb
                    else "--data-parallel-backend" if ns.data_parallel_backend != "mp"
                    else "--autoscale" if ns.autoscale is not None else "--data-parallel-size-local 0")
            _fail(parser, f"--data-parallel-rank {ns.data_parallel_rank} starts one rank for an external "
                          f"load balancer; {flag} runs a deployment: drop one of them")
        return True
    return ns.data_parallel_size == 1 and not deployment


def _check_single_rank_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                             extra: set[str]) -> None:
    """Deployment-only flags given to a single rank are refused (they would do nothing)."""
    for action in parser._actions:
        if action.dest in extra and action.option_strings and getattr(ns, action.dest) != action.default:
            _fail(parser, f"{action.option_strings[0]} applies to a data-parallel deployment "
                          "(--data-parallel-size > 1 without --data-parallel-rank); this command starts one "
                          "rank: drop it")


def parse(argv: list[str], env: dict[str, str] | None = None) -> Plan | None:
    """The plan for this node, or None when `lbd serve` is the single-rank engine. Exits 2 on bad flags."""
    env = dict(os.environ) if env is None else env
    parser, passed, own = make_deploy_parser()
    ns, rest = parser.parse_known_args(argv)
    if rest:
        _fail(parser, f"unknown flag {rest[0]!r} (lbd serve --help lists every flag)")
    if is_single_rank(ns, parser, own):
        probe = argparse.ArgumentParser(add_help=False)
        add_supervisor_arguments(probe)
        _check_single_rank_flags(parser, ns, own | ({a.dest for a in probe._actions} - {"help"}))
        return None
    try:
        return _plan(parser, ns, passed, env)
    except SupervisorArgError as e:
        _fail(parser, str(e))
    raise AssertionError("unreachable")


def _role(ns: argparse.Namespace) -> NodeRole:
    if ns.headless and ns.data_parallel_hybrid_lb:
        raise SupervisorArgError("--headless and --data-parallel-hybrid-lb exclude each other: a hybrid node "
                                 "runs its own router, a headless one none")
    if ns.data_parallel_backend == "ray":
        for flag, given in (("--headless", ns.headless),
                            ("--data-parallel-hybrid-lb", ns.data_parallel_hybrid_lb),
                            ("--data-parallel-address", ns.data_parallel_address is not None),
                            ("--data-parallel-rpc-port", ns.data_parallel_rpc_port is not None)):
            if given:
                raise SupervisorArgError(f"--data-parallel-backend ray places every rank from this one "
                                         f"command (no registering nodes): drop {flag}")
    if ns.headless:
        return NodeRole.HEADLESS
    return NodeRole.HYBRID if ns.data_parallel_hybrid_lb else NodeRole.HEAD


def _topology(ns: argparse.Namespace, role: NodeRole) -> tuple[int, int, int]:
    """(N, L, S) of this node; the supervisor re-checks the rest (divisibility, ranges)."""
    n = ns.data_parallel_size
    local = ns.data_parallel_size_local if ns.data_parallel_size_local is not None else n
    if ns.data_parallel_backend == "ray":
        if ns.node_rank or ns.data_parallel_start_rank:
            raise SupervisorArgError("--data-parallel-backend ray places every rank of the group from this "
                                     "one command: drop --node-rank and --data-parallel-start-rank")
        return n, n, 0  # one supervisor, every rank; --data-parallel-size-local = ranks per Ray node
    if local < 0:
        raise SupervisorArgError(f"--data-parallel-size-local must be >= 0, got {local}")
    if local > n:
        raise SupervisorArgError(f"--data-parallel-size-local {local} is larger than --data-parallel-size "
                                 f"{n}: a node cannot run more ranks than the whole group")
    if local == 0 and role != NodeRole.HEAD:
        raise SupervisorArgError(f"a {'--headless' if role is NodeRole.HEADLESS else 'hybrid'} node with "
                                 "--data-parallel-size-local 0 would have nothing to run: give it ranks")
    start = (ns.data_parallel_start_rank if ns.data_parallel_start_rank is not None
             else ns.node_rank * local)
    if role == NodeRole.HEAD and start != 0:
        raise SupervisorArgError(f"the head (no --headless) runs ranks 0..{max(local, 1) - 1}; a node whose "
                                 f"ranks start at {start} runs with --headless")
    if local and not 0 <= start <= n - local:
        raise SupervisorArgError(f"--data-parallel-start-rank {start} + --data-parallel-size-local {local} "
                                 f"exceeds --data-parallel-size {n}: use a start rank in 0..{n - local}")
    return n, local, start


def _check_unused(ns: argparse.Namespace, role: NodeRole, remote: bool, moe_group: bool) -> None:
    """Flags this node would not use are refused rather than ignored (an MoE group on one node meets at
    --data-parallel-address:--data-parallel-rpc-port too)."""
    unused = []
    for flag, value in (("--data-parallel-advertise-address", ns.data_parallel_advertise_address),
                        ("--data-parallel-address", None if moe_group else ns.data_parallel_address),
                        ("--data-parallel-rpc-port", None if moe_group else ns.data_parallel_rpc_port)):
        if value is not None and not remote and ns.data_parallel_backend == "mp":
            unused.append((flag, "it applies to groups spanning nodes"))
    if ns.rank_port is not None and ns.data_parallel_backend == "ray":
        unused.append(("--rank-port", "Ray-placed ranks take a free port on their node"))
    if ns.route_policy is not None and role == NodeRole.HEADLESS:
        unused.append(("--route-policy", "a --headless node runs no router"))
    wires = (remote and ns.data_parallel_backend == "mp") or moe_group
    for flag, given in (("--cluster-token-file", ns.cluster_token_file is not None),
                        ("--insecure-cluster", ns.insecure_cluster)):
        if given and not wires:
            unused.append((flag, "no wire between nodes or MoE group here: everything is on this machine"))
    for flag, why in unused:
        raise SupervisorArgError(f"{flag} does nothing here ({why}): drop it")


def _ready_needed(policy: str, view: int) -> int:
    if policy == "all":
        return view
    if policy == "any":
        return 1
    if int(policy) > view:
        raise SupervisorArgError(f"--ready-policy {policy} asks for more ready ranks than the {view} this "
                                 f"node's health port answers for: use at most {view}, or all")
    return int(policy)


def _plan(parser: OneLineParser, ns: argparse.Namespace, passed: set[str], env: dict[str, str]) -> Plan:
    role = _role(ns)
    n, local, start = _topology(ns, role)
    head_of_group = start == 0 and role != NodeRole.HEADLESS
    address = ns.data_parallel_address
    if role == NodeRole.HEADLESS and ns.api_server_count != 1:
        raise SupervisorArgError("--api-server-count is the router's worker count and a --headless node runs "
                                 "no router: drop it (give it to the head)")
    if role == NodeRole.HEADLESS:
        for flag, value in (("--max-num-queued-reqs", ns.max_num_queued_reqs),
                            ("--max-num-queued-tokens", ns.max_num_queued_tokens)):
            if value is not None:
                raise SupervisorArgError(f"{flag} applies to the whole deployment and is enforced by the "
                                         "head's router: give it to the head, not to a --headless node")
    remote = ns.data_parallel_backend == "mp" and (local < n or role == NodeRole.HEADLESS
                                                   or (role == NodeRole.HEAD and address is not None))
    registry, member = remote and head_of_group, remote and not head_of_group
    moe_group = n > 1 and model_moe(ns.model, ns.device) is not None
    _check_unused(ns, role, remote, moe_group)
    check_tls(ns, role, remote, moe_group)
    if remote and address is None:
        who = ("the head must tell remote nodes where to register" if head_of_group
               else "this node registers its ranks with the head")
        raise SupervisorArgError(f"--data-parallel-size {n} with --data-parallel-size-local {local}: {who}; "
                                 "pass --data-parallel-address <the head's address> (and "
                                 "--data-parallel-rpc-port, default 29550)")
    rpc_port = ns.data_parallel_rpc_port if ns.data_parallel_rpc_port is not None else DEFAULT_RPC_PORT
    runs_router = role != NodeRole.HEADLESS
    rank_port = ns.rank_port if ns.rank_port is not None else ns.port + (1 if runs_router else 0)
    one_machine = not remote or is_loopback(address)  # no remote nodes, or a group that meets on loopback
    rank_host = _rank_host(ns, role, one_machine)
    view = n if role == NodeRole.HEAD else local
    needed = _ready_needed(ns.ready_policy, max(view, 1))
    autoscale, needed = autoscale_plan(ns, local, n, role == NodeRole.HEADLESS, needed)
    _check_ports(ns, role, local, rank_port, rank_host, rpc_port if registry else None)
    token = cluster_token(ns, env)  # read once: the token file, or $LBD_CLUSTER_TOKEN
    plan = Plan(
        role=role, dp_size=n, dp_size_local=local, dp_start_rank=start, address=address, rpc_port=rpc_port,
        registry=registry, member=member,
        advertise=ns.data_parallel_advertise_address or (address if head_of_group else None),
        rank_host=rank_host, health_port=ns.data_parallel_supervisor_port,
        # one machine: the health port on loopback (the router's /readyz answers outside); several: every
        # interface, for the orchestrator's probes of each node
        health_host=ns.supervisor_host or (LOOPBACK if one_machine else "0.0.0.0"),
        ready_policy=ns.ready_policy, ready_needed=needed, view_size=view,
        probe_interval_s=ns.dp_supervisor_probe_interval_s, probe_timeout_s=ns.dp_supervisor_probe_timeout_s,
        probe_failure_threshold=ns.dp_supervisor_probe_failure_threshold,
        shutdown_timeout_s=ns.shutdown_timeout, models=list(engine_args_from_namespace(ns).model_names),
        cluster_token=token, insecure_cluster=ns.insecure_cluster,
        supervise_argv=supervise_argv(parser, ns, passed, n, local, start, rank_port, rank_host)
        + (group_argv(ns, address, rpc_port) if moe_group else [])
        + (["--insecure-cluster"] if moe_group and ns.insecure_cluster else []),
        route_argv=route_argv(ns, role, needed) if runs_router else None,
        router_host=ns.host or "0.0.0.0", router_port=ns.port, router_workers=ns.api_server_count,
        api_keys=engine_secrets(ns.api_key, env), internal_key=_internal_key(env, token),
        limits=limits_from(ns), ssl_certfile=ns.ssl_certfile,
        ssl_keyfile=ns.ssl_keyfile, ssl_ca_certs=ns.ssl_ca_certs, autoscale=autoscale)
    _validate_children(parser, ns, plan, env)
    check_cluster_auth(address if remote else None, plan.cluster_token, plan.insecure_cluster)
    return plan


def _internal_key(env: dict[str, str], cluster_token: str | None) -> str:
    """The deployment's internal key: given (256 bits or more: its HMACs travel), derived from the cluster
    token, or made here."""
    try:
        given = read_strong_internal_key(env)
    except ClusterTokenError as e:
        raise SupervisorArgError(str(e)) from None
    return given or (derive_key(cluster_token) if cluster_token else secrets.token_hex(32))


def _rank_host(ns: argparse.Namespace, role: NodeRole, one_machine: bool) -> str | None:
    """The ranks' bind address (None: every interface). On one machine loopback (the router is beside
    them); across machines reachable from the head (a headless node's --host, else every interface)."""
    if role == NodeRole.HEADLESS:
        return ns.host or (LOOPBACK if one_machine else None)
    # elsewhere --host is the router's
    return LOOPBACK if one_machine and ns.data_parallel_backend != "ray" else None


def _check_ports(ns: argparse.Namespace, role: NodeRole, local: int, rank_port: int, rank_host: str | None,
                 rpc_port: int | None) -> None:
    if not 0 < rank_port <= 65535 - max(local - 1, 0):
        raise SupervisorArgError(f"--rank-port {rank_port} + {local} ranks is out of range: use 1..65535")
    if role != NodeRole.HEADLESS:
        if rank_port <= ns.port < rank_port + local:
            raise SupervisorArgError(f"--port {ns.port} (the router) is inside the rank ports {rank_port}.."
                                     f"{rank_port + local - 1}: move --rank-port")
        problem = port_in_use(ns.host, ns.port)
        if problem:
            raise SupervisorArgError(f"--port {ns.port} (the router): {problem}: pick a free --port")
    if rpc_port is not None and rank_port <= rpc_port < rank_port + local:
        raise SupervisorArgError(f"--data-parallel-rpc-port {rpc_port} is inside the rank ports: move it")
    if ns.data_parallel_backend == "mp":
        for i in range(local):
            problem = port_in_use(rank_host, rank_port + i)
            if problem:
                raise SupervisorArgError(f"--rank-port {rank_port}: local rank {i}'s {problem}: pick a free "
                                         "--rank-port")


def _validate_children(parser: OneLineParser, ns: argparse.Namespace, plan: Plan,
                       env: dict[str, str]) -> None:
    """Let the supervisor and the router check their own flags now, before anything starts (exit 2)."""
    if plan.dp_size_local:
        parse_args([*plan.supervise_argv, "--data-parallel-supervisor-port", str(plan.health_port)], env,
                   prog=PROG)
    else:  # a router-only head: the engine flags still have to be valid for the remote ranks
        engine_ns = argparse.Namespace(**vars(ns))
        engine_ns.data_parallel_address = engine_ns.data_parallel_rpc_port = None
        validate(engine_args_from_namespace(engine_ns), parser)
    if plan.route_argv is not None:
        from lbd.router.config import parse_args as route_args

        try:
            route_args([*plan.route_argv, "--upstreams", "supervisor://127.0.0.1:1"])
        except SystemExit:
            sys.stderr.write(f"{PROG}: error: the router refused the flags above (from --api-server-count, "
                             "--route-policy or the queue limits)\n")
            raise

