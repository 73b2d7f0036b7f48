"""The model runner: owns the device, the weights and the KV cache; turns a SchedulerOutput into tokens.

It is single-device shaped. A tensor/pipeline-parallel worker (``engine/executor/stage.py``) builds one with a
``ParallelContext`` (its shard of the model, its share of the KV cache) and overrides only ``_forward`` and
``_logits``; batch preparation (``device_batch``), KV sizing and allocation, fp8 scales and CUDA graphs
are the same code. KV sizing is in two steps (``measure_num_blocks``, ``allocate_kv``) so a rank's workers
can agree on one block count (the smallest any of them can hold) before allocating.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.placement import rank_threads
from lbd.engine.config.slices import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerLimits,
    engine_config,
    resolved_dtype,
)
from lbd.engine.core import kv_alloc
from lbd.engine.core.device_batch import StepBatch, device_batch
from lbd.engine.core.host_batch import HostBatch
from lbd.engine.core.sampler import Sampler, SampleRow
from lbd.engine.core.sched_output import SampledToken, ScheduledSeq, SchedulerOutput
from lbd.engine.core.step_profile import NO_PROFILE, NullProfiler
from lbd.engine.distributed.context import ParallelContext
from lbd.engine.loader import load_weights, read_kv_scales
from lbd.engine.models import build_model
from lbd.engine.models.config import load_hf_config
from lbd.engine.models.kv_spec import KVSpec
from lbd.engine.models.parallel import kv_heads_per_rank
from lbd.engine.structured import mask as token_mask
from lbd.kernels import ops

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was given but no CUDA device is available: use --device cpu")
    return torch.device(name)


def resolve_config(args: EngineArgs) -> EngineConfig:
    """``args`` in slices for this process's device: the one place ``--device auto`` is resolved (torch)."""
    return engine_config(args, resolve_device(args.device).type)


def cpu_threads(parallel: ParallelConfig) -> int:
    """This process's compute threads (lbd.engine.config.placement; a worker gets OMP_NUM_THREADS)."""
    return rank_threads(parallel.data_parallel_size_local, parallel.data_parallel_size)


def cpu_has_bf16() -> bool:
    """AVX-512 BF16 or AMX-BF16: bf16 dot products in hardware (oneDNN and the packed GEMM use them)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        flags = next((line for line in lines if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def warn_emulated_bf16(dtype: torch.dtype) -> None:
    """``--dtype bfloat16`` on a CPU without bf16 instructions still runs (torch emulates bf16 math, and the
    result is the same) but is slower than float32: say so once rather than refuse a valid dtype."""
    if dtype == torch.bfloat16 and not cpu_has_bf16():
        logger.warning("--dtype bfloat16: this CPU has no AVX-512 BF16 or AMX, so bf16 math is emulated "
                       "(same results, usually slower than --dtype float32)")


def setup_cpu_threads(threads: int, dtype: torch.dtype) -> None:
    """How the core's compute threads share this process's CPUs.

    Where the packed kernels take the model's dtype (fp32 from AVX2 up, bf16 with AVX-512 BF16), the C kernels
    run on their own pool (the core's thread plus a helper pinned to each other CPU; ``pin_core_thread`` pins
    the core's), which never waits for a thread that was descheduled, and torch's own ops run on the core's
    thread alone (kernels/cpu/pool.c: on a loaded host a second OpenMP thread slows a decode step down several
    times: benchmarks/RESULTS.md, "CPU threads"). Elsewhere torch's OpenMP threads run everything, pinned one
    per CPU. Either way only when the threads are exactly as many as the CPUs this process may use (the usual
    single-rank case; DP ranks sharing CPUs stay unpinned on torch's threads). LBD_CPU_POOL=0 keeps torch's
    threads, LBD_CPU_BIND=0 leaves them unpinned."""
    from lbd.kernels import cpu as cpu_kernels
    from lbd.kernels.cpu import packed

    cpus = sorted(os.sched_getaffinity(0))
    exact = len(cpus) == threads
    if exact and os.environ.get("LBD_CPU_POOL", "1") != "0" and packed.supported(dtype) \
            and cpu_kernels.start_pool(cpus):
        torch.set_num_threads(1)
        logger.info("CPU kernels on a pool of %d threads pinned to CPUs %s; torch ops on 1 thread", threads,
                    cpus)
        return
    torch.set_num_threads(threads)
    if exact and os.environ.get("LBD_CPU_BIND", "1") != "0" and cpu_kernels.bind_threads(cpus):
        logger.info("torch's %d OpenMP threads pinned to CPUs %s", threads, cpus)


def pin_core_thread() -> None:
    """The core process's main thread onto the one CPU of its affinity that the kernels' pool left to it (a
    thread, not the process: pid 0 in sched_setaffinity is the caller). No-op without the pool."""
    from lbd.kernels import cpu as cpu_kernels

    if cpu_kernels.pool_threads() > 1:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _eos_token_id(folder: Path, config: object) -> int | None:
    eos = None
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return eos


def grammar_mask(sampling: list[ScheduledSeq], vocab_size: int) -> token_mask.TokenMask | None:
    """The structured-output token mask of a step's sampling rows, from their matchers (None: no grammar);
    the TP/PP executor sends it to its sampling worker."""
    if not any(s.request.grammar is not None for s in sampling):
        return None
    return token_mask.build([s.request.grammar.matcher if s.request.grammar is not None else None
                             for s in sampling], vocab_size)


class ModelRunner:
    profiler: NullProfiler = NO_PROFILE  # the core sets a StepProfiler under --profile-steps
    lora = None  # the model's LoRA slots (lbd.engine.lora.slots.LoraDevice) under --enable-lora

    def __init__(self, model_path: str, model: ModelConfig, cache: CacheConfig, limits: SchedulerLimits,
                 parallel: ParallelContext | None = None, *, threads: int | None = None,
                 allocate: bool = True, model_options: dict | None = None) -> None:
        """``model.device`` and ``model.dtype`` resolved (``resolve_config``; ``from_args`` does it); the
        budgets in ``limits`` size the CUDA graphs and the activation reserve; ``threads`` (CPU) defaults to
        this process's share (``OMP_NUM_THREADS``, ``LBD_RANK_CPUS``, else every CPU)."""
        self._t0 = time.monotonic()
        self.model_options = model_options or {}  # for build_model, e.g. a DP member's expert_shard
        self.model_path = model_path
        self.cache_config = cache
        self.enforce_eager = model.enforce_eager
        self.parallel = parallel or ParallelContext.single()
        self.torch_device = torch.device(model.device)
        self.device = str(self.torch_device)
        self.torch_dtype = _DTYPES[resolved_dtype(model.dtype, self.torch_device.type)]
        self.dtype = str(self.torch_dtype).removeprefix("torch.")
        if self.torch_device.type == "cpu":
            warn_emulated_bf16(self.torch_dtype)
            setup_cpu_threads(threads or rank_threads(None), self.torch_dtype)
        hf_config = load_hf_config(model_path)
        self.max_model_len = model.max_model_len or hf_config.max_position_embeddings
        if self.max_model_len > hf_config.max_position_embeddings:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {hf_config.max_position_embeddings}")
        self.model = self._load_model(hf_config)
        cfg = self.model.cfg
        if cfg.sliding_window and self.max_model_len > cfg.sliding_window:
            raise ValueError(f"the model uses a {cfg.sliding_window}-token sliding window, which is not "
                             f"supported: pass --max-model-len {cfg.sliding_window} or less")
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = _eos_token_id(Path(model_path), hf_config)
        self.block_size = cache.block_size
        self.max_num_seqs, self.max_num_batched_tokens = limits.max_num_seqs, limits.max_num_batched_tokens
        self.kv_spec = self._kv_spec(kv_alloc.kv_dtype(cache.kv_cache_dtype, self.torch_dtype))
        # the whole rank's block: every pipeline stage's layers, every TP rank's KV heads (replicas included)
        rank_heads = self.kv_spec.num_kv_heads * self.parallel.tp_size
        self.rank_kv_spec = dataclasses.replace(self.kv_spec, num_layers=cfg.num_layers,
                                                num_kv_heads=rank_heads)
        self.sampler = Sampler(self.torch_device, model.seed)
        self.graphs = None
        self.num_blocks = 0
        self.kv_caches: list = []
        if allocate:
            self.allocate_kv(self.measure_num_blocks())

    @classmethod
    def from_args(cls, args: EngineArgs, model_path: str, parallel: ParallelContext | None = None,
                  **options: Any) -> ModelRunner:
        """From the command line: the slices of ``resolve_config`` and this process's CPU share."""
        cfg = resolve_config(args)
        return cls(model_path, cfg.model, cfg.cache, cfg.scheduler, parallel,
                   threads=cpu_threads(cfg.parallel), **options)

    # ------------------------------------------------------------------------------------------- set-up

    def _load_model(self, hf_config: object) -> torch.nn.Module:
        with torch.device(self.torch_device), _default_dtype(self.torch_dtype):
            model = build_model(hf_config, self.max_model_len, self.parallel, **self.model_options)
        load_weights(model, self.model_path)
        model.init_rope(self.torch_device)
        ops.pack_linear_weights(model)  # CPU: weights packed once for the packed GEMM (kernels/cpu/packed.py)
        return model.eval()

    def _kv_spec(self, dtype: torch.dtype) -> KVSpec:
        """This process's K/V caches: its stage's layers, its TP rank's KV heads; unless the model has a cache
        of its own (MLA's latents)."""
        model, cfg = self.model, self.model.cfg
        if not hasattr(model, "kv_cache_spec"):
            start, end = self.parallel.layer_range(cfg.num_layers)
            return KVSpec(end - start, kv_heads_per_rank(cfg.num_kv_heads, self.parallel.tp_size),
                                   cfg.head_dim, self.block_size, dtype)
        if dtype == torch.float8_e4m3fn:
            raise ValueError(f"--kv-cache-dtype {self.cache_config.kv_cache_dtype} is not supported for "
                             f"{type(model).__name__}: pass --kv-cache-dtype auto")
        spec = model.kv_cache_spec(self.block_size, dtype)
        if hasattr(model, "mha_kv_elements_per_token"):
            mha = model.mha_kv_elements_per_token() * torch.empty(0, dtype=dtype).element_size()
            logger.info("MLA KV cache: %d bytes per token (%d layers x %d latent values), plain MHA of this "
                        "model would take %d (%.1fx more)", spec.bytes_per_token, spec.num_layers,
                        spec.num_kv_heads * spec.head_dim, mha, mha / spec.bytes_per_token)
        return spec

    def measure_num_blocks(self) -> int:
        """Blocks this process can hold. On the CPU ``--kv-cache-memory-bytes`` is the whole rank's budget
        (its workers share it by what each holds: every worker gets the same block count); on CUDA it and
        ``--gpu-memory-utilization`` are per device."""
        per_block = self.kv_spec.bytes_per_block
        if self.torch_device.type == "cpu":
            blocks = kv_alloc.cpu_num_blocks(self.rank_kv_spec, self.cache_config.kv_cache_memory_bytes)
        elif self.cache_config.kv_cache_memory_bytes:
            blocks = self.cache_config.kv_cache_memory_bytes // per_block
        else:
            blocks = self._profile_cuda_blocks()
        if blocks < 1:
            raise ValueError(f"the KV-cache budget holds no block of {per_block} bytes: raise "
                             "--kv-cache-memory-bytes (or --gpu-memory-utilization)")
        return int(blocks)

    def allocate_kv(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks, set fp8 scales, capture CUDA graphs."""
        self.num_blocks = num_blocks
        self.kv_caches = kv_alloc.allocate(self.kv_spec, num_blocks, self.torch_device)
        if self.kv_spec.dtype == torch.float8_e4m3fn:
            self._set_kv_scales()
        if self.torch_device.type == "cuda" and not self.enforce_eager:
            self.graphs = self._capture_graphs()
        logger.info("model %s loaded on %s (%s) in %.1f s; KV cache: %d blocks x %d tokens (%s)",
                    Path(self.model_path).name, self.device, self.dtype, time.monotonic() - self._t0,
                    self.num_blocks, self.block_size, str(self.kv_spec.dtype).removeprefix("torch."))

    def _capture_graphs(self):  # noqa: ANN202 (a DecodeGraphs)
        from lbd.engine.core.cuda_graph import DecodeGraphs

        return DecodeGraphs(self.model, self.kv_caches, self.max_num_seqs, self.max_model_len,
                            self.block_size, self.torch_device)

    def _profile_cuda_blocks(self) -> int:
        """Run the largest step once with a scratch cache; what the budget leaves goes to the KV cache."""
        free, total = torch.cuda.mem_get_info(self.torch_device)
        torch.cuda.reset_peak_memory_stats(self.torch_device)
        tokens = min(self.max_num_batched_tokens, self.max_model_len)
        scratch = kv_alloc.allocate(self.kv_spec, math.ceil(tokens / self.block_size) + 1, self.torch_device)
        self._dummy_prefill(scratch, tokens)
        torch.cuda.synchronize(self.torch_device)
        peak = torch.cuda.max_memory_allocated(self.torch_device)
        scratch_bytes = self.kv_spec.bytes_per_block * (math.ceil(tokens / self.block_size) + 1)
        del scratch
        torch.cuda.empty_cache()
        others = total - free - torch.cuda.memory_reserved(self.torch_device)  # other processes, CUDA context
        graph_reserve = 0 if self.enforce_eager else 512 << 20
        activations = peak - scratch_bytes  # weights + the largest step's activations
        budget = int(total * self.cache_config.gpu_memory_utilization) - others - activations - graph_reserve
        logger.info("profile: peak %.2f GiB, others %.2f GiB, KV budget %.2f GiB", peak / 2**30,
                    others / 2**30, budget / 2**30)
        return max(0, budget) // self.kv_spec.bytes_per_block

    def _dummy_prefill(self, kv_caches: list, tokens: int) -> None:
        gen = torch.Generator(device="cpu").manual_seed(0)
        ids = torch.randint(0, self.vocab_size, (tokens,), generator=gen).tolist()
        nb = math.ceil(tokens / self.block_size)
        rows = min(tokens, self.max_num_seqs)
        host = HostBatch(ids, [0], [tokens], [tokens], [list(range(nb))], list(range(tokens - rows, tokens)),
                         0)
        batch = device_batch(host, self.block_size, self.torch_device)
        with torch.inference_mode():
            hidden = self._forward(batch, kv_caches)
            if hidden is not None:
                self._logits(hidden, batch)

    def _set_kv_scales(self) -> None:
        """fp8 KV cache: the checkpoint's calibrated per-layer scales, else 1.0 (vLLM's default)."""
        layers = self.model.attention_layers  # this pipeline stage's
        start, end = self.parallel.layer_range(self.model.cfg.num_layers)
        found = read_kv_scales(self.model_path, self.model.cfg.num_layers)
        scales = found[start:end] if found else [(1.0, 1.0)] * len(layers)
        for attn, (k, v) in zip(layers, scales, strict=True):
            attn.k_scale, attn.v_scale = k, v
        logger.info("fp8 KV cache: %s", "per-layer scales from the checkpoint" if found else
                    "the checkpoint has no k_scale/v_scale: scales 1.0")

    # ------------------------------------------------------------------------------------------- a step

    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        if out.finished_ids:
            self.sampler.drop(out.finished_ids)
        seqs = out.seqs
        if not seqs:
            return []
        prof = self.profiler
        batch = self.prepare(seqs)
        if self.lora is not None:  # each token's adapter slot (-1: the base model)
            self.lora.set_step([(s.request.lora_slot, s.num_new_tokens) for s in seqs], self.torch_device)
        sampling = [s for s in seqs if s.sample]
        prof.lap("prepare")
        with torch.inference_mode():
            hidden = self._forward(batch, self.kv_caches)
            prof.lap("forward")
            if not sampling:
                return []
            logits = self._logits(hidden, batch)
            prof.lap("lm_head")
            rows = [SampleRow(s.request.request_id, s.request.sampling, s.request.prompt_token_ids,
                              s.request.output_token_ids) for s in sampling]
            ids, logprobs = self.sampler(logits, rows, grammar_mask(sampling, self.vocab_size))
            prof.lap("sample")
        return [SampledToken(r.request_id, t, lp) for r, t, lp in zip(rows, ids, logprobs, strict=True)]

    def enable_lora(self, flags: Any) -> Any:  # LoraFlags -> LoraManager
        """Give the model ``flags.max_loras`` adapter slots and return the rank's adapter manager. The fused
        one-call CPU decoder has no LoRA hook: a step with adapted tokens runs layer by layer (steps of the
        base model alone keep it). The decode CUDA graphs are turned off (their step would need the slots as
        inputs): every CUDA step runs eagerly. (TP workers: ``MultiprocExecutor.enable_lora``.)"""
        from lbd.engine.lora import slots
        from lbd.engine.lora.manager import LoraManager

        device = slots.attach_runner(self, flags)
        return LoraManager(flags, device, slots.module_shapes(self.model.cfg), self.model.cfg.num_layers,
                           self.torch_dtype)

    def _forward(self, batch: StepBatch, kv_caches: list) -> torch.Tensor | None:
        """The forward this process runs: here the whole model (a pipeline stage in a worker, which returns
        None before the last stage)."""
        if self.graphs is not None and batch.is_decode_only and self.graphs.fits(batch.meta.num_seqs):
            return self.graphs.run(batch)
        return self.model(batch.input_ids, batch.positions, batch.meta, kv_caches)

    def _logits(self, hidden: torch.Tensor, batch: StepBatch) -> torch.Tensor | None:
        """Logits of the sampling rows (with TP: on TP rank 0 only, None elsewhere)."""
        rows_t = torch.tensor(batch.sample_rows, device=self.torch_device)
        return self.model.compute_logits(hidden.index_select(0, rows_t))

    def prepare(self, seqs: list[ScheduledSeq]) -> StepBatch:
        """Flat batch for ``seqs`` (decodes first)."""
        return device_batch(HostBatch.from_seqs(seqs, self.block_size), self.block_size, self.torch_device)
