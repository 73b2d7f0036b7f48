"""Messages between front ends and the core, over ZMQ, framed with msgpack.

Wiring: the core binds a ROUTER socket at ``input_address``; each front end connects a DEALER socket with a
unique identity and sends ``[kind, payload]`` frames. The core answers through the same ROUTER to the
identity that sent the request, so N front ends share one core and each gets only its own requests' outputs.

Front end -> core kinds:  ``add`` (EngineCoreRequest), ``abort`` ({"ids", "reason"}; see abort_from_payload),
``hello`` (empty), ``reset_prefix_cache`` ({"id"}; answered with ``reset_done`` {"id", "ok"}).
Core -> front end kinds:  ``outputs`` (EngineCoreOutputs in the positional form of ``encode_outputs``; read
it with ``outputs_from_dict(decode(payload))``), ``ready`` (CoreInfo, answer to ``hello``), ``error``
({"request_id", "message", "status"}), ``stats`` (SchedulerStats, sent at most every 100 ms when idle so
gauges stay fresh), ``dp`` (a rank of an MoE DP group only: its group status, lbd.wire.dp.DPStatus as a
dict with its wave counters, sent after ``ready`` and on every change).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

ADD, ABORT, HELLO, RESET = b"add", b"abort", b"hello", b"reset_prefix_cache"
OUTPUTS, READY, ERROR, STATS, RESET_DONE, DP = b"outputs", b"ready", b"error", b"stats", b"reset_done", b"dp"


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
    # (queued_at, first_scheduled_at, num_preemptions), core wall-clock times, on a request's first and last
    # outputs only: the front end turns them into vLLM's queue/prefill/decode/inference time histograms.
    timings: tuple[float, float, int] | None = None
    timestamp: float = 0.0  # when the core sent it (set on decode from the message; not sent per row)


@dataclass(slots=True)
class SchedulerStats:
    """The core's load, sent to every front end with each step's outputs (and every 100 ms while it has
    work): what a front end's GET /telemetry answers. Counters are cumulative, with the values of vLLM's
    counters of the same names on /metrics (prefix-cache tokens queried and hit, prompt and generated
    tokens)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_blocks: int = 0
    block_size: int = 16
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0


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


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _plain(obj: Any) -> Any:
    """msgpack's hook for types it does not know: a dataclass becomes a shallow dict of its fields, and
    msgpack recurses into them (10x faster than ``dataclasses.asdict``, which deep-copies everything)."""
    cls = type(obj)
    names = _FIELD_NAMES.get(cls)
    if names is None:
        if not hasattr(cls, "__dataclass_fields__"):
            raise TypeError(f"cannot encode {cls.__name__}")
        names = _FIELD_NAMES[cls] = tuple(cls.__dataclass_fields__)
    return {name: getattr(obj, name) for name in names}


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_plain, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def request_from_dict(d: dict[str, Any]) -> EngineCoreRequest:
    d = dict(d)
    d["sampling"] = SamplingParams(**d["sampling"])
    return EngineCoreRequest(**d)


_STATS_FIELDS = tuple(SchedulerStats.__dataclass_fields__)


def encode_outputs(msg: EngineCoreOutputs) -> bytes:
    """The ``outputs`` message in positional form: the core sends one per front end per step, and rows of
    plain values pack (and unpack) about 4x faster than dicts of field names. ``outputs_from_dict`` reads it.
    """
    rows = [(o.request_id, o.new_token_ids,
             None if o.new_logprobs is None else
             [(lp.token_logprob, lp.top_ids, lp.top_logprobs) for lp in o.new_logprobs],
             o.finish_reason, o.stop_reason, o.num_cached_tokens, o.timings) for o in msg.outputs]
    stats = [getattr(msg.stats, name) for name in _STATS_FIELDS]
    return msgpack.packb((rows, stats, msg.timestamp), use_bin_type=True)


def outputs_from_dict(d: dict[str, Any] | list[Any]) -> EngineCoreOutputs:
    """Decoded ``outputs`` payload -> EngineCoreOutputs; takes the positional form of ``encode_outputs``
    and the field-name form of ``encode(EngineCoreOutputs(...))``."""
    if isinstance(d, (list, tuple)):
        rows, stats, timestamp = d
        outs = [EngineCoreOutput(rid, toks, None if lps is None else [TokenLogprobs(*lp) for lp in lps],
                                 reason, stop, cached, None if t is None else tuple(t), timestamp)
                for rid, toks, lps, reason, stop, cached, t in rows]
        return EngineCoreOutputs(outputs=outs, stats=SchedulerStats(*stats), timestamp=timestamp)
    outs = []
    for o in d["outputs"]:
        lps = o.get("new_logprobs")
        o = dict(o)
        o["new_logprobs"] = [TokenLogprobs(**lp) for lp in lps] if lps is not None else None
        if o.get("timings") is not None:
            o["timings"] = tuple(o["timings"])
        o["timestamp"] = d["timestamp"]
        outs.append(EngineCoreOutput(**o))
    return EngineCoreOutputs(outputs=outs, stats=SchedulerStats(**d["stats"]), timestamp=d["timestamp"])


def abort_from_payload(body: Any) -> tuple[list[str], str]:
    """An ``abort`` payload: ``{"ids": [...], "reason": "abort"|"stop"}`` or a bare list of ids."""
    if isinstance(body, list):
        return [str(i) for i in body], "abort"
    if isinstance(body, dict) and isinstance(body.get("ids"), list):
        reason = body.get("reason", "abort")
        if reason not in ("abort", "stop"):
            raise ValueError(f"unknown abort reason {reason!r}")
        return [str(i) for i in body["ids"]], reason
    raise TypeError(f"abort wants a list of request ids or {{ids, reason}}, got {type(body).__name__}")
