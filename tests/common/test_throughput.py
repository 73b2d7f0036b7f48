"""A rank's token rate and the fleet's capacity (lbd.common.throughput): the busy measure of a compute-bound
rank, which the autoscaling rule reads (issue 46). Pure: no processes."""

from __future__ import annotations

import pytest

from lbd.common import scaling
from lbd.common.throughput import Capacity, Offered, OutputSize, TokenRate


def _feed(rate: TokenRate, per_s: float, seconds: float, start: float = 0.0, tokens: float = 0.0,
          every_s: float = 0.25) -> tuple[float, float]:
    """Readings every ``every_s`` of counters growing ``per_s``; (the time and the tokens at the end)."""
    t = start
    while t < start + seconds - 1e-9:
        t += every_s
        tokens += per_s * every_s
        rate.update(tokens, t)
    return t, tokens


def test_the_rate_follows_the_counters_and_starts_over_on_a_new_process() -> None:
    rate = TokenRate(tau_s=5.0)
    assert rate.update(1000.0, 0.0) == 0.0  # one reading: no rate yet
    t, tokens = _feed(rate, 200.0, 40.0, tokens=1000.0)
    assert rate.rate == pytest.approx(200.0, rel=0.01)
    _feed(rate, 0.0, 5.0, start=t, tokens=tokens)  # idle for one time constant: ~1/e of it left
    assert rate.rate == pytest.approx(200.0 / 2.718, rel=0.1)
    assert rate.update(10.0, t + 6.0) == 0.0  # the counters went down: a restarted rank
    rate.update(10.0, t + 6.0)  # the same instant again: no division by zero
    _feed(rate, 100.0, 40.0, start=t + 6.0, tokens=10.0, every_s=1.0)  # sparser readings, same answer
    assert rate.rate == pytest.approx(100.0, rel=0.01)


def test_capacity_is_the_highest_rate_after_lasting_saturation() -> None:
    """A moment's queue (or a start-up burst) is not the limit; two time constants of waiting requests are,
    and the highest such reading stays (a rank saturated at fewer tokens a second was KV-bound)."""
    cap, rate = Capacity(), TokenRate(tau_s=5.0)
    t, tokens = _feed(rate, 200.0, 30.0)
    cap.observe(rate, t)
    assert cap.tokens_per_s == 0.0 and cap.busy(300.0) == 0.0  # never saturated: unknown, says nothing
    for _ in range(8):  # 2 s with requests waiting: too short
        t, tokens = t + 0.25, tokens + 100.0
        rate.update(tokens, t, waiting=True)
        cap.observe(rate, t)
    assert cap.tokens_per_s == 0.0
    rate.update(tokens + 100.0, t + 0.25)  # the queue drained: the clock starts over
    t, tokens = t + 0.25, tokens + 100.0
    for _ in range(200):  # 50 s saturated at 400 tokens/s
        t, tokens = t + 0.25, tokens + 100.0
        rate.update(tokens, t, waiting=True)
        cap.observe(rate, t)
    assert cap.tokens_per_s == pytest.approx(400.0, rel=0.02) and cap.busy(300.0) == pytest.approx(0.75, 0.02)
    for speed, expected in ((150.0, 600.0), (50.0, 600.0)):  # another rank saturated later: the highest
        other = TokenRate(tau_s=5.0)
        other.update(0.0, 100.0)
        for i in range(1, 200):
            other.update(speed * i, 100.0 + 0.25 * i, waiting=True)
            cap.observe(other, 100.0 + 0.25 * i)
        assert cap.tokens_per_s == pytest.approx(expected, rel=0.02)  # 200 tokens/s saturated: KV-bound


def test_a_compute_bound_rank_counts_as_busy_in_the_rule() -> None:
    """Two CPU ranks decoding without a queue or much KV: by queue and KV alone the rule would ask for one
    rank; their throughput, near what one saturated rank served, keeps two."""
    idle_looking = [scaling.rank_load(0, 0.0, 0.1, busy=0.0) for _ in range(2)]
    assert scaling.recommended_ranks(scaling.fleet_signals(idle_looking, 0)) == 1
    busy = [scaling.rank_load(0, 0.0, 0.1, busy=0.55) for _ in range(2)]
    assert scaling.recommended_ranks(scaling.fleet_signals(busy, 0)) == 2
    assert scaling.rank_load(0, 0.0, 0.1, fresh=False, busy=0.9) == 0.0  # stale telemetry: not counted


def test_the_router_learns_capacity_from_telemetry_and_the_rule_sees_a_compute_bound_fleet() -> None:
    """Through the router's own record (``Fleet.observe``) and report: one rank queued for 15 s at 400
    tokens/s teaches the capacity; two ranks then serving 300 tokens/s each with nothing waiting and little
    KV in use read 0.75 busy (queue and KV alone: 0.25), so the rule keeps both."""
    import asyncio

    from lbd.router.autoscale_signals import router_report
    from lbd.router.config import parse_args
    from lbd.router.shared import SharedCounters
    from lbd.router.state import RouterState
    from lbd.router.telemetry import Sample

    async def run() -> None:
        urls = ["http://a:1", "http://b:1"]
        cfg = parse_args(["--upstreams", ",".join(urls), "--kv-events", "off"])
        state = RouterState(cfg, SharedCounters(1, 8))
        a, b = (state.add(u, "static") for u in urls)
        try:
            for i in range(61):  # rank a, 15 s with requests waiting
                state.observe(a, Sample(running=16, waiting=3, kv_usage=0.2, generation_tokens=100.0 * i),
                              began_at=0.25 * i)
            assert state.capacity.tokens_per_s == pytest.approx(400.0, rel=0.02)
            for i in range(61, 241):  # then both ranks, 45 s at 300 tokens/s each, nothing waiting
                for ep in (a, b):
                    state.observe(ep, Sample(running=8, kv_usage=0.2, generation_tokens=75.0 * i),
                                  began_at=0.25 * i)
            snaps = state.snapshots()
            assert [s.tokens_per_s for s in snaps] == [pytest.approx(300.0, rel=0.02)] * 2
            report = router_report(snaps, cfg.flow, 1e9, 0.0, 2.0, None, capacity=state.capacity)
            assert report.signals.saturation == pytest.approx(0.75, rel=0.03)
            assert report.signals.capacity_tokens_per_s == pytest.approx(400.0, rel=0.02)
            assert report.recommended_ranks == 2
            blind = router_report(snaps, cfg.flow, 1e9, 0.0, 2.0, None)  # without the throughput measure
            assert blind.signals.saturation < 0.3 and blind.recommended_ranks == 1
        finally:
            for u in urls:
                state.remove(u)

    asyncio.run(run())


def test_output_size_is_generated_tokens_per_finished_request_over_a_minute() -> None:
    """Tokens count as generated, requests as they end: a mix of 32- and 500-token answers (one long in
    ten) reads its mean, 78.8 tokens a request; unknown before five requests ended."""
    out = OutputSize()
    out.observe(400.0, 2.0, 0.0)
    assert out.per_request == 0.0  # two requests: not known yet
    for i in range(1, 121):  # 2 requests/s for 60 s: 1.8 of 32 tokens, 0.2 of 500
        out.observe(1.8 * 32 + 0.2 * 500, 2.0, 0.5 * i)
    assert out.per_request == pytest.approx(0.9 * 32 + 0.1 * 500, rel=0.05)


def test_offered_reads_served_in_a_steady_load_and_drops_at_once_when_the_load_drops() -> None:
    """A rank taking 2 requests/s (100 prompt tokens, 50 out each) offers and serves 300 tokens/s. When the
    arrivals stop, the offered rate falls within seconds while 500-token streams still decode; counters
    that go down (a new process) add nothing."""
    out, offered = OutputSize(), Offered()
    prompt = generated = 0.0
    sent = finished = 0
    t = 0.0
    for _ in range(240):  # 60 s steady
        t += 0.25
        prompt, generated, sent, finished = prompt + 50, generated + 25, sent + 0.5, finished + 0.5
        offered.update(prompt, generated, int(sent), int(finished), t, out)
    assert out.per_request == pytest.approx(50.0, rel=0.05)
    assert offered.tokens_per_s() == pytest.approx(300.0, rel=0.1)
    for _ in range(40):  # 10 s: nothing new arrives, the old streams decode on at 250 tokens/s
        t += 0.25
        generated += 62.5
        offered.update(prompt, generated, int(sent), int(finished), t, out)
    assert offered.tokens_per_s() < 0.15 * 300.0
    before = offered.total
    offered.update(0.0, 0.0, int(sent) + 5, int(finished), t + 0.25, out)  # a restarted engine
    assert offered.total == before


def test_offered_is_unknown_until_the_output_size_is() -> None:
    out, offered = OutputSize(), Offered()
    for i in range(8):
        offered.update(100.0 * i, 0.0, i, 0, 0.25 * i, out)
    assert offered.tokens_per_s() is None


def test_the_rule_lets_a_rank_go_while_the_streams_of_a_passed_load_decode() -> None:
    """Through the router's record and report: two ranks at 250 tokens/s each (2 requests/s, 100 prompt
    tokens and 25 out each) against a 400 tokens/s capacity keep two ranks. The arrivals then drop to a
    third while the passed load's streams decode on (150 tokens/s): served tokens alone would still ask for
    two ranks; counted in the share still arriving, the fleet reads one rank's worth within 10 s."""
    import asyncio

    from lbd.router.autoscale_signals import router_report
    from lbd.router.config import parse_args
    from lbd.router.shared import SharedCounters
    from lbd.router.state import RouterState
    from lbd.router.telemetry import Sample

    async def run() -> None:
        urls = ["http://a:1", "http://b:1"]
        cfg = parse_args(["--upstreams", ",".join(urls), "--kv-events", "off"])
        state = RouterState(cfg, SharedCounters(1, 8))
        eps = [state.add(u, "static") for u in urls]
        counters = {ep.url: [0.0, 0.0] for ep in eps}  # prompt, generated tokens
        try:
            state.capacity.tokens_per_s = 400.0  # as if learned (the test above learns one)

            def step(i: int, arrivals_every: int) -> None:
                for ep in eps:
                    c = counters[ep.url]
                    if i % arrivals_every == 0:  # a request arrives: 100 prompt tokens in
                        state.shared.dispatch(ep.slot, 100)
                        state.shared.start(ep.slot, 100)
                        c[0] += 100
                    if i % 2 == 0:  # one ends (the steady rate), its 50 tokens made over its life
                        state.shared.finish(ep.slot)
                    c[1] += 12.5 if arrivals_every == 2 else 37.5  # decode: 50, then 150 tokens/s
                    sample = Sample(running=8, kv_usage=0.2, prompt_tokens=c[0], generation_tokens=c[1])
                    state.observe(ep, sample, began_at=0.25 * i)

            for i in range(240):  # 60 s at 2 requests/s a rank: 200 prompt + 50 generated tokens/s
                step(i, 2)
            report = router_report(state.snapshots(), cfg.flow, 1e9, 0.0, 2.0, None, capacity=state.capacity)
            assert report.signals.offered_tokens_per_s == pytest.approx(2 * 250.0, rel=0.15)
            assert report.recommended_ranks == 2
            for i in range(240, 280):  # 10 s: a third of the arrivals; the old streams decode on
                step(i, 6)
            snaps = state.snapshots()
            report = router_report(snaps, cfg.flow, 1e9, 0.0, 2.0, None, capacity=state.capacity)
            assert report.recommended_ranks == 1
            served_only = scaling.fleet_signals([s.tokens_per_s / 400.0 for s in snaps], 0)
            assert scaling.recommended_ranks(served_only) == 2
        finally:
            for u in urls:
                state.remove(u)

    asyncio.run(run())
