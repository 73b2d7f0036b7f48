"""What the router knows of its endpoints, and the one place that changes it.

``Endpoint`` is the record of one rank endpoint: identity (URL, DP rank, models, role, pid), health (failures
by source, ejection, half-open re-admission), the attempts waiting on it for a first byte, and its last load
sample. ``Fleet`` holds every record, in rank order, and is the only code that assigns a record's fields
(``tests/test_architecture.py`` reads the router's source and fails on an assignment anywhere else). Each
source of knowledge calls one of its named methods, never a field:

- the endpoint list (static, ``--upstreams-file``, a supervisor's /status, DNS: ``lbd.router.monitor``,
  ``lbd.router.discovery``): ``add``, ``remove``, ``supervise`` (ready, draining, role, pid); /v1/models:
  ``set_models``; --prefill/--decode (``lbd.router.disagg``): ``set_role``;
- telemetry, scraped (``lbd.router.monitor``) or pushed (``lbd.router.load_feed``): ``observe`` (a
  ``lbd.router.telemetry.Sample``; it also feeds each rank's token rates, served and offered, and the
  fleet's ``capacity`` and ``output`` size, ``lbd.common.throughput``), ``sample_holds`` (a fresh stream
  sent no change), ``use_telemetry`` and ``refuse_telemetry`` (which path to scrape), ``scrape_failed``;
- health probes and request outcomes: ``fail``, ``succeeded``, ``readmit``; a new process behind the URL:
  ``restarted``;
- passive outlier detection (``lbd.router.outlier`` decides; the fleet records): ``sent``, ``answered``,
  ``ended``, ``eject``, ``open_half``, ``forgive``.

The policies never see a record: ``snapshot`` and ``snapshots`` hand out ``lbd.policies.EndpointSnapshot``s,
one object per endpoint refreshed in place, where what changes only with telemetry and health is copied only
after it changed (the record's ``__setattr__`` marks the copy stale). Whoever must act on an endpoint's life
listens: ``on_added``, ``on_removed``, ``on_readmitted``, ``on_restarted`` (the router's state opens and
closes upstream pools and makes the policy and the exact view forget; the monitor starts and stops its
loops).

Not here, on purpose: the dispatch counters every worker writes (``lbd.router.shared``, shared memory; a
snapshot sums them), parsing telemetry (``lbd.router.telemetry``, a pure function), and each pushed stream's
connection state (``lbd.router.load_feed``: socket, sequence numbers, staleness, which decides when the scrape
loop runs; what a stream says reaches the endpoint through ``observe``).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from lbd.common.throughput import Capacity, Offered, OutputSize, TokenRate
from lbd.policies import EndpointSnapshot
from lbd.router.shared import SharedCounters, Totals
from lbd.router.telemetry import Sample, with_cards

if TYPE_CHECKING:  # (not the config: lbd.router.config imports lbd.router.outlier, which imports this)
    from lbd.router.metrics import RouterMetrics

log = logging.getLogger("lbd.router")

# Endpoint fields the policies' snapshot copies (besides the per-request counters and the sample's age).
_SNAPSHOT_INPUTS = frozenset(
    {"url", "rank", "models", "healthy", "routable", "draining", "sample", "prefix_hit_rate", "role"}
)


@dataclass(slots=True)
class Endpoint:
    """One rank endpoint's record. Read it anywhere; only ``Fleet`` changes it."""

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
    samples: int = 0  # samples taken in (the snapshot's telemetry_seq)
    rate: TokenRate = field(default_factory=TokenRate)  # prompt + generated tokens per second
    offered: Offered = field(default_factory=Offered)  # of the work arriving (lbd.common.throughput)
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

    def takes_traffic(self) -> bool:
        return self.healthy and self.routable and not self.draining

    def __setattr__(self, name: str, value: Any) -> None:
        # Any change to what the snapshot copies from the endpoint marks the copy stale (rare: scrapes,
        # probes, supervisor updates); the hot path then copies only the per-request numbers.
        object.__setattr__(self, name, value)
        if name in _SNAPSHOT_INPUTS:
            object.__setattr__(self, "snap_stale", True)

    def state(self) -> str:
        if self.draining:
            return "draining"
        if not self.routable:
            return "not_ready"
        if self.half_open:
            return "half_open"
        return "ready" if self.healthy else "ejected"


class Fleet:
    """Every endpoint's record, keyed by URL and in rank order (``order``), and every change to one.

    An endpoint holds a shared-counter slot (lbd.router.shared) from ``add`` to ``remove``; removing it
    releases the slot, so endpoints that come and go (pod IPs, Ray ports) never fill the table."""

    def __init__(self, shared: SharedCounters, metrics: RouterMetrics, *, failure_threshold: int,
                 consecutive_5xx: int, max_ejection_percent: float) -> None:
        """The thresholds: --health-failure-threshold, --outlier-consecutive-5xx,
        --outlier-max-ejection-percent."""
        self.failure_threshold = failure_threshold
        self.consecutive_5xx = consecutive_5xx
        self.max_ejection_percent = max_ejection_percent
        self.shared = shared
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.endpoints: dict[str, Endpoint] = {}
        self.order: list[Endpoint] = []
        self.half_open: list[Endpoint] = []  # waiting for (or running) their trial request
        self.capacity = Capacity()  # a saturated rank's tokens per second (lbd.common.throughput)
        self.output = OutputSize()  # the fleet's generated tokens per finished request (the same)
        self.on_added: list[Callable[[Endpoint], None]] = []
        self.on_removed: list[Callable[[Endpoint], None]] = []
        self.on_readmitted: list[Callable[[Endpoint], None]] = []  # back from an ejection
        self.on_restarted: list[Callable[[Endpoint, str], None]] = []  # a new process: its cache is cold

    # ---- the table ------------------------------------------------------------------------------------
    def add(self, url: str, source: str, rank: int | None = None) -> Endpoint:
        """The endpoint at ``url`` (listed by ``source``), added if new; a known ``rank`` is taken."""
        ep = self.endpoints.get(url)
        if ep is not None:
            if rank is not None and rank != ep.rank:
                ep.rank = rank
                self._reorder()
            return ep
        slot = self.shared.slot(url)
        if slot < 0:
            raise RuntimeError(f"shared counter table is full; cannot add {url}")
        ep = Endpoint(url=url, source=source, slot=slot, rank=rank, progress_at=self.loop.time())
        self.endpoints[url] = ep
        self._reorder()
        log.info("endpoint added: %s (rank %s, from %s)", url, rank, source)
        for cb in self.on_added:
            cb(ep)
        return ep

    def remove(self, url: str) -> None:
        ep = self.endpoints.pop(url, None)
        if ep is None:
            return
        self._reorder()
        self._end_half_open(ep)
        log.info("endpoint removed: %s (rank %s)", url, ep.rank)
        for cb in self.on_removed:
            cb(ep)
        self.shared.release(ep.slot)  # freed once no worker holds it and its requests have ended

    def _reorder(self) -> None:
        self.order = sorted(
            self.endpoints.values(), key=lambda e: (e.rank if e.rank is not None else 1 << 30, e.url)
        )

    # ---- snapshots ------------------------------------------------------------------------------------
    def snapshot(self, ep: Endpoint, now: float | None = None) -> EndpointSnapshot:
        """``ep`` as the policies see it at ``now`` (default: the loop's time). One object per endpoint,
        updated in place (the hot path builds one per endpoint per request); a decision keeps only its key
        past the current request step."""
        d, f, st, dt, stt = self.shared.sums(ep.slot)
        snap = ep.snap
        if snap is None or ep.snap_stale:
            snap = self._copy(ep)
        snap.inflight, snap.unstarted, snap.unstarted_tokens = d - f, d - st, dt - stt
        if ep.sample is not None:
            snap.delta = (d - ep.base_dispatched) - (f - ep.base_finished)
            age = (self.loop.time() if now is None else now) - ep.sample_at
            snap.age_s = age if age > 0.0 else 0.0
        return snap

    def snapshots(self, load: bool = True) -> list[EndpointSnapshot]:
        """Every endpoint as the policy sees it; without ``load`` the live numbers (in flight, delta, age) are
        left as they were (for a policy that reads none of them)."""
        if not load:
            return [ep.snap if ep.snap is not None and not ep.snap_stale else self._copy(ep)
                    for ep in self.order]
        now = self.loop.time()
        snapshot = self.snapshot
        return [snapshot(ep, now) for ep in self.order]

    def _copy(self, ep: Endpoint) -> EndpointSnapshot:
        """Copy what changes only with telemetry and health into ``ep``'s snapshot."""
        snap = ep.snap
        if snap is None or snap.key != ep.url:
            snap = ep.snap = EndpointSnapshot(key=ep.url)
        snap.rank, snap.models, snap.role = ep.rank, ep.models, ep.role
        snap.healthy, snap.draining = ep.healthy and ep.routable, ep.draining
        s = ep.sample
        snap.lora = with_cards(s.lora if s is not None else None, ep.model_cards)
        snap.telemetry_seq, snap.tokens_per_s = ep.samples, ep.rate.rate
        snap.offered_tokens_per_s = ep.offered.tokens_per_s()
        if s is not None:
            snap.running, snap.waiting, snap.kv_usage = s.running, s.waiting, s.kv_usage
            snap.prefix_hit_rate, snap.block_size, snap.num_blocks = ep.prefix_hit_rate, s.block_size or 16, \
                s.num_blocks
        ep.snap_stale = False
        return snap

    # ---- health ---------------------------------------------------------------------------------------
    def fail(self, ep: Endpoint, source: str, error: str) -> None:
        """A connect error, timeout or 5xx from ``ep`` seen by ``source`` (probe, scrape or request); sources
        count apart (/metrics answering does not excuse a failing /health). Failed requests count against
        --outlier-consecutive-5xx and may not eject more than --outlier-max-ejection-percent of the
        endpoints: one client's bad requests cannot empty the fleet."""
        passive = source == "request"
        threshold = self.consecutive_5xx if passive else self.failure_threshold
        n = ep.failures_by[source] = ep.failures_by.get(source, 0) + 1
        ep.failures = max(ep.failures, n)
        ep.last_error = f"{source}: {error}"
        if ep.healthy and n >= threshold and (not passive or self.may_eject(ep)):
            ep.healthy, ep.ejected_at, ep.ejected_by = False, self.loop.time(), "health"
            self.metrics.ejections.labels(ep.url).inc()
            log.warning(
                "endpoint ejected: %s (rank %s) after %d failures: %s", ep.url, ep.rank, ep.failures, error
            )

    def succeeded(self, ep: Endpoint, source: str) -> None:
        """``source`` got a good answer from ``ep``: its consecutive failures start over."""
        if ep.healthy and ep.failures_by.get(source):
            ep.failures_by[source] = 0
            ep.failures = max(ep.failures_by.values())

    def may_eject(self, ep: Endpoint) -> bool:
        """Whether a passive signal may eject ``ep`` now (--outlier-max-ejection-percent)."""
        ejected = sum(1 for e in self.endpoints.values() if not e.healthy and e is not ep)
        return ejected + 1 <= ejection_cap(len(self.endpoints), self.max_ejection_percent)

    def readmit(self, ep: Endpoint, why: str) -> None:
        """``ep`` takes traffic again, with a clean health record. Back from an ejection it may be a new
        process: nothing it held is known to be cached."""
        if not ep.healthy:
            self.metrics.readmissions.labels(ep.url).inc()
            log.info("endpoint re-admitted: %s (rank %s): %s", ep.url, ep.rank, why)
            ep.new_process = True
            ep.forgot_at = self.loop.time()
            for cb in self.on_readmitted:
                cb(ep)
        self._end_half_open(ep)
        ep.healthy, ep.failures, ep.last_error = True, 0, ""
        ep.failures_by.clear()
        ep.ejected_by, ep.trial = "", None

    def restarted(self, ep: Endpoint, why: str) -> None:
        """The process behind ``ep`` is new: its prefix cache is cold."""
        log.info("endpoint %s (rank %s) restarted (%s): forgetting what it had cached", ep.url, ep.rank, why)
        ep.new_process = True
        ep.forgot_at = self.loop.time()
        ep.telemetry_refused = False  # a new process may serve the JSON telemetry its /metrics advertises
        for cb in self.on_restarted:
            cb(ep, why)

    # ---- passive outlier detection (lbd.router.outlier decides) ---------------------------------------
    def sent(self, ep: Endpoint, attempt: object, now: float, trial: bool = False) -> None:
        """An attempt went to ``ep`` at ``now`` and waits for a first byte (``trial``: the half-open one)."""
        ep.waiting[attempt] = now
        if trial:
            ep.trial = attempt

    def answered(self, ep: Endpoint, attempt: object, now: float) -> bool:
        """The attempt's first byte came: ``ep`` makes progress. True when it was the half-open trial."""
        ep.waiting.pop(attempt, None)
        ep.progress_at = now
        return ep.trial is attempt

    def ended(self, ep: Endpoint, attempt: object) -> bool:
        """The attempt is over. True when it was the trial and ended without a first byte (it failed)."""
        ep.waiting.pop(attempt, None)
        if ep.trial is not attempt:
            return False
        ep.trial = None
        return True

    def eject(self, ep: Endpoint, now: float, why: str, duration_s: float) -> None:
        """An outlier: out for ``duration_s``, then half-open. A trial in flight is dropped (the caller
        abandons the attempts waiting there, the trial with them)."""
        ep.outlier_ejections += 1
        first = ep.healthy
        ep.healthy, ep.ejected_by, ep.ejected_at = False, "outlier", now
        ep.readmit_at = now + duration_s
        ep.last_error = f"outlier: {why}"
        ep.trial = None
        self._end_half_open(ep)
        if first:
            self.metrics.ejections.labels(ep.url).inc()

    def open_half(self, ep: Endpoint) -> None:
        """An outlier's ejection is over: its next request is a trial."""
        ep.half_open = True
        self.half_open.append(ep)

    def forgive(self, ep: Endpoint) -> None:
        """Healthy for long: its next outlier ejection is short again."""
        ep.outlier_ejections = 0

    def _end_half_open(self, ep: Endpoint) -> None:
        ep.half_open = False
        if ep in self.half_open:
            self.half_open.remove(ep)

    # ---- telemetry ------------------------------------------------------------------------------------
    def observe(self, ep: Endpoint, sample: Sample, began_at: float, totals: Totals | None = None) -> None:
        """``ep``'s load as a scrape that began at ``began_at`` read it (or as its pushed stream said then);
        ``totals``: the shared counters at that time (default: now), the base of the snapshot's delta. The
        sample may teach the endpoint's rank and models."""
        if totals is None:
            totals = self.shared.totals(ep.slot)
        prev = ep.sample
        if prev is not None:
            if sample.generation_tokens > prev.generation_tokens or sample.prompt_tokens > prev.prompt_tokens:
                ep.progress_at = began_at
            dq = sample.prefix_queries - prev.prefix_queries
            if dq > 0:
                rate = max(0.0, min(1.0, (sample.prefix_hits - prev.prefix_hits) / dq))
                ep.prefix_hit_rate += 0.3 * (rate - ep.prefix_hit_rate)
        ep.sample, ep.sample_at = sample, began_at
        ep.samples += 1
        ep.rate.update(sample.prompt_tokens + sample.generation_tokens, began_at, sample.waiting > 0)
        self.capacity.observe(ep.rate, began_at)
        ep.offered.update(sample.prompt_tokens, sample.generation_tokens, totals.dispatched, totals.finished,
                          began_at, self.output)
        ep.base_dispatched, ep.base_finished = totals.dispatched, totals.finished
        ep.new_process = False
        if sample.models and not ep.model_cards:
            ep.models = frozenset(sample.models)
        if len(sample.ranks) == 1 and ep.rank is None:
            ep.rank = next(iter(sample.ranks))
            self._reorder()

    def sample_holds(self, ep: Endpoint, now: float) -> None:
        """A fresh pushed stream sends every change: ``ep``'s last state still holds at ``now``."""
        ep.sample_at = now

    def use_telemetry(self, ep: Endpoint, path: str) -> None:
        """``ep``'s /metrics advertised ``path`` for its telemetry (unless that path failed before)."""
        if not ep.telemetry_refused:
            ep.telemetry_path = path

    def refuse_telemetry(self, ep: Endpoint) -> None:
        """The advertised path failed: /metrics until a new process; its counters may lag the JSON's by a
        flush, so the next scrape's lower numbers are not a restart."""
        ep.telemetry_path, ep.telemetry_refused = "/metrics", True
        ep.new_process = True

    def scrape_failed(self, ep: Endpoint, error: str) -> None:
        ep.scrape_errors += 1
        self.metrics.scrape_errors.labels(ep.url).inc()
        self.fail(ep, "scrape", error)

    # ---- identity -------------------------------------------------------------------------------------
    def set_models(self, ep: Endpoint, cards: list[dict[str, Any]]) -> None:
        """``ep``'s /v1/models answered ``cards`` (each with an ``id``)."""
        ep.model_cards = cards
        ep.models = frozenset(str(c["id"]) for c in cards)

    def set_role(self, ep: Endpoint, role: str) -> None:
        """``ep`` is a prefill, decode or mixed rank (--prefill/--decode; lbd.router.disagg)."""
        ep.role = role

    def supervise(self, ep: Endpoint, routable: bool, draining: bool, role: str, pid: int | None,
                  state: str) -> bool:
        """Mirror ``ep``'s row of its supervisor's /status (``state`` names it, for the log). True when a
        (re)started process the supervisor found ready was re-admitted: ask for its models again."""
        ep.draining = draining
        ep.role = role
        new_pid = pid is not None and ep.pid is not None and pid != ep.pid
        if new_pid:  # seen while it starts, too: nothing the old process cached is there any more
            self.restarted(ep, f"supervisor reports a new pid {pid}")
        back = routable and (not ep.routable or new_pid)
        if back:  # start clean
            self.readmit(ep, f"supervisor reports {state} (pid {pid})")
        ep.routable = routable or draining
        if pid is not None:
            ep.pid = pid
        return back


def ejection_cap(total: int, percent: float) -> int:
    """How many endpoints passive signals may hold ejected at once: ``percent`` of them, at least one."""
    return max(1, math.floor(total * percent / 100.0))
