"""The scaling rule and the planner's hysteresis (lbd.common.scaling): pure, no processes."""

from __future__ import annotations

import math

import msgspec
import orjson

from lbd.common.scaling import (
    TARGET_UTILIZATION,
    AutoscaleReport,
    Planner,
    Signals,
    fleet_signals,
    rank_load,
    recommended_ranks,
    report,
)


def test_rank_load_is_flow_controls_saturation_point() -> None:
    assert rank_load(8192, 0, 0) == 1.0
    assert rank_load(0, 2, 0) == 0.5
    assert rank_load(0, 0, 0.95) == 1.0
    assert rank_load(0, 8, 0.1) == 2.0
    # stale telemetry: only the router's own queued tokens count
    assert rank_load(4096, 8, 0.9, fresh=False) == 0.5
    assert rank_load(0, 1, 0, max_waiting=1) == 1.0


def test_fleet_signals() -> None:
    s = fleet_signals([0.5, 2.0], 8000, 2.0, 4000.0)
    assert s.ranks == 2 and s.saturation == 0.75  # each rank capped at 1
    assert s.predicted_ttft_s == 1.0 and s.token_backlog == 8000
    assert fleet_signals([], 0).saturation == 0.0 and fleet_signals([], 0).predicted_ttft_s == 0.0
    assert math.isinf(fleet_signals([], 10).predicted_ttft_s)


def test_rule_for_utilisation() -> None:
    # one saturated rank: 1 / 0.9 -> 2
    assert recommended_ranks(Signals(1, 1.0, 0, 0.0)) == 2
    # 4 ranks at 0.45: 1.8 / 0.9 = 2 exactly (no rounding up past it)
    assert recommended_ranks(Signals(4, 0.45, 0, 0.0)) == 2
    assert recommended_ranks(Signals(2, 0.5, 0, 0.0)) == 2
    assert recommended_ranks(Signals(2, 0.3, 0, 0.0)) == 1
    assert recommended_ranks(Signals(4, 0.35, 0, 0.0), target_utilization=0.7) == 2


def test_default_target_sits_at_the_sweeps_slo_knee() -> None:
    """The default utilisation target (0.9) against benchmarks/elastic.py's sweep at 3x load, where 4 ranks
    met a 2 s TTFT SLO at saturation 0.82 and 3 ranks missed it at 0.95: the rule holds the 4 and grows
    the 3; at the old default (0.7) it asked for 5 at the 4 the SLO needs."""
    assert TARGET_UTILIZATION == 0.9
    assert recommended_ranks(Signals(4, 0.82, 0, 0.0)) == 4
    assert recommended_ranks(Signals(3, 0.95, 0, 0.0)) == 4
    assert recommended_ranks(Signals(4, 0.82, 0, 0.0), target_utilization=0.7) == 5
    # the 1x load after it, still on the 6 ranks of a burst (saturation 0.35 each): 3, not 6
    assert recommended_ranks(Signals(6, 0.35, 0, 0.0)) == 3
    # a backlog past the TTFT target still sizes by it, below the utilisation target
    assert recommended_ranks(Signals(4, 0.5, 32000, 3.0, 2.0)) == 6


def test_rule_for_the_backlog_and_bounds() -> None:
    # TTFT 3x the target on 2 ranks: 6 ranks, though the fleet is not saturated
    assert recommended_ranks(Signals(2, 0.2, 48000, 6.0, 2.0)) == 6
    assert recommended_ranks(Signals(2, 0.2, 48000, 6.0, 2.0), max_ranks=4) == 4
    assert recommended_ranks(Signals(2, 0.0, 0, 0.0), min_ranks=2) == 2
    # idle: scale to the minimum, zero included; any work keeps one rank
    assert recommended_ranks(Signals(3, 0.0, 0, 0.0), min_ranks=0) == 0
    assert recommended_ranks(Signals(3, 0.01, 0, 0.0), min_ranks=0) == 1
    # nothing serving and work waiting: one rank (then measure again)
    assert recommended_ranks(Signals(0, 0.0, 100, math.inf), min_ranks=0, max_ranks=8) == 1
    assert recommended_ranks(Signals(0, 0.0, 0, 0.0), min_ranks=0) == 0


def test_report_round_trips_through_json() -> None:
    r = report(Signals(2, 0.95, 1000, 0.125, 2.0), 1, 4)
    assert r.recommended_ranks == 3
    body = orjson.dumps(r)
    assert msgspec.json.decode(body, type=AutoscaleReport) == r


def _hot(ranks: int) -> Signals:
    return Signals(ranks, 1.0, 0, 0.0)


def _idle(ranks: int) -> Signals:
    return Signals(ranks, 0.0, 0, 0.0)


def test_planner_scales_up_after_up_after_s_and_then_cools_down() -> None:
    p = Planner(1, 8, up_after_s=2.0, down_after_s=10.0, cooldown_s=5.0)
    assert p.observe(_hot(1), 1, 0.0) is None
    assert p.observe(_hot(1), 1, 1.0) is None
    assert p.observe(_hot(1), 1, 2.0) == 2
    # cooldown: nothing while the new size settles, however hot
    assert p.observe(_hot(2), 2, 3.0) is None
    assert p.state(3.0)["cooling"] is True
    assert p.observe(_hot(2), 2, 7.0) == 3  # hot since 3.0, past up_after_s and the cooldown
    # a dip resets the trend
    p2 = Planner(1, 8, up_after_s=2.0)
    assert p2.observe(_hot(1), 1, 0.0) is None
    assert p2.observe(Signals(1, 0.5, 0, 0.0), 1, 1.5) is None
    assert p2.observe(_hot(1), 1, 2.5) is None
    assert p2.observe(_hot(1), 1, 4.5) == 2


def test_planner_jumps_up_and_comes_down_to_the_window_s_mean_demand() -> None:
    """Down to the mean demand of its last down_after_s, not the highest sample: one-second samples swing
    around the load (here 4.5 and 2.5 ranks' worth, recommendations 5 and 3, in turn: the highest would hold
    5, one rank too many), and only once it has a window of samples taken since its last change."""
    p = Planner(1, 8, up_after_s=0.0, down_after_s=10.0, cooldown_s=0.0)
    assert p.observe(Signals(2, 1.0, 64000, 8.0, 2.0), 2, 0.0) == 8
    for t in range(1, 11):  # demand 8 x sat / 0.9: 4.5 at odd seconds, 2.5 at even ones
        assert p.observe(Signals(8, 0.50625 if t % 2 else 0.28125, 0, 0.0), 8, float(t)) is None, t
    assert p.state(10.0)["below_for_s"] == 9.0  # the window's mean (3.5 and over) recommends 4 since t = 1
    assert p.observe(Signals(8, 0.50625, 0, 0.0), 8, 11.0) == 4  # mean 3.59 -> 4
    for t in range(12, 22):  # the window starts again at the new size
        assert p.observe(_idle(4), 4, float(t)) is None, t
    assert p.observe(_idle(4), 4, 22.0) == 1
    assert p.decisions == 3


def test_planner_averages_before_it_floors_at_one_rank() -> None:
    """Two ranks whose demand swings between 0.6 and 1.2 ranks' worth (mean 0.9) go down to one. Floored
    per sample at one rank, the swing read 1.0 and 1.2 and its mean stayed above one rank's worth for as long
    as any sample of the window did (CPU ranks after a 3x load: shrunk 33 s after the step, not 18)."""
    p = Planner(1, 4, up_after_s=3.0, down_after_s=10.0, cooldown_s=0.0)
    for t in range(10):  # demand 2 x sat / 0.9: 1.2 at odd seconds, 0.6 at even ones
        sat = 0.54 if t % 2 else 0.27
        assert p.observe(Signals(2, sat, 0, 0.0), 2, float(t)) is None, t
    assert p.observe(Signals(2, 0.27, 0, 0.0), 2, 10.0) == 1  # a whole window since t = 0: mean 0.93
    q = Planner(0, 4, down_after_s=2.0, cooldown_s=0.0)  # scale to zero: the floor holds while work is seen
    for t in range(3):
        assert q.observe(Signals(1, 0.05, 0, 0.0), 1, float(t)) is None, t
    assert q.observe(Signals(1, 0.0, 0, 0.0), 1, 3.0) is None  # the window still saw work
    for t in range(4, 7):
        q.observe(Signals(1, 0.0, 0, 0.0), 1, float(t))
    assert q.decisions == 1 and q.last is not None and q.last.recommended_ranks == 0


def test_planner_holds_at_the_minimum_and_pulls_back_into_bounds() -> None:
    p = Planner(2, 4, down_after_s=0.0, cooldown_s=0.0)
    assert p.observe(_idle(2), 2, 0.0) is None  # recommendation 2 (the minimum): nothing to do
    assert p.observe(_idle(1), 1, 1.0) == 2
    assert p.observe(_hot(6), 6, 2.0) == 4
    st = p.state(2.0)
    assert st["recommended_ranks"] == 4 and st["decisions"] == 2
