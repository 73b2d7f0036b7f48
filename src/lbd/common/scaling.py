"""How many ranks a deployment should run: the signals an autoscaler reads, the one rule that turns them into
a rank count, and a planner that applies the rule with hysteresis.

The router (``lbd route``, fleet-wide), the supervisor (``lbd supervise``, its node) and the built-in planner
(``lbd serve --autoscale MIN:MAX``) all use this module, so the exported ``*_recommended_ranks`` gauge and
what the planner does are the same rule. Pure: no I/O, no clock (callers pass ``now``), standard library
only; ``Signals`` and ``AutoscaleReport`` are dataclasses msgspec and orjson encode and decode as they are.

**A rank's load** (``rank_load``) is measured against flow control's saturation thresholds
(``lbd route --flow-max-*``; ``lbd.router.flow.saturation``): the largest of its queued prefill tokens over
``max_tokens``, its engine's waiting requests over ``max_waiting`` and its KV-cache use over ``max_kv``.
1.0 is the point where flow control calls the rank saturated and starts holding requests. Where the router
knows it, also its token throughput over what a saturated rank of the fleet served
(``lbd.common.throughput``): a compute-bound rank (a CPU rank decoding many streams) runs slow with no
queue and little KV in use, and only its throughput says how close it is to its limit.

**The signals** (``Signals``):
- ``ranks``: ranks that take traffic now (healthy, not draining);
- ``saturation``: the fleet's busy fraction, the mean over those ranks of each one's load capped at 1.0
  (0 = idle, 1.0 = every routable rank saturated);
- ``token_backlog``: prompt tokens waiting for a first token: queued in the engines plus held in the router;
- ``predicted_ttft_s``: how long a request arriving now waits for its first token if the backlog is shared
  evenly: ``token_backlog / (ranks x prefill tokens per second per rank)``;
- ``ttft_target_s``: the TTFT the deployment aims for (``--ttft-target-ms``);
- ``capacity_tokens_per_s``: the tokens per second a saturated rank served, which a rank's throughput is
  measured against (0 until the router saw one: ``lbd.common.throughput``).
- ``served_tokens_per_s``, ``offered_tokens_per_s``: the tokens per second the ranks serve and those of the
  work arriving at them (``lbd.common.throughput``); a rank's throughput counts in ``saturation`` only in the
  share the offered make of the served (after a drop in load, the passed load's streams are served, not
  offered: they resume on the ranks that stay when a rank leaves, so they need no rank of their own).

**The rule** (``recommended_ranks``), with ``n`` = ``ranks``:
    for utilisation  ceil(n x saturation / target_utilization)   (saturation falls to the target)
    for the backlog  ceil(n x predicted_ttft_s / ttft_target_s)  (the backlog drains within the target;
                                                                   TTFT shrinks as 1/ranks)
    the larger of the two, at least 1 while there is any work (backlog or busy ranks), clamped to
    [min_ranks, max_ranks].
The two terms guard different limits. The backlog term holds the TTFT target where the wait is prefill (a
queue of prompt tokens). The utilisation term keeps the fleet below flow control's saturation point, where a
rank stops admitting at once (its KV cache full, its queue at ``max_waiting``; for queued prompts, 8,192
tokens is ~2 s of prefill at 4,000 tokens/s: the default TTFT target): below it a request waits only for its
own prefill. So ``target_utilization`` is a margin for the signal's noise and for the seconds added ranks
take to serve, not for queueing: 0.9 by default. An offline sweep (``benchmarks/elastic.py --sweep``, a 2 s
TTFT SLO on a KV-bound load) puts the SLO's knee there: at 3x load 4 ranks ran at saturation 0.82 and met it
(99%), 3 ranks ran at 0.95 and missed it (45%); 0.7, the default before, kept 20-40% more ranks than the
sweep's need (ceil(4 x 0.82 / 0.7) = 5).
With no rank serving (``n`` = 0) and work waiting it recommends one rank (then the rule measures again).
It does not keep a rank for its in-flight streams: a removed rank drains and the router resumes its streams on
the ranks that stay, so in-flight work needs no rank of its own.

**The planner** (``Planner``) turns recommendations into resizes: up at once to the recommendation once it
has stayed above the current size for ``up_after_s``; down once it has ``down_after_s`` of samples since its
last change (longer: capacity is cheap to keep for a minute and slow to bring back) and the mean demand of
the last ``down_after_s`` (``demand``: the rule before rounding; the terms averaged, then floored at one rank
where the window saw work) recommends fewer ranks, to that many.
The mean, not the window's highest recommendation: one-second samples of a KV-bound fleet's saturation swing
by +-0.2 around their mean (one 500-token stream holds a third of a small rank's KV), so the highest sample
of a window is the top of that noise, not a load to keep ranks for (elastic.py: 5 ranks held through a 3x
phase the sweep serves with 4, and a descent one rank per window after it); nor one rank at a time, which
made a drop from P ranks cost ``down_after_s`` x (P - 1)(P - 2)/2 rank-seconds. Nothing for ``cooldown_s``
after each change (the new size's signals must settle first).

``target_utilization`` (0.9 by default, ``--autoscale-target-utilization`` on ``lbd route`` and ``lbd serve``)
is the deployment's own trade: lower keeps more spare ranks for bursts.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

# Flow control's default saturation thresholds (lbd route --flow-max-prefill-tokens-per-rank,
# --flow-max-waiting-per-rank, --flow-max-kv-usage); the supervisor, which has no such flags, uses these.
MAX_TOKENS = 8192
MAX_WAITING = 4.0
MAX_KV = 0.95
TARGET_UTILIZATION = 0.9  # the module docstring says why
TTFT_TARGET_S = 2.0
# Prefill tokens per second per rank when nothing better is known (the predicted_ttft policy's starting
# rate, lbd.policies.ttft.TtftModel; it learns the real one from first bytes and the router uses that).
PREFILL_TOKENS_PER_S = 4000.0
# A waiting request's prompt, in tokens, where only request counts are known (the supervisor's view).
TOKENS_PER_WAITING_REQUEST = 256


@dataclass(frozen=True, slots=True)
class Signals:
    """What an autoscaler reads (the module docstring says what each one means)."""

    ranks: int
    saturation: float
    token_backlog: int
    predicted_ttft_s: float
    ttft_target_s: float = TTFT_TARGET_S
    capacity_tokens_per_s: float = 0.0  # a saturated rank's throughput behind ``saturation`` (0: unknown)
    served_tokens_per_s: float = 0.0  # what the ranks serve (the router's view; 0: not known)
    offered_tokens_per_s: float | None = None  # of the work arriving at them (None: not known)


@dataclass(frozen=True, slots=True)
class AutoscaleReport:
    """The signals with the rule's answer: ``/router/status``'s and the supervisor's ``/status``'s
    ``autoscale`` section, and what ``lbd serve --autoscale`` reads from its router."""

    signals: Signals
    recommended_ranks: int
    min_ranks: int
    max_ranks: int


def rank_load(queued_tokens: float, waiting: float, kv_usage: float, fresh: bool = True, *,
              max_tokens: float = MAX_TOKENS, max_waiting: float = MAX_WAITING,
              max_kv: float = MAX_KV, busy: float = 0.0) -> float:
    """One rank's load, 1.0 at flow control's saturation point; the engine's numbers count only when
    ``fresh`` (stale telemetry: only the router's own queued tokens). ``busy``: its token throughput over a
    saturated rank's (``lbd.common.throughput``; 0 where unknown), which sees a compute-bound rank."""
    load = queued_tokens / max_tokens if max_tokens > 0 else 0.0
    if fresh:
        if max_waiting > 0:
            load = max(load, waiting / max_waiting)
        if max_kv > 0:
            load = max(load, kv_usage / max_kv)
        load = max(load, busy)
    return max(0.0, load)


def fleet_signals(loads: list[float], token_backlog: int, ttft_target_s: float = TTFT_TARGET_S,
                  prefill_tokens_per_s: float = PREFILL_TOKENS_PER_S) -> Signals:
    """The signals of ranks with ``loads`` (``rank_load`` each, ranks that take traffic only)."""
    n = len(loads)
    saturation = sum(min(1.0, x) for x in loads) / n if n else 0.0
    if token_backlog <= 0:
        ttft = 0.0
    elif n == 0 or prefill_tokens_per_s <= 0:
        ttft = math.inf
    else:
        ttft = token_backlog / (n * prefill_tokens_per_s)
    return Signals(n, round(saturation, 6), max(0, int(token_backlog)), ttft, ttft_target_s)


def demand(s: Signals, target_utilization: float = TARGET_UTILIZATION, max_ranks: int = 1 << 16,
           floor: bool = True) -> float:
    """The rule's need in ranks before rounding (module docstring): the larger of the utilisation and the
    backlog terms, at least 1 while there is work (unless not ``floor``: the planner averages the terms and
    floors the mean)."""
    busy = has_work(s)
    if s.ranks <= 0:
        return 1.0 if busy else 0.0
    for_load = s.ranks * s.saturation / target_utilization if target_utilization > 0 else 0.0
    if s.predicted_ttft_s <= 0 or s.ttft_target_s <= 0:
        for_ttft = 0.0
    elif math.isinf(s.predicted_ttft_s):
        for_ttft = float(max_ranks)
    else:
        for_ttft = s.ranks * s.predicted_ttft_s / s.ttft_target_s
    need = max(for_load, for_ttft)
    return max(need, 1.0) if busy and floor else need


def has_work(s: Signals) -> bool:
    """A backlog or a busy rank: the rule keeps one rank at least."""
    return s.token_backlog > 0 or s.saturation > 0


def recommended_ranks(s: Signals, min_ranks: int = 1, max_ranks: int = 1 << 16,
                      target_utilization: float = TARGET_UTILIZATION) -> int:
    """The rule (module docstring): ranks for the utilisation target, at least enough to serve the backlog
    within the TTFT target, at least 1 while there is work; clamped to [min_ranks, max_ranks]."""
    return _ranks(demand(s, target_utilization, max_ranks), min_ranks, max_ranks)


def _ranks(need: float, min_ranks: int, max_ranks: int) -> int:
    return max(min_ranks, min(max_ranks, math.ceil(need - 1e-9)))


def report(s: Signals, min_ranks: int = 1, max_ranks: int = 1 << 16,
           target_utilization: float = TARGET_UTILIZATION) -> AutoscaleReport:
    return AutoscaleReport(s, recommended_ranks(s, min_ranks, max_ranks, target_utilization), min_ranks,
                           max_ranks)


@dataclass(slots=True)
class Planner:
    """Hysteresis over ``recommended_ranks`` (module docstring). ``observe`` is called every few seconds
    with the signals and the node's current size; it returns a new size to apply, or None."""

    min_ranks: int
    max_ranks: int
    up_after_s: float = 0.0
    down_after_s: float = 60.0
    cooldown_s: float = 30.0
    target_utilization: float = TARGET_UTILIZATION
    above_since: float | None = None
    below_since: float | None = None  # since when the down window's mean recommends fewer ranks
    window: deque[tuple[float, float, bool]] = field(default_factory=deque)  # (now, demand unfloored, work)
    window_from: float | None = None  # the first sample since the last change
    changed_at: float | None = None
    last: AutoscaleReport | None = None
    decisions: int = field(default=0)

    def observe(self, s: Signals, current: int, now: float) -> int | None:
        raw, work = demand(s, self.target_utilization, self.max_ranks, floor=False), has_work(s)
        rec = _ranks(max(raw, 1.0) if work else raw, self.min_ranks, self.max_ranks)
        self.last = AutoscaleReport(s, rec, self.min_ranks, self.max_ranks)
        self.above_since = _since(self.above_since, now) if rec > current else None
        settled = self._settled(raw, work, now)
        self.below_since = _since(self.below_since, now) if settled < current else None
        if self.changed_at is not None and now - self.changed_at < self.cooldown_s:
            return None
        if current < self.min_ranks or current > self.max_ranks:  # outside the bounds: back in at once
            return self._change(max(self.min_ranks, min(self.max_ranks, current)), now)
        if self.above_since is not None and now - self.above_since >= self.up_after_s:
            return self._change(rec, now)
        full = self.window_from is not None and now - self.window_from >= self.down_after_s
        if full and settled < current:
            return self._change(settled, now)
        return None

    def _settled(self, need: float, work: bool, now: float) -> int:
        """The recommendation of the down window's mean demand (samples since the last change, the last
        ``down_after_s`` of them). The mean of the terms, floored at one rank after averaging where the
        window saw work: floored per sample, every sample of a fleet that needs less than one rank's worth
        reads 1.0, and the mean of a window with one sample above it stays above 1.0 (a 2 -> 1 shrink then
        waits for a whole window of quiet samples: the window's highest, not its mean)."""
        self.window.append((now, need, work))
        self.window_from = now if self.window_from is None else self.window_from
        while self.window[0][0] < now - self.down_after_s:
            self.window.popleft()
        mean = sum(d for _, d, _ in self.window) / len(self.window)
        if any(w for _, _, w in self.window):
            mean = max(mean, 1.0)
        return _ranks(mean, self.min_ranks, self.max_ranks)

    def _change(self, size: int, now: float) -> int:
        self.changed_at, self.above_since, self.below_since, self.window_from = now, None, None, None
        self.window.clear()
        self.decisions += 1
        return size

    def cooling(self, now: float) -> bool:
        return self.changed_at is not None and now - self.changed_at < self.cooldown_s

    def state(self, now: float) -> dict[str, object]:
        """For status pages: bounds, delays, the last recommendation and how long each trend has lasted."""
        return {
            "min_ranks": self.min_ranks, "max_ranks": self.max_ranks, "up_after_s": self.up_after_s,
            "down_after_s": self.down_after_s, "cooldown_s": self.cooldown_s,
            "recommended_ranks": None if self.last is None else self.last.recommended_ranks,
            "above_for_s": None if self.above_since is None else round(now - self.above_since, 3),
            "below_for_s": None if self.below_since is None else round(now - self.below_since, 3),
            "cooling": self.cooling(now), "decisions": self.decisions,
        }


def _since(start: float | None, now: float) -> float:
    """When a trend began: ``start``, or ``now`` if it begins now."""
    return now if start is None else start
