"""The scheduler's settings (resolved once from the configuration's slices), its cumulative counters, and
the refusal it raises: the types the core, the metrics recorder and the tests share with the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field

from lbd.engine.config.slices import CacheConfig, SchedulerLimits


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_blocks: int
    block_size: int
    enable_prefix_caching: bool = True
    max_num_queued_reqs: int | None = None
    max_num_queued_tokens: int | None = None
    prefix_caching_hash_algo: str = "sha256"
    max_prefill_tokens_with_decodes: int | None = None  # None: no cap (the whole token budget)
    scheduling_policy: str = "fcfs"  # or "priority": the queues' order (lbd.engine.core.priority)

    @classmethod
    def from_slices(cls, limits: SchedulerLimits, cache: CacheConfig, *, num_blocks: int,
                    max_model_len: int) -> SchedulerConfig:
        """From the configuration's scheduler and cache slices, and what the runner found (the blocks that
        fit, the context length)."""
        return cls(max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens,
                   max_model_len=max_model_len, num_blocks=num_blocks, block_size=cache.block_size,
                   enable_prefix_caching=cache.enable_prefix_caching,
                   max_num_queued_reqs=limits.max_num_queued_reqs,
                   max_num_queued_tokens=limits.max_num_queued_tokens,
                   prefix_caching_hash_algo=cache.prefix_caching_hash_algo,
                   max_prefill_tokens_with_decodes=limits.max_prefill_tokens_with_decodes,
                   scheduling_policy=limits.scheduling_policy)


@dataclass(slots=True)
class SchedulerCounters:
    """Cumulative counts the core turns into Prometheus counters (it records deltas)."""

    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt length of each request, counted when its first token is sampled
    generation_tokens: int = 0
    prompt_cached_tokens: int = 0  # of those prompt tokens, the ones found in the prefix cache
    finished: int = 0  # requests finished, for any reason (aborts included)
    finished_by_reason: dict[str, int] = field(default_factory=dict)


class RequestRejected(Exception):
    """A request the core will not take; ``status`` is the HTTP status the front end should answer."""

    def __init__(self, message: str, status: int, reason: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.reason = reason  # for 503s: the queue limit ("max_num_queued_reqs" or "max_num_queued_tokens")
