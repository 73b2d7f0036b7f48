"""The engine core in one process, without ZMQ: scheduler + model runner, stepped by the caller.

``process.py`` wraps it in the core process's busy loop; tests and parity checks use it directly.
No torch import here: a one-device runner (which imports torch, or not for ``--device sim``) is loaded in
``make_local_runner``. With TP x PP > 1 the runner is the executor (``engine/executor``), which drives worker
processes; it is made above this package (``lbd.engine.rank_core.build_core``) and handed in. With PP > 1 it
takes up to PP batches at once (``max_in_flight``), and ``step`` keeps its queue full so the stages overlap
(vLLM V1's batch queue).
"""

from __future__ import annotations

import importlib
import logging
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.lora import LoraModule
from lbd.engine.config.slices import EngineConfig, device_kind, engine_config
from lbd.engine.core.metrics_recorder import MetricsRecorder
from lbd.engine.core.request import Request
from lbd.engine.core.sched_output import SampledToken, SchedulerOutput
from lbd.engine.core.scheduler import RequestRejected, Scheduler, SchedulerConfig
from lbd.engine.core.step_profile import NO_PROFILE, NullProfiler, OpTimer, StepProfiler
from lbd.engine.structured.compiler import GrammarCompiler
from lbd.wire.core_messages import (
    CoreInfo,
    EngineCoreOutput,
    EngineCoreRequest,
    LoraCommand,
    LoraDone,
    SchedulerStats,
)

if TYPE_CHECKING:
    from lbd.engine.kv_events.publisher import KVEvents
    from lbd.engine.lora.manager import LoraManager
    from lbd.engine.metrics import CoreMetrics

logger = logging.getLogger(__name__)

__all__ = ["EngineCore", "RequestRejected", "make_local_runner", "needs_executor"]

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


def needs_executor(args: EngineArgs) -> bool:
    """Whether the rank's runner drives worker processes (TP x PP > 1, or Ray) rather than one device."""
    parallel = args.tensor_parallel_size * args.pipeline_parallel_size > 1
    return parallel or args.distributed_executor_backend == "ray"


def make_local_runner(args: EngineArgs, model_path: str) -> Runner:
    """The runner of a one-device rank (``sim`` or the model runner), imported lazily so the core stays light
    for ``sim``. A TP/PP rank's runner is the executor, made by ``lbd.engine.rank_core.make_runner``."""
    if needs_executor(args):
        raise ValueError("a tensor/pipeline-parallel (or Ray) rank's runner is the executor: build the core "
                         "with lbd.engine.rank_core.build_core")
    if args.device == "sim":
        module, name = "lbd.engine.core.sim_runner", "SimRunner"
    else:
        module, name = "lbd.engine.core.runner", "ModelRunner"
    return getattr(importlib.import_module(module), name).from_args(args, model_path)


def scheduler_config(config: EngineConfig, runner: Runner) -> SchedulerConfig:
    """The scheduler's slices (device defaults applied there, the same the runner sized its CUDA graphs
    by) and what the runner found: the blocks that fit, the context length."""
    return SchedulerConfig.from_slices(config.scheduler, config.cache, num_blocks=runner.num_blocks,
                                       max_model_len=runner.max_model_len)


def make_kv_events(config: EngineConfig, block_size: int) -> KVEvents | None:
    """The KV-event publisher of ``--kv-events-config`` (None when off); binds its sockets now."""
    if config.observability.kv_events_config is None:
        return None
    from lbd.engine.config.kv_events import parse_kv_events_config

    cfg = parse_kv_events_config(config.observability.kv_events_config)
    if not cfg.active:
        return None
    from lbd.engine.kv_events.publisher import KVEvents

    host = config.server.host
    return KVEvents(cfg, config.parallel.rank, block_size,
                    host if host not in (None, "", "0.0.0.0", "::") else None)


def make_loras(config: EngineConfig, runner: Runner) -> LoraManager | None:
    """The rank's LoRA manager under ``--enable-lora`` (the runner gives its model slots), else None."""
    if not config.lora.enable_lora:
        return None
    enable = getattr(runner, "enable_lora", None)
    if enable is None:
        raise ValueError(f"--enable-lora is not supported by this rank's runner ({type(runner).__name__}): "
                         "LoRA runs on one CPU or CUDA device per rank")
    return enable(config.lora)


class KVConnector(Protocol):
    """Prefill/decode disaggregation's hooks into the core (``lbd.engine.kv_transfer.connector``, attached
    above this package by ``lbd.engine.rank_core.build_core``)."""

    def admit(self, req: Request) -> bool: ...

    def poll(self, wait: bool = False) -> None: ...

    def attach(self, outputs: list[EngineCoreOutput]) -> None: ...

    def advertised(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, model_path: str = "",
                 metrics: CoreMetrics | None = None) -> None:
        """``config``: the slices for ``runner``'s device (``engine_config``); the core reads only those.
        The core owns ``runner`` from here: ``close`` stops it, and so does a failed start."""
        self.model_path = model_path
        self.kv_events: KVEvents | None = None
        self.kv_transfer: KVConnector | None = None  # set by lbd.engine.kv_transfer.connector.attach
        self.runner = runner
        self.engine_config = config
        try:
            self.config = scheduler_config(config, runner)
            self._check_capacity()
            self.kv_events = make_kv_events(self.engine_config, self.config.block_size)
        except Exception:
            self.close()
            raise
        # structured outputs; none on the simulated device, which samples no logits (such requests get a 400)
        self.grammars = None if runner.device == "sim" else GrammarCompiler(
            config.structured.resolve(), config.model.tokenizer or model_path, runner.vocab_size,
            runner.eos_token_id)
        try:
            self.loras = make_loras(config, runner)  # --enable-lora (lbd.engine.lora)
        except Exception:
            self.close()  # a bad --lora-modules entry or a model without LoRA support stops start-up
            raise
        self.scheduler = Scheduler(self.config, self.kv_events.recorder if self.kv_events else None,
                                   self.grammars, self.loras)
        self._depth = getattr(self.runner, "max_in_flight", 1)
        self._batches: deque[tuple[SchedulerOutput, Any]] = deque()  # submitted, not yet updated
        self.metrics = metrics
        self.profiler: NullProfiler = NO_PROFILE
        if self.engine_config.observability.profile_steps:
            self.start_profiling(self.engine_config.observability.profile_steps)
        self._log_capacity()
        self.recorder: MetricsRecorder | None = None
        if metrics is not None:
            metrics.set_cache_config(self.cache_config_info())
            self.recorder = MetricsRecorder(metrics, self.scheduler)
            self.recorder.flush()

    @classmethod
    def from_args(cls, args: EngineArgs, model_path: str, metrics: CoreMetrics | None = None,
                  runner: Runner | None = None) -> EngineCore:
        """For callers that hold flags: the runner (one device's unless one is handed in), then ``args`` cut
        into slices once, for that runner's device."""
        runner = runner if runner is not None else make_local_runner(args, model_path)
        return cls(engine_config(args, device_kind(runner.device)), runner, model_path, metrics)

    # ---- start-up -------------------------------------------------------------------------------------
    def start_profiling(self, every: int) -> StepProfiler:
        """Time every step's phases and the forward's kernels (engine/core/step_profile.py)."""
        sync = None
        if getattr(self.runner, "device", "cpu").startswith("cuda"):
            import torch

            sync = torch.cuda.synchronize
        prof = StepProfiler(every, sync=sync)
        self._op_timer = OpTimer(prof)
        self._op_timer.install()
        self.profiler = self.runner.profiler = prof
        return prof

    def stop_profiling(self) -> None:
        if self.profiler.enabled:
            self._op_timer.uninstall()
            self.profiler = self.runner.profiler = NO_PROFILE

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

    def cache_config_info(self) -> dict[str, object]:
        """The CacheConfig fields vLLM exports in vllm:cache_config_info that lbd has."""
        cache, cfg = self.engine_config.cache, self.config
        return {"block_size": cfg.block_size, "cache_dtype": cache.kv_cache_dtype,
                "enable_prefix_caching": cfg.enable_prefix_caching,
                "gpu_memory_utilization": cache.gpu_memory_utilization,
                "kv_cache_memory_bytes": cache.kv_cache_memory_bytes, "num_cpu_blocks": None,
                "num_gpu_blocks": cfg.num_blocks, "num_gpu_blocks_override": None,
                "sliding_window": None, "is_attention_free": False}

    def core_info(self) -> CoreInfo:
        r, cfg = self.runner, self.config
        return CoreInfo(model_path=self.model_path, max_model_len=cfg.max_model_len,
                        block_size=cfg.block_size, num_blocks=cfg.num_blocks, vocab_size=r.vocab_size,
                        eos_token_id=r.eos_token_id,
                        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                        device=r.device, dtype=r.dtype,
                        extra={"enable_prefix_caching": cfg.enable_prefix_caching,
                               "kv_cache_dtype": self.engine_config.cache.kv_cache_dtype,
                               "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
                               "kv_events": self.kv_events.advertised() if self.kv_events else None,
                               "kv_transfer": self.kv_transfer.advertised() if self.kv_transfer else None})

    # ---- requests -------------------------------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest, client: bytes = b"") -> None:
        """Queue a request; raises RequestRejected (with an HTTP status) when it cannot be taken."""
        req = Request.from_core_request(request, client)
        if request.lora_name is not None:
            self._set_adapter(req, request.lora_name)
        if req.eos_token_id is None:
            req.eos_token_id = self.runner.eos_token_id
        ids = req.prompt_token_ids
        if ids and (min(ids) < 0 or max(ids) >= self.runner.vocab_size):
            raise RequestRejected(f"Token id out of vocabulary (vocab_size={self.runner.vocab_size})", 400)
        try:
            if self.kv_transfer is None or not self.kv_transfer.admit(req):
                self.scheduler.add_request(req)
        except RequestRejected as e:
            if e.reason is not None and self.metrics is not None:
                self.metrics.admission_rejection(e.reason)
            raise

    def _set_adapter(self, req: Request, name: str) -> None:
        adapter = self.loras.lookup(name) if self.loras is not None else None
        if adapter is None:
            raise RequestRejected(f"The model `{name}` does not exist.", 404)
        req.lora_id, req.lora_name = adapter.lora_id, name
        req.hash_extra = (("lora", name, adapter.path),)  # vLLM's extra key: blocks are per adapter

    def lora_command(self, cmd: LoraCommand, token: Any) -> LoraDone | None:
        """Load (answered later, by ``take_lora_answers``, with ``token``) or unload (answered now)."""
        if self.loras is None:
            return LoraDone(cmd.id, 400, "LoRA is not enabled on this rank: start it with --enable-lora")
        if cmd.op == "unload":
            if self.loras.remove(cmd.name):
                return LoraDone(cmd.id, 200, f"Success: LoRA adapter '{cmd.name}' removed successfully.")
            return LoraDone(cmd.id, 404, f"The lora adapter '{cmd.name}' cannot be found.")
        self.loras.load(LoraModule(cmd.name, cmd.path, cmd.base_model_name), (token, cmd.id))
        return None

    def take_lora_answers(self) -> list[tuple[Any, LoraDone]]:
        """(token, answer) of the loads that finished since the last call."""
        if self.loras is None:
            return []
        return [(tok[0], LoraDone(tok[1], status, message))
                for tok, status, message in self.loras.take_answers() if tok is not None]

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[str]:
        """Finish requests now; ``reason`` is "stop" when the front end matched a stop string."""
        aborted = self.scheduler.abort(list(request_ids), reason)
        if self.recorder is not None and aborted:
            self.recorder.flush()  # the client may already have its answer (a stop string): count it now
        return aborted

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (AllBlocksCleared); False while requests hold blocks."""
        done = self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self.kv_events.flush()
        return done

    def has_work(self) -> bool:
        loading = self.loras is not None and self.loras.busy
        return self.scheduler.has_work() or bool(self._batches) or loading

    def close(self) -> None:
        """Flush and close the KV-event publisher; stop the runner's worker processes, if it has any."""
        if self.kv_transfer is not None:
            self.kv_transfer.close()
            self.kv_transfer = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        if getattr(self, "loras", None) is not None:
            self.loras.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def stats(self) -> SchedulerStats:
        stats = self.scheduler.stats()
        if self.loras is not None:
            s = self.scheduler
            stats.lora = self.loras.state(s.running, [*s.waiting, *self.loras.waiting])
        return stats

    def take_rejected(self) -> list[tuple[str, str, int]]:
        """Requests refused after admission (a structured output whose grammar failed to compile): (id,
        message, HTTP status) each, once; the core loop answers their front ends with an error."""
        rejected, self.scheduler.rejected = self.scheduler.rejected, []
        return rejected

    # ---- the step -------------------------------------------------------------------------------------
    def step(self) -> list[EngineCoreOutput]:
        """Schedule a batch and run it; return each touched request's new tokens (and finish).

        With a pipelined runner, a batch is only submitted while fewer than ``max_in_flight`` are queued;
        the oldest one's results are collected when the queue is full or nothing more can be scheduled.
        Under ``--profile-steps`` an executor's step (TP/PP workers) counts as ``forward``."""
        prof = self.profiler
        own_step = prof.enabled and not prof.in_step  # stepped directly (tests), not by the core's loop
        if own_step:
            prof.begin()
        batches, depth = self._batches, self._depth
        if self.kv_transfer is not None:  # land pulled KV blocks; only parked requests: wait a moment
            self.kv_transfer.poll(wait=not (self.scheduler.waiting or self.scheduler.running or batches))
        if len(batches) < depth:
            # PP: the live requests spread over `depth` micro-batches, so every stage has one to work on
            out = self.scheduler.schedule(None if depth == 1 else -(-len(self.scheduler.requests) // depth))
            prof.lap("schedule")
            if out.seqs:
                batches.append((out, self._submit(out)))
                if len(batches) < depth:
                    if own_step:
                        prof.end()  # filling the pipeline: no batch finished, not counted as a step
                    return []
        if not batches:
            if own_step:
                prof.end()  # nothing scheduled: not counted as a step
            return []
        out, handle = batches.popleft()
        sampled = self.runner.collect(handle) if depth > 1 else handle
        # a runner that marks its own phases (ModelRunner) left ~0 s to this lap; the TP/PP executor did not
        # mark any, so its whole step (the workers' prepare .. sample, the broadcast, the wait) counts here
        prof.lap("forward")
        outputs = self.scheduler.update(out, sampled)
        if self.kv_transfer is not None:
            self.kv_transfer.attach(outputs)
        if self.kv_events is not None:
            self.kv_events.flush()
        prof.lap("update")
        if prof.enabled:
            tokens = out.num_tokens
            prof.shape(len(out.seqs), tokens, tokens == len(out.seqs))
            if own_step:
                prof.end()
        if self.recorder is not None:
            self.recorder.step(out.scheduled_tokens)
        return outputs

    def flush_metrics(self) -> None:
        """Write out what the recorder tallied (the core loop calls this every 100 ms, idle or not)."""
        if self.recorder is not None:
            self.recorder.flush()
            if self.loras is not None:
                self.metrics.set_lora(self.stats().lora)
        if self.kv_transfer is not None:
            self.kv_transfer.poll()  # served and expired leases go back even while idle

    def flush_kv_events(self) -> None:
        if self.kv_events is not None:
            self.kv_events.flush()

    def _submit(self, out: SchedulerOutput) -> Any:
        if self._depth > 1:
            return self.runner.submit(out)  # type: ignore[attr-defined]
        return self.runner.execute(out)
