"""Timing profiles for ``--device sim``: how long one scheduler step would take on a named GPU and model.

The simulated device keeps the real scheduler, KV-cache manager and prefix cache and replaces only the forward
pass by ``SimProfile.step_time``, a roofline model of one step:

    t = overhead + seqs * seq_overhead + max(t_compute, t_memory)            (then times ``time_scale``)
    t_compute = (new tokens * 2 * params + attention pairs * 4 * layers * q_dim) / effective FLOP/s
    t_memory  = (weight bytes + KV tokens read * KV bytes per token) / effective bytes/s

"new tokens" are the prefill tokens not served from the prefix cache plus one per decoding sequence;
"attention pairs" counts (query, key) pairs (a chunk of n new tokens after c cached ones has n*c + n(n+1)/2);
"KV tokens read" is each sequence's context after the step. Every constant is written down below with its
source: vendor datasheets, the model's published config, and stated efficiency factors.

Prefill/decode disaggregation: a decode rank's pull of the KV blocks it lacks takes ``kv_transfer_time``,
the link's per-pull latency plus the blocks' tokens * KV bytes per token over the link's bandwidth.

This module imports only the standard library (16 simulated ranks share two CPU cores).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

GB = 1e9
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one scheduler step asks of the device."""

    prefill_tokens: int = 0  # prompt tokens computed this step (cache misses only)
    prefill_seqs: int = 0  # sequences those prefill tokens belong to
    decode_seqs: int = 0  # sequences generating one token each
    kv_tokens_read: int = 0  # sum over sequences of the context attended to (after this step)
    attn_pairs: int = 0  # (query, key) pairs of attention computed this step

    @property
    def num_seqs(self) -> int:
        return self.prefill_seqs + self.decode_seqs


@dataclass(frozen=True, slots=True)
class SimProfile:
    name: str
    description: str
    source: str
    # device
    device_memory_bytes: float
    peak_bandwidth: float  # bytes/s (datasheet)
    bandwidth_efficiency: float  # fraction of peak a large streaming read reaches
    peak_flops: float  # dense FLOP/s at the serving dtype (datasheet)
    flops_efficiency: float  # model FLOPs utilisation of large GEMMs
    # model
    params: float
    weight_bytes: float
    num_layers: int
    q_dim: int  # heads * head_dim
    kv_bytes_per_token: float  # 2 (K and V) * layers * kv_heads * head_dim * dtype bytes
    max_model_len: int
    # server
    activation_bytes: float  # memory kept back for activations, CUDA graphs and the allocator
    step_overhead_s: float  # per step: kernel launches and host work that does not overlap the device
    seq_overhead_s: float  # per sequence in the batch: sampling, metadata
    time_scale: float = 1.0  # > 1 dilates simulated time (CPU-bound hosts: keep the "device" the bottleneck)
    # the link KV blocks cross between a prefill and a decode rank (lbd.engine.kv_transfer.sim)
    kv_link_bandwidth: float = 25 * GB  # effective bytes/s of one pull
    kv_link_latency_s: float = 0.5e-3  # per pull: request, descriptor exchange, completion notice
    # LoRA (--enable-lora, lbd.engine.core.sim_lora): a rank-16 adapter into a device slot, from disk (read,
    # check, build tensors: vLLM's load of a small adapter) or from the CPU cache (a host-to-device copy)
    lora_load_s: float = 0.08
    lora_copy_s: float = 0.004

    @property
    def flops(self) -> float:
        return self.peak_flops * self.flops_efficiency

    @property
    def bandwidth(self) -> float:
        return self.peak_bandwidth * self.bandwidth_efficiency

    def step_time(self, shape: StepShape) -> float:
        tokens = shape.prefill_tokens + shape.decode_seqs
        if tokens == 0:
            return 0.0
        compute = (
            tokens * 2.0 * self.params + shape.attn_pairs * 4.0 * self.num_layers * self.q_dim
        ) / self.flops
        memory = (self.weight_bytes + shape.kv_tokens_read * self.kv_bytes_per_token) / self.bandwidth
        host = self.step_overhead_s + shape.num_seqs * self.seq_overhead_s
        return self.time_scale * (host + max(compute, memory))

    def kv_transfer_time(self, tokens: int) -> float:
        """Seconds one pull of ``tokens`` tokens' KV takes over the profile's link (then times
        ``time_scale``): the per-pull latency plus the bytes over the effective bandwidth."""
        return self.time_scale * (
            self.kv_link_latency_s + tokens * self.kv_bytes_per_token / self.kv_link_bandwidth
        )

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> float:
        """KV budget the way vLLM sizes it: utilisation * memory - weights - activation peak."""
        return self.device_memory_bytes * gpu_memory_utilization - self.weight_bytes - self.activation_bytes

    def num_blocks(
        self, block_size: int, gpu_memory_utilization: float, kv_bytes: float | None = None
    ) -> int:
        budget = self.kv_cache_bytes(gpu_memory_utilization) if kv_bytes is None else kv_bytes
        return max(int(budget // (self.kv_bytes_per_token * block_size)), 1)

    def scaled(self, time_scale: float) -> SimProfile:
        return dataclasses.replace(self, time_scale=self.time_scale * time_scale)


# --- Llama-3-8B (Meta, config.json of meta-llama/Meta-Llama-3-8B): 8.03e9 parameters, 32 layers,
# hidden 4096 = 32 heads * 128, 8 KV heads * 128, vocab 128256, max_position_embeddings 8192. bf16 weights:
# 8.03e9 * 2 B = 16.06 GB. KV per token: 2 * 32 layers * 8 heads * 128 * 2 B = 131072 B (128 KiB).
_LLAMA3_8B = dict(
    params=8.03e9,
    weight_bytes=16.06 * GB,
    num_layers=32,
    q_dim=4096,
    kv_bytes_per_token=2 * 32 * 8 * 128 * 2,
    max_model_len=8192,
)
# Efficiency factors (assumptions, stated once): large streaming reads reach ~80% of HBM peak and large bf16
# GEMMs ~55% of dense peak in serving engines; 0.5 ms of non-overlapped host work per step (vLLM V1 with CUDA
# graphs) and 10 us per sequence. Check: batch-1 decode = 0.5 ms + 16.06 GB / (0.8 * 3.35 TB/s) = 6.5 ms
# (~150 tok/s), in line with published single-stream vLLM numbers for Llama-3-8B bf16 on an H100.
_SERVING = dict(
    bandwidth_efficiency=0.80, flops_efficiency=0.55, step_overhead_s=0.5e-3, seq_overhead_s=10e-6
)
# The KV link of a P/D pair (a prefill rank on one node, its decode rank on another): DGX H100/H200 give each
# GPU one ConnectX-7 NIC, 400 Gb/s InfiniBand NDR = 50 GB/s line rate (NVIDIA DGX H100 datasheet). A pull
# moves every layer's K and V of each block as separate scattered pieces (a few KiB each for 16-token
# blocks), so we assume half of line rate: 25 GB/s. Per pull 0.5 ms (assumed): the request to the producer,
# the descriptor exchange and the completion notice, a few network round trips plus the transfer engine's
# bookkeeping.
_LINK_NDR = dict(kv_link_bandwidth=0.5 * 50 * GB, kv_link_latency_s=0.5e-3)
# DGX A100: one ConnectX-6 per GPU, 200 Gb/s InfiniBand HDR = 25 GB/s line rate; the same half and latency.
_LINK_HDR = dict(kv_link_bandwidth=0.5 * 25 * GB, kv_link_latency_s=0.5e-3)
# vLLM keeps back the peak activation memory of a max_num_batched_tokens=8192 profile run plus CUDA graphs and
# non-torch allocations: about 4 GB for an 8B model.
_ACTIVATIONS_8B = 4.0 * GB

PROFILES: dict[str, SimProfile] = {
    "h100-llama3-8b": SimProfile(
        name="h100-llama3-8b",
        description="NVIDIA H100 SXM5 80GB serving Llama-3-8B in bf16 (vLLM-style server)",
        source="NVIDIA H100 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16, 80 GB (81559 MiB usable); "
        "Llama-3-8B config; efficiency factors above. KV at --gpu-memory-utilization 0.9: "
        "0.9 * 85.5 GB - 16.06 GB - 4 GB = 56.9 GB = 434k tokens = 27.1k blocks of 16",
        device_memory_bytes=81559 * 2**20,
        peak_bandwidth=3.35e12,
        peak_flops=989e12,
        activation_bytes=_ACTIVATIONS_8B,
        **_LLAMA3_8B,
        **_SERVING,
        **_LINK_NDR,
    ),
    "h200-llama3-8b": SimProfile(
        name="h200-llama3-8b",
        description="NVIDIA H200 SXM 141GB serving Llama-3-8B in bf16",
        source="NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s dense BF16, 141 GB; Llama-3-8B config; "
        "same efficiency factors as h100-llama3-8b",
        device_memory_bytes=141 * GB,
        peak_bandwidth=4.8e12,
        peak_flops=989e12,
        activation_bytes=_ACTIVATIONS_8B,
        **_LLAMA3_8B,
        **_SERVING,
        **_LINK_NDR,
    ),
    "a100-llama3-8b": SimProfile(
        name="a100-llama3-8b",
        description="NVIDIA A100 SXM4 80GB serving Llama-3-8B in bf16",
        source="NVIDIA A100 datasheet: 2.039 TB/s HBM2e, 312 TFLOP/s dense BF16, 80 GB; Llama-3-8B config; "
        "same efficiency factors as h100-llama3-8b",
        device_memory_bytes=80 * GIB,
        peak_bandwidth=2.039e12,
        peak_flops=312e12,
        activation_bytes=_ACTIVATIONS_8B,
        **_LLAMA3_8B,
        **_SERVING,
        **_LINK_HDR,
    ),
    # Measured run: this project's build machines (2 x86 cores), transformers fp32 greedy on
    # SmolLM2-135M-Instruct (shared/ENV-NOTES.md): ~10 tok/s single stream, prefill ~220 tok/s. Expressed as
    # effective rates: 2 * 135e6 FLOP * 220 tok/s = 59.4 GFLOP/s; 135e6 * 4 B / 0.1 s = 5.4 GB/s.
    "cpu-smollm2-135m": SimProfile(
        name="cpu-smollm2-135m",
        description="2 x86 cores running SmolLM2-135M-Instruct in fp32 (transformers)",
        source="measured: shared/ENV-NOTES.md reference behaviour (10 tok/s decode, 220 tok/s prefill); "
        "SmolLM2-135M config: 30 layers, 9 heads * 64, 3 KV heads * 64, 8192 positions; 4 GiB KV budget "
        "at utilisation 0.9 (the CPU engine's default)",
        device_memory_bytes=(4 * GIB + 0.54 * GB) / 0.9,
        peak_bandwidth=5.4e9,
        bandwidth_efficiency=1.0,
        peak_flops=59.4e9,
        flops_efficiency=1.0,
        params=135e6,
        weight_bytes=0.54 * GB,
        num_layers=30,
        q_dim=576,
        kv_bytes_per_token=2 * 30 * 3 * 64 * 4,
        max_model_len=8192,
        activation_bytes=0.0,
        step_overhead_s=0.0,
        seq_overhead_s=0.0,
        # measured: one LbdConnector pull of 64 blocks (47.2 MB) between two CPU ranks here took 678 ms end to
        # end (copy out 299, loopback ZMQ TCP 148, copy in 231 ms; benchmarks/RESULTS.md, issue 31):
        # 70 MB/s; 1 ms per pull (assumed: a loopback round trip and two thread hand-offs)
        kv_link_bandwidth=47.2e6 / 0.678,
        kv_link_latency_s=1e-3,
    ),
}
DEFAULT_PROFILE = "h100-llama3-8b"


class UnknownProfileError(ValueError):
    pass


def get_profile(spec: str) -> SimProfile:
    """``NAME``, ``NAME*K`` (time dilated K times), or a JSON file of SimProfile fields (``PATH[*K]``)."""
    base, _, scale_text = spec.partition("*")
    scale = 1.0
    if scale_text:
        try:
            scale = float(scale_text)
        except ValueError:
            scale = -1.0
        if scale <= 0:
            raise UnknownProfileError(
                f"--sim-profile {spec!r}: the time scale after '*' must be a positive number"
            )
    if base in PROFILES:
        return PROFILES[base].scaled(scale)
    path = Path(base)
    if path.suffix == ".json" and path.is_file():
        return _from_json(path).scaled(scale)
    raise UnknownProfileError(
        f"--sim-profile {spec!r} is unknown: use one of {', '.join(PROFILES)} "
        "(optionally NAME*K to dilate time K times) or a .json file of profile fields"
    )


def _from_json(path: Path) -> SimProfile:
    data = json.loads(path.read_text())
    fields = {f.name for f in dataclasses.fields(SimProfile)}
    unknown = set(data) - fields
    if unknown:
        raise UnknownProfileError(f"--sim-profile {path}: unknown fields {sorted(unknown)}")
    data.setdefault("name", path.stem)
    data.setdefault("description", f"profile from {path}")
    data.setdefault("source", str(path))
    try:
        return SimProfile(**data)
    except TypeError as e:
        raise UnknownProfileError(f"--sim-profile {path}: {e}") from e
