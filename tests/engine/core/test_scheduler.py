"""Scheduler without a model: a driver plays the runner, writing token ids into a simulated paged KV store.

Every step the driver checks the runner's contract (budget, max_num_seqs, decodes first, blocks allocated,
``sample`` exactly when a chunk reaches the last token) and that the paged store holds, for every position a
sequence attends to, exactly that sequence's token (so a wrong prefix hit or a reused block that still
belongs to someone shows up). Tokens are a deterministic function of the whole sequence, like a greedy
model, so any skipped, repeated or reordered sampling changes the output.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

from lbd.engine.core.request import Request, RequestStatus
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput
from lbd.engine.core.scheduler import RequestRejected, Scheduler, SchedulerConfig
from lbd.wire.core_messages import EngineCoreOutput, SamplingParams

VOCAB = 1000


def next_token(tokens: list[int]) -> int:
    acc = 31 * len(tokens)
    for i, t in enumerate(tokens[-8:]):
        acc += (i + 1) * t
    return acc % VOCAB


def reference(prompt: list[int], max_tokens: int, max_model_len: int = 10**9) -> list[int]:
    seq = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens and len(seq) < max_model_len:
        t = next_token(seq)
        seq.append(t)
        out.append(t)
    if not out:  # the first token is always sampled
        out.append(next_token(seq))
    return out


def make_sched(**kw: object) -> Scheduler:
    cfg = dict(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256, num_blocks=256, block_size=4)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg))


def new_req(rid: str, prompt: list[int], eos: int | None = None, **sampling: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(**sampling), eos_token_id=eos, arrival_time=0.0)


class Driver:
    def __init__(self, sched: Scheduler) -> None:
        self.s = sched
        self.store: dict[int, list[int | None]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish: dict[str, EngineCoreOutput] = {}
        self.first: dict[str, EngineCoreOutput] = {}
        self.steps = 0
        self.finished_ids: list[str] = []  # handed to the runner in SchedulerOutput.finished_ids
        self.finished_at: dict[str, int] = {}  # request id -> step that finished it

    def add(self, r: Request) -> Request:
        self.s.add_request(r)
        return r

    def step(self) -> SchedulerOutput:
        running_before = {r.request_id for r in self.s.running}
        preemptions_before = self.s.counters.num_preemptions
        out = self.s.schedule()
        self.check(out)
        if self.s.counters.num_preemptions != preemptions_before:  # the cache is tight: nobody new
            assert {q.request.request_id for q in out.seqs} <= running_before
        sampled = [SampledToken(q.request.request_id, next_token(q.request.all_token_ids))
                   for q in out.seqs if q.sample]
        for o in self.s.update(out, sampled):
            self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            self.first.setdefault(o.request_id, o)
            if o.finish_reason is not None:
                self.finish[o.request_id] = o
                self.finished_at[o.request_id] = self.steps
        self.finished_ids += out.finished_ids
        self.steps += 1
        return out

    def check(self, out: SchedulerOutput) -> None:
        cfg, bs = self.s.config, self.s.config.block_size
        assert out.num_tokens <= cfg.max_num_batched_tokens
        assert len(out.seqs) <= cfg.max_num_seqs and len(self.s.running) <= cfg.max_num_seqs
        lens = [q.num_new_tokens for q in out.seqs]
        assert lens == sorted(lens, key=lambda n: n > 1), "decodes (1 token) come first"
        assert len({q.request.request_id for q in out.seqs}) == len(out.seqs)
        orders = [r.order for r in self.s.running]
        assert orders == sorted(orders), "running stays in priority order (preemption victims at the tail)"
        for q in out.seqs:
            r = q.request
            assert r.status is RequestStatus.RUNNING and q.num_new_tokens > 0
            start, end = r.num_computed_tokens, r.num_computed_tokens + q.num_new_tokens
            assert end <= r.num_tokens and end <= cfg.max_model_len
            assert len(r.block_ids) * bs >= end
            assert q.sample == (end == r.num_tokens)
            for p in range(start, end):  # the runner writes the new tokens' K/V ...
                self.store.setdefault(r.block_ids[p // bs], [None] * bs)[p % bs] = r.all_token_ids[p]
            seen = [self.store[r.block_ids[p // bs]][p % bs] for p in range(end)]
            assert seen == r.all_token_ids[:end], f"{r.request_id}: KV store disagrees with its tokens"

    def run(self, max_steps: int = 10_000) -> None:
        while self.s.has_work():
            self.step()
            assert self.steps < max_steps, "no progress"


def assert_idle_and_free(s: Scheduler) -> None:
    kv = s.kv
    assert not s.has_work() and not s.requests
    assert kv.ref_cnt == [0] * kv.num_blocks and kv.num_free_blocks == kv.num_blocks and kv.usage == 0.0
    assert s.num_waiting_tokens == 0


def test_chunked_prefill_across_steps() -> None:
    d = Driver(make_sched(max_num_batched_tokens=32))
    r = d.add(new_req("a", range(1, 101), max_tokens=3))
    chunks = []
    while d.s.has_work():
        out = d.step()
        chunks.append([(q.num_new_tokens, q.sample) for q in out.seqs])
    assert chunks == [[(32, False)], [(32, False)], [(32, False)], [(4, True)], [(1, True)], [(1, True)]]
    assert d.outputs["a"] == reference(list(r.prompt_token_ids), 3)
    assert d.finish["a"].finish_reason == "length"
    assert_idle_and_free(d.s)


def test_decodes_and_prefill_chunks_share_the_budget() -> None:
    d = Driver(make_sched(max_num_batched_tokens=16))
    for i in range(3):
        d.add(new_req(f"d{i}", [i + 1] * 3, max_tokens=50))
    d.step()  # 3 short prefills
    d.add(new_req("long", range(1, 41), max_tokens=2))
    out = d.step()
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs] == [
        ("d0", 1), ("d1", 1), ("d2", 1), ("long", 13)]
    out = d.step()
    assert [q.num_new_tokens for q in out.seqs] == [1, 1, 1, 13]
    d.run()
    assert d.outputs["long"] == reference(list(range(1, 41)), 2)
    assert_idle_and_free(d.s)


def test_one_token_prefills_run_with_the_decodes() -> None:
    d = Driver(make_sched(block_size=4))
    d.add(new_req("warm", range(1, 10), max_tokens=1))
    d.run()
    d.add(new_req("x", range(50, 56), max_tokens=2))  # a 6-token prefill
    d.add(new_req("y", range(1, 10), max_tokens=2))  # 8 of 9 tokens cached: a 1-token prefill
    out = d.step()
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs] == [("y", 1), ("x", 6)]
    d.run()
    assert d.outputs["y"] == reference(list(range(1, 10)), 2)


def _random_workload(rng: random.Random, n: int, max_prompt: int,
                     max_out: int) -> list[tuple[list[int], int]]:
    return [([rng.randrange(1, VOCAB) for _ in range(rng.randint(1, max_prompt))], rng.randint(1, max_out))
            for _ in range(n)]


def test_mixed_load_respects_limits_and_matches_reference() -> None:
    rng = random.Random(0)
    d = Driver(make_sched(max_num_seqs=8, max_num_batched_tokens=48))
    work = _random_workload(rng, 40, 90, 30)
    for i, (prompt, mt) in enumerate(work[:20]):
        d.add(new_req(f"r{i}", prompt, max_tokens=mt))
    for _ in range(5):
        d.step()
    for i, (prompt, mt) in enumerate(work[20:], start=20):  # arrivals while others run
        d.add(new_req(f"r{i}", prompt, max_tokens=mt))
        d.step()
    d.run()
    for i, (prompt, mt) in enumerate(work):
        assert d.outputs[f"r{i}"] == reference(prompt, mt), f"r{i}"
    # The runner hears of every finished request in the next step's output (the last step's: not yet).
    handed = {rid for rid, step in d.finished_at.items() if step < d.steps - 1}
    assert sorted(d.finished_ids) == sorted(handed) and len(d.finish) == 40
    assert d.s.counters.generation_tokens == sum(mt for _, mt in work)
    assert d.s.counters.prompt_tokens == sum(len(p) for p, _ in work)
    assert_idle_and_free(d.s)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_with_a_tiny_kv_cache_completes_every_request(prefix_caching: bool) -> None:
    # 12 blocks of 4 = 48 tokens for 10 requests that each grow to ~30: constant preemption.
    rng = random.Random(1)
    sched = make_sched(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48, num_blocks=12,
                       enable_prefix_caching=prefix_caching)
    d = Driver(sched)
    shared = [7] * 8  # a shared prefix too, so hits on blocks that get evicted are exercised
    work = _random_workload(rng, 10, 16, 24)
    work = [((shared if i % 2 else []) + p, mt) for i, (p, mt) in enumerate(work)]
    for i, (prompt, mt) in enumerate(work):
        d.add(new_req(f"r{i}", prompt, max_tokens=mt))
    d.run()
    assert sched.counters.num_preemptions > 0
    for i, (prompt, mt) in enumerate(work):
        assert d.outputs[f"r{i}"] == reference(prompt, mt, 48), f"r{i}"
        assert d.finish[f"r{i}"].finish_reason == "length"
    assert_idle_and_free(sched)


def test_preempted_request_goes_back_to_the_front_and_keeps_its_priority() -> None:
    s = make_sched(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, num_blocks=8)
    d = Driver(s)
    reqs = [d.add(new_req(f"r{i}", [i + 1] * 7, max_tokens=20)) for i in range(4)]
    d.step()  # 4 x 2 blocks: the cache is full
    assert s.kv.num_free_blocks == 0
    for _ in range(2):
        d.step()  # every request needs a 3rd block at token 9: the latest arrivals are preempted
    assert s.counters.num_preemptions >= 2
    assert reqs[0].status is RequestStatus.RUNNING
    assert [r.request_id for r in s.running] == sorted(r.request_id for r in s.running)
    assert list(s.waiting)[0].order < list(s.waiting)[-1].order
    d.run()
    for r in reqs:
        assert d.outputs[r.request_id] == reference(list(r.prompt_token_ids), 20, 32)
    assert_idle_and_free(s)


def test_prefix_cache_hits_through_the_scheduler() -> None:
    s = make_sched(block_size=16)
    d = Driver(s)
    prefix = list(range(100, 164))  # 64 tokens = 4 blocks
    d.add(new_req("a", prefix + [1, 2, 3], max_tokens=2))
    d.run()
    d.add(new_req("b", prefix + [4, 5], max_tokens=2))
    d.run()
    assert s.kv.prefix_hits == 64 and s.kv.prefix_queries == 67 + 66
    assert d.first["b"].num_cached_tokens == 64 and d.first["a"].num_cached_tokens == 0
    d.add(new_req("c", prefix, max_tokens=2))  # exactly the prefix: the last block is recomputed
    d.run()
    assert s.kv.prefix_hits == 64 + 48
    assert d.outputs["b"] == reference(prefix + [4, 5], 2)
    assert_idle_and_free(s)


def test_stop_conditions() -> None:
    prompt = [5, 6, 7]
    ref = reference(prompt, 40)
    eos = ref[3]
    first_eos = ref.index(eos)
    d = Driver(make_sched(max_model_len=40))  # caps every request at 37 new tokens, below max_tokens
    d.add(new_req("eos", prompt, eos=eos, max_tokens=40))
    d.add(new_req("ignore", prompt, eos=eos, max_tokens=40, ignore_eos=True))
    d.add(new_req("stopid", prompt, max_tokens=40, stop_token_ids=[ref[5], 999_999]))
    d.add(new_req("min", prompt, eos=eos, max_tokens=40, min_tokens=first_eos + 2))
    d.add(new_req("maxlen", prompt, max_tokens=40))
    d.run()
    assert d.outputs["eos"] == ref[:first_eos + 1]
    assert (d.finish["eos"].finish_reason, d.finish["eos"].stop_reason) == ("stop", None)
    assert d.outputs["ignore"] == ref[:37] and d.finish["ignore"].finish_reason == "length"
    stop_at = ref.index(ref[5])
    assert d.outputs["stopid"] == ref[:stop_at + 1]
    assert (d.finish["stopid"].finish_reason, d.finish["stopid"].stop_reason) == ("stop", ref[5])
    later = [j for j in range(first_eos + 1, 37) if ref[j] == eos]  # eos positions past min_tokens - 1
    assert d.outputs["min"] == (ref[:later[0] + 1] if later else ref[:37])
    assert d.outputs["maxlen"] == ref[:37] and d.finish["maxlen"].finish_reason == "length"
    assert_idle_and_free(d.s)


def test_abort_frees_everything() -> None:
    s = make_sched(max_num_seqs=2, max_num_batched_tokens=16)
    d = Driver(s)
    for i in range(4):
        d.add(new_req(f"r{i}", range(1, 30), max_tokens=50))
    d.step()
    d.step()
    assert len(s.running) == 2 and len(s.waiting) == 2 and s.kv.usage > 0
    assert s.abort(["r0", "r3", "nope"]) == ["r0", "r3"]
    assert s.abort(["r0"]) == []  # twice: ignored
    assert [r.request_id for r in s.running] == ["r1"] and [r.request_id for r in s.waiting] == ["r2"]
    out = d.step()
    assert set(out.finished_ids) == {"r0", "r3"}  # the runner drops their state
    assert s.abort(["r1", "r2"]) == ["r1", "r2"]
    assert_idle_and_free(s)
    assert s.stats().num_running == 0 and s.stats().kv_cache_usage == 0.0


def test_admission_limits_and_bad_requests() -> None:
    s = make_sched(max_num_queued_reqs=2, max_num_queued_tokens=50, max_model_len=64)
    s.add_request(new_req("a", range(1, 11)))
    s.add_request(new_req("b", range(1, 11)))
    with pytest.raises(RequestRejected, match="Scheduler waiting queue is full") as e:
        s.add_request(new_req("c", range(1, 11)))
    assert e.value.status == 503
    s.schedule()  # both admitted: the queue is empty again
    s.add_request(new_req("c", range(1, 41)))
    with pytest.raises(RequestRejected, match="max_num_queued_tokens=50") as e:
        s.add_request(new_req("d", range(1, 12)))
    assert e.value.status == 503
    with pytest.raises(RequestRejected, match="already running") as e:
        s.add_request(new_req("a", [1]))
    assert e.value.status == 400
    with pytest.raises(RequestRejected, match="max_model_len=64") as e:
        s.add_request(new_req("long", range(1, 66)))
    assert e.value.status == 400
    with pytest.raises(RequestRejected, match="empty"):
        s.add_request(new_req("empty", []))
    assert s.num_waiting_tokens == 40 and len(s.waiting) == 1


def test_schedule_and_update_overhead_for_32_running_decodes() -> None:
    s = make_sched(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=4096, num_blocks=4096,
                   block_size=16)
    for i in range(32):
        s.add_request(new_req(f"r{i}", range(1, 200), max_tokens=10_000, ignore_eos=True))
    s.update(s.schedule(), [SampledToken(f"r{i}", 1) for i in range(32)])
    times = []
    for _ in range(300):
        t0 = time.perf_counter()
        out = s.schedule()
        s.update(out, [SampledToken(q.request.request_id, 7) for q in out.seqs])
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    print(f"schedule+update, 32 decodes: median {median * 1e6:.0f} us")
    assert len(out.seqs) == 32
    assert median < 1e-3


def test_decode_steps_carry_at_most_the_mixed_prefill_cap() -> None:
    """Once over twice as many requests decode as wait for a first token, prefill chunks and admissions share
    the cap; for a burst of arrivals, and without decodes, they get the whole budget."""
    d = Driver(make_sched(max_num_batched_tokens=64, max_prefill_tokens_with_decodes=10))
    first = [d.add(new_req(f"a{i}", range(1 + i, 13 + i), max_tokens=40)) for i in range(5)]
    first.append(d.add(new_req("p", range(30, 60), max_tokens=40)))
    out = d.step()  # nobody decodes yet: the whole budget (5 x 12, then 4 of p's 30)
    assert [q.num_new_tokens for q in out.seqs] == [12] * 5 + [4]
    out = d.step()  # 5 decode, only p waits: its prefill goes on 10 tokens a step
    assert [q.num_new_tokens for q in out.seqs] == [1] * 5 + [10]
    burst = [d.add(new_req(f"b{i}", range(70 + i, 90 + i), max_tokens=30)) for i in range(4)]
    out = d.step()  # 5 decoding, 5 waiting: the whole budget, FCFS (p's 16, then the burst's)
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs][5:] == [
        ("p", 16), ("b0", 20), ("b1", 20), ("b2", 3)]
    while any(not r.output_token_ids for r in first + burst):  # 8 decoding, 2 waiting: the cap
        prompting = {r.request_id for r in first + burst if not r.output_token_ids}
        out = d.step()
        prefill = sum(q.num_new_tokens for q in out.seqs
                      if q.request.request_id in prompting and not (q.num_new_tokens == 1 and q.sample))
        assert prefill <= 10, [(q.request.request_id, q.num_new_tokens) for q in out.seqs]
    d.run()
    for r in first + burst:
        assert d.outputs[r.request_id] == reference(list(r.prompt_token_ids), r.sampling.max_tokens)
    assert_idle_and_free(d.s)


def test_a_queue_beyond_the_free_seats_does_not_lift_the_cap() -> None:
    """Requests that cannot be seated are no burst being admitted: with every seat taken but one, a long
    prompt taking that seat still goes in capped chunks."""
    d = Driver(make_sched(max_num_seqs=4, max_num_batched_tokens=64, max_prefill_tokens_with_decodes=8))
    for i in range(3):
        d.add(new_req(f"a{i}", [i + 1] * 4, max_tokens=40))
    d.step()
    for i in range(6):  # one seat left, six long prompts queued
        d.add(new_req(f"long{i}", range(100 + i, 160 + i), max_tokens=2))
    out = d.step()
    assert [(q.request.request_id, q.num_new_tokens) for q in out.seqs] == [
        ("a0", 1), ("a1", 1), ("a2", 1), ("long0", 8)]
    d.run()
    assert_idle_and_free(d.s)
