"""One choice of a request as the front end sees it (``Sequence``: its detokenizer, finish state and timings)
and what one core output added to it (``Delta``). Plain data read by the handlers, the request metrics and the
tracer, so none of them imports the generation logic (``lbd.engine.server.generate``) for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from lbd.engine.tokenizer import IncrementalDetokenizer
from lbd.wire.core_messages import EngineCoreOutput, TokenLogprobs
from lbd.wire.kv_transfer import KVTransferParams


@dataclass(slots=True)
class Delta:
    """What one core output added to one sequence."""

    seq: Sequence
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    offsets: list[int]  # offset of each token's text in the sequence's text (completions logprobs)
    finished: bool


class Sequence:
    """One choice: a core request, its detokenizer and its finish state."""

    __slots__ = ("index", "prompt_index", "request_id", "prompt_ids", "detok", "num_tokens", "finish_reason",
                 "stop_reason", "first_time", "last_time", "core_done", "num_cached", "timings",
                 "first_core_ts", "last_core_ts", "kv_transfer_params")

    def __init__(self, index: int, prompt_index: int, request_id: str, prompt_ids: list[int],
                 detok: IncrementalDetokenizer) -> None:
        self.index = index
        self.prompt_index = prompt_index
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.detok = detok
        self.num_tokens = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_time = 0.0  # front-end monotonic times of the first and latest tokens
        self.last_time = 0.0
        self.core_done = False  # the core finished (or never needs an abort)
        self.num_cached = 0  # prompt tokens the prefix cache served
        self.timings: tuple[float, float, int] | None = None  # (queued, scheduled, preemptions), core clock
        self.first_core_ts = 0.0  # core wall-clock times of the outputs with the first and latest tokens
        self.last_core_ts = 0.0
        self.kv_transfer_params: KVTransferParams | None = None  # a finished prefill's, for its decode

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self.detok.text

    def consume(self, out: EngineCoreOutput) -> Delta:
        if out.timings is not None:
            if self.timings is None:
                self.num_cached = out.num_cached_tokens
            self.timings = out.timings
        if out.new_token_ids:
            if not self.first_core_ts:
                self.first_core_ts = out.timestamp
            self.last_core_ts = out.timestamp
        ids: list[int] = []
        offsets: list[int] = []
        for token_id in out.new_token_ids:
            offsets.append(self.detok.length)
            ids.append(token_id)
            stop = self.detok.add(token_id)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                break
        self.num_tokens += len(ids)
        if out.finish_reason is not None:
            self.core_done = True
            self.kv_transfer_params = out.kv_transfer_params
            if self.finish_reason is None:
                self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        lps = out.new_logprobs[: len(ids)] if out.new_logprobs is not None else None
        return Delta(self, self.detok.take(final=self.finished), ids, lps, offsets, self.finished)
