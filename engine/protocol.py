"""Messages between front ends and the core, over ZMQ, framed with msgpack.

Wiring: the core binds a ROUTER socket at ``input_address``; each front end connects a DEALER socket with a
unique identity and sends ``[kind, payload]`` frames. The core answers through the same ROUTER to the
identity that sent the request, so N front ends share one core and each gets only its own requests' outputs.

Front end -> core kinds:  ``add`` (EngineCoreRequest), ``abort`` (list of request ids), ``hello`` (empty).
Core -> front end kinds:  ``outputs`` (EngineCoreOutputs), ``ready`` (CoreInfo, answer to ``hello``),
``error`` ({"request_id", "message", "status"}), ``stats`` (SchedulerStats, sent at most every 100 ms when
idle so gauges stay fresh).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack

ADD, ABORT, HELLO = b"add", b"abort", b"hello"
OUTPUTS, READY, ERROR, STATS = b"outputs", b"ready", b"error", b"stats"


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per generated token; 0 = only the chosen token's
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.time() at the front end


@dataclass(slots=True)
class TokenLogprobs:
    """Logprob of the sampled token plus the top-k (ids and logprobs, best first)."""

    token_logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", or None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first output only)


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_blocks: int = 0
    block_size: int = 16


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float


@dataclass(slots=True)
class CoreInfo:
    """What the core tells a front end after ``hello``: enough to validate requests without asking again."""

    model_path: str
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    eos_token_id: int | None
    max_num_seqs: int
    max_num_batched_tokens: int
    device: str
    dtype: str
    extra: dict[str, Any] = field(default_factory=dict)


def _plain(obj: Any) -> Any:
    return asdict(obj) if hasattr(obj, "__dataclass_fields__") else obj


def encode(obj: Any) -> bytes:
    return msgpack.packb(_plain(obj), use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def request_from_dict(d: dict[str, Any]) -> EngineCoreRequest:
    d = dict(d)
    d["sampling"] = SamplingParams(**d["sampling"])
    return EngineCoreRequest(**d)


def outputs_from_dict(d: dict[str, Any]) -> EngineCoreOutputs:
    outs = []
    for o in d["outputs"]:
        lps = o.get("new_logprobs")
        o = dict(o)
        o["new_logprobs"] = [TokenLogprobs(**lp) for lp in lps] if lps is not None else None
        outs.append(EngineCoreOutput(**o))
    return EngineCoreOutputs(outputs=outs, stats=SchedulerStats(**d["stats"]), timestamp=d["timestamp"])
