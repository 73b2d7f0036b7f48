"""What the scheduler hands the model runner for one step, and what the runner gives back."""

from __future__ import annotations

from dataclasses import dataclass, field

from lbd.engine.core.request import Request
from lbd.wire.core_messages import TokenLogprobs


@dataclass(slots=True)
class ScheduledSeq:
    """Compute ``request.all_token_ids[start : start + num_new_tokens]`` with ``start =
    request.num_computed_tokens`` (its KV goes into ``request.block_ids``, already allocated). When ``sample``
    is True this chunk reaches the last known token, and the runner samples the next one."""

    request: Request
    num_new_tokens: int
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)  # decodes (num_new_tokens == 1) first
    finished_ids: list[str] = field(default_factory=list)  # freed since the last step (runner drops state)
    scheduled_tokens: int = 0  # the sum of num_new_tokens, counted while scheduling (metrics read it)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)


@dataclass(slots=True)
class SampledToken:
    request_id: str
    token_id: int
    logprobs: TokenLogprobs | None = None
