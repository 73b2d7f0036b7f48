"""The engine core in one process, without ZMQ: scheduler + model runner, stepped by the caller.

``process.py`` wraps it in the core process's busy loop; tests and parity checks use it directly.
No torch import here: the runner (which imports torch, or not for ``--device sim``) is loaded in
``make_runner``. With TP x PP > 1 the runner is the executor (``engine/executor``), which drives worker
processes; with PP > 1 it takes up to PP batches at once (``max_in_flight``), and ``step`` keeps its queue
full so the stages overlap (vLLM V1's batch queue).
"""

from __future__ import annotations

import importlib
import logging
from collections import Counter, deque
from typing import TYPE_CHECKING, Any, Protocol

from engine.args import EngineArgs
from engine.core.request import Request
from engine.core.sched_output import SampledToken, SchedulerOutput
from engine.core.scheduler import RequestRejected, Scheduler, SchedulerConfig, SchedulerCounters
from engine.protocol import CoreInfo, EngineCoreOutput, EngineCoreRequest, SchedulerStats

if TYPE_CHECKING:
    from engine.metrics import EngineMetrics

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "RequestRejected", "make_runner"]

# vLLM's defaults: (max_num_seqs, max_num_batched_tokens) on a GPU and on a CPU.
_GPU_DEFAULTS = (256, 8192)
_CPU_DEFAULTS = (128, 512)


class Runner(Protocol):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None
    device: str
    dtype: str

    def execute(self, out: SchedulerOutput) -> list[SampledToken]: ...


class PipelinedRunner(Runner, Protocol):
    """A runner that takes batches before the earlier ones are done (the multiprocess executor)."""

    max_in_flight: int

    def submit(self, out: SchedulerOutput) -> Any: ...

    def collect(self, handle: Any) -> list[SampledToken]: ...

    def close(self) -> None: ...


def make_runner(args: EngineArgs, model_path: str, **executor_options: Any) -> Runner:
    """The one place that picks the runner class; imported lazily so the core stays light for ``sim``."""
    parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    if parallel or args.distributed_executor_backend == "ray":
        from engine.executor import make_executor

        return make_executor(args, model_path, **executor_options)
    if args.device == "sim":
        module, name = "engine.core.sim_runner", "SimRunner"
    else:
        module, name = "engine.core.runner", "ModelRunner"
    cls = getattr(importlib.import_module(module), name)
    return cls(args, model_path)


def scheduler_config(args: EngineArgs, runner: Runner) -> SchedulerConfig:
    """Flags win; else the runner's limits (it may size CUDA graphs by them); else vLLM's defaults."""
    seqs, tokens = _CPU_DEFAULTS if runner.device == "cpu" else _GPU_DEFAULTS
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs or getattr(runner, "max_num_seqs", None) or seqs,
        max_num_batched_tokens=(args.max_num_batched_tokens or getattr(runner, "max_num_batched_tokens", None)
                                or tokens),
        max_model_len=runner.max_model_len,
        num_blocks=runner.num_blocks,
        block_size=runner.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
    )


class EngineCore:
    def __init__(self, args: EngineArgs, model_path: str, metrics: EngineMetrics | None = None,
                 runner: Runner | None = None, **executor_options: Any) -> None:
        self.args = args
        self.model_path = model_path
        self.runner = runner if runner is not None else make_runner(args, model_path, **executor_options)
        try:
            self.config = scheduler_config(args, self.runner)
            self._check_capacity()
        except Exception:
            self.close()
            raise
        self.scheduler = Scheduler(self.config)
        self._depth = getattr(self.runner, "max_in_flight", 1)
        self._batches: deque[tuple[SchedulerOutput, Any]] = deque()  # submitted, not yet updated
        self.metrics = metrics
        self._recorded = SchedulerCounters()
        self._recorded_queries = self._recorded_hits = 0
        self._finished_reasons: Counter[str] = Counter()
        self._log_capacity()
        if metrics is not None:
            metrics.set_cache_config(self.runner.block_size, self.runner.num_blocks, args.kv_cache_dtype,
                                     args.enable_prefix_caching)
            self._record_gauges()

    # ---- start-up -------------------------------------------------------------------------------------
    def _check_capacity(self) -> None:
        cfg = self.config
        need = -(-cfg.max_model_len // cfg.block_size)
        if need > cfg.num_blocks:
            raise ValueError(
                f"max_model_len={cfg.max_model_len} needs {need} KV-cache blocks of {cfg.block_size} tokens "
                f"but only {cfg.num_blocks} fit ({cfg.num_blocks * cfg.block_size} tokens): raise "
                "--kv-cache-memory-bytes (or --gpu-memory-utilization) or lower --max-model-len")

    def _log_capacity(self) -> None:
        cfg = self.config
        tokens = cfg.num_blocks * cfg.block_size
        concurrency = cfg.num_blocks / -(-cfg.max_model_len // cfg.block_size)
        logger.info("KV cache size: %s tokens (%d blocks of %d) on %s, dtype %s, prefix caching %s",
                    f"{tokens:,}", cfg.num_blocks, cfg.block_size, self.runner.device, self.runner.dtype,
                    "on" if cfg.enable_prefix_caching else "off")
        logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{cfg.max_model_len:,}",
                    concurrency)

    def core_info(self) -> CoreInfo:
        r, cfg = self.runner, self.config
        return CoreInfo(model_path=self.model_path, max_model_len=cfg.max_model_len,
                        block_size=cfg.block_size, num_blocks=cfg.num_blocks, vocab_size=r.vocab_size,
                        eos_token_id=r.eos_token_id,
                        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                        device=r.device, dtype=r.dtype,
                        extra={"enable_prefix_caching": cfg.enable_prefix_caching,
                               "kv_cache_dtype": self.args.kv_cache_dtype})

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, client: bytes = b"") -> None:
        """Queue a request; raises RequestRejected (with an HTTP status) when it cannot be taken."""
        req = Request.from_core_request(request, client)
        if req.eos_token_id is None:
            req.eos_token_id = self.runner.eos_token_id
        ids = req.prompt_token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.runner.vocab_size):
            raise RequestRejected(f"Token id out of vocabulary (vocab_size={self.runner.vocab_size})", 400)
        self.scheduler.add_request(req)

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[str]:
        """Finish requests now; ``reason`` is "stop" when the front end matched a stop string."""
        aborted = self.scheduler.abort(list(request_ids), reason)
        self._finished_reasons[reason] += len(aborted)
        if self.metrics is not None:
            self._record()
        return aborted

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._batches)

    def close(self) -> None:
        """Stop the runner's worker processes, if it has any."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # ---- the step -------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule a batch and run it; return each touched request's new tokens (and finish).

        With a pipelined runner, a batch is only submitted while fewer than ``max_in_flight`` are queued;
        the oldest one's results are collected when the queue is full or nothing more can be scheduled."""
        batches, depth = self._batches, self._depth
        if len(batches) < depth:
            # PP: the live requests spread over `depth` micro-batches, so every stage has one to work on
            out = self.scheduler.schedule(None if depth == 1 else -(-len(self.scheduler.requests) // depth))
            if out.seqs:
                batches.append((out, self._submit(out)))
                if len(batches) < depth:
                    return []  # fill the pipeline first
        if not batches:
            return []
        out, handle = batches.popleft()
        sampled = self.runner.collect(handle) if depth > 1 else handle
        outputs = self.scheduler.update(out, sampled)
        for o in outputs:
            if o.finish_reason is not None:
                self._finished_reasons[o.finish_reason] += 1
        if self.metrics is not None:
            self._record()
        return outputs

    def _submit(self, out: SchedulerOutput) -> Any:
        if self._depth > 1:
            return self.runner.submit(out)  # type: ignore[attr-defined]
        return self.runner.execute(out)

    # ---- metrics --------------------------------------------------------------------------------------
    def _record(self) -> None:
        m, c, done = self.metrics, self.scheduler.counters, self._recorded
        kv = self.scheduler.kv
        assert m is not None
        if c.num_preemptions != done.num_preemptions:
            m.num_preemptions.inc(c.num_preemptions - done.num_preemptions)
        if c.prompt_tokens != done.prompt_tokens:
            m.prompt_tokens.inc(c.prompt_tokens - done.prompt_tokens)
        if c.generation_tokens != done.generation_tokens:
            m.generation_tokens.inc(c.generation_tokens - done.generation_tokens)
        if kv.prefix_queries != self._recorded_queries:
            m.prefix_cache_queries.inc(kv.prefix_queries - self._recorded_queries)
            m.prefix_cache_hits.inc(kv.prefix_hits - self._recorded_hits)
            self._recorded_queries, self._recorded_hits = kv.prefix_queries, kv.prefix_hits
        self._recorded = SchedulerCounters(c.num_preemptions, c.prompt_tokens, c.generation_tokens)
        if self._finished_reasons:
            for reason, n in self._finished_reasons.items():
                m.request_success(reason).inc(n)
            self._finished_reasons.clear()
        self._record_gauges()

    def _record_gauges(self) -> None:
        m, s = self.metrics, self.scheduler
        assert m is not None
        m.num_requests_running.set(len(s.running))
        m.num_requests_waiting.set(len(s.waiting))
        m.kv_cache_usage_perc.set(s.kv.usage)
