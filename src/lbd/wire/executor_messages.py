"""The messages between a TP x PP rank's core (``lbd.engine.executor.mp``) and its workers
(``lbd.engine.executor.worker``): one msgspec Struct per kind, msgpack arrays whose first element is the kind.

Core -> every worker, one PUB broadcast each (``ToWorker``):
  ``config``    WorkerConfig: everything a worker needs to join the group and load its shard (once, first)
  ``kv``        KVSize: the rank's block count, after every worker said what it can hold
  ``step``      Step: one step's batch, the requests to sample, new requests and finished ones
  ``lora``      LoraSlot: an adapter's tensors for a device slot (``--enable-lora``), before the step using it
  ``profile``   Profile: answered by every worker with its counters
  ``shutdown``  Shutdown
Worker -> core, PUSH to one PULL (``FromWorker``: every one carries the worker's world ``rank``):
  ``blocks``    Blocks: the KV blocks it can hold and facts of the model and device
  ``ready``     Ready: its KV cache is allocated
  ``out``       Out: a step's sampled tokens (the sampler worker only)
  ``profile``   Counters: its counters since the last reset
  ``error``     WorkerError: a one-line reason it is exiting

Every type is positional (``array_like``: a step is sent every forward pass, and arrays are cheaper to pack
than maps); a newer field goes at the end with a default, and a reader skips trailing fields it does not
know. Both ends come from one install (the core spawns its workers), so an unknown kind is simply a
ValueError. Standard library and msgspec only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from lbd.wire.core_messages import SamplingParams, TokenLogprobs

# ---- core -> worker ----------------------------------------------------------------------------------------


class ToWorker(msgspec.Struct, array_like=True, tag_field="kind"):
    """The base of the core's broadcasts."""


class WorkerConfig(ToWorker, tag="config"):
    args: dict[str, Any]  # EngineArgs fields
    model_path: str
    tp: int
    pp: int
    partition: list[int] | None  # layers per pipeline stage (None: even)
    store: tuple[str, int]  # the rendezvous TCPStore
    timeout_s: float
    timed: bool | None = None  # time the collectives (LBD_PROFILE_COLLECTIVES)


class KVSize(ToWorker, tag="kv"):
    num_blocks: int


class NewRequest(msgspec.Struct, array_like=True):
    """A request the sampler worker keeps state for from now on."""

    request_id: str
    sampling: SamplingParams
    prompt_token_ids: list[int] | None  # only with a repetition penalty
    output_token_ids: list[int]


class Step(ToWorker, tag="step"):
    seq: int
    batch: list[Any]  # HostBatch.to_wire()
    sample_ids: list[str]  # one per sample row
    new: list[NewRequest]
    finished: list[str]
    # structured outputs: the constrained sample rows and their token bitmask words (int32, row after row;
    # lbd.engine.structured.mask.TokenMask.to_wire)
    mask_rows: list[int] = msgspec.field(default_factory=list)
    mask: bytes = b""
    lora_slots: list[int] = msgspec.field(default_factory=list)  # per sequence (-1 base); empty: no LoRA


class LoraSlot(ToWorker, tag="lora"):
    """Slot ``slot`` := the adapter in ``tensors`` (``lbd.engine.lora.remote.pack``: safetensors bytes, every
    (layer, projection)'s A and B, scaling folded in B); each worker keeps its own shard of it."""

    slot: int
    tensors: bytes


class Profile(ToWorker, tag="profile"):
    reset: bool = True


class Shutdown(ToWorker, tag="shutdown"):
    pass


# ---- worker -> core ----------------------------------------------------------------------------------------


class FromWorker(msgspec.Struct, array_like=True, tag_field="kind"):
    """The base of a worker's answers: which worker (its world rank)."""

    rank: int


class Blocks(FromWorker, tag="blocks"):
    num_blocks: int
    facts: dict[str, Any]  # block_size, max_model_len, vocab_size, eos_token_id, device, dtype, ...


class Ready(FromWorker, tag="ready"):
    pid: int


class Out(FromWorker, tag="out"):
    seq: int
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Counters(FromWorker, tag="profile"):
    counters: dict[str, Any]


class WorkerError(FromWorker, tag="error"):
    reason: str


_ENCODER = msgspec.msgpack.Encoder()
_TO_WORKER = msgspec.msgpack.Decoder(WorkerConfig | KVSize | Step | LoraSlot | Profile | Shutdown)
_FROM_WORKER = msgspec.msgpack.Decoder(Blocks | Ready | Out | Counters | WorkerError)


def encode(msg: ToWorker | FromWorker) -> bytes:
    return _ENCODER.encode(msg)


def decode_to_worker(data: bytes) -> ToWorker:
    """A broadcast of the core; ValueError (msgspec's errors are ValueErrors) for anything else."""
    return _TO_WORKER.decode(data)


def decode_from_worker(data: bytes) -> FromWorker:
    """A worker's answer; ValueError for anything else."""
    return _FROM_WORKER.decode(data)
