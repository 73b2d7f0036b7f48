"""One rank endpoint's router-side state: identity, health (eject / half-open re-admit), last telemetry."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from lbd.policies import EndpointSnapshot
from lbd.router.shared import SharedCounters
from lbd.router.telemetry import Sample

# Endpoint fields the policies' snapshot copies (besides the per-request counters and the sample's age).
_SNAPSHOT_INPUTS = frozenset(
    {"url", "rank", "models", "healthy", "routable", "draining", "sample", "prefix_hit_rate", "role"}
)


@dataclass(slots=True)
class Endpoint:
    url: str
    source: str  # "static", "file" or the supervisor URL that lists it
    slot: int
    rank: int | None = None
    models: frozenset[str] = frozenset()
    model_cards: list[dict[str, Any]] = field(default_factory=list)
    # health
    healthy: bool = True
    failures: int = 0  # the largest consecutive count of any source
    failures_by: dict[str, int] = field(default_factory=dict)
    ejected_at: float = 0.0
    last_error: str = ""
    routable: bool = True  # the supervisor's word (ready); static endpoints: always
    draining: bool = False
    pid: int | None = None
    role: str = "mixed"  # a supervisor's word: prefill, decode or mixed (lbd.router.disagg)
    # passive outlier detection (lbd.router.outlier)
    ejected_by: str = ""  # "health" (probes, scrapes, failed requests) or "outlier" (no first byte)
    waiting: dict[Any, float] = field(default_factory=dict)  # attempts without a first byte -> dispatched at
    progress_at: float = 0.0  # loop time of the last first byte or telemetry that showed tokens moving
    outlier_ejections: int = 0
    readmit_at: float = 0.0  # an outlier ejection ends then, with one trial request (half-open)
    half_open: bool = False
    trial: Any = None  # the half-open trial attempt in flight
    # telemetry
    sample: Sample | None = None
    sample_at: float = -math.inf  # loop time the sampled scrape began
    base_dispatched: int = 0  # shared totals when that scrape began (delta accounting)
    base_finished: int = 0
    prefix_hit_rate: float = 0.0
    scrape_errors: int = 0
    telemetry_path: str = "/metrics"  # or the cheap JSON path the engine's /metrics advertised (/telemetry)
    telemetry_refused: bool = False  # that path failed: /metrics until the process behind is a new one
    new_process: bool = False  # a restart was just handled: the next scrape's lower counters are expected
    forgot_at: float = -math.inf  # loop time its cached prefixes were last forgotten (restart, re-admission)
    snap: EndpointSnapshot | None = None
    snap_stale: bool = True  # set by __setattr__ when one of _SNAPSHOT_INPUTS changes

    @property
    def key(self) -> str:
        return self.url

    def record_failure(
        self, source: str, error: str, threshold: int, now: float, may_eject: bool = True
    ) -> bool:
        """Count a connect error, timeout or 5xx seen by ``source`` (probe, scrape, request); True when this
        one ejects the endpoint. Sources count apart: /metrics answering does not excuse a failing /health."""
        n = self.failures_by[source] = self.failures_by.get(source, 0) + 1
        self.failures = max(self.failures, n)
        self.last_error = f"{source}: {error}"
        if self.healthy and n >= threshold and may_eject:
            self.healthy = False
            self.ejected_at = now
            self.ejected_by = "health"
            return True
        return False

    def record_success(self, source: str) -> None:
        if self.healthy and self.failures_by.get(source):
            self.failures_by[source] = 0
            self.failures = max(self.failures_by.values())

    def readmit(self) -> None:
        self.healthy, self.failures, self.last_error = True, 0, ""
        self.failures_by.clear()
        self.ejected_by, self.half_open, self.trial = "", False, None

    def take_sample(self, sample: Sample, began_at: float, base_dispatched: int, base_finished: int) -> bool:
        """Keep a scrape; True when it taught us the endpoint's rank."""
        prev = self.sample
        if prev is not None:
            if sample.generation_tokens > prev.generation_tokens or sample.prompt_tokens > prev.prompt_tokens:
                self.progress_at = began_at
            dq = sample.prefix_queries - prev.prefix_queries
            if dq > 0:
                rate = max(0.0, min(1.0, (sample.prefix_hits - prev.prefix_hits) / dq))
                self.prefix_hit_rate += 0.3 * (rate - self.prefix_hit_rate)
        self.sample, self.sample_at = sample, began_at
        self.base_dispatched, self.base_finished = base_dispatched, base_finished
        if sample.models and not self.model_cards:
            self.models = frozenset(sample.models)
        if len(sample.ranks) == 1 and self.rank is None:
            self.rank = next(iter(sample.ranks))
            return True
        return False

    def __setattr__(self, name: str, value: Any) -> None:
        # Any change to what the snapshot copies from the endpoint marks the copy stale (rare: scrapes,
        # probes, supervisor updates); the hot path then copies only the per-request numbers.
        object.__setattr__(self, name, value)
        if name in _SNAPSHOT_INPUTS:
            object.__setattr__(self, "snap_stale", True)

    def snapshot(self, shared: SharedCounters, now: float) -> EndpointSnapshot:
        """This endpoint as the policies see it now. One object per endpoint, updated in place (the hot path
        builds one per endpoint per request); a decision keeps only its key past the current request step.
        What changes only with scrapes and health is copied only after it changed."""
        d, f, st, dt, stt = shared.sums(self.slot)
        snap = self.snap
        if snap is None or self.snap_stale:
            snap = self._refresh_snapshot()
        snap.inflight, snap.unstarted, snap.unstarted_tokens = d - f, d - st, dt - stt
        if self.sample is not None:
            snap.delta = (d - self.base_dispatched) - (f - self.base_finished)
            age = now - self.sample_at
            snap.age_s = age if age > 0.0 else 0.0
        return snap

    def static_snapshot(self) -> EndpointSnapshot:
        """The snapshot without its live numbers refreshed (identity, health, last scrape)."""
        snap = self.snap
        if snap is None or self.snap_stale:
            snap = self._refresh_snapshot()
        return snap

    def _refresh_snapshot(self) -> EndpointSnapshot:
        snap = self.snap
        if snap is None or snap.key != self.url:
            snap = self.snap = EndpointSnapshot(key=self.url)
        snap.rank, snap.models, snap.role = self.rank, self.models, self.role
        snap.healthy, snap.draining = self.healthy and self.routable, self.draining
        s = self.sample
        if s is not None:
            snap.running, snap.waiting, snap.kv_usage = s.running, s.waiting, s.kv_usage
            snap.prefix_hit_rate, snap.block_size, snap.num_blocks = (
                self.prefix_hit_rate,
                s.block_size or 16,
                s.num_blocks,
            )
        object.__setattr__(self, "snap_stale", False)
        return snap

    def state(self) -> str:
        if self.draining:
            return "draining"
        if not self.routable:
            return "not_ready"
        if self.half_open:
            return "half_open"
        return "ready" if self.healthy else "ejected"
