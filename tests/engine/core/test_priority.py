"""--scheduling-policy priority in the real Scheduler, driven without a model (lbd.engine.core.priority).

A small driver plays the runner as tests/engine/core/test_scheduler.py's does: tokens are a deterministic
function of the whole sequence (a greedy model), and a simulated paged store checks that every position a
sequence attends to holds its own token, so a preempted request that came back with wrong KV, a skipped or a
repeated token shows up as a different output.
"""

from __future__ import annotations

import random

import pytest

from lbd.engine.core.priority import priority_key
from lbd.engine.core.request import Request, RequestStatus
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput
from lbd.engine.core.scheduler import Scheduler, SchedulerConfig
from lbd.wire.core_messages import SamplingParams

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    return (31 * len(tokens) + sum((i + 1) * t for i, t in enumerate(tokens[-8:]))) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_tokens):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def make_sched(policy: str = "priority", **kw: object) -> Scheduler:
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, num_blocks=256, block_size=4,
               scheduling_policy=policy)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


class Driver:
    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.store: dict[int, list[int | None]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.first_step: dict[str, int] = {}
        self.done_step: dict[str, int] = {}
        self.steps = 0

    def add(self, rid: str, prompt: list[int], max_tokens: int, priority: int = 0,
            arrival: float = 0.0) -> Request:
        r = Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, arrival,
                    priority=priority)
        self.s.add_request(r)
        return r

    def schedule(self) -> SchedulerOutput:
        out = self.s.schedule()
        self.check(out)
        return out

    def update(self, out: SchedulerOutput) -> None:
        sampled = [SampledToken(q.request.request_id, next_token(q.request.all_token_ids))
                   for q in out.seqs if q.sample]
        for o in self.s.update(out, sampled):
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            self.first_step.setdefault(o.request_id, self.steps)
            if o.finish_reason is not None:
                self.done_step[o.request_id] = self.steps
        self.steps += 1

    def step(self) -> SchedulerOutput:
        out = self.schedule()
        self.update(out)
        return out

    def check(self, out: SchedulerOutput) -> None:
        s, bs = self.s, self.s.config.block_size
        assert len(s.running) <= s.config.max_num_seqs and out.num_tokens == out.scheduled_tokens
        assert out.num_tokens <= s.config.max_num_batched_tokens
        if s.order.name == "priority":
            assert [priority_key(r) for r in s.running] == sorted(priority_key(r) for r in s.running)
            assert [priority_key(r) for r in s.waiting] == sorted(priority_key(r) for r in s.waiting)
        for q in out.seqs:
            r = q.request
            assert r.status is RequestStatus.RUNNING and r in s.running
            start, end = r.num_computed_tokens, r.num_computed_tokens + q.num_new_tokens
            assert len(r.block_ids) * bs >= end and q.sample == (end == r.num_tokens)
            for p in range(start, end):
                self.store.setdefault(r.block_ids[p // bs], [None] * bs)[p % bs] = r.all_token_ids[p]
            seen = [self.store[r.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == r.all_token_ids[:end], f"{r.request_id}: KV store disagrees with its tokens"

    def run(self, max_steps: int = 5000) -> None:
        while self.s.has_work():
            self.step()
            assert self.steps < max_steps, "no progress"


def assert_idle_and_free(s: Scheduler) -> None:
    assert not s.has_work() and not s.requests and s.num_waiting_tokens == 0
    assert s.kv.num_free_blocks == s.kv.num_blocks


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_waiting_queue_is_served_by_priority_then_arrival(policy: str) -> None:
    d = Driver(make_sched(policy, max_num_seqs=1))
    plan = [("a", 3, 0.0), ("b", 1, 2.0), ("c", 2, 0.5), ("d", 1, 1.0), ("e", 3, 0.1)]
    for rid, prio, arrival in plan:
        d.add(rid, [7, 8, 9], max_tokens=2, priority=prio, arrival=arrival)
    d.run()
    served = sorted(d.first_step, key=d.first_step.get)
    assert served == (["d", "b", "c", "a", "e"] if policy == "priority" else ["a", "b", "c", "d", "e"])
    assert d.s.counters.num_preemptions == 0  # fcfs ignores the field; nothing displaced anything
    assert_idle_and_free(d.s)


def test_kv_pressure_preempts_the_least_important_not_the_latest() -> None:
    # 10 blocks of 4: three requests of 7 tokens take 2 blocks each, and each needs a 3rd at its 9th token.
    d = Driver(make_sched(max_num_seqs=8, num_blocks=8))
    low = d.add("low", [1] * 7, max_tokens=12, priority=5)
    mid = d.add("mid", [2] * 7, max_tokens=12, priority=2)
    d.step()
    high = d.add("high", [3] * 7, max_tokens=12, priority=0)  # admitted last, most important
    d.step()
    assert [r.request_id for r in d.s.running] == ["high", "mid", "low"]
    while d.s.counters.num_preemptions == 0:
        d.step()
    assert low.status is RequestStatus.PREEMPTED and high.status is mid.status is RequestStatus.RUNNING
    d.run()
    for r in (low, mid, high):
        assert d.outputs[r.request_id] == reference(r.prompt_token_ids, 12)
    assert_idle_and_free(d.s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_waiting_request_of_higher_priority_takes_a_seat(policy: str) -> None:
    d = Driver(make_sched(policy, max_num_seqs=2))
    lows = [d.add(f"low{i}", [i + 1] * 5, max_tokens=30, priority=1) for i in range(2)]
    for _ in range(3):
        d.step()
    high = d.add("high", [9] * 5, max_tokens=4, priority=0)
    d.step()
    if policy == "fcfs":  # the field means nothing: it waits for a seat
        assert high.status is RequestStatus.WAITING and d.s.counters.num_preemptions == 0
    else:  # the later low one (the tail of running) makes way, at once
        assert high.status is RequestStatus.RUNNING and d.s.counters.num_preemptions == 1
        assert lows[1].status is RequestStatus.PREEMPTED and lows[1].num_preemptions == 1
        assert list(d.s.waiting) == [lows[1]]
    d.run()
    for r in (*lows, high):
        assert d.outputs[r.request_id] == reference(r.prompt_token_ids, r.sampling.max_tokens)
    if policy == "priority":
        assert d.done_step["high"] < d.first_step["low1"] + 30  # it did not wait for a low one to finish
        assert d.done_step["high"] < d.done_step["low0"]
    assert_idle_and_free(d.s)


def test_a_waiting_request_of_higher_priority_takes_kv_room() -> None:
    # seats enough, but 2 requests of 15 tokens + growth fill all 8 blocks
    d = Driver(make_sched(max_num_seqs=8, num_blocks=8, max_num_batched_tokens=64))
    lows = [d.add(f"low{i}", [i + 1] * 15, max_tokens=1000, priority=3) for i in range(2)]
    d.step()
    assert d.s.kv.num_free_blocks == 0
    high = d.add("high", [9] * 6, max_tokens=5, priority=-1)
    out = d.step()
    # its first chunk is in this very step, and the displaced request is not (it had been scheduled first)
    assert high.status is RequestStatus.RUNNING and "high" in {q.request.request_id for q in out.seqs}
    assert lows[1].status is RequestStatus.PREEMPTED
    assert "low1" not in {q.request.request_id for q in out.seqs}
    for r in lows:
        d.s.abort([r.request_id])  # their max_tokens would outlast the context: enough seen
    d.run()
    assert d.outputs["high"] == reference(high.prompt_token_ids, 5)
    assert_idle_and_free(d.s)


def test_equal_priority_never_displaces() -> None:
    d = Driver(make_sched(max_num_seqs=2, num_blocks=6))
    for i in range(2):
        d.add(f"r{i}", [i + 1] * 7, max_tokens=3, priority=2)
    d.step()
    late = d.add("late", [5] * 7, max_tokens=3, priority=2)
    d.step()
    assert late.status is RequestStatus.WAITING and d.s.counters.num_preemptions == 0
    d.run()
    assert_idle_and_free(d.s)


def test_requests_in_a_batch_in_flight_are_never_displaced() -> None:
    d = Driver(make_sched(max_num_seqs=2))
    lows = [d.add(f"low{i}", [i + 1] * 5, max_tokens=8, priority=4) for i in range(2)]
    d.step()
    out = d.schedule()  # a pipeline-parallel batch: both lows in flight until its update
    high = d.add("high", [9] * 5, max_tokens=2, priority=0)
    assert not d.s.schedule().seqs  # nothing to run: the lows are in flight and may not go
    assert high.status is RequestStatus.WAITING and d.s.counters.num_preemptions == 0
    d.update(out)
    d.step()
    assert high.status is RequestStatus.RUNNING and lows[1].status is RequestStatus.PREEMPTED
    d.run()
    for r in (*lows, high):
        assert d.outputs[r.request_id] == reference(r.prompt_token_ids, r.sampling.max_tokens)
    assert_idle_and_free(d.s)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_priorities_in_a_tiny_cache_finish_with_the_reference_output(seed: int) -> None:
    rng = random.Random(seed)
    d = Driver(make_sched(max_num_seqs=5, max_num_batched_tokens=24, max_model_len=64, num_blocks=14))
    work = [([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, 20))], rng.randint(1, 30),
             rng.randint(-2, 3)) for _ in range(30)]
    for i, (prompt, mt, prio) in enumerate(work):
        d.add(f"r{i}", prompt, mt, prio, arrival=float(i))
        for _ in range(rng.randint(0, 3)):
            d.step()
    d.run()
    assert d.s.counters.num_preemptions > 0
    for i, (prompt, mt, _) in enumerate(work):
        assert d.outputs[f"r{i}"] == reference(prompt, mt), f"r{i}"
    assert_idle_and_free(d.s)
