"""The messages between an engine rank's front ends and its core: one type per kind, msgpack on ZMQ.

Wiring: the core binds a ROUTER socket; each front end connects a DEALER with a unique identity and sends
``[kind, payload]`` frames; the core answers through the same ROUTER to the identity that sent the request, so
N front ends share one core and each gets only its own requests' outputs. ``encode`` makes a payload,
``decode(kind, payload)`` reads one back as the kind's type (``MESSAGES``); the producer (the core process,
``lbd.engine.core.process``) and the consumer (``lbd.engine.server.core_client``) both use this module.

Front end -> core: ``add`` EngineCoreRequest, ``abort`` Abort, ``hello`` Hello, ``reset_prefix_cache``
ResetPrefixCache, ``lora`` LoraCommand (answered by ``lora_done`` LoraDone). Core -> front end: ``outputs``
EngineCoreOutputs (each step, per front end), ``ready`` CoreInfo (the answer to ``hello``), ``error``
RequestError, ``stats`` SchedulerStats (at most every 100 ms when idle, so gauges stay fresh), ``reset_done``
ResetDone, ``dp`` DPStatus (``lbd.wire.dp``: a rank of an MoE DP group only, after ``ready`` and on every
change).

Compatibility: a reader ignores fields it does not know, and a field it knows but does not receive takes its
default. Types marked *positional* (``array_like``: the per-step ones; arrays are cheaper to pack than maps,
benchmarks/RESULTS.md, "Core messages") are encoded as arrays: add new fields at their end only, with a
default. Standard library and msgspec only.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from lbd.wire.dp import DPStatus
from lbd.wire.kv_transfer import KVTransferParams

ADD, ABORT, HELLO, RESET = b"add", b"abort", b"hello", b"reset_prefix_cache"
OUTPUTS, READY, ERROR, STATS, RESET_DONE, DP = b"outputs", b"ready", b"error", b"stats", b"reset_done", b"dp"
LORA, LORA_DONE = b"lora", b"lora_done"


# ---- front end -> core ---------------------------------------------------------------------------------

class StructuredOutputs(msgspec.Struct, frozen=True):
    """A constraint on the output (vLLM's ``structured_outputs``): ``kind`` ``json`` (``spec`` is the JSON
    schema's text), ``json_object`` (any JSON object; ``spec`` empty), ``regex``, ``choice`` (``spec`` is a
    JSON list of the allowed strings) or ``grammar`` (EBNF for xgrammar, Lark for guidance). The core compiles
    it (lbd.engine.structured) and masks the tokens the grammar does not allow. Frozen: it is the key of the
    compiled-grammar cache."""

    kind: str
    spec: str = ""
    strict: bool = True  # json: no properties or items beyond the schema's (OpenAI's json_schema.strict)
    disable_any_whitespace: bool = False  # json: compact output (vLLM's field and flag)


class SamplingParams(msgspec.Struct):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per generated token; 0 = only the chosen token's
    prompt_logprobs: int | None = None
    # the prompt's last n tokens are output of this answer (a stream resumed on another rank: lbd.router);
    # frequency and presence penalties count them as output
    prior_output_tokens: int = 0
    structured: StructuredOutputs | None = None  # structured outputs: the grammar the output must match

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5


class EngineCoreRequest(msgspec.Struct):
    """``add``: one sequence to generate."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None
    arrival_time: float  # time.time() at the front end
    kv_transfer_params: KVTransferParams | None = None  # prefill/decode disaggregation (lbd.wire.kv_transfer)
    priority: int = 0  # vLLM's field: lower is more important; only --scheduling-policy priority orders by it
    lora_name: str | None = None  # the LoRA adapter to run with (the request's ``model``); None: base model


class Abort(msgspec.Struct):
    """``abort``: finish these requests now; "stop" when the front end matched a stop string."""

    ids: list[str]
    reason: Literal["abort", "stop"] = "abort"


class Hello(msgspec.Struct):
    """``hello``: a front end asks for the core's CoreInfo (resent until the core answers)."""


class LoraCommand(msgspec.Struct):
    """``lora``: load (``path`` given) or unload adapter ``name``; answered with LoraDone of the same id once
    done (a load: after the core read and checked it, off its step loop)."""

    id: str
    op: Literal["load", "unload"]
    name: str
    path: str = ""
    base_model_name: str | None = None


class ResetPrefixCache(msgspec.Struct):
    """``reset_prefix_cache``: forget every cached block; answered with ResetDone of the same id."""

    id: str


# ---- core -> front end ---------------------------------------------------------------------------------

class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprob of the sampled token plus the top-k (ids and logprobs, best first). Positional."""

    token_logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """One request's new tokens of one step. Positional."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop" (eos / stop token), "length", "abort", or None
    stop_reason: int | None = None  # the stop token id that ended it, if any
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (first output only)
    # (queued_at, first_scheduled_at, num_preemptions), core wall-clock times, on a request's first and last
    # outputs only: the front end turns them into vLLM's queue/prefill/decode/inference time histograms.
    timings: tuple[float, float, int] | None = None
    timestamp: float = 0.0  # when the core sent it: the message's, set by ``decode`` (sent as 0)
    kv_transfer_params: KVTransferParams | None = None  # a finished prefill's, for its remote decode


class LoraState(msgspec.Struct):
    """A rank's LoRA adapters: vLLM's ``lora_requests_info`` (adapters with running or waiting requests,
    ``max_lora``) and what it lacks: where each loaded adapter is (``device`` slots, ``cpu`` cache, an adapter
    in a slot is in both), the free slots, the adapter a load would take a slot from (``evicts``: the least
    recently used slot no running request uses; empty while a slot is free or every slot is in use) and each
    adapter's last load time in seconds; and, cumulative since
    the rank started, adapters read from disk into host memory (``reads``) and copied into a device slot
    (``slot_fills``: slot misses)."""

    max_lora: int = 0
    running: list[str] = msgspec.field(default_factory=list)
    waiting: list[str] = msgspec.field(default_factory=list)
    device: list[str] = msgspec.field(default_factory=list)
    cpu: list[str] = msgspec.field(default_factory=list)
    free_slots: int = 0
    load_seconds: dict[str, float] = msgspec.field(default_factory=dict)
    reads: int = 0
    slot_fills: int = 0
    evicts: str = ""


class SchedulerStats(msgspec.Struct, array_like=True):
    """``stats``, and part of every ``outputs``: the core's load, what a front end's GET /telemetry answers.
    Counters are cumulative, with the values of vLLM's counters of the same names on /metrics (prefix-cache
    tokens queried and hit, prompt and generated tokens). Positional."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    num_blocks: int = 0
    block_size: int = 16
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    lora: LoraState | None = None  # --enable-lora only


class EngineCoreOutputs(msgspec.Struct, array_like=True):
    """``outputs``: one front end's share of one step. Positional."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float


class CoreInfo(msgspec.Struct):
    """``ready``: enough for a front end to validate requests without asking again."""

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
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class RequestError(msgspec.Struct):
    """``error``: the core refused or dropped a request; ``status`` is the HTTP status to answer with."""

    request_id: str
    message: str
    status: int = 500


class LoraDone(msgspec.Struct):
    """``lora_done``: the answer to LoraCommand ``id``: an HTTP status and vLLM's message."""

    id: str
    status: int
    message: str


class ResetDone(msgspec.Struct):
    """``reset_done``: the answer to ResetPrefixCache ``id``; ``ok`` is False while requests hold blocks."""

    id: str
    ok: bool


MESSAGES: dict[bytes, type] = {
    ADD: EngineCoreRequest, ABORT: Abort, HELLO: Hello, RESET: ResetPrefixCache,
    OUTPUTS: EngineCoreOutputs, READY: CoreInfo, ERROR: RequestError, STATS: SchedulerStats,
    RESET_DONE: ResetDone, DP: DPStatus, LORA: LoraCommand, LORA_DONE: LoraDone,
}
_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in MESSAGES.items()}


def encode(msg: object) -> bytes:
    """A message's payload."""
    return _ENCODER.encode(msg)


def decode(kind: bytes, payload: bytes) -> Any:
    """The payload of a ``kind`` message as its type; ValueError for an unknown kind, msgspec.DecodeError
    (a ValueError too) for a payload that is not one."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ValueError(f"unknown message kind {kind[:32]!r}")
    msg = decoder.decode(payload)
    if kind == OUTPUTS:
        for out in msg.outputs:
            out.timestamp = msg.timestamp
    return msg
