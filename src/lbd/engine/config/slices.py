"""The engine's configuration in slices: what the model, the KV cache, the scheduler, the parallel layout,
the HTTP server and observability each need, resolved once.

``EngineArgs`` is the flat record of the command line (vLLM's flag names); ``engine_config`` cuts it into an
``EngineConfig`` of slices and applies the defaults that depend on the device (the dtype, the scheduler's
sequence and token budgets), so a component takes only its slices and a test builds one from a few lines.
The device itself is resolved engine-side (``lbd.engine.core.runner.resolve_device``, which needs torch);
this module is standard library only, like the rest of ``lbd.engine.config``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from lbd.common.limits import DEFAULTS as LIMITS
from lbd.engine.config.args import DEFAULT_MODEL_NAME, EngineArgs
from lbd.engine.config.lora import LoraFlags, lora_flags
from lbd.engine.config.structured import StructuredOutputsFlags

# vLLM's defaults per device kind: (max_num_seqs, max_num_batched_tokens). CPU: vLLM's CPU build.
DEVICE_BUDGETS = {"cuda": (256, 8192), "cpu": (128, 2048), "sim": (256, 8192)}
# Prefill tokens a step may carry once decoding requests outnumber waiting ones (lbd.engine.core.scheduler).
# CPU only: there a step's time is about linear in its tokens, and 128 keeps a mixed step close to a
# 32-sequence decode step (benchmarks/RESULTS.md, "Mixed steps"). On CUDA a decode step is memory-bound.
CPU_MIXED_PREFILL_TOKENS = 128


@dataclass(slots=True, frozen=True)
class ModelConfig:
    model: str | None = None
    served_model_name: list[str] | None = None
    tokenizer: str | None = None
    chat_template: str | None = None
    dtype: str = "auto"  # resolved: float32 | float16 | bfloat16 (auto: bfloat16 on CUDA, else float32)
    device: str = "auto"  # resolved: cuda | cpu | sim
    sim_profile: str = "h100-llama3-8b"
    max_model_len: int | None = None  # None: the model's max_position_embeddings (known once loaded)
    seed: int = 0
    enforce_eager: bool = False

    @property
    def model_name(self) -> str:
        """The name answers carry: the first --served-model-name, else --model."""
        if self.served_model_name:
            return self.served_model_name[0]
        return self.model or DEFAULT_MODEL_NAME

    @property
    def model_names(self) -> list[str]:
        """Every name a request may ask for."""
        return list(self.served_model_name) if self.served_model_name else [self.model_name]


@dataclass(slots=True, frozen=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    prefix_caching_hash_algo: str = "sha256"
    kv_transfer_config: str | None = None  # vLLM's JSON (lbd.engine.config.kv_transfer)


@dataclass(slots=True, frozen=True)
class SchedulerLimits:
    """The scheduler's budgets, device defaults applied (never None but where None means "no limit")."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_prefill_tokens_with_decodes: int | None = None  # None: no cap
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lbd.engine.core.priority)


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    data_parallel_rank: int | None = None
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    pp_layer_partition: str | None = None
    distributed_executor_backend: str = "mp"
    distributed_timeout_s: float = 600.0
    enable_expert_parallel: bool = False
    all2all_backend: str = "auto"
    dp_idle_check_steps: int = 32

    @property
    def rank(self) -> int:
        return self.data_parallel_rank or 0


@dataclass(slots=True, frozen=True)
class ServerConfig:
    host: str | None = None
    port: int = 8000
    api_server_count: int = 1
    shutdown_timeout: float = 30.0
    api_key: list[str] | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0
    health_stall_timeout_s: float = 60.0
    max_request_line_bytes: int = LIMITS.max_request_line_bytes
    max_header_bytes: int = LIMITS.max_header_bytes
    max_headers: int = LIMITS.max_headers
    max_head_bytes: int = LIMITS.max_head_bytes
    max_request_body_bytes: int = LIMITS.max_request_body_bytes
    header_read_timeout_s: float = LIMITS.header_read_timeout_s
    body_read_timeout_s: float = LIMITS.body_read_timeout_s
    keep_alive_timeout_s: float = LIMITS.keep_alive_timeout_s
    max_connections: int = LIMITS.max_connections
    max_logprobs: int = 20
    responses_store_max_entries: int = 4096
    responses_store_max_bytes: int = 256 * 1024 * 1024
    enable_auto_tool_choice: bool = False  # "auto" answers read by tool_call_parser (server.tool_parsers)
    tool_call_parser: str | None = None


@dataclass(slots=True, frozen=True)
class ObservabilityConfig:
    log_level: str = "info"
    disable_log_requests: bool = False
    otlp_traces_endpoint: str | None = None
    profile_steps: int = 0
    kv_events_config: str | None = None  # vLLM's JSON (lbd.engine.config.kv_events)
    load_heartbeat_s: float = 1.0  # the pushed load state's heartbeat (lbd.wire.load_state); 0 = off


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Every slice; ``engine_config`` builds it from the flags, a test from the slices it cares about."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerLimits = field(default_factory=SchedulerLimits)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    structured: StructuredOutputsFlags = field(default_factory=StructuredOutputsFlags)
    lora: LoraFlags = field(default_factory=LoraFlags)


@dataclass(slots=True, frozen=True)
class FrontendConfig:
    """What a front end reads: the model's names, tokenizer and chat template, the HTTP server, observability
    and the rank it answers for. The launcher builds it before the core resolves ``--device``, so the model
    slice's device and dtype stay as flagged: the front end never reads them."""

    model: ModelConfig = field(default_factory=ModelConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    rank: int = 0
    lora: LoraFlags = field(default_factory=LoraFlags)


SLICES = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerLimits,
          "parallel": ParallelConfig, "server": ServerConfig, "observability": ObservabilityConfig,
          "structured": StructuredOutputsFlags, "lora": LoraFlags}


def _cut(cls: type, args: EngineArgs, **resolved: object) -> object:
    return cls(**{f.name: resolved.get(f.name, getattr(args, f.name)) for f in dataclasses.fields(cls)})


def parallel_config(args: EngineArgs) -> ParallelConfig:
    """The parallel slice alone (it has no device defaults): what the executor plans workers by."""
    return _cut(ParallelConfig, args)


def scheduler_limits(args: EngineArgs, device: str) -> SchedulerLimits:
    """The flags' budgets, else ``device``'s defaults (cuda, cpu or sim; vLLM's)."""
    seqs, tokens = DEVICE_BUDGETS[device]
    budget = args.max_num_batched_tokens or tokens
    mixed = args.max_prefill_tokens_with_decodes or (CPU_MIXED_PREFILL_TOKENS if device == "cpu" else None)
    return _cut(SchedulerLimits, args, max_num_seqs=args.max_num_seqs or seqs, max_num_batched_tokens=budget,
                max_prefill_tokens_with_decodes=min(mixed, budget) if mixed is not None else None)


def frontend_config(args: EngineArgs) -> FrontendConfig:
    """The front end's slices (no device defaults: the front end has none to apply)."""
    return FrontendConfig(model=_cut(ModelConfig, args), server=_cut(ServerConfig, args),
                          observability=_cut(ObservabilityConfig, args), rank=args.rank,
                          lora=lora_flags(args))


def resolved_dtype(name: str, device: str) -> str:
    """``--dtype auto``: bfloat16 on CUDA, float32 elsewhere."""
    if name != "auto":
        return name
    return "bfloat16" if device == "cuda" else "float32"


def device_kind(device: str) -> str:
    """A runner's device ("cuda:1", "cpu", "sim") as the kind the defaults go by."""
    return device.split(":", 1)[0]


def engine_config(args: EngineArgs, device: str) -> EngineConfig:
    """``args`` in slices, for a rank whose device kind is ``device`` (cuda, cpu or sim: ``--device auto``
    already resolved)."""
    if device not in DEVICE_BUDGETS:
        raise ValueError(f"engine_config wants a resolved device kind (cuda, cpu or sim), got {device!r}")
    return EngineConfig(
        model=_cut(ModelConfig, args, device=device, dtype=resolved_dtype(args.dtype, device)),
        cache=_cut(CacheConfig, args), scheduler=scheduler_limits(args, device),
        parallel=parallel_config(args), server=_cut(ServerConfig, args),
        observability=_cut(ObservabilityConfig, args), structured=_cut(StructuredOutputsFlags, args),
        lora=lora_flags(args))
