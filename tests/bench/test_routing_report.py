"""routing_report.py: where round robin saturates, the stepped verdicts, the start-up split (no server)."""

from __future__ import annotations

import math

from benchmarks.routing_report import Row, cold_waits, saturated_step, startup_split, verdicts

from lbd.bench.client import RequestRecord


def test_saturation_is_where_the_median_request_queues() -> None:
    assert saturated_step([108.8, 108.1, 118.5, 325.3]) == 3  # round robin in a 4-step run
    assert saturated_step([15.0, 17.1, 18.2, 21.2]) is None  # a cache-aware router: hits stay fast
    assert saturated_step([50.0]) is None


def row(target: str, step: float, p90: float, p50: float) -> Row:
    return Row("many-tenant", target, 10, 0, p50, 1.0, math.nan, 1.0, 1.0, 0.5, 0.6, "1/1", 1, 1,
               ttft_p90_ms=p90, step_rate=step)


def test_stepped_verdicts_name_the_saturating_step_and_the_ratio_at_the_top() -> None:
    rows = [
        row("lbd:round_robin", 100, 50, 40), row("lbd:round_robin", 200, 900, 400),
        row("lbd:predicted_ttft", 100, 40, 10), row("lbd:predicted_ttft", 200, 100, 12),
        row("sglang-router:cache_aware", 100, 41, 10), row("sglang-router:cache_aware", 200, 250, 14),
    ]
    out = verdicts(rows)
    assert out[0].startswith("- MET: many-tenant: round robin saturates at 200 req/s (p50 TTFT 400.0 ms)")
    assert out[1].startswith("- MET:") and "2.50x lower" in out[1]
    out = verdicts([r for r in rows if r.step_rate == 100])
    assert out[0].startswith("- MISSED: many-tenant: round robin saturates nowhere")


def test_startup_ends_when_every_group_has_its_first_token() -> None:
    """Two groups: group 1's first request (sent at 0.5 s) answers at 2.5 s, so everything sent before
    2.5 s is start-up; the slowest 1% of 200 requests (2) are group 1's cold request and its follower."""
    recs = [
        RequestRecord("a", 0, start=0.0, ttft=1.0, group=0),
        RequestRecord("b", 0, start=0.5, ttft=2.0, group=1),
        RequestRecord("c", 0, start=0.6, ttft=1.95, group=1),
        RequestRecord("d", 0, start=2.4, ttft=0.1, group=0),
    ]
    recs += [RequestRecord(f"s{i}", 1, start=3.0 + i / 100, ttft=0.1 + i / 1000, group=i % 2)
             for i in range(196)]
    recs.append(RequestRecord("x", 0, start=1.0, error="timeout", group=0))  # failures count nowhere
    n, p99, slowest = startup_split(recs, scale=10.0)
    assert (n, slowest) == (4, "2/2")
    steady = sorted(0.1 + i / 1000 for i in range(196))
    want = (steady[193] + (steady[194] - steady[193]) * 0.05) * 1e3 / 10.0  # numpy's p99 of 196, in sim ms
    assert math.isclose(p99, want)
    n, p99, slowest = startup_split([], 1.0)
    assert n == 0 and math.isnan(p99) and slowest == ""


def test_a_cold_request_slower_than_a_bare_prefill_counts_as_waited() -> None:
    """Four groups: the fastest cold request sets the floor; one at 2x and one at 1.3x waited for other work
    on their ranks; one at 1.1x is a bare prefill beside decodes; a slow warm turn is not a cold request."""
    recs = [
        RequestRecord("a", 0, start=0.0, ttft=1.0, group=0),
        RequestRecord("b", 0, start=0.5, ttft=2.0, group=1),
        RequestRecord("c", 0, start=0.6, ttft=1.3, group=2),
        RequestRecord("d", 0, start=0.7, ttft=1.1, group=3),
        RequestRecord("a", 1, start=1.2, ttft=3.0, group=0),
    ]
    assert cold_waits(recs) == (4, 2)
    assert cold_waits([RequestRecord("a", 0, start=0.0, ttft=2.5, group=0)]) == (1, 0)
    assert cold_waits([]) == (0, 0)
