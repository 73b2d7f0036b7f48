"""The command lines `lbd serve` gives its children, rebuilt from its parsed flags: `lbd supervise` for this
node's ranks (only the engine flags changed from their defaults, without those this layer consumes), where an
MoE group meets, and `lbd route` for the node's API port.
"""

from __future__ import annotations

import argparse

from lbd.common.limits import DEFAULTS as LIMIT_DEFAULTS
from lbd.common.limits import limits_from
from lbd.supervisor.flags import OneLineParser, engine_flags
from lbd.wire.roles import NodeRole

# consumed by `lbd serve`, never passed to the ranks' supervisor as such
_OWN = frozenset({"host", "port", "api_server_count", "data_parallel_address", "data_parallel_rpc_port",
                  "ready_policy", "supervisor_host", "data_parallel_supervisor_port", "max_num_queued_reqs",
                  "max_num_queued_tokens", "cluster_token_file", "insecure_cluster"})


def supervise_argv(parser: OneLineParser, ns: argparse.Namespace, passed: set[str], n: int, local: int,
                   start: int, rank_port: int, rank_host: str | None) -> list[str]:
    """`lbd supervise` flags for this node's ranks (the internal health port is added at start)."""
    argv = engine_flags(parser, ns, passed - _OWN)
    argv += ["--data-parallel-multi-port-external-lb", "--data-parallel-size", str(n),
             "--port", str(rank_port)]
    if ns.data_parallel_backend == "ray":
        if ns.data_parallel_size_local is not None:
            argv += ["--data-parallel-size-local", str(ns.data_parallel_size_local)]
    else:
        argv += ["--data-parallel-size-local", str(local), "--data-parallel-start-rank", str(start)]
    if rank_host is not None:
        argv += ["--host", rank_host]
    return [a for a in argv if not a.startswith("--node-rank")]  # the start rank is explicit


def group_argv(ns: argparse.Namespace, address: str | None, rpc_port: int) -> list[str]:
    """Where an MoE group meets (lbd.serve.group.rendezvous: the store on P+1, the coordinator on P+2 and
    its HTTP on P+3, beside the head's registration on P); on one node without the flags the supervisor picks
    loopback and free ports."""
    if address is not None:
        return ["--data-parallel-address", address, "--data-parallel-rpc-port", str(rpc_port)]
    if ns.data_parallel_rpc_port is not None:
        return ["--data-parallel-rpc-port", str(rpc_port)]
    return []


def route_argv(ns: argparse.Namespace, role: NodeRole, needed: int) -> list[str]:
    """`lbd route` flags: the node's API port, workers, probes like the supervisor's, the queue limits."""
    interval = ns.dp_supervisor_probe_interval_s
    argv = ["--host", ns.host or "0.0.0.0", "--port", str(ns.port), "--workers", str(ns.api_server_count),
            "--min-ready-endpoints", str(needed), "--health-check-interval-s", str(interval),
            "--health-check-timeout-s", str(ns.dp_supervisor_probe_timeout_s),
            "--health-failure-threshold", str(ns.dp_supervisor_probe_failure_threshold),
            "--supervisor-poll-interval-s", str(min(0.5, interval)),
            *_limit_flags(ns), "--shutdown-timeout", str(ns.shutdown_timeout), "--log-level", ns.log_level,
            "--serving-health"]  # the API port stands in for a vLLM server: /health means a request is served
    for flag, value in (("--ssl-certfile", ns.ssl_certfile), ("--ssl-keyfile", ns.ssl_keyfile),
                        ("--ssl-ca-certs", ns.ssl_ca_certs)):
        if value is not None:
            argv.append(f"{flag}={value}")
    if ns.route_policy:
        argv += ["--policy", ns.route_policy]
    if ns.max_num_queued_reqs is not None:
        argv += ["--max-num-queued-reqs", str(ns.max_num_queued_reqs)]
    if ns.max_num_queued_tokens is not None:
        argv += ["--max-num-queued-tokens", str(ns.max_num_queued_tokens)]
    if ns.ttft_target_ms is not None:  # the autoscaling signals' target (lbd.serve.autoscale)
        argv += ["--ttft-target-ms", str(ns.ttft_target_ms)]
    if ns.autoscale_target_utilization is not None:
        argv += ["--autoscale-target-utilization", str(ns.autoscale_target_utilization)]
    if getattr(ns, "otlp_traces_endpoint", None):  # the router's span is the engine span's parent
        argv += ["--otlp-traces-endpoint", ns.otlp_traces_endpoint]
    if getattr(ns, "prefill_ranks", None) or getattr(ns, "decode_ranks", None):  # a P/D node: two stages
        argv.append("--vllm-pd-disaggregation")
    return argv


def _limit_flags(ns: argparse.Namespace) -> list[str]:
    """The connection limits the user changed (the API port is the router's: they apply there too, and the
    body limit always, as the ranks get the same)."""
    limits = limits_from(ns)
    out = []
    for name in type(limits).__dataclass_fields__:
        value = getattr(limits, name)
        if name == "max_request_body_bytes" or value != getattr(LIMIT_DEFAULTS, name):
            out.append(f"--{name.replace('_', '-')}={value}")
    return out
