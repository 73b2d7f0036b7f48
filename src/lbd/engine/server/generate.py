"""One HTTP request's core requests (n choices x prompts): submit, turn outputs into text deltas, abort.

All sequences of a request share one asyncio queue, so a request with n=4 costs no extra tasks. Stop strings
are found here in the detokenized text; a hit aborts the core request and trims the text.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from lbd.engine.server.core_client import CoreError
from lbd.engine.server.errors import APIError
from lbd.engine.server.openai_protocol import CommonParams
from lbd.engine.server.request_metrics import record_finished, record_prompt_done
from lbd.engine.server.sequence import Delta, Sequence
from lbd.engine.server.state import FrontendState
from lbd.engine.tokenizer import IncrementalDetokenizer
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams
from lbd.wire.kv_transfer import params_to_obj


@dataclass(slots=True)
class PromptInput:
    ids: list[int]
    max_tokens: int


class Generation:
    """Submit every sequence of one HTTP request and iterate their deltas in arrival order."""

    def __init__(self, state: FrontendState, prefix: str, prompts: list[PromptInput],
                 common: CommonParams) -> None:
        self.state = state
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.arrival_wall = time.time()
        self.created = int(self.arrival_wall)
        self.arrival = time.monotonic()
        self.common = common
        self.prompts = prompts
        self.seqs: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._requests: list[EngineCoreRequest] = []
        self._unfinished = [common.n] * len(prompts)  # sequences of each prompt not finished yet
        tok = state.tokenizer
        for p_index, prompt in enumerate(prompts):
            for i in range(common.n):
                index = p_index * common.n + i
                rid = f"{self.id}-{index}"
                detok = IncrementalDetokenizer(tok, prompt.ids, common.stop, common.skip_special_tokens,
                                               common.include_stop)
                seq = Sequence(index, p_index, rid, prompt.ids, detok)
                self.seqs.append(seq)
                self._by_id[rid] = seq
                self._requests.append(EngineCoreRequest(rid, prompt.ids, self._sampling(prompt, i),
                                                        state.eos_token_id, time.time(),
                                                        common.kv_transfer_params, common.priority,
                                                        state.adapter(common.model)))

    def _sampling(self, prompt: PromptInput, i: int) -> SamplingParams:
        sp = msgspec.structs.replace(self.common.sampling, max_tokens=prompt.max_tokens, n=1)
        if sp.seed is not None and i:
            sp.seed += i  # n choices with one seed must still differ, reproducibly
        return sp

    async def start(self) -> None:
        client = self.state.client
        for req in self._requests:
            client.register(req.request_id, self._queue)
        try:
            for req in self._requests:
                await client.add(req)
        except CoreError as e:  # the core died between the availability check and now
            raise APIError(e.message, e.status) from e

    async def deltas(self) -> AsyncIterator[Delta]:
        pending = len(self.seqs)
        prof = self.state.client.profiler
        while pending:
            item = await self._queue.get()
            if isinstance(item, CoreError):
                raise APIError(item.message, item.status)
            seq = self._by_id.get(item.request_id)
            if seq is None or seq.finished:
                continue  # outputs already in flight when a stop string ended the sequence
            if prof is None:
                delta = seq.consume(item)
            else:
                t0 = time.perf_counter()
                delta = seq.consume(item)
                prof.add("detokenize", time.perf_counter() - t0)
            self._record(seq, delta)
            if delta.finished:
                pending -= 1
                if not seq.core_done:
                    seq.core_done = True
                    await self.state.client.abort([seq.request_id], reason=seq.finish_reason or "abort")
            yield delta

    def _record(self, seq: Sequence, delta: Delta) -> None:
        now = time.monotonic()
        m = self.state.metrics
        if delta.token_ids:
            if seq.first_time == 0.0:
                seq.first_time = now
                m.time_to_first_token.observe(now - self.arrival)
            else:
                gap = (now - seq.last_time) / len(delta.token_ids)
                for _ in delta.token_ids:
                    m.inter_token_latency.observe(gap)
            seq.last_time = now
        if delta.finished:
            record_finished(m, seq, now - self.arrival, self.common.max_tokens)
            left = self._unfinished[seq.prompt_index] = self._unfinished[seq.prompt_index] - 1
            if left == 0:
                siblings = self.seqs[seq.prompt_index * self.common.n:(seq.prompt_index + 1) * self.common.n]
                record_prompt_done(m, self.common.n, max(s.num_tokens for s in siblings))

    async def close(self) -> None:
        """Abort what is still running in the core (client gone, error, shutdown) and drop the routes."""
        client = self.state.client
        live = [s.request_id for s in self.seqs if not s.core_done]
        for s in self.seqs:
            client.unregister(s.request_id)
        if live:
            await client.abort(live)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    def kv_transfer_field(self) -> dict[str, Any]:
        """A response's ``kv_transfer_params`` (a finished prefill's, for its remote decode), else nothing."""
        for s in self.seqs:
            if s.kv_transfer_params is not None:
                return {"kv_transfer_params": params_to_obj(s.kv_transfer_params)}
        return {}

    def usage(self) -> dict[str, int]:
        p, c = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}
