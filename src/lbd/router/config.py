"""`lbd route`'s flags validated (exit 2 naming the flag) into a RouterConfig, and the upstream specs they
name (the flags themselves: ``lbd.router.flags``)."""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from lbd.common.auth import key_lines, read_key_file
from lbd.common.cluster import ClusterTokenError, read_strong_internal_key, read_strong_token
from lbd.common.internal_key import INTERNAL_KEY_ENV
from lbd.common.limits import Limits, check_limits, limits_from
from lbd.common.lora_modules import LoraModule
from lbd.common.otlp import check_otlp_endpoint
from lbd.common.tls import check_tls
from lbd.policies import compose
from lbd.router.auth import ROUTER_KEYS_ENV, UPSTREAM_KEY_ENV
from lbd.router.flags import OneLineParser, make_parser
from lbd.router.flow.settings import FlowSettings, flow_settings
from lbd.router.kv.index import DEFAULT_MAX_BLOCKS


@dataclass(slots=True, frozen=True)
class Upstream:
    """An engine base URL, or a supervisor whose /status lists a node's ranks."""

    kind: str  # "engine" | "supervisor" | "supervisor-dns" (every address of a DNS name is a supervisor)
    url: str  # http(s)://host:port with no trailing slash (a supervisor's health-port base)

    @property
    def status_url(self) -> str:
        return self.url + "/status"


def parse_upstream(text: str) -> Upstream:
    """``http://host:port``, ``https://...``, ``supervisor://host:port``, ``supervisor+https://host:port`` (a
    supervisor whose health port speaks TLS; IPv6 literals in brackets) or ``supervisor+dns://name:port``:
    every address the name resolves to, re-resolved periodically (a Kubernetes headless Service of
    supervisors)."""
    raw = text.strip()
    if "://" not in raw:
        raise ValueError(f"{raw!r} has no scheme: use http://host:port or supervisor://host:port")
    parts = urlsplit(raw)
    if parts.scheme not in ("http", "https", "supervisor", "supervisor+https", "supervisor+dns"):
        raise ValueError(
            f"{raw!r}: scheme must be http, https, supervisor, supervisor+https or supervisor+dns"
        )
    try:
        host, port = parts.hostname, parts.port
    except ValueError as e:
        raise ValueError(f"{raw!r}: {e}") from None
    if not host:
        raise ValueError(f"{raw!r} has no host")
    if parts.path not in ("", "/") or parts.query:
        raise ValueError(f"{raw!r}: give the base URL only (no path or query)")
    try:
        netloc_host = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        netloc_host = host
    if parts.scheme in ("supervisor", "supervisor+https"):
        scheme = "https" if parts.scheme == "supervisor+https" else "http"
        return Upstream("supervisor", f"{scheme}://{netloc_host}:{port or 9256}")
    if parts.scheme == "supervisor+dns":
        return Upstream("supervisor-dns", f"http://{netloc_host}:{port or 9256}")
    default = 443 if parts.scheme == "https" else 80
    return Upstream("engine", f"{parts.scheme}://{netloc_host}:{port or default}")


def read_upstreams_file(path: Path) -> list[Upstream]:
    """One upstream per line (commas allowed); ``#`` starts a comment."""
    out: list[Upstream] = []
    for line in path.read_text().splitlines():
        for item in line.split("#", 1)[0].split(","):
            if item.strip():
                out.append(parse_upstream(item))
    return out


@dataclass(slots=True)
class RouterConfig:
    upstreams: list[Upstream]
    upstreams_file: Path | None
    host: str
    port: int
    policy: str  # a built-in policy's name, or the --routing-config profile's
    workers: int
    scrape_interval_s: float
    scrape_timeout_s: float
    stale_after_s: float
    health_interval_s: float
    health_timeout_s: float
    health_failure_threshold: int
    supervisor_poll_interval_s: float
    connect_timeout_s: float
    response_timeout_s: float
    stream_idle_timeout_s: float
    max_retries: int
    retry_budget_s: float
    max_request_body_bytes: int
    migration_limit: int
    migrate_pinned: bool
    pin_fallback: bool
    debug_headers: bool
    session_header: str
    prefill_tokens_per_s: float | None
    log_level: str
    kv_events: str = "auto"
    kv_index_max_blocks: int = DEFAULT_MAX_BLOCKS  # the exact index's caps (lbd.router.kv.index)
    kv_index_max_blocks_per_endpoint: int | None = None  # None: from the endpoint's KV capacity
    telemetry_push: str = "auto"  # follow the load streams ranks advertise (lbd.router.load_feed)
    evict_weight: float = 1.0
    lora_max_replicas: int = 0  # the adapter scorer's cap on one adapter's device copies (0: none)
    lora_modules: tuple[LoraModule, ...] = ()  # adapters loaded on demand (lbd.router.adapter_loader)
    tokenizer: Path | None = None
    forward_prompt_ids: bool = True  # send ranks that take them our token ids (lbd.router.kv.forward)
    dns_refresh_interval_s: float = 5.0
    min_ready_endpoints: int = 1
    serving_health: bool = False  # /health and /v1/models 503 until a request would be served
    max_num_queued_reqs: int | None = None  # over every endpoint (see lbd.router.admission)
    max_num_queued_tokens: int | None = None
    shutdown_timeout_s: float = 5.0
    otlp_traces_endpoint: str | None = None
    limits: Limits = field(default_factory=Limits)
    max_streams_per_endpoint: int = 1024
    # authentication and rate limits (lbd.router.auth)
    api_keys: list[str] = field(default_factory=list)
    api_key_file: Path | None = None
    forward_authorization: bool = False
    upstream_api_key: str | None = None
    internal_key: str | None = field(default=None, repr=False)  # $LBD_INTERNAL_KEY: signs forwarded ids
    rate_limit_rps: float = 0.0
    rate_limit_tps: float = 0.0
    rate_limit_burst_s: float = 1.0
    # passive outlier detection (lbd.router.outlier)
    outlier_first_byte_timeout_s: float = 30.0
    outlier_ejection_s: float = 30.0
    outlier_max_ejection_percent: float = 50.0
    outlier_consecutive_5xx: int = 5
    # TLS
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    # prefill/decode disaggregation (lbd.router.disagg)
    pd_disaggregation: bool = False
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    pd_min_prompt_tokens: int = 256
    pd_prefill_timeout_s: float = 60.0
    routing_config: Path | None = None  # the file the policy's profile was composed from
    flow: FlowSettings = field(default_factory=FlowSettings)  # flow control (lbd.router.flow)
    ttft_target_s: float = 2.0  # the autoscaling signals' TTFT target (lbd.router.autoscale_signals)
    autoscale_target_utilization: float = 0.9  # the busy fraction the recommendation aims for


def parse_args(argv: list[str]) -> RouterConfig:
    """The router's settings from its command line; a bad value exits 2 naming the flag and the fix."""
    p = make_parser()
    ns = p.parse_args(argv)
    upstreams = _upstreams(p, ns)
    _check_numbers(p, ns)
    if len({m.name for m in ns.lora_modules}) != len(ns.lora_modules):
        p.error("--lora-modules names an adapter twice: give each name once")
    limits = _check_files_and_limits(p, ns)
    _check_keys(p, ns)
    _routing_config(p, ns)
    flow = flow_settings(ns)
    if isinstance(flow, str):
        p.error(flow)
    ns.flow = flow
    try:  # $LBD_CLUSTER_TOKEN keys the CURVE load streams it follows (lbd.router.load_feed),
        read_strong_token(None)  # $LBD_INTERNAL_KEY signs forwarded ids: each 256 bits or more
        read_strong_internal_key()
    except ClusterTokenError as e:
        p.error(str(e))
    return _config(ns, upstreams, limits)


def _routing_config(p: OneLineParser, ns: argparse.Namespace) -> None:
    """--routing-config: the profile it composes, registered under its name, becomes the policy (the forked
    workers inherit the registration)."""
    path = ns.routing_config
    if path is None:
        return
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        p.error(f"--routing-config {path}: {e.strerror or e}")
    except ValueError as e:
        p.error(f"--routing-config {path}: not JSON ({e}); write the profile as a JSON object")
    try:
        ns.policy = compose.register(data)  # (and the prefill profile it composes for P/D, if any)
    except compose.ConfigError as e:
        p.error(f"--routing-config {path}: {e}")


def _upstreams(p: OneLineParser, ns: argparse.Namespace) -> list[Upstream]:
    """--upstreams, checked; --upstreams-file is read here only to check it (the app follows it)."""
    upstreams: list[Upstream] = _pd_upstreams(p, ns)
    for item in (x for arg in ns.upstreams for x in arg.split(",") if x.strip()):
        try:
            upstreams.append(parse_upstream(item))
        except ValueError as e:
            p.error(f"--upstreams: {e}")
    if ns.upstreams_file is not None:
        try:
            read_upstreams_file(ns.upstreams_file)
        except OSError as e:
            p.error(f"--upstreams-file {ns.upstreams_file}: {e.strerror or e}")
        except ValueError as e:
            p.error(f"--upstreams-file {ns.upstreams_file}: {e}")
    elif not upstreams:
        p.error("--upstreams (or --upstreams-file) is required: e.g. --upstreams supervisor://127.0.0.1:9256")
    return upstreams


def _pd_upstreams(p: OneLineParser, ns: argparse.Namespace) -> list[Upstream]:
    """--prefill and --decode: engine URLs, also upstreams; normalized back into ``ns`` (endpoint keys)."""
    out: list[Upstream] = []
    for flag in ("prefill", "decode"):
        urls = []
        for item in (x for arg in getattr(ns, flag) for x in arg.split(",") if x.strip()):
            try:
                up = parse_upstream(item)
            except ValueError as e:
                p.error(f"--{flag}: {e}")
            if up.kind != "engine":
                p.error(f"--{flag} {item}: give an engine rank's http(s):// URL (a supervisor's ranks say "
                        "their roles in its /status)")
            urls.append(up.url)
            out.append(up)
        setattr(ns, flag, tuple(urls))
    if ns.pd_min_prompt_tokens < 0 or ns.pd_prefill_timeout_s <= 0:
        p.error("--pd-min-prompt-tokens must be >= 0 and --pd-prefill-timeout-s > 0")
    return out


def _check_files_and_limits(p: OneLineParser, ns: argparse.Namespace) -> Limits:
    """The trace endpoint, the tokenizer, the HTTP limits and the TLS files."""
    if ns.otlp_traces_endpoint:
        problem = check_otlp_endpoint(ns.otlp_traces_endpoint)
        if problem:
            p.error(problem)
    tok = ns.tokenizer
    if tok is not None and not (tok.is_file() or (tok / "tokenizer.json").is_file()):
        p.error(f"--tokenizer {ns.tokenizer}: no tokenizer.json there")
    limits = limits_from(ns)
    problem = check_limits(limits) or check_tls(
        ns.ssl_certfile, ns.ssl_keyfile, ns.ssl_ca_certs, ns.ssl_cert_reqs
    )
    if problem:
        p.error(problem)
    return limits


def _check_keys(p: OneLineParser, ns: argparse.Namespace) -> None:
    """The clients' API keys (flags, the environment, the key file) and the rate limits that need them."""
    ns.api_key = [*ns.api_key, *key_lines(os.environ.get(ROUTER_KEYS_ENV, ""))]
    if (ns.rate_limit_rps or ns.rate_limit_tps) and not (ns.api_key or ns.api_key_file):
        p.error("--rate-limit-rps/--rate-limit-tps are per API key: give --api-key or --api-key-file too")
    if ns.api_key_file is not None:
        try:
            read_key_file(ns.api_key_file)
        except OSError as e:
            p.error(f"--api-key-file {ns.api_key_file}: {e.strerror or e}")
        except ValueError as e:
            p.error(f"--api-key-file: {e}")


def _config(ns: argparse.Namespace, upstreams: list[Upstream], limits: Limits) -> RouterConfig:
    """The checked flags as settings (an argument table)."""
    per_worker = ns.scrape_interval_ms * max(1, ns.workers)
    stale = ns.stale_after_ms if ns.stale_after_ms is not None else max(1000.0, 10 * ns.scrape_interval_ms,
                                                                        3 * per_worker)
    return RouterConfig(
        upstreams=upstreams,
        upstreams_file=ns.upstreams_file,
        host=ns.host, port=ns.port,
        policy=ns.policy,
        workers=ns.workers,
        scrape_interval_s=ns.scrape_interval_ms / 1000,
        scrape_timeout_s=ns.scrape_timeout_ms / 1000,
        stale_after_s=stale / 1000,
        health_interval_s=ns.health_check_interval_s,
        health_timeout_s=ns.health_check_timeout_s,
        health_failure_threshold=ns.health_failure_threshold,
        supervisor_poll_interval_s=ns.supervisor_poll_interval_s,
        connect_timeout_s=ns.connect_timeout_s,
        response_timeout_s=ns.response_timeout_s,
        stream_idle_timeout_s=ns.stream_idle_timeout_s,
        max_retries=ns.max_retries,
        retry_budget_s=ns.retry_budget_s,
        max_request_body_bytes=ns.max_request_body_bytes,
        migration_limit=ns.migration_limit, migrate_pinned=ns.migrate_pinned,
        pin_fallback=ns.pin_fallback,
        debug_headers=ns.debug_headers,
        session_header=ns.session_header,
        prefill_tokens_per_s=ns.prefill_tokens_per_s,
        log_level=ns.log_level,
        otlp_traces_endpoint=ns.otlp_traces_endpoint,
        kv_events=ns.kv_events, telemetry_push=ns.telemetry_push,
        evict_weight=ns.evict_weight, lora_max_replicas=ns.lora_max_replicas,
        lora_modules=tuple(ns.lora_modules), tokenizer=ns.tokenizer,
        forward_prompt_ids=ns.forward_prompt_ids is not False,
        limits=limits,
        max_streams_per_endpoint=ns.max_streams_per_endpoint,
        api_keys=list(ns.api_key),
        api_key_file=ns.api_key_file,
        forward_authorization=ns.forward_authorization,
        upstream_api_key=ns.upstream_api_key or os.environ.get(UPSTREAM_KEY_ENV) or None,
        internal_key=os.environ.get(INTERNAL_KEY_ENV, "").strip() or None,
        rate_limit_rps=ns.rate_limit_rps,
        rate_limit_tps=ns.rate_limit_tps,
        rate_limit_burst_s=ns.rate_limit_burst_s,
        outlier_first_byte_timeout_s=ns.outlier_first_byte_timeout_s,
        outlier_ejection_s=ns.outlier_ejection_s,
        outlier_max_ejection_percent=ns.outlier_max_ejection_percent,
        outlier_consecutive_5xx=ns.outlier_consecutive_5xx,
        ssl_keyfile=ns.ssl_keyfile, ssl_certfile=ns.ssl_certfile, ssl_ca_certs=ns.ssl_ca_certs,
        ssl_cert_reqs=ns.ssl_cert_reqs,
        dns_refresh_interval_s=ns.dns_refresh_interval_s,
        min_ready_endpoints=ns.min_ready_endpoints,
        serving_health=ns.serving_health,
        max_num_queued_reqs=ns.max_num_queued_reqs,
        max_num_queued_tokens=ns.max_num_queued_tokens,
        shutdown_timeout_s=ns.shutdown_timeout, routing_config=ns.routing_config, flow=ns.flow,
        ttft_target_s=ns.ttft_target_ms / 1000, autoscale_target_utilization=ns.autoscale_target_utilization,
        **_pd_settings(ns), **_kv_index_settings(ns),
    )


def _kv_index_settings(ns: argparse.Namespace) -> dict[str, object]:
    """The exact KV index's caps (lbd.router.kv.index)."""
    return {"kv_index_max_blocks": ns.kv_index_max_blocks,
            "kv_index_max_blocks_per_endpoint": ns.kv_index_max_blocks_per_endpoint}


def _pd_settings(ns: argparse.Namespace) -> dict[str, object]:
    """Prefill/decode disaggregation's settings (lbd.router.disagg); --prefill/--decode turn it on."""
    return {"pd_disaggregation": bool(ns.pd_disaggregation or ns.prefill or ns.decode), "prefill": ns.prefill,
            "decode": ns.decode, "pd_min_prompt_tokens": ns.pd_min_prompt_tokens,
            "pd_prefill_timeout_s": ns.pd_prefill_timeout_s}


def _check_numbers(p: OneLineParser, ns: argparse.Namespace) -> None:
    positive = {
        "--workers": ns.workers,
        "--scrape-interval-ms": ns.scrape_interval_ms,
        "--scrape-timeout-ms": ns.scrape_timeout_ms,
        "--health-check-interval-s": ns.health_check_interval_s,
        "--health-check-timeout-s": ns.health_check_timeout_s,
        "--health-failure-threshold": ns.health_failure_threshold,
        "--supervisor-poll-interval-s": ns.supervisor_poll_interval_s,
        "--connect-timeout-s": ns.connect_timeout_s,
        "--response-timeout-s": ns.response_timeout_s,
        "--stream-idle-timeout-s": ns.stream_idle_timeout_s,
        "--max-streams-per-endpoint": ns.max_streams_per_endpoint,
        "--rate-limit-burst-s": ns.rate_limit_burst_s,
        "--outlier-ejection-s": ns.outlier_ejection_s,
        "--outlier-consecutive-5xx": ns.outlier_consecutive_5xx,
        "--max-request-body-bytes": ns.max_request_body_bytes,
        "--dns-refresh-interval-s": ns.dns_refresh_interval_s,
        "--min-ready-endpoints": ns.min_ready_endpoints,
        "--kv-index-max-blocks": ns.kv_index_max_blocks,
        "--ttft-target-ms": ns.ttft_target_ms,
    }
    for flag, value in {"--max-num-queued-reqs": ns.max_num_queued_reqs,
                        "--max-num-queued-tokens": ns.max_num_queued_tokens}.items():
        if value is not None:
            positive[flag] = value
    if not 0 < ns.autoscale_target_utilization <= 1:
        p.error(f"--autoscale-target-utilization must be in (0, 1], got {ns.autoscale_target_utilization}")
    if ns.stale_after_ms is not None:
        positive["--stale-after-ms"] = ns.stale_after_ms
    if ns.kv_index_max_blocks_per_endpoint is not None:
        positive["--kv-index-max-blocks-per-endpoint"] = ns.kv_index_max_blocks_per_endpoint
    if ns.prefill_tokens_per_s is not None:
        positive["--prefill-tokens-per-s"] = ns.prefill_tokens_per_s
    for flag, value in positive.items():
        if not value > 0:
            p.error(f"{flag} must be positive, got {value}")
    for flag, value in {
        "--max-retries": ns.max_retries,
        "--retry-budget-s": ns.retry_budget_s,
        "--migration-limit": ns.migration_limit,
        "--rate-limit-rps": ns.rate_limit_rps,
        "--rate-limit-tps": ns.rate_limit_tps,
        "--outlier-first-byte-timeout-s": ns.outlier_first_byte_timeout_s,
        "--shutdown-timeout": ns.shutdown_timeout,
        "--evict-weight": ns.evict_weight, "--lora-max-replicas": ns.lora_max_replicas,
    }.items():
        if value < 0:
            p.error(f"{flag} must be >= 0, got {value}")
    if ns.forward_prompt_ids and ns.kv_events == "off":
        p.error("--forward-prompt-ids needs the exact view, which --kv-events off turns off: drop one")
    if ns.forward_prompt_ids and not os.environ.get(INTERNAL_KEY_ENV, "").strip():
        p.error(f"--forward-prompt-ids needs the ranks' internal key in ${INTERNAL_KEY_ENV} (the ids go "
                "signed with it; ranks take no others): set it, the same as the ranks', or drop the flag")
    if not 0 <= ns.port <= 65535:
        p.error(f"--port {ns.port} is out of range: use 0..65535")
    if not 0 <= ns.outlier_max_ejection_percent <= 100:
        p.error(f"--outlier-max-ejection-percent must be in 0..100, got {ns.outlier_max_ejection_percent}")
    if ns.workers > 64:
        p.error(f"--workers {ns.workers} is more than 64")
