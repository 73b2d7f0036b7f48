"""Core components built from the configuration slices they use, in a few lines and without an EngineArgs:
a scheduler (the scheduler's budgets and the cache's), the sim runner (model and cache) and the model runner
(model, cache, budgets); and the core builds its scheduler from the slices it resolved."""

from __future__ import annotations

from pathlib import Path

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.slices import CacheConfig, EngineConfig, ModelConfig, SchedulerLimits, engine_config
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.core.request import Request
from lbd.engine.core.runner import ModelRunner
from lbd.engine.core.scheduler import Scheduler, SchedulerConfig
from lbd.engine.core.sim_runner import SimRunner
from lbd.wire.core_messages import SamplingParams


def test_a_scheduler_from_two_slices() -> None:
    cfg = SchedulerConfig.from_slices(SchedulerLimits(max_num_seqs=2, max_num_batched_tokens=16),
                                      CacheConfig(block_size=4), num_blocks=32, max_model_len=64)
    sched = Scheduler(cfg)
    for i in range(3):
        sched.add_request(Request(f"r{i}", [1 + i] * 8, SamplingParams(max_tokens=2), None, 0.0))
    out = sched.schedule()
    assert [s.request.request_id for s in out.seqs] == ["r0", "r1"]  # max_num_seqs 2, 8 tokens each
    assert out.scheduled_tokens == 16
    assert (cfg.block_size, cfg.num_blocks, cfg.enable_prefix_caching) == (4, 32, True)


def test_the_core_schedules_by_the_resolved_slices(tiny_llama: Path) -> None:
    """``--device sim`` with no budgets: the scheduler gets the sim device's defaults from the slices, the
    flags that were given unchanged."""
    args = EngineArgs(device="sim", max_model_len=512, max_num_queued_reqs=9, block_size=32)
    core = EngineCore.from_args(args, str(tiny_llama))
    try:
        want = engine_config(args, "sim")
        assert core.engine_config == want
        cfg = core.config
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens) == (256, 8192)
        assert (cfg.max_num_queued_reqs, cfg.block_size, cfg.max_model_len) == (9, 32, 512)
        assert cfg.max_prefill_tokens_with_decodes is None
    finally:
        core.close()


def test_a_core_from_its_slices_and_a_runner(tiny_llama: Path) -> None:
    model, cache = ModelConfig(device="sim", max_model_len=256), CacheConfig(block_size=32)
    core = EngineCore(EngineConfig(model=model, cache=cache, scheduler=SchedulerLimits(max_num_seqs=2)),
                      SimRunner(tiny_llama, model, cache))
    try:
        for i in range(3):
            core.scheduler.add_request(Request(f"r{i}", [1 + i] * 8, SamplingParams(max_tokens=2), None, 0.0))
        assert sorted(o.request_id for o in core.step()) == ["r0", "r1"]  # max_num_seqs 2
        assert (core.config.block_size, core.config.max_model_len) == (32, 256)
    finally:
        core.close()


def test_runners_from_their_slices(tiny_llama: Path) -> None:
    sim = SimRunner(tiny_llama, ModelConfig(device="sim", max_model_len=256), CacheConfig(block_size=32))
    assert (sim.device, sim.block_size, sim.max_model_len) == ("sim", 32, 256)
    runner = ModelRunner(str(tiny_llama), ModelConfig(device="cpu", dtype="float32", max_model_len=128),
                         CacheConfig(block_size=8, kv_cache_memory_bytes=1 << 20),
                         SchedulerLimits(max_num_seqs=4, max_num_batched_tokens=64))
    assert (runner.device, runner.dtype, runner.block_size) == ("cpu", "float32", 8)
    assert runner.max_model_len == 128
    assert (runner.max_num_seqs, runner.num_blocks > 0) == (4, True)
