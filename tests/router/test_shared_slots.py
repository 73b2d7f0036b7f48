"""Shared-counter slots are freed when their endpoint goes (lbd.router.shared, lbd.router.state): a fleet
that churns through thousands of URLs (pod IPs, Ray ports) never fills the 1,024-slot table, and a slot is
reused only once no worker holds it and nothing is in flight there, with its counters zeroed."""

from __future__ import annotations

import asyncio
import multiprocessing
import os

from lbd.router.config import parse_args
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState


def _url(i: int) -> str:
    return f"http://10.{i // 62500 % 250}.{i // 250 % 250}.{i % 250 + 1}:8000"


def test_churning_3000_endpoints_through_the_table() -> None:
    async def run() -> None:
        shared = SharedCounters(1, 1024)
        state = RouterState(parse_args(["--upstreams", _url(0), "--kv-events", "off"]), shared)
        kept = [state.add(_url(i), "static") for i in range(100)]  # a standing fleet beside the churn
        for ep in kept:
            shared.dispatch(ep.slot, 10)
        for i in range(100, 3100):
            ep = state.add(_url(i), "static")
            shared.dispatch(ep.slot, 7)
            shared.start(ep.slot, 7)
            assert shared.totals(ep.slot).dispatched == 1, i  # a reused slot starts from zero
            shared.finish(ep.slot)
            state.remove(_url(i))
        assert shared.held() == 100
        assert [shared.totals(ep.slot).inflight for ep in kept] == [1] * 100  # untouched by the churn
        for ep in kept:
            shared.finish(ep.slot)
            state.remove(ep.url)
        assert shared.held() == 0

    asyncio.run(run())


def test_a_slot_is_reused_only_when_no_worker_holds_it_and_nothing_is_in_flight() -> None:
    c = SharedCounters(workers=2, slots=4)
    a = c.slot("http://a:1")
    c.bind_worker(1)
    assert c.slot("http://a:1") == a  # both workers hold it
    c.dispatch(a, 5)  # worker 1 has a request in flight there
    c.bind_worker(0)
    c.release(a)  # worker 0 removed the endpoint: worker 1 still holds it
    others = [c.slot(f"http://o:{i}") for i in range(3)]
    assert a not in others and c.slot("http://x:1") == -1  # full: a is held
    for s in others:
        c.release(s)
    c.bind_worker(1)
    c.release(a)  # no holder, but a request still runs there: not reused yet
    c.bind_worker(0)
    taken = {c.slot(f"http://n:{i}") for i in range(3)}
    assert a not in taken and c.slot("http://y:1") == -1
    c.bind_worker(1)
    c.finish(a)  # its last request ended: the next claim takes it, counters zeroed
    c.bind_worker(0)
    assert c.slot("http://z:1") == a and c.totals(a).dispatched == 0 and c.totals(a).finished == 0
    c.close_out(0)  # a dead worker holds nothing
    assert c.held() == 0


def _churn(shared: SharedCounters, worker: int, n: int) -> None:
    shared.bind_worker(worker)
    for i in range(n):
        url = _url(i % 1500)  # the two workers add and remove the same URLs, out of step
        slot = shared.slot(url)
        if slot < 0:
            os._exit(3)
        shared.dispatch(slot, 1)
        shared.finish(slot)
        shared.release(slot)
    os._exit(0)


def test_forked_workers_churn_the_same_table() -> None:
    shared = SharedCounters(workers=2, slots=1024)
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_churn, args=(shared, w, 3000)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert shared.held() == 0
