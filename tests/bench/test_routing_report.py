"""routing_report.py and routing_quality.served_rate: saturation and the stepped verdicts (no server)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parents[2] / "benchmarks")]

from routing_quality import served_rate  # noqa: E402
from routing_report import Row, verdicts  # noqa: E402

from lbd.bench.client import RequestRecord  # noqa: E402


def rec(start: float, e2e: float) -> RequestRecord:
    return RequestRecord(session_id="s", turn=0, start=start, ttft=0.01, e2e=e2e)


def test_served_rate_is_the_offered_rate_until_a_queue_builds() -> None:
    arrivals = [i / 100 for i in range(100)]  # 100 req/s for 1 s
    assert math.isclose(served_rate([rec(t, 0.5) for t in arrivals]), 100.0)  # each answered in 0.5 s
    # a server that completes one every 20 ms (50/s): answers spread over 2 s, the queue drains at its rate
    assert math.isclose(served_rate([rec(t, 0.5 + i * 0.02 - t) for i, t in enumerate(arrivals)]), 50.0)
    assert math.isnan(served_rate([rec(0.0, 1.0)]))


def row(target: str, step: float, p90: float, served: float) -> Row:
    return Row("many-tenant", target, 10, 0, 1.0, 1.0, math.nan, 1.0, 1.0, 0.5, 0.6, "1/1", 1, 1,
               ttft_p90_ms=p90, step_rate=step, served_req_s=served)


def test_stepped_verdicts_name_the_saturating_step_and_the_ratio_at_the_top() -> None:
    rows = [
        row("lbd:round_robin", 100, 50, 98), row("lbd:round_robin", 200, 900, 150),
        row("lbd:predicted_ttft", 100, 40, 99), row("lbd:predicted_ttft", 200, 100, 197),
        row("sglang-router:cache_aware", 100, 41, 99), row("sglang-router:cache_aware", 200, 250, 190),
    ]
    out = verdicts(rows)
    assert out[0].startswith("- MET: many-tenant: round robin saturates at 200 req/s (serves 150)")
    assert out[1].startswith("- MET:") and "2.50x lower" in out[1]
    out = verdicts([r for r in rows if r.step_rate == 100])
    assert out[0].startswith("- MISSED: many-tenant: round robin saturates at no step")
