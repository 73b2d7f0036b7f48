"""The router's own Prometheus metrics (never the engines').

With ``--workers N`` > 1 the launcher points PROMETHEUS_MULTIPROC_DIR at a fresh folder before this module is
imported, counters and histograms from every worker are summed at exposition, and the gauges that must be
exact across workers (in-flight) are read from the shared dispatch counters at exposition time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess as _mp
from prometheus_client.core import GaugeMetricFamily
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


class RouterMetrics:
    def __init__(self, live_rows: Callable[[], Iterable[tuple[str, int, bool, float]]]) -> None:
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        own = None if self.multiprocess else CollectorRegistry()
        kw: dict[str, Any] = {"registry": own}
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
        self.disconnects = Counter(
            "lbd_router_client_disconnects", "Clients gone before their response ended.", ["endpoint"], **kw
        )
        self._registry = CollectorRegistry()
        if self.multiprocess:
            _mp.MultiProcessCollector(self._registry)
        else:
            self._registry = own  # type: ignore[assignment]
        self._registry.register(_Live(live_rows))
        self._decision_children: dict[tuple[str, str], Any] = {}

    def decision(self, policy: str, reason: str) -> None:
        child = self._decision_children.get((policy, reason))
        if child is None:
            child = self._decision_children[(policy, reason)] = self.decisions.labels(policy, reason)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self._registry)
