"""The core's side of the metrics: scheduler counters and gauges into vLLM's families, cheaply.

In multiprocess mode every Prometheus write takes a lock and touches an mmap (benchmarks/RESULTS.md,
"Metrics writes"), so the recorder keeps a plain tally of tokens per step (everything else is a cumulative
counter of the scheduler or the KV manager, finish reasons included) and writes them out after a step that
finished a request and after an abort (so a client that has its answer sees it counted), else at most every
``RECORD_INTERVAL_S`` while the core is busy, and on ``flush`` (the core loop calls it every 100 ms, idle or
not). Only values that changed are written. ``benchmarks/telemetry.py`` measures the per-step cost.
"""

from __future__ import annotations

import bisect
import time
from typing import TYPE_CHECKING

from lbd.engine.core.scheduler import Scheduler, SchedulerCounters
from lbd.engine.metrics import ITERATION_TOKENS_BUCKETS

if TYPE_CHECKING:
    from lbd.engine.metrics import CoreMetrics

RECORD_INTERVAL_S = 0.025  # gauges a scrape reads are at most this much older than the core's state


class MetricsRecorder:
    def __init__(self, metrics: CoreMetrics, scheduler: Scheduler) -> None:
        self.m = metrics
        self.scheduler = scheduler
        self._done = SchedulerCounters()  # the scheduler's counters as last written
        self._queries = self._hits = 0  # the KV manager's prefix counters as last written
        self._gauges = (-1, -1, -1.0)  # (running, waiting, kv usage) as last written
        self._finished: dict[str, int] = {}  # finish reason -> requests as last written
        self._step_tokens = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)  # per bucket, then +Inf
        self._step_tokens_sum = 0
        self._next = 0.0

    def step(self, num_tokens: int) -> None:
        """One engine step of ``num_tokens`` tokens ran."""
        self._step_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, num_tokens)] += 1
        self._step_tokens_sum += num_tokens
        now = time.monotonic()
        if self.scheduler.counters.finished != self._done.finished or now >= self._next:
            self._next = now + RECORD_INTERVAL_S
            self.flush()

    def flush(self) -> None:
        m, c, done = self.m, self.scheduler.counters, self._done
        if c != done:
            if c.num_preemptions != done.num_preemptions:
                m.num_preemptions.inc(c.num_preemptions - done.num_preemptions)
            if c.prompt_tokens != done.prompt_tokens:
                cached = c.prompt_cached_tokens - done.prompt_cached_tokens
                m.prompt_tokens.inc(c.prompt_tokens - done.prompt_tokens)
                m.prompt_computed.inc(c.prompt_tokens - done.prompt_tokens - cached)
                if cached:
                    m.prompt_cache_hit.inc(cached)
                    m.prompt_tokens_cached.inc(cached)
            if c.generation_tokens != done.generation_tokens:
                m.generation_tokens.inc(c.generation_tokens - done.generation_tokens)
            if c.finished != done.finished:
                for reason, n in c.finished_by_reason.items():
                    if n != self._finished.get(reason, 0):
                        m.request_success(reason).inc(n - self._finished.get(reason, 0))
                self._finished = dict(c.finished_by_reason)
            self._done = SchedulerCounters(c.num_preemptions, c.prompt_tokens, c.generation_tokens,
                                           c.prompt_cached_tokens, c.finished, self._finished)
        kv = self.scheduler.kv
        if kv.prefix_queries != self._queries:
            m.prefix_cache_queries.inc(kv.prefix_queries - self._queries)
            hits = kv.prefix_hits - self._hits
            if hits:
                m.prefix_cache_hits.inc(hits)
                m.cached_on_device.inc(hits)
            self._queries, self._hits = kv.prefix_queries, kv.prefix_hits
        if self._step_tokens_sum:
            self._flush_step_tokens()
        self._write_gauges()

    def _flush_step_tokens(self) -> None:
        # A histogram child keeps one (non-cumulative) counter per bucket and a sum: adding the tallies
        # directly beats replaying one observe() per step.
        child = self.m.iteration_tokens
        for bucket, n in zip(child._buckets, self._step_tokens, strict=True):
            if n:
                bucket.inc(n)
        child._sum.inc(self._step_tokens_sum)
        self._step_tokens = [0] * len(self._step_tokens)
        self._step_tokens_sum = 0

    def _write_gauges(self) -> None:
        s = self.scheduler
        now = (len(s.running), len(s.waiting), s.kv.usage)
        if now == self._gauges:
            return
        (running, waiting, usage), (last_running, last_waiting, last_usage) = now, self._gauges
        m = self.m
        if running != last_running:
            m.num_requests_running.set(running)
        if waiting != last_waiting:
            m.num_requests_waiting.set(waiting)
            m.waiting_capacity.set(waiting)
        if usage != last_usage:
            m.kv_cache_usage_perc.set(usage)
        self._gauges = now
