"""The router's autoscaling signals (issue 46): what a KEDA ScaledObject, an HPA or ``lbd serve --autoscale``
reads to size the fleet, computed from what the router already knows, at scrape time (never on the request
path).

Per endpoint that takes traffic (healthy, not draining), from the same snapshot flow control decides by:
- its load (``lbd.common.scaling.rank_load``) against flow control's thresholds (``--flow-max-*``): queued
  prefill tokens (the router's requests there without a first byte, every worker's), the engine's waiting
  requests and KV use (while fresh), and its token throughput against a saturated rank's
  (``lbd.common.throughput``: the busy measure of a compute-bound rank, once some rank was seen saturated),
  counted in the share of the fleet's served tokens that its offered tokens make (at most all of them):
  after the load drops, the streams of the passed load still decode and need no rank of their own (a removed
  rank's streams resume elsewhere);
- its queued prompt tokens: the larger of the router's own count and the engine's waiting requests times the
  average prompt (other routers' requests are seen too, the router's own are not counted twice).
Plus the requests held in the router's flow queues (every worker's) times their flows' mean dispatched
prompt. The prefill rate behind the predicted TTFT is the predicted_ttft policy's (``--prefill-tokens-per-s``
or learned from first bytes), else ``lbd.common.scaling.PREFILL_TOKENS_PER_S``.

With ``--workers N`` every worker computes the same numbers: the router's queued tokens and the flow queues
are shared counters (``lbd.router.shared``, ``lbd.router.shared_flows``) and the engines' numbers come from
the same telemetry; only a learned prefill rate is each worker's own (learned from its own first bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from lbd.common import scaling
from lbd.common.scaling import AutoscaleReport, rank_load
from lbd.common.throughput import Capacity
from lbd.policies import EndpointSnapshot
from lbd.router.flow.settings import FlowSettings


def router_report(snaps: Iterable[EndpointSnapshot], flow: FlowSettings, stale_s: float, held_tokens: float,
                  ttft_target_s: float, policy: Any, target_utilization: float = scaling.TARGET_UTILIZATION,
                  capacity: Capacity | None = None) -> AutoscaleReport:
    """The fleet's signals and the rule's recommendation (at least 1 rank; no upper bound: the
    autoscaler's own bounds apply). ``capacity``: a saturated rank's token rate, learned from telemetry."""
    avg_prompt = _learned(policy, "avg_prompt_tokens", scaling.TOKENS_PER_WAITING_REQUEST)
    routable = [s for s in snaps if s.healthy and not s.draining]
    served, offered = _fleet_rates(routable)
    arriving = min(1.0, offered / served) if offered is not None and served > 0 else 1.0
    loads, backlog = [], held_tokens
    for snap in routable:
        fresh = snap.fresh(stale_s)
        busy = capacity.busy(snap.tokens_per_s * arriving) if capacity is not None else 0.0
        loads.append(rank_load(snap.unstarted_tokens, snap.waiting, snap.kv_usage, fresh,
                               max_tokens=flow.max_prefill_tokens_per_rank,
                               max_waiting=flow.max_waiting_per_rank, max_kv=flow.max_kv_usage, busy=busy))
        backlog += max(snap.unstarted_tokens, snap.waiting * avg_prompt if fresh else 0.0)
    rate = _learned(policy, "rate", scaling.PREFILL_TOKENS_PER_S)
    signals = scaling.fleet_signals(loads, round(backlog), ttft_target_s, rate)
    signals = replace(signals, served_tokens_per_s=round(served, 3),
                      offered_tokens_per_s=round(offered, 3) if offered is not None else None)
    if capacity is not None and capacity.tokens_per_s > 0:
        signals = replace(signals, capacity_tokens_per_s=round(capacity.tokens_per_s, 3))
    return scaling.report(signals, target_utilization=target_utilization)


def _fleet_rates(snaps: list[EndpointSnapshot]) -> tuple[float, float | None]:
    """The tokens per second ``snaps`` serve, and those offered to them (None where a rank's is unknown)."""
    served = sum(s.tokens_per_s for s in snaps)
    rates = [s.offered_tokens_per_s for s in snaps]
    return served, None if not rates or None in rates else sum(r for r in rates if r is not None)


def held_tokens(rows: Iterable[Any]) -> float:
    """Prompt tokens held in the flow queues (every worker's): each flow's held requests times its mean
    dispatched prompt (a flow that has dispatched nothing yet counts the default prompt)."""
    total = 0.0
    for r in rows:
        if r.queued > 0:
            mean = r.dispatched_tokens / r.dispatched if r.dispatched else scaling.TOKENS_PER_WAITING_REQUEST
            total += r.queued * mean
    return total


def _learned(policy: Any, name: str, default: float) -> float:
    """A number the routing policy learned (the prefill rate, the mean prompt), else ``default``."""
    try:
        value = getattr(policy, name)
    except AttributeError:
        return default
    return float(value) if isinstance(value, int | float) and value > 0 else default


class AutoscaleCollector(Collector):
    """``lbd_router_autoscale_*`` gauges, computed when /metrics is read."""

    def __init__(self, report: Callable[[], AutoscaleReport]) -> None:
        self.report = report

    def collect(self) -> Iterable[GaugeMetricFamily]:
        r = self.report()
        s = r.signals
        ttft = s.predicted_ttft_s if s.predicted_ttft_s != float("inf") else 1e9
        for name, doc, value in (
            ("saturation", "The fleet's busy fraction: the mean over ranks taking traffic of each one's load "
             "against flow control's saturation thresholds, capped at 1 (1.0 = every rank saturated).",
             s.saturation),
            ("token_backlog", "Prompt tokens waiting for a first token: queued in the engines plus held in "
             "the router's flow queues.", s.token_backlog),
            ("predicted_ttft_seconds", "The backlog over the fleet's prefill rate: how long a request "
             "arriving now waits for its first token.", ttft),
            ("ttft_target_seconds", "The TTFT target (--ttft-target-ms).", s.ttft_target_s),
            ("ranks", "Ranks taking traffic (healthy, not draining).", s.ranks),
            ("capacity_tokens_per_second", "Prompt + generated tokens per second a saturated rank served, "
             "which each rank's throughput counts against in saturation (0 until one was seen).",
             s.capacity_tokens_per_s),
            ("served_tokens_per_second", "Prompt + generated tokens per second the ranks taking traffic "
             "serve.", s.served_tokens_per_s),
            ("offered_tokens_per_second", "Tokens per second of the work arriving at them: prompt tokens "
             "taken in plus requests sent times the fleet's generated tokens per finished request (-1 "
             "until known); their throughput counts in saturation in this share of the served tokens.",
             -1.0 if s.offered_tokens_per_s is None else s.offered_tokens_per_s),
            ("recommended_ranks", "Ranks the scaling rule recommends (lbd.common.scaling).",
             r.recommended_ranks),
        ):
            yield GaugeMetricFamily(f"lbd_router_autoscale_{name}", doc, value=value)
