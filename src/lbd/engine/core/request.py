"""A request's state inside the core."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from lbd.wire.core_messages import EngineCoreRequest, SamplingParams
from lbd.wire.kv_transfer import KVTransferParams

if TYPE_CHECKING:
    from lbd.engine.structured.compiler import GrammarState


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    client: bytes = b""  # ZMQ identity of the front end that owns it
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)  # prompt + output, kept in step
    block_ids: list[int] = field(default_factory=list)  # KV blocks, in position order
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first schedule (-1: not yet)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | None = None
    order: int = 0  # admission order at the core: lower = higher priority (FCFS, preemption victim = highest)
    priority: int = 0  # vLLM's field, lower is more important (--scheduling-policy priority: core/priority)
    block_hashes: list[bytes | int] = field(default_factory=list)  # chained keys of the full blocks
    num_registered_blocks: int = 0  # leading blocks of block_ids already offered to the prefix cache
    # for vLLM's per-request timing metrics (wall clock, the core's): when queued and first scheduled
    queued_at: float = 0.0
    scheduled_at: float = 0.0
    num_preemptions: int = 0
    kv_transfer_params: KVTransferParams | None = None  # prefill/decode disaggregation (engine/kv_transfer)
    grammar: GrammarState | None = None  # structured outputs: compiling, then the matcher (engine/structured)
    # LoRA (engine/lora): the adapter's id (0: base model) and name, its device slot while running (-1: none),
    # and the extra key of its prefix-cache blocks (vLLM's ("lora", name, path)), so adapters share no block
    lora_id: int = 0
    lora_name: str | None = None
    lora_slot: int = -1
    hash_extra: tuple | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest, client: bytes = b"", order: int = 0) -> Request:
        return cls(r.request_id, list(r.prompt_token_ids), r.sampling, r.eos_token_id, r.arrival_time, client,
                   order=order, priority=r.priority, kv_transfer_params=r.kv_transfer_params)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
