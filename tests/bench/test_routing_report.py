"""routing_report.py: where round robin saturates and the stepped verdicts (no server)."""

from __future__ import annotations

import math

from benchmarks.routing_report import Row, saturated_step, verdicts


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
