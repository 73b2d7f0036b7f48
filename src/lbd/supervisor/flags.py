"""`lbd supervise`'s flags: the supervisor's own beside every engine flag (``lbd.engine.config.args``), a
parser that reports an error as one line and exits 2, and the engine flags to pass on to each rank."""

from __future__ import annotations

import argparse
import sys

from lbd.common.cluster import CLUSTER_TOKEN_ENV
from lbd.engine.config.args import add_engine_arguments
from lbd.supervisor.engines import ENGINES

PROG = "lbd supervise"
ADMIN_TOKEN_ENV = "LBD_ADMIN_TOKEN"
# Set by the supervisor per rank; a user value would be overwritten, so they are never passed through.
RANK_OVERRIDES = frozenset({"port", "data_parallel_rank", "data_parallel_size", "data_parallel_size_local",
                            "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port"})
# Handed to ranks in their environment ($LBD_API_KEYS), never on a command line others can read in ps.
ENV_ONLY = frozenset({"api_key"})
FAILURE_POLICIES = ("restart-group", "restart-rank", "restart", "exit")
DP_BACKENDS = ("mp", "ray")
RAY_PACK_STRATEGIES = ("strict", "fill", "span")


class SupervisorArgError(Exception):
    """A command-line problem found after argparse (ports, devices): one line, exit 2."""


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error as one line (no usage block) and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _ready_policy(text: str) -> str:
    if text in ("all", "any") or (text.isdigit() and int(text) > 0):
        return text
    raise argparse.ArgumentTypeError(f"use all, any or a positive number of ranks, got {text!r}")


def add_supervisor_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("supervisor")
    g.add_argument("--data-parallel-multi-port-external-lb", action="store_true",
                   help="one engine server per DP rank on its own port (vLLM's mode; always on here)")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this node's index; --data-parallel-start-rank defaults to node_rank x local size")
    g.add_argument("--data-parallel-supervisor-port", type=int, default=9256,
                   help="health port: /health, /readyz, /status, /metrics and the admin endpoints")
    g.add_argument("--supervisor-host", default=None,
                   help="bind address of the health port (default: loopback when the ranks' --host is "
                        "loopback or lbd serve runs on one machine, else every interface, where a cluster "
                        "router and the orchestrator read it)")
    g.add_argument("--cluster-token-file", default=None, metavar="PATH",
                   help=f"file whose first line is the cluster token (else ${CLUSTER_TOKEN_ENV}): it "
                        "authenticates the wires between nodes (registration, an MoE group's coordinator); "
                        "required when they listen beyond loopback")
    g.add_argument("--insecure-cluster", action="store_true",
                   help="run the wires between nodes beyond loopback without a cluster token (anyone who "
                        "reaches them can join the group)")
    g.add_argument("--dp-supervisor-probe-interval-s", type=_positive_float, default=5.0,
                   help="seconds between two /health probes of a rank")
    g.add_argument("--dp-supervisor-probe-timeout-s", type=_positive_float, default=5.0,
                   help="a probe not answered within this counts as a failure")
    g.add_argument("--dp-supervisor-probe-failure-threshold", type=_positive_int, default=3,
                   help="consecutive failed probes (timeouts, connection errors) that make a rank unhealthy")
    g.add_argument("--dp-supervisor-probe-generate", type=int, default=0, metavar="N",
                   help="every Nth probe of a ready rank is a 1-token completion instead of /health, so a "
                        "core that no longer makes progress shows even with no traffic (0: never; a queue "
                        "longer than the probe timeout then reads as a hang)")
    g.add_argument("--dp-supervisor-startup-timeout-s", type=_positive_float, default=1800.0,
                   help="a rank not ready this long after its start is restarted")
    g.add_argument("--ready-policy", type=_ready_policy, default="all",
                   help="/readyz is 200 when all ranks, any rank or at least <k> ranks are ready")
    g.add_argument("--on-rank-failure", choices=FAILURE_POLICIES, default="restart",
                   help="restart-rank (dense models' default): restart the failed rank alone, with backoff, "
                        "the others keep serving; restart-group (MoE groups' default): the group stops "
                        "serving, only the failed member restarts, the survivors keep their processes and "
                        "re-join a new process group; restart: the model's default; exit: stop the node, "
                        "exit 1 (vLLM's behaviour)")
    g.add_argument("--admin-token", default=None,
                   help=f"bearer token of the drain/restart endpoints (or ${ADMIN_TOKEN_ENV}); "
                        "without one they answer 404")
    g.add_argument("--drain-timeout-s", type=_non_negative_float, default=None,
                   help="longest wait for a draining rank's in-flight requests (default: --shutdown-timeout)")
    g.add_argument("--scale-down-drain-timeout-s", type=_non_negative_float, default=30.0,
                   help="when POST /scale (lbd scale) removes ranks: longest wait for their in-flight "
                        "requests before SIGTERM; what still runs then is cut with a retryable error, which "
                        "a router resumes on another rank")
    g.add_argument("--restart-backoff-initial-s", type=_non_negative_float, default=1.0,
                   help="delay before the first restart of a failed rank; doubles on each further failure")
    g.add_argument("--restart-backoff-max-s", type=_non_negative_float, default=60.0,
                   help="cap of the restart delay")
    g.add_argument("--restart-backoff-reset-s", type=_non_negative_float, default=300.0,
                   help="a rank ready this long gets the initial delay again on its next failure")
    g.add_argument("--data-parallel-backend", choices=DP_BACKENDS, default="mp",
                   help="mp: ranks are processes on this machine; ray: every rank of the group is placed on "
                        "the Ray cluster (RAY_ADDRESS, else the local one), one placement group per rank, "
                        "--data-parallel-size-local ranks per Ray node")
    g.add_argument("--ray-dp-pack-strategy", choices=RAY_PACK_STRATEGIES, default="strict",
                   help="vLLM's VLLM_RAY_DP_PACK_STRATEGY: strict = exactly --data-parallel-size-local ranks "
                        "on each node used (nodes with less room are skipped); fill = that many on this "
                        "node, as many as fit on the others; span = one rank over several nodes")
    g.add_argument("--rank-engine", choices=ENGINES, default="lbd",
                   help="what each rank runs: lbd's engine, vLLM's OpenAI server (vllm serve) or SGLang's "
                        "(python3 -m sglang.launch_server), each with its own flags for port, DP rank and "
                        "devices; engine flags are translated, or refused when the engine has no equivalent")
    g.add_argument("--prefill-ranks", default=None, metavar="I[,I...]",
                   help="local ranks that prefill for other ranks' decodes (KV producers: their "
                        "--kv-transfer-config is set); /status names their role")
    g.add_argument("--decode-ranks", default=None, metavar="I[,I...]",
                   help="local ranks that decode prompts prefilled elsewhere (KV consumers)")
    g.add_argument("--rank-command", default=None, metavar="TEMPLATE",
                   help="run this command per rank instead; placeholders {model} {served_model_name} {host} "
                        "{port} {rank} {local_rank} {dp_size} {dp_size_local} {devices} {cpus} {tp} {pp}")


def make_parser(prog: str = PROG) -> tuple[OneLineParser, set[str]]:
    """The full parser, and the dests that belong to the engine (passed through to ranks)."""
    # resolve: a flag defined here again (e.g. one the engine lists only to refuse it) means ours
    parser = OneLineParser(prog=prog, allow_abbrev=False, conflict_handler="resolve",
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                           description="Run this node's DP ranks, each an engine server on its own port; "
                                       "probe, restart and drain them; serve one health port.")
    add_engine_arguments(parser)
    engine_dests = {a.dest for a in parser._actions if a.dest != "help"}
    add_supervisor_arguments(parser)
    # a flag both list belongs to the supervisor (see conflict_handler): it is not passed on to ranks
    return parser, engine_dests & {a.dest for a in parser._actions if a.option_strings} - _supervisor_dests()


def _supervisor_dests() -> set[str]:
    probe = argparse.ArgumentParser(add_help=False)
    add_supervisor_arguments(probe)
    return {a.dest for a in probe._actions}


def engine_flags(parser: argparse.ArgumentParser, ns: argparse.Namespace, dests: set[str]) -> list[str]:
    """Rebuild the engine flags the user changed from their defaults, in parser order."""
    out: list[str] = []
    for action in parser._actions:
        if action.dest not in dests or action.dest in RANK_OVERRIDES | ENV_ONLY or not action.option_strings:
            continue
        value = getattr(ns, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            out.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == 0:  # store_true / store_false / store_const
            if value == action.const:
                out.append(flag)
        elif isinstance(value, list | tuple):
            out += [flag, *map(str, value)]
        else:
            out.append(f"{flag}={value}")  # one token: a value that starts with "-" stays a value
    return out


def changed_engine_options(parser: argparse.ArgumentParser, ns: argparse.Namespace,
                           dests: set[str]) -> dict[str, object]:
    """Engine options the user set to something else than their default (rank-assigned ones excluded)."""
    return {a.dest: getattr(ns, a.dest) for a in parser._actions
            if a.dest in dests and a.dest not in RANK_OVERRIDES | ENV_ONLY and a.option_strings
            and getattr(ns, a.dest) != a.default}
