"""The supervisor's Prometheus metrics, in a registry of its own (never multiprocess mode)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_PROBE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class SupervisorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rank_ready = Gauge("lbd_supervisor_rank_ready", "1 when the rank answers its probes and serves.",
                                ["rank"], registry=self.registry)
        self.rank_restarts = Counter("lbd_supervisor_rank_restarts_total", "Restarts of the rank's process.",
                                     ["rank"], registry=self.registry)
        self.probe_duration = Histogram("lbd_supervisor_probe_duration_seconds",
                                        "Duration of /health probes of the ranks, timeouts included.",
                                        ["rank"], buckets=_PROBE_BUCKETS, registry=self.registry)
        self.rank_state = Gauge("lbd_supervisor_rank_state",
                                "1 for the state the rank is in (starting, ready, unhealthy, restarting, "
                                "draining, stopped, failed), 0 for the others.", ["rank", "state"],
                                registry=self.registry)
        self.phase = Gauge("lbd_supervisor_phase", "1 for the node's phase (running, stopping, failed).",
                           ["phase"], registry=self.registry)
        self.ranks = Gauge("lbd_supervisor_ranks", "Local ranks of this node.", registry=self.registry)
        self.ready_ranks = Gauge("lbd_supervisor_ready_ranks", "Local ranks in state ready.",
                                 registry=self.registry)
        self.probe_failures = Counter("lbd_supervisor_probe_failures_total",
                                      "Failed /health probes of a serving rank, by reason.",
                                      ["rank", "reason"], registry=self.registry)
        self.node_ready = Gauge("lbd_supervisor_ready", "1 when /readyz answers 200.", registry=self.registry)

    def add_rank(self, rank: int, states: tuple[str, ...]) -> None:
        """Export a rank's series at 0 from the start, so dashboards see every rank before its first event."""
        self.rank_ready.labels(rank=str(rank)).set(0)
        self.rank_restarts.labels(rank=str(rank))
        self.probe_duration.labels(rank=str(rank))
        for state in states:
            self.rank_state.labels(rank=str(rank), state=state).set(0)
        self.ranks.inc()

    def set_state(self, rank: int, old: str, new: str) -> None:
        self.rank_state.labels(rank=str(rank), state=old).set(0)
        self.rank_state.labels(rank=str(rank), state=new).set(1)

    def set_phase(self, phase: str, phases: tuple[str, ...]) -> None:
        for p in phases:
            self.phase.labels(phase=p).set(1 if p == phase else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
