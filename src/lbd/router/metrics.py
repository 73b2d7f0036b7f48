"""The router's own Prometheus metrics (never the engines').

With ``--workers N`` > 1 the launcher points PROMETHEUS_MULTIPROC_DIR at a fresh folder before this module is
imported, counters and histograms from every worker are summed at exposition, and the gauges that must be
exact across workers (in-flight) are read from the shared dispatch counters at exposition time.

The per-request updates (requests by endpoint and status, the latency histogram, decisions) are tallied in
plain ints and flushed into the prometheus children at exposition, and with several workers also every
``FLUSH_S`` (another worker's exposition cannot flush this one's tally). Why: in multiprocess mode every
``inc`` takes a lock and packs a double into an mmap, four to five times per request; a tally costs a dict
update. The price is that another worker's last ``FLUSH_S`` of updates may be missing from one exposition.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess as _mp
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
)
FLUSH_S = 0.1
# the router's own time before a request is handed to its upstream's connection: parsing and the decision
_OVERHEAD_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                     1.0)


class _Live(Collector):
    """Gauges computed at exposition: in-flight (all workers), health, scrape age of each endpoint."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, int, bool, float]]]) -> None:
        self.rows = rows

    def collect(self) -> Iterable[GaugeMetricFamily]:
        inflight = GaugeMetricFamily(
            "lbd_router_inflight_requests",
            "Requests in flight per endpoint (all router workers).",
            labels=["endpoint"],
        )
        healthy = GaugeMetricFamily(
            "lbd_router_endpoint_healthy", "1 when the endpoint takes traffic.", labels=["endpoint"]
        )
        age = GaugeMetricFamily(
            "lbd_router_scrape_age_seconds",
            "Age of the endpoint's last /metrics sample.",
            labels=["endpoint"],
        )
        for url, n, ok, age_s in self.rows():
            inflight.add_metric([url], n)
            healthy.add_metric([url], 1.0 if ok else 0.0)
            age.add_metric([url], age_s if age_s != float("inf") else -1.0)
        yield inflight
        yield healthy
        yield age


class _KvLive(Collector):
    """KV-event gauges per endpoint with a feed: event lag, age of the last batch, indexed blocks."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, float, float, int]]]) -> None:
        self.rows = rows

    def collect(self) -> Iterable[GaugeMetricFamily]:
        lag = GaugeMetricFamily(
            "lbd_router_kv_event_lag_seconds",
            "Arrival time minus the engine's timestamp of the last KV-event batch (this worker).",
            labels=["endpoint"],
        )
        age = GaugeMetricFamily(
            "lbd_router_kv_event_age_seconds",
            "Seconds since the endpoint's last KV-event batch (-1: none yet; this worker).",
            labels=["endpoint"],
        )
        blocks = GaugeMetricFamily(
            "lbd_router_kv_index_blocks", "Blocks in the exact index of the endpoint (this worker).",
            labels=["endpoint"],
        )
        for url, lag_s, age_s, n in self.rows():
            lag.add_metric([url], lag_s)
            age.add_metric([url], age_s)
            blocks.add_metric([url], n)
        yield lag
        yield age
        yield blocks


class _PushLive(Collector):
    """Pushed-telemetry gauges per endpoint that advertises a load stream (lbd.router.load_feed)."""

    def __init__(self, rows: Callable[[], Iterable[tuple[str, float, bool]]]) -> None:
        self.rows = rows

    def collect(self) -> Iterable[GaugeMetricFamily]:
        age = GaugeMetricFamily(
            "lbd_router_telemetry_push_age_seconds",
            "Seconds since the endpoint's last pushed load state (-1: none yet; this worker).",
            labels=["endpoint"],
        )
        stale = GaugeMetricFamily(
            "lbd_router_telemetry_push_stale",
            "1 when the endpoint's load stream went silent and it is scraped instead (this worker).",
            labels=["endpoint"],
        )
        for url, age_s, is_stale in self.rows():
            age.add_metric([url], age_s)
            stale.add_metric([url], 1.0 if is_stale else 0.0)
        yield age
        yield stale


class FlowCollector(Collector):
    """Flow control per tenant and class, summed over every worker from shared memory (lbd.router.flow):
    held requests, their waits, what was dispatched and served, what was answered instead of held."""

    def __init__(self, rows: Callable[[], Iterable[Any]]) -> None:
        self.rows = rows

    def collect(self) -> Iterable[Any]:
        lab = ["tenant", "priority"]
        fams = (GaugeMetricFamily("lbd_router_flow_queued", "Requests held in the router.", labels=lab),
                CounterMetricFamily("lbd_router_flow_wait_seconds", "Time requests were held.", labels=lab),
                CounterMetricFamily("lbd_router_flow_dispatched", "Requests let through.", labels=lab),
                CounterMetricFamily("lbd_router_flow_dispatched_tokens", "Prompt tokens let through.",
                                    labels=lab),
                CounterMetricFamily("lbd_router_flow_served_tokens", "Prompt and output tokens of ended "
                                    "requests.", labels=lab))
        shed = CounterMetricFamily("lbd_router_flow_shed", "Requests answered instead of held, by reason "
                                   "(sheddable 503, queue_full 429, late 503).", labels=[*lab, "reason"])
        for r in self.rows():
            values = (r.queued, r.wait_s, r.dispatched, r.dispatched_tokens, r.served_tokens)
            for fam, v in zip(fams, values, strict=True):
                fam.add_metric([r.tenant, str(r.priority)], v)
            for reason, v in (("sheddable", r.shed), ("queue_full", r.full), ("late", r.late)):
                shed.add_metric([r.tenant, str(r.priority), reason], v)
        yield from fams
        yield shed


class RouterMetrics:
    def __init__(
        self,
        live_rows: Callable[[], Iterable[tuple[str, int, bool, float]]],
        kv_rows: Callable[[], Iterable[tuple[str, float, float, int]]] = list,
        push_rows: Callable[[], Iterable[tuple[str, float, bool]]] = list,
    ) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        own = None if self.multiprocess else CollectorRegistry()
        self._declare({"registry": own})
        self._registry = CollectorRegistry()
        if self.multiprocess:
            _mp.MultiProcessCollector(self._registry)
        else:
            self._registry = own  # type: ignore[assignment]
        self._registry.register(_Live(live_rows))
        self._registry.register(_KvLive(kv_rows))
        self._registry.register(_PushLive(push_rows))
        # tallies since the last flush
        self._requests: dict[tuple[str, str], int] = {}
        self._decisions: dict[tuple[str, str], int] = {}
        self._latency: dict[str, list[float]] = {}  # endpoint -> [count per bucket..., +Inf count, sum]
        self._overhead: dict[str, list[float]] = {}  # policy -> the same
        self._flush_at: asyncio.TimerHandle | None = None

    def register(self, collector: Collector) -> None:
        """Another collector of live values on /metrics (the exact KV index's: lbd.router.kv.memory)."""
        self._registry.register(collector)

    def _declare(self, kw: dict[str, Any]) -> None:
        """The metrics (a table); ``kw``: the registry to put them in (None: the multiprocess one)."""
        self.requests = Counter(
            "lbd_router_requests",
            "Requests answered, by endpoint and HTTP status.",
            ["endpoint", "status"],
            **kw,
        )
        self.latency = Histogram(
            "lbd_router_request_duration_seconds",
            "Time from request to last byte.",
            ["endpoint"],
            buckets=_BUCKETS,
            **kw,
        )
        self.overhead = Histogram(
            "lbd_router_overhead_seconds",
            "Router time from a request's arrival to its dispatch to the chosen upstream (body parse, "
            "facts, decision), per attempt.",
            ["policy"],
            buckets=_OVERHEAD_BUCKETS,
            **kw,
        )
        self.decisions = Counter(
            "lbd_router_decisions", "Routing decisions by policy and reason.", ["policy", "reason"], **kw
        )
        self.retries = Counter(
            "lbd_router_retries", "Requests retried on another endpoint, by cause.", ["reason"], **kw
        )
        self.ejections = Counter(
            "lbd_router_ejections", "Endpoints ejected after consecutive failures.", ["endpoint"], **kw
        )
        self.readmissions = Counter(
            "lbd_router_readmissions", "Ejected endpoints re-admitted by a probe.", ["endpoint"], **kw
        )
        self.scrape_errors = Counter(
            "lbd_router_scrape_errors", "Failed /metrics scrapes.", ["endpoint"], **kw
        )
        self.upstream_errors = Counter(
            "lbd_router_upstream_errors", "Upstream failures by kind.", ["endpoint", "kind"], **kw
        )
        self.rate_limited = Counter(
            "lbd_router_rate_limited", "Requests answered 429 by a key's rate limit.", ["key"], **kw
        )
        self.disconnects = Counter(
            "lbd_router_client_disconnects", "Clients gone before their response ended.", ["endpoint"], **kw
        )
        self.migrations = Counter(
            "lbd_router_migrations",
            "Streams moved to another rank after a mid-stream failure (lbd.router.migration), by the failure "
            "and outcome (resumed, failed, impossible, limit, no_endpoint; finished: cut after its finish).",
            ["reason", "outcome"],
            **kw,
        )
        self.migration_gap = Histogram(
            "lbd_router_migration_gap_seconds",
            "Time from a stream's failure to the next token from the rank it moved to.",
            buckets=_BUCKETS,
            **kw,
        )

    def _dirty(self) -> None:
        if self.multiprocess and self._flush_at is None:
            self._flush_at = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def decision(self, policy: str, reason: str) -> None:
        key = (policy, reason)
        self._decisions[key] = self._decisions.get(key, 0) + 1
        self._dirty()

    def request(self, endpoint: str, status: str, seconds: float | None) -> None:
        """One answered request: requests_total and (unless ``seconds`` is None) the latency histogram."""
        key = (endpoint, status)
        self._requests[key] = self._requests.get(key, 0) + 1
        self._dirty()
        if seconds is None:
            return
        tally = self._latency.get(endpoint)
        if tally is None:
            tally = self._latency[endpoint] = [0.0] * (len(_BUCKETS) + 2)
        tally[bisect.bisect_left(_BUCKETS, seconds)] += 1
        tally[-1] += seconds

    def dispatched(self, policy: str, reason: str, overhead_s: float) -> None:
        """A request sent to an upstream: the decision's reason and the router's overhead until then."""
        key = (policy, reason)
        self._decisions[key] = self._decisions.get(key, 0) + 1
        self._dirty()
        tally = self._overhead.get(policy)
        if tally is None:
            tally = self._overhead[policy] = [0.0] * (len(_OVERHEAD_BUCKETS) + 2)
        tally[bisect.bisect_left(_OVERHEAD_BUCKETS, overhead_s)] += 1
        tally[-1] += overhead_s

    def flush(self) -> None:
        """Move the tallies into the prometheus children."""
        self._flush_at = None
        requests, self._requests = self._requests, {}
        decisions, self._decisions = self._decisions, {}
        latency, self._latency = self._latency, {}
        overhead, self._overhead = self._overhead, {}
        for (endpoint, status), n in requests.items():
            self.requests.labels(endpoint, status).inc(n)
        for (policy, reason), n in decisions.items():
            self.decisions.labels(policy, reason).inc(n)
        for endpoint, tally in latency.items():
            _add_tally(self.latency.labels(endpoint), tally)
        for policy, tally in overhead.items():
            _add_tally(self.overhead.labels(policy), tally)

    def close(self) -> None:
        if self._flush_at is not None:
            self._flush_at.cancel()
        self.flush()

    def render(self) -> bytes:
        self.flush()
        return generate_latest(self._registry)


def _add_tally(child: Any, tally: list[float]) -> None:
    # A histogram child keeps one (non-cumulative) counter per bucket and a sum; observe() would replay every
    # request.
    for bucket, n in zip(child._buckets, tally[:-1], strict=True):
        if n:
            bucket.inc(n)
    child._sum.inc(tally[-1])
