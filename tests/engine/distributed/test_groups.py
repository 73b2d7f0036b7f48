"""Tensor/pipeline parallelism without processes: layout arithmetic, CPU placement, worker plans, the shard
each TP rank loads, and the scheduler's batches in flight (PP's batch queue)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.layout import ParallelLayout, parse_partition, split_layers
from lbd.engine.config.placement import format_cpus, parse_cpus, rank_threads, split_cpus
from lbd.engine.config.slices import ParallelConfig, parallel_config
from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import SampledToken
from lbd.engine.core.scheduler import Scheduler, SchedulerConfig
from lbd.engine.distributed.context import ParallelContext
from lbd.engine.distributed.groups import ProcessGroups
from lbd.engine.executor.plan import plan_workers
from lbd.engine.loader import load_weights
from lbd.engine.models import build_model
from lbd.engine.models.config import load_hf_config
from lbd.engine.models.parallel import Absent, qkv_sources
from lbd.wire.core_messages import SamplingParams
from support import make_tiny_llama


def test_world_rank_layout() -> None:
    layout = ParallelLayout(tp_size=2, pp_size=3, dp_size=2, dp_rank=1)
    assert layout.world_size == 12
    assert layout.world_rank(pp=2, tp=1) == 1 * 6 + 2 * 2 + 1  # dp * (PP*TP) + pp * TP + tp
    assert [layout.coords(r) for r in (0, 5, 11)] == [(0, 0, 0), (0, 2, 1), (1, 2, 1)]
    assert layout.tp_group(1) == [8, 9] and layout.pp_group(0) == [6, 8, 10]
    assert layout.all_tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_layer_split() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 4) == [(0, 7), (7, 15), (15, 23), (23, 30)]  # the remainder: before the last
    assert split_layers(32, 3, [10, 10, 12]) == [(0, 10), (10, 20), (20, 32)]
    assert parse_partition(" 10, 10,12 ") == [10, 10, 12] and parse_partition(None) is None
    with pytest.raises(ValueError, match="comma-separated"):
        parse_partition("10;10")


def test_cpu_placement() -> None:
    assert split_cpus([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert split_cpus([0, 1], 4) == [[0], [1], [0], [1]]  # oversubscribed: round robin
    assert format_cpus([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and parse_cpus("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    assert rank_threads(2, 2, env={"LBD_RANK_CPUS": "0-3"}) == 4  # already this rank's share
    assert rank_threads(2, 2, env={"OMP_NUM_THREADS": "3"}) == 3


def test_worker_plans_split_the_rank(tiny_llama: Path) -> None:
    args = EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=2, pp_layer_partition="1,1")
    plans = plan_workers(parallel_config(args), 2, env={"LBD_RANK_CPUS": "4-7"})
    assert [(p.world_rank, p.pp_rank, p.tp_rank, p.layers) for p in plans] == [
        (0, 0, 0, (0, 1)), (1, 0, 1, (0, 1)), (2, 1, 0, (1, 2)), (3, 1, 1, (1, 2))]
    assert [p.cpu_list for p in plans] == ["4", "5", "6", "7"] and {p.threads for p in plans} == {1}
    assert [p.device_index for p in plans] == [0, 1, 2, 3]
    two = plan_workers(ParallelConfig(tensor_parallel_size=2), 2, env={"LBD_RANK_CPUS": "0-7"})
    assert [p.cpu_list for p in two] == ["0-3", "4-7"] and {p.threads for p in two} == {4}


def test_kv_heads_split_or_replicated() -> None:
    # 4 query heads of dim 8, 2 KV heads: TP=2 splits both, TP=4 gives each rank one (shared) KV head
    assert [qkv_sources(4, 2, 8, r, 2) for r in range(2)] == [[(0, 16), (0, 8), (0, 8)],
                                                               [(16, 16), (8, 8), (8, 8)]]
    assert [qkv_sources(4, 2, 8, r, 4)[1] for r in range(4)] == [(0, 8), (0, 8), (8, 8), (8, 8)]


def _shard(path: Path, tp: int, pp: int, tp_rank: int, pp_rank: int) -> torch.nn.Module:
    """Rank (tp_rank, pp_rank)'s model, loaded as a worker would, without joining a group (no collective
    runs while loading)."""
    layout = ParallelLayout(tp_size=tp, pp_size=pp)
    groups = ProcessGroups(layout, layout.world_rank(pp_rank, tp_rank), torch.device("cpu"), None,
                           layout.world_rank(pp_rank, 0))
    model = build_model(load_hf_config(path), 64, ParallelContext(layout, pp_rank, tp_rank, None, groups))
    load_weights(model, path)
    return model


@pytest.fixture(scope="module")
def tied_mqa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers, 4 heads, 1 KV head (replicated under TP), tied embeddings, a vocabulary 3 does not divide."""
    return make_tiny_llama(tmp_path_factory.mktemp("tied-mqa"), layers=4, heads=4, kv_heads=1, tie=True,
                           hidden=48, intermediate=96)


def test_each_rank_loads_its_slice(tied_mqa: Path) -> None:
    full = _shard(tied_mqa, 1, 1, 0, 0)
    ref = dict(full.named_parameters())
    vocab, d = full.cfg.vocab_size, full.cfg.head_dim
    for tp_rank in range(2):
        for pp_rank in range(2):
            shard = _shard(tied_mqa, 2, 2, tp_rank, pp_rank)
            params = dict(shard.named_parameters())
            start, end = (0, 2) if pp_rank == 0 else (2, 4)
            assert all(isinstance(shard.model.layers[i], Absent) == (not start <= i < end) for i in range(4))
            qkv = params[f"model.layers.{start}.self_attn.qkv_proj.weight"]
            q, k = ref[f"model.layers.{start}.self_attn.qkv_proj.weight"].split([4 * d, d + d])[0], \
                ref[f"model.layers.{start}.self_attn.qkv_proj.weight"][4 * d:5 * d]
            assert torch.equal(qkv[: 2 * d], q[tp_rank * 2 * d:(tp_rank + 1) * 2 * d])
            assert torch.equal(qkv[2 * d:3 * d], k)  # the single KV head, replicated on both ranks
            o = params[f"model.layers.{start}.self_attn.o_proj.weight"]
            o_ref = ref[f"model.layers.{start}.self_attn.o_proj.weight"]
            assert torch.equal(o, o_ref[:, tp_rank * 2 * d:(tp_rank + 1) * 2 * d])
            if pp_rank == 1:  # the tied LM head of the last stage comes from the embedding tensor
                head = params["lm_head.weight"]
                rows = head.shape[0]
                want = ref["model.embed_tokens.weight"][tp_rank * rows:(tp_rank + 1) * rows]
                assert torch.equal(head[: want.shape[0]], want) and not head[want.shape[0]:].any()
                assert "model.embed_tokens.weight" not in params
            else:
                assert "lm_head.weight" not in params
    three = dict(_shard(tied_mqa, 3, 1, 2, 0).named_parameters())["model.embed_tokens.weight"]
    per = -(-vocab // 3)
    assert torch.equal(three[: vocab - 2 * per], ref["model.embed_tokens.weight"][2 * per:])  # padded tail


# ---- the scheduler with batches in flight ----------------------------------------------------------------


def _scheduler(blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256,
                                     num_blocks=blocks, block_size=4))


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=20, ignore_eos=True), None, 0.0)


def _tokens(out) -> list[SampledToken]:  # noqa: ANN001
    return [SampledToken(s.request.request_id, 7) for s in out.seqs if s.sample]


def test_requests_in_flight_are_not_scheduled_again() -> None:
    s = _scheduler()
    for i in range(4):
        s.add_request(_req(f"r{i}", 10))
    first = s.schedule()
    assert {q.request.request_id for q in first.seqs} == {"r0", "r1", "r2", "r3"}
    assert not s.schedule().seqs  # all four are in flight: nothing to schedule
    s.update(first, _tokens(first))
    assert not s.in_flight and len(s.schedule().seqs) == 4


def test_pp_micro_batches_split_the_live_requests() -> None:
    s = _scheduler()
    for i in range(5):
        s.add_request(_req(f"r{i}", 6))
    first, second = s.schedule(max_batch_seqs=3), s.schedule(max_batch_seqs=3)
    assert [q.request.request_id for q in first.seqs] == ["r0", "r1", "r2"]
    assert [q.request.request_id for q in second.seqs] == ["r3", "r4"]
    s.update(first, _tokens(first))
    assert [q.request.request_id for q in s.schedule(max_batch_seqs=3).seqs] == ["r0", "r1", "r2"]


def test_two_batches_alternate_and_an_abort_in_flight_is_dropped() -> None:
    s = _scheduler()
    s.add_request(_req("a", 10))
    batch_a = s.schedule()
    s.add_request(_req("b", 10))
    batch_b = s.schedule()
    assert [q.request.request_id for q in batch_b.seqs] == ["b"]
    s.abort(["a"])
    assert s.update(batch_a, _tokens(batch_a)) == []  # finished while in flight: its token is dropped
    outs = s.update(batch_b, _tokens(batch_b))
    assert [o.request_id for o in outs] == ["b"] and s.kv.num_free_blocks == 64 - 3


def test_no_preemption_of_a_request_in_flight() -> None:
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, num_blocks=4,
                                  block_size=4, enable_prefix_caching=False))
    s.add_request(_req("A", 7))
    s.add_request(_req("B", 7))
    for _ in range(2):  # prefill (2 blocks each: the cache is full), then a decode that needs no new block
        out = s.schedule()
        s.update(out, _tokens(out))
    s.in_flight.add("B")  # B's next batch is on its way through the pipeline
    assert not s.schedule().seqs  # A needs a block; only B could give one, and B is in flight: A waits
    assert s.counters.num_preemptions == 0 and len(s.running) == 2
    s.in_flight.discard("B")  # B's batch came back
    out = s.schedule()
    assert [q.request.request_id for q in out.seqs] == ["A"] and s.counters.num_preemptions == 1
    assert s.waiting[0].request_id == "B"


# ---- the shared-memory all-reduce of CPU TP groups -------------------------------------------------------


def test_shm_all_reduce_sums_in_rank_order_and_times_out() -> None:
    """Two members in two threads of this process (the algorithm is the same as across processes)."""
    import threading

    from lbd.engine.distributed.shm import ShmAllReduce

    path = ShmAllReduce.new_path()
    members = [ShmAllReduce(path, True, 2, 0, 5.0), ShmAllReduce(path, False, 2, 1, 5.0)]
    members[0].unlink()
    results: list[list[torch.Tensor]] = [[], []]

    def run(i: int) -> None:
        gen = torch.Generator().manual_seed(i)
        for n in range(1, 40):  # many rounds through both buffers, varying sizes
            x = torch.randn(n, 8, generator=gen)
            results[i].append((x.clone(), members[i].all_reduce(x).clone()))

    thread = threading.Thread(target=run, args=(1,))
    thread.start()
    run(0)
    thread.join()
    for (a, sum_a), (b, sum_b) in zip(results[0], results[1], strict=True):
        assert torch.equal(sum_a, sum_b) and torch.equal(sum_a, a + b)  # the same bits on both members
    assert not members[0].fits(torch.empty(1 << 21))  # 8 MiB: gloo's
    members[0].timeout_s = 0.2
    with pytest.raises(TimeoutError, match="did not arrive"):
        members[0].all_reduce(torch.ones(4))  # member 1 never comes
