"""`lbd route`'s flags: the argument table and a parser that reports an error as one line and exits 2."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from lbd import policies
from lbd.common.cpus import usable_cpus
from lbd.common.limits import add_limit_arguments
from lbd.common.lora_modules import lora_module_arg
from lbd.common.tls import add_tls_arguments
from lbd.router.auth import add_auth_arguments
from lbd.router.flow.settings import add_flow_arguments
from lbd.router.kv.index import DEFAULT_BLOCKS_PER_ENDPOINT, DEFAULT_MAX_BLOCKS
from lbd.router.outlier import add_outlier_arguments

PROG = "lbd route"
WORKERS_ENV = "LBD_ROUTE_WORKERS"
AUTO_WORKERS_MAX = 8


def _workers(value: str) -> int:
    """``--workers``: a count, or ``auto`` (one per usable CPU, at most AUTO_WORKERS_MAX)."""
    if value.strip().lower() == "auto":
        return min(AUTO_WORKERS_MAX, usable_cpus())
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number or auto") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} is below 1: give 1 or more, or auto")
    return n


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports an error as one line naming the flag and exits 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)


def make_parser() -> OneLineParser:
    p = OneLineParser(
        prog=PROG,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Balance OpenAI HTTP traffic over DP rank endpoints using their telemetry.",
    )
    g = p.add_argument_group("upstreams")
    g.add_argument(
        "--upstreams",
        action="append",
        default=[],
        metavar="URL[,URL...]",
        help="engine base URLs (http://host:8001) or supervisors (supervisor://host:9256); repeatable",
    )
    g.add_argument(
        "--upstreams-file", type=Path, default=None, help="file with one upstream per line; re-read on SIGHUP"
    )
    g.add_argument(
        "--supervisor-poll-interval-s",
        type=float,
        default=0.5,
        help="how often each supervisor's /status is read (ranks, drains, restarts)",
    )
    g.add_argument("--dns-refresh-interval-s", type=float, default=5.0,
                   help="how often supervisor+dns:// names are resolved again (supervisors come and go)")
    g = p.add_argument_group("prefill/decode disaggregation (vllm-router's flags; lbd.router.disagg)")
    g.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a prefill rank (http://host:port); repeatable; implies --vllm-pd-disaggregation")
    g.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a decode rank (http://host:port); repeatable; implies --vllm-pd-disaggregation")
    g.add_argument("--vllm-pd-disaggregation", "--pd-disaggregation", dest="pd_disaggregation",
                   action="store_true",
                   help="run chat/completions in two stages (prefill rank, then decode rank) with vLLM's "
                        "kv_transfer_params; roles from --prefill/--decode or the supervisors' /status")
    g.add_argument("--pd-min-prompt-tokens", type=int, default=256,
                   help="prompts estimated shorter than this run colocated on one rank (moving their KV "
                        "costs more than it saves)")
    g.add_argument("--pd-prefill-timeout-s", type=float, default=60.0,
                   help="a prefill stage not answered by then runs the request colocated")
    g = p.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="bind address")
    g.add_argument("--port", type=int, default=8080, help="listen port")
    g.add_argument(
        "--workers",
        type=_workers,
        default=os.environ.get(WORKERS_ENV, "auto"),
        help="router processes sharing the port (SO_REUSEPORT) and their load counters: a number, or auto: "
        f"one per usable CPU (affinity set, cgroup quota), at most {AUTO_WORKERS_MAX} (each worker follows "
        f"every rank's KV events and keeps its own index); the default can be set by ${WORKERS_ENV}",
    )
    g.add_argument(
        "--debug-headers",
        action="store_true",
        help="add x-lbd-endpoint and x-lbd-route-reason to every response",
    )
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log verbosity")
    g.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OTLP/HTTP collector URL (e.g. http://collector:4318): a span per request, its context sent "
        "to the engine as W3C traceparent (a client's is continued); off by default",
    )
    g.add_argument(
        "--max-streams-per-endpoint",
        type=int,
        default=1024,
        help="requests in flight to one endpoint (all workers); a full endpoint is skipped, and when every "
        "one is full the answer is 503 with Retry-After",
    )
    add_limit_arguments(p)
    add_tls_arguments(p)
    add_auth_arguments(p)
    g.add_argument("--shutdown-timeout", type=float, default=5.0,
                   help="seconds open requests get to finish after SIGTERM (the port closes at once)")
    g.add_argument("--min-ready-endpoints", type=int, default=1,
                   help="/readyz is 200 once this many endpoints take traffic (at most as many as the router "
                   "knows: a fleet scaled down below it is ready when all it has are)")
    g = p.add_argument_group("admission (over every endpoint together, as vLLM's internal load balancer)")
    g.add_argument("--max-num-queued-reqs", type=int, default=None,
                   help="answer 503 when this many requests are already in flight through the router")
    g.add_argument("--max-num-queued-tokens", type=int, default=None,
                   help="answer 503 while the prompts of requests not yet answering (estimated tokens) "
                        "add up to this many")
    add_flow_arguments(p)
    g = p.add_argument_group("autoscaling signals (lbd_router_autoscale_*: lbd.common.scaling)")
    g.add_argument("--ttft-target-ms", type=float, default=2000.0,
                   help="the time to first token the fleet is sized for: the scaling rule recommends enough "
                        "ranks to serve the token backlog within it (lbd_router_autoscale_recommended_ranks)")
    g.add_argument("--autoscale-target-utilization", type=float, default=0.9,
                   help="the busy fraction (lbd_router_autoscale_saturation) the recommended rank count aims "
                        "for, in (0, 1]: a margin below flow control's saturation point (1.0, where ranks "
                        "stop admitting at once) for the signal's noise and the time added ranks take; lower "
                        "keeps more spare ranks (lbd.common.scaling says why 0.9)")
    g = p.add_argument_group("policy")
    g.add_argument(
        "--policy",
        default=policies.DEFAULT_POLICY,
        choices=sorted(policies.available()),
        help="; ".join(f"{k}: {v}" for k, v in policies.available().items()),
    )
    g.add_argument(
        "--routing-config",
        type=Path,
        default=None,
        metavar="FILE",
        help="a JSON profile composed of registered plugins (filters, weighted scorers, a picker); replaces "
        "--policy; its optional \"prefill\" (a policy's name or a profile object) is the profile P/D's "
        "prefill stages run by, default pd_prefill (see lbd.policies.compose)",
    )
    g.add_argument("--session-header", default="X-Session-ID", help="header the session policy hashes on")
    g.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=None,
        help="predicted_ttft prefill rate; default: learned from observed times to first byte",
    )
    g.add_argument(
        "--evict-weight",
        type=float,
        default=1.0,
        help="predicted_ttft: weight of the hot prefix tokens a placement would evict from a full KV cache "
        "(each evicted one is computed again by its next request); 0 turns the charge off",
    )
    g.add_argument(
        "--lora-max-replicas",
        type=int,
        default=0,
        help="predicted_ttft's adapter scorer: once this many ranks hold a LoRA adapter on device, others "
        "are charged heavily for it, so a popular adapter does not evict every other; 0: no cap",
    )
    g.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module_arg,
        default=(),
        metavar="NAME=PATH",
        help="LoRA adapters the router may load on demand (the engine's syntax; paths as the ranks see "
        "them): a request for one no rank lists loads it on the rank the policy picks",
    )
    g.add_argument(
        "--pin-fallback",
        action="store_true",
        help="route a request pinned to an unhealthy or draining rank elsewhere instead of 503",
    )
    g.add_argument(
        "--kv-events",
        default="auto",
        choices=["auto", "on", "off"],
        help="follow the engines' KV-cache events for exact prefix-cache routing: auto = where an endpoint "
        "advertises them (/kv_event_sources), on = everywhere (warn where missing), off = never; endpoints "
        "without events are routed on the approximate text-prefix index",
    )
    g.add_argument(
        "--tokenizer",
        type=Path,
        default=None,
        help="tokenizer.json (or a folder with it and the chat template) for endpoints that do not serve "
        "their tokenizer (vLLM); lbd engines serve theirs",
    )
    g.add_argument(
        "--forward-prompt-ids",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send each request's token ids (the router tokenized it for the exact view) to the ranks that "
        "advertise they take ids of the same tokenizer and template, so they skip rendering and tokenizing "
        "the prompt again (default: on with the exact view and $LBD_INTERNAL_KEY, the ranks' internal key "
        "the ids are signed with; needs --kv-events auto or on)",
    )
    g.add_argument(
        "--kv-index-max-blocks", type=int, default=DEFAULT_MAX_BLOCKS,
        help="the most blocks the exact KV index holds per worker, over every endpoint: each endpoint gets "
        "an equal share at most (the index costs 100 to 300 bytes per endpoint-block: benchmarks/RESULTS.md)",
    )
    g.add_argument(
        "--kv-index-max-blocks-per-endpoint", type=int, default=None,
        help="the most blocks the exact KV index holds for one endpoint; over it, the endpoint's least "
        "recently stored blocks go (default: twice its reported KV capacity, else "
        f"{DEFAULT_BLOCKS_PER_ENDPOINT})",
    )
    g = p.add_argument_group("telemetry and health")
    g.add_argument(
        "--scrape-interval-ms", type=float, default=100.0,
        help="how often each rank's /metrics is read, by the router as a whole: with --workers N each worker "
        "reads it every N intervals (the engines' metrics cost them CPU; the workers share dispatch counts)",
    )
    g.add_argument(
        "--telemetry-push", default="auto", choices=["auto", "off"],
        help="auto: follow the load stream a rank advertises in its JSON telemetry (lbd.wire.load_state) and "
        "scrape it only while the stream is silent; off: scrape every rank",
    )
    g.add_argument("--scrape-timeout-ms", type=float, default=1000.0,
                   help="a scrape slower than this counts as failed")
    g.add_argument(
        "--stale-after-ms",
        type=float,
        default=None,
        help="telemetry older than this is ignored (default: 10 scrape intervals, at least 1000)",
    )
    g.add_argument(
        "--health-check-interval-s",
        type=float,
        default=5.0,
        help="/health probe interval; also the half-open re-admission probe of ejected endpoints",
    )
    g.add_argument("--health-check-timeout-s", type=float, default=5.0,
                   help="a /health probe slower than this counts as failed")
    g.add_argument(
        "--health-failure-threshold",
        type=int,
        default=3,
        help="consecutive failures (probes, scrapes, connect errors, 5xx; never 4xx) that eject",
    )
    g.add_argument(
        "--serving-health",
        action="store_true",
        help="/health and /v1/models answer 503 with the reason until a request would be served (an endpoint "
        "is ready and its models are known), and a worker holds requests that arrive before then for up to "
        "--retry-budget-s: what /health means on the vLLM server this router stands in for (lbd serve sets "
        "it); without it /health is liveness. /readyz keeps its meaning (--min-ready-endpoints)",
    )
    add_outlier_arguments(g)
    g = p.add_argument_group("timeouts and retries")
    g.add_argument("--connect-timeout-s", type=float, default=5.0,
                   help="TCP connect to an upstream")
    g.add_argument(
        "--response-timeout-s",
        type=float,
        default=600.0,
        help="time to the upstream's response headers (a non-streamed answer sends them at the end)",
    )
    g.add_argument(
        "--stream-idle-timeout-s", type=float, default=300.0, help="longest gap between two chunks"
    )
    g.add_argument(
        "--max-retries",
        type=int,
        default=2,
        help="other endpoints tried when one fails before any byte reached the client",
    )
    g.add_argument("--retry-budget-s", type=float, default=30.0, help="no retry starts after this long")
    g.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="moves of one streamed request to another rank after its upstream failed mid-stream (the "
        "router resumes it from the tokens already sent, lbd.router.migration); 0: the stream ends with an "
        "error event",
    )
    g.add_argument(
        "--migrate-pinned",
        action="store_true",
        help="also move a request pinned with X-data-parallel-rank (without it, it ends with an error event)",
    )
    return p
