"""The node's autoscaling signals (issue 46): ``lbd_supervisor_autoscale_*`` on the health port's /metrics,
the same signals and rule as the router's (``lbd.common.scaling``), for this node's ranks.

What the supervisor reads cheaply: each ready rank's waiting requests, KV-cache use and prompt + generated
token counters (``Prober.load``: lbd's JSON /telemetry, else the engine's /metrics), at each scrape of its
/metrics. It has no router queue to see, so:
- a rank's load is its waiting requests over flow control's default ``--flow-max-waiting-per-rank``, its KV
  use over ``--flow-max-kv-usage`` (``lbd.common.scaling.MAX_WAITING``, ``MAX_KV``) or its tokens per second
  over the most a rank of the node served after requests waited in it for 10 s, the largest
  (``lbd.common.throughput``: the busy measure of a compute-bound rank; the router also weighs it by the work
  still arriving, which only a router sees);
- the token backlog is the waiting requests times ``TOKENS_PER_WAITING_REQUEST`` (a request count is all an
  engine reports), the predicted TTFT that backlog over ``PREFILL_TOKENS_PER_S`` per ready rank, against the
  default target (``TTFT_TARGET_S``).
The router's numbers are the better ones where a router fronts the fleet (exact queued tokens, a learned
prefill rate, held requests, ``--ttft-target-ms``); these serve a node scaled on its own.

Health answers never wait on a child: a scrape answers from the last reading and, when that is older than the
probe interval, starts the next one in the background (at most one at a time).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from dataclasses import replace

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lbd.common import scaling
from lbd.common.scaling import AutoscaleReport
from lbd.common.throughput import Capacity, TokenRate
from lbd.supervisor.node import Supervisor
from lbd.supervisor.probe import RankLoad
from lbd.wire.states import RankState


class NodeLoads:
    """The node's ranks as last read: each one's waiting requests, KV use and token rate, and the node's
    capacity (``lbd.common.throughput``). Pure: readings and their times come in."""

    def __init__(self) -> None:
        self.loads: list[tuple[float, float, float]] = []  # (waiting, kv use, tokens/s) of each rank read
        self.rates: dict[str, TokenRate] = {}  # rank (its probe URL) -> its token rate
        self.capacity = Capacity()

    def observe(self, readings: dict[str, RankLoad], at: float) -> None:
        """The ranks that answered, by probe URL, read at ``at`` (monotonic seconds); ranks not among them
        are forgotten (gone, or not ready)."""
        self.rates = {url: self.rates.get(url) or TokenRate() for url in readings}
        self.loads = []
        for url, r in readings.items():
            rate = self.rates[url]
            if r.tokens is not None:
                rate.update(r.tokens, at, r.waiting > 0)
                self.capacity.observe(rate, at)
            self.loads.append((r.waiting, r.kv_usage, rate.rate if r.tokens is not None else 0.0))

    def report(self) -> AutoscaleReport:
        loads = [scaling.rank_load(0, waiting, kv, busy=self.capacity.busy(rate))
                 for waiting, kv, rate in self.loads]
        backlog = round(sum(w for w, _, _ in self.loads) * scaling.TOKENS_PER_WAITING_REQUEST)
        signals = scaling.fleet_signals(loads, backlog)
        signals = replace(signals, served_tokens_per_s=round(sum(r for _, _, r in self.loads), 3),
                          capacity_tokens_per_s=round(self.capacity.tokens_per_s, 3))
        return scaling.report(signals)


class NodeSignals(Collector):
    """The last reading of the node's ranks, refreshed on scrape; a Prometheus collector of the gauges."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup
        self.every_s = sup.cfg.probe_interval_s
        self.node = NodeLoads()
        self.read_at = -float("inf")
        self._task: asyncio.Task[None] | None = None
        sup.metrics.registry.register(self)

    def report(self) -> AutoscaleReport:
        return self.node.report()

    def kick(self) -> None:
        """Start a reading in the background when the last one is older than the probe interval."""
        if (self._task is None or self._task.done()) and time.monotonic() - self.read_at >= self.every_s:
            self._task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        ready = [w for w in self.sup.workers if w.state is RankState.READY]
        got = await asyncio.gather(*(self.sup.prober.load(w.spec.probe_url) for w in ready))
        self.read_at = time.monotonic()
        self.node.observe({w.spec.probe_url: r for w, r in zip(ready, got, strict=True) if r is not None},
                          self.read_at)

    def describe(self) -> list[GaugeMetricFamily]:
        return []  # (the registry's auto-describe would call collect at registration: a reading too early)

    def collect(self) -> Iterable[GaugeMetricFamily]:
        try:
            self.kick()
        except RuntimeError:  # no running loop (rendered outside the server): the last reading only
            pass
        r = self.report()
        s = r.signals
        for name, doc, value in (
            ("saturation", "The node's busy fraction: the mean over its ready ranks of each one's waiting "
             "requests and KV use against flow control's default thresholds or its tokens per second "
             "against the node's capacity, the largest, capped at 1.", s.saturation),
            ("capacity_tokens_per_second", "The most prompt + generated tokens per second a rank of the "
             "node served after requests waited in it for 10 s (0 until then).", s.capacity_tokens_per_s),
            ("served_tokens_per_second", "Prompt + generated tokens per second the node's ranks serve.",
             s.served_tokens_per_s),
            ("token_backlog", "Waiting requests x the default prompt length (tokens).", s.token_backlog),
            ("predicted_ttft_seconds", "The backlog over the default prefill rate of the ready ranks.",
             s.predicted_ttft_s if s.predicted_ttft_s != float("inf") else 1e9),
            ("ttft_target_seconds", "The TTFT target (the router's --ttft-target-ms default).",
             s.ttft_target_s),
            ("ranks", "Ready ranks whose load was read.", s.ranks),
            ("recommended_ranks", "Ranks the scaling rule recommends for this node (lbd.common.scaling).",
             r.recommended_ranks),
        ):
            yield GaugeMetricFamily(f"lbd_supervisor_autoscale_{name}", doc, value=value)
