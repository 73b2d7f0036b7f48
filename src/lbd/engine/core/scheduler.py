"""Continuous-batching scheduler (vLLM v1 style): one token budget shared by decodes and prefill chunks.

Each step: running requests first, in priority order (a decode costs 1 token, a request still in chunked
prefill gets its next chunk), then waiting requests FCFS, all within ``max_num_batched_tokens`` tokens and
``max_num_seqs`` running requests. When the KV cache cannot hold a running request's next tokens, the
lowest-priority running request (latest admitted) is preempted by recompute: its blocks are freed, its
computed-token count reset, and it goes back to the front of the waiting queue with the tokens it generated,
so its output does not change. After the model runner samples, ``update`` appends tokens, checks stop
conditions and frees finished requests. That is ``--scheduling-policy fcfs``; under ``priority`` both queues
are ordered by the request's ``priority`` field, then arrival, and a waiting request that finds no seat or no
KV room preempts a running one of lower priority the same way (lbd.engine.core.priority).

Decodes first once most requests stream (after Sarathi-Serve's stall-free batching): when more than twice as
many requests are decoding as are waiting for their first token (in chunked prefill, or queued with a free
seat), a step carries at most ``max_prefill_tokens_with_decodes`` prefill tokens. A prefill chunk in a decode
step stretches every decoding request's inter-token gap by the chunk's cost; on a CPU, where a step's time
grows with its tokens, a full-budget chunk makes that step many times a 32-sequence decode step
(benchmarks/RESULTS.md, "Mixed steps"). The cap does not lower the decoders' total delay (the prompt's tokens
cost the same, spread or not); it bounds the longest gap, at the price of a later first token for the waiting.
So it binds where one prompt (a long one, say) would stall many streams, and not for a burst of arrivals: that
is admitted at the full budget, which stalls the fewer streams once and gives the many their first tokens
sooner. Steps without decodes keep the whole budget.

Batches in flight (pipeline parallelism: the core keeps up to PP batches queued, vLLM V1's batch queue): a
request stays in ``in_flight`` from ``schedule`` until ``update`` of its batch, and meanwhile it is neither
scheduled again (its next token is not known yet) nor preempted (a stage may still write its KV). An abort may
finish it; its result is then dropped. So that PP batches overlap, the core passes ``max_batch_seqs`` (the
live requests divided by PP): a batch takes at most that many sequences, and the live requests spread over PP
micro-batches instead of all going into the first. With one batch at a time ``in_flight`` is empty whenever
``schedule`` runs and there is no cap: all of this is a no-op.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from lbd.engine.core.kv_cache import CacheListener, KVCacheManager
from lbd.engine.core.priority import make_order, unschedule
from lbd.engine.core.request import Request, RequestStatus
from lbd.engine.core.sched_config import RequestRejected, SchedulerConfig, SchedulerCounters
from lbd.engine.core.sched_output import SampledToken, ScheduledSeq, SchedulerOutput
from lbd.engine.structured.compiler import GrammarCompiler, GrammarWait, failure
from lbd.wire.core_messages import EngineCoreOutput, SchedulerStats

if TYPE_CHECKING:
    from lbd.engine.lora.manager import LoraManager

logger = logging.getLogger(__name__)

PREEMPTION_LOG_EVERY = 50  # a warning on the first preemption, then on every 50th (vLLM logs similarly)


class Scheduler:
    def __init__(self, config: SchedulerConfig, cache_listener: CacheListener | None = None,
                 grammars: GrammarCompiler | None = None, loras: LoraManager | None = None) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching,
                                 config.prefix_caching_hash_algo, cache_listener)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # most important first (fcfs: Request.order; see self.order)
        self.order = make_order(config.scheduling_policy)  # where requests go in waiting and running
        self.requests: dict[str, Request] = {}
        self.counters = SchedulerCounters()
        self._finished_ids: list[str] = []  # freed since the last SchedulerOutput
        self.in_flight: set[str] = set()  # ids of requests in a batch that has not been updated yet
        self._waiting_tokens = 0
        self._next_order = 0
        self._prefill_budget = 0  # prefill tokens the step being scheduled may still take
        # prefill/decode disaggregation (lbd.engine.kv_transfer): requests admitted but waiting for their KV
        # blocks (not schedulable until ``unpark``), and a hook that sees each request finish before its
        # blocks are freed
        self.parked: dict[str, Request] = {}
        self.on_finish: Callable[[Request], None] | None = None
        # structured outputs (lbd.engine.structured): requests wait in ``compiling`` until their grammar is
        # compiled off the loop; those whose grammar failed leave through ``rejected`` (id, message, status)
        self.grammars = grammars
        self.compiling: GrammarWait[Request] = GrammarWait()
        self.rejected: list[tuple[str, str, int]] = []
        # LoRA (lbd.engine.lora): requests wait in ``loras.waiting`` until their adapter is in host memory,
        # and are admitted only with a device slot for it (held while they run)
        self.loras = loras

    # ---- intake ---------------------------------------------------------------------------------------
    def add_request(self, req: Request, parked: bool = False) -> None:
        """Queue ``req`` (raises RequestRejected with an HTTP status if it cannot be taken); ``parked``: admit
        it but hold it back until ``unpark``."""
        cfg = self.config
        if req.request_id in self.requests:
            raise RequestRejected(f"Request id {req.request_id} is already running", 400)
        if not req.prompt_token_ids:
            raise RequestRejected("The prompt is empty: at least one token is needed", 400)
        if req.num_tokens > cfg.max_model_len:
            raise RequestRejected(
                f"The prompt has {req.num_tokens} tokens, more than the model's context length "
                f"(max_model_len={cfg.max_model_len})", 400)
        if cfg.max_num_queued_reqs is not None and len(self.waiting) >= cfg.max_num_queued_reqs:
            raise RequestRejected(
                f"Scheduler waiting queue is full ({len(self.waiting)} requests waiting, "
                f"max_num_queued_reqs={cfg.max_num_queued_reqs})", 503, "max_num_queued_reqs")
        if (cfg.max_num_queued_tokens is not None
                and self._waiting_tokens + req.num_tokens > cfg.max_num_queued_tokens):
            raise RequestRejected(
                f"Scheduler waiting queue is full ({self._waiting_tokens} prompt tokens waiting, this "
                f"request adds {req.num_tokens}, max_num_queued_tokens={cfg.max_num_queued_tokens})", 503,
                "max_num_queued_tokens")
        if req.sampling.structured is not None:
            self._attach_grammar(req)
        if self.kv.enable_prefix_caching:  # keys of the prompt's full blocks now, outside any step
            self.kv.hash_upto(req, req.num_tokens // cfg.block_size)
        if req.lora_id:
            self.loras.hold(req)
        req.order = self._next_order
        self._next_order += 1
        req.queued_at = time.time()
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        if parked:
            self.parked[req.request_id] = req
            return
        self._enqueue(req)

    def _attach_grammar(self, req: Request) -> None:
        """The request's grammar: compiling (it waits in ``compiling``), or from the cache; a cached failure
        is refused here."""
        if self.grammars is None:
            raise RequestRejected("structured outputs are not available on this rank (--device sim samples "
                                  "no logits)", 400)
        n = req.sampling.prior_output_tokens  # a resumed stream: its grammar starts past what was sent
        sent = req.prompt_token_ids[-n:] if n else ()
        req.grammar = state = self.grammars.state(req.sampling.structured, sent)
        if state.ready:
            try:
                state.start()
            except Exception as e:  # noqa: BLE001 (a bad grammar: the client's 400)
                raise RequestRejected(*failure(e)) from None

    def _enqueue(self, req: Request) -> None:
        if req.grammar is not None and req.grammar.matcher is None:
            self.compiling.add(req)
            return
        if req.lora_id and self.loras.needs_wait(req):
            self.loras.waiting.append(req)
            return
        self.order.enqueue(self.waiting, req)
        self._waiting_tokens += req.num_tokens

    def unpark(self, request_id: str) -> None:
        """A parked request joins the waiting queue (no-op when it is gone: aborted)."""
        req = self.parked.pop(request_id, None)
        if req is not None:
            self._enqueue(req)

    def _admit_compiled(self) -> None:
        """Requests whose grammar is compiled join the waiting queue; failed ones finish (``rejected``).
        With nothing else to run, wait a moment for a compile rather than spin."""
        if not self.waiting and not self.running:
            self.compiling.wait(0.005)
        ready, failed = self.compiling.take_ready()
        if self.loras is not None and self.loras.waiting:
            more, lost = self.loras.take_ready(not self.waiting and not self.running)
            ready, failed = [*ready, *more], [*failed, *lost]
        for req in ready:
            self.order.enqueue(self.waiting, req)
            self._waiting_tokens += req.num_tokens
        for req, message, status in failed:
            self.rejected.append((req.request_id, message, status))
            req.finish_reason = "abort"
            self._finish(req)

    def abort(self, request_ids: list[str], reason: str = "abort") -> list[str]:
        """Finish the given requests now and free their blocks; returns the ids that were known."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue  # already finished or never seen: aborts race with completions
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
            elif self.parked.pop(rid, None) is not None or self.compiling.remove(req) or \
                    (req.lora_id and self.loras.unwait(req)):
                pass
            else:
                self.waiting.remove(req)
                self._waiting_tokens -= req.num_tokens
            req.finish_reason = reason
            self._finish(req)
            aborted.append(rid)
        return aborted

    # ---- scheduling -----------------------------------------------------------------------------------
    def schedule(self, max_batch_seqs: int | None = None) -> SchedulerOutput:
        if self.compiling or (self.loras is not None and self.loras.waiting):
            self._admit_compiled()
        budget = self.config.max_num_batched_tokens
        decodes: list[ScheduledSeq] = []
        prefills: list[ScheduledSeq] = []
        seats = max_batch_seqs if max_batch_seqs is not None else self.config.max_num_seqs
        self._prefill_budget = self._prefill_cap(budget)
        budget, preempted = self._schedule_running(budget, decodes, prefills, seats)
        if not preempted:  # after a preemption the cache is tight: admitting more would only thrash
            budget = self._schedule_waiting(budget, decodes, prefills, seats)
        if not decodes and not prefills:
            return SchedulerOutput()  # freed ids wait for the next batch the runner actually sees
        if self.loras is not None:  # one contiguous run of rows per adapter: LoRA's matmuls take slices
            decodes.sort(key=lambda s: (s.num_new_tokens > 1, s.request.lora_slot))
        decodes.extend(prefills)
        out = SchedulerOutput(seqs=decodes, finished_ids=self._finished_ids,
                              scheduled_tokens=self.config.max_num_batched_tokens - budget)
        self._finished_ids = []
        self.in_flight.update(seq.request.request_id for seq in decodes)
        return out

    def _prefill_cap(self, budget: int) -> int:
        """Prefill tokens this step may carry: the cap while over twice as many requests decode as wait for
        their first token, else the whole budget."""
        cap = self.config.max_prefill_tokens_with_decodes
        if cap is None or cap >= budget:
            return budget
        in_flight = self.in_flight
        decoding = sum(1 for r in self.running
                       if r.num_tokens - r.num_computed_tokens == 1 and r.request_id not in in_flight)
        seats = max(0, self.config.max_num_seqs - len(self.running))  # a queue beyond them is no burst
        prompting = len(self.running) - decoding + min(len(self.waiting), seats)
        return cap if decoding > 2 * prompting else budget

    def _schedule_running(self, budget: int, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq],
                          seats: int) -> tuple[int, bool]:
        running, in_flight = self.running, self.in_flight
        preemptions_before = self.counters.num_preemptions
        i = 0
        while i < len(running) and budget > 0 and len(decodes) + len(prefills) < seats:
            req = running[i]
            if req.request_id in in_flight:
                i += 1
                continue
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, budget)
            if remaining > 1:
                num_new = min(num_new, self._prefill_budget)
                if num_new == 0:
                    i += 1  # this step's prefill share is spent; the decodes behind it still go
                    continue
            if not self._make_room(req, num_new):
                break  # req was the lowest priority left (now waiting), or must wait for batches in flight
            seq = ScheduledSeq(req, num_new, req.num_computed_tokens + num_new == req.num_tokens)
            (decodes if num_new == 1 else prefills).append(seq)  # the runner takes 1-token rows first
            if remaining > 1:
                self._prefill_budget -= num_new
            budget -= num_new
            i += 1
        return budget, self.counters.num_preemptions != preemptions_before

    def _make_room(self, req: Request, num_new: int) -> bool:
        """Allocate ``req``'s next tokens, preempting from the tail of ``running`` (the lowest priority,
        never one already scheduled this step nor one in flight) until they fit; False if ``req`` had to go
        itself, or if only requests in flight rank below it (then it waits for their batch, unpreempted)."""
        running, in_flight = self.running, self.in_flight
        while not self.kv.allocate_for(req, num_new):
            j = len(running) - 1
            while running[j].request_id in in_flight:
                j -= 1  # stops at req at the latest: it is not in flight
            if running[j] is req and j < len(running) - 1:
                return False
            victim = running.pop(j)
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, budget: int, decodes: list[ScheduledSeq], prefills: list[ScheduledSeq],
                          seats: int) -> int:
        waiting, running, kv = self.waiting, self.running, self.kv
        max_seqs = self.config.max_num_seqs
        now = 0.0
        no_slot: list[Request] = []  # LoRA requests whose adapter found no free slot: the rest go on
        while waiting and budget > 0 and self._prefill_budget > 0:
            req = waiting[0]
            seat = len(running) < max_seqs
            if seat and len(decodes) + len(prefills) >= seats:
                break  # this batch is full, not the rank (pipeline parallelism): the next batch has room
            if req.lora_id and not self.loras.acquire(req):
                no_slot.append(waiting.popleft())  # every slot is in use by running requests
                continue
            if seat:
                computed, num_cached = kv.get_computed_prefix(req)
                num_new = min(req.num_tokens - num_cached, budget, self._prefill_budget)
            if not (seat and kv.allocate_for(req, num_new, computed)):
                # no seat or no KV room: under priority, push out a less important request
                given = self._displace(req, decodes, prefills)
                if given is None:
                    break  # nobody overtakes the head of the queue
                budget += given
                continue
            waiting.popleft()
            self._waiting_tokens -= req.num_tokens
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.scheduled_at = now = now or time.time()
            req.status = RequestStatus.RUNNING
            if req.lora_id:
                self.loras.pin(req)
            self.order.admit(running, req)  # running stays sorted (lbd.engine.core.priority)
            seq = ScheduledSeq(req, num_new, num_cached + num_new == req.num_tokens)
            (decodes if num_new == 1 else prefills).append(seq)
            budget -= num_new
            self._prefill_budget -= num_new
        waiting.extendleft(reversed(no_slot))  # back at the head, in their order
        return budget

    def _displace(self, req: Request, decodes: list[ScheduledSeq],
                  prefills: list[ScheduledSeq]) -> int | None:
        """Preempt the running request the waiting ``req`` may push out (none under fcfs), taking it out of
        the step being built; the tokens it gives back to the step's budget, or None when there is none."""
        victim = self.order.displaceable(req, self.running, self.in_flight)
        if victim is None:
            return None
        tokens, prefill_tokens = unschedule(victim, decodes, prefills)
        self._prefill_budget += prefill_tokens
        self.running.remove(victim)
        self._preempt(victim, kv_pressure=False)
        logger.debug("Request %s (priority %d) is preempted by recompute for request %s (priority %d)",
                     victim.request_id, victim.priority, req.request_id, req.priority)
        return tokens

    def _preempt(self, req: Request, kv_pressure: bool = True) -> None:
        self.kv.free(req)
        if req.lora_slot >= 0:
            self.loras.unpin(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.order.requeue(self.waiting, req)
        self._waiting_tokens += req.num_tokens
        req.num_preemptions += 1
        self.counters.num_preemptions += 1
        n = self.counters.num_preemptions
        if kv_pressure and (n == 1 or n % PREEMPTION_LOG_EVERY == 0):
            logger.warning(
                "Request %s is preempted by recompute because there is not enough KV cache space. This can "
                "affect end-to-end performance; give the KV cache more memory (--kv-cache-memory-bytes or "
                "--gpu-memory-utilization) or lower --max-num-seqs. total_num_cumulative_preemption=%d",
                req.request_id, n)

    # ---- results --------------------------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[SampledToken]) -> list[EngineCoreOutput]:
        """Advance computed tokens, append sampled tokens, finish what must stop; outputs per request."""
        kv, counters = self.kv, self.counters
        max_model_len = self.config.max_model_len
        outputs: list[EngineCoreOutput] = []
        k = 0
        any_finished = False
        for seq in out.seqs:
            req = seq.request
            self.in_flight.discard(req.request_id)
            if req.status is RequestStatus.FINISHED:  # aborted while its batch was in flight
                k += seq.sample
                continue
            req.num_computed_tokens += seq.num_new_tokens
            kv.cache_blocks(req)
            if not seq.sample:
                continue
            tok = sampled[k]
            k += 1
            req.append_token(tok.token_id)
            if req.grammar is not None:
                req.grammar.advance(tok.token_id, req.request_id)
            num_out = len(req.output_token_ids)
            first = num_out == 1
            o = EngineCoreOutput(req.request_id, [tok.token_id],
                                 [tok.logprobs] if tok.logprobs is not None else None)
            if first:
                cached = max(req.num_cached_tokens, 0)
                counters.prompt_tokens += req.num_prompt_tokens
                counters.prompt_cached_tokens += cached
                o.num_cached_tokens = cached
                o.timings = (req.queued_at, req.scheduled_at, req.num_preemptions)
            counters.generation_tokens += 1
            if self._check_stop(req, tok.token_id, num_out, max_model_len):
                o.finish_reason, o.stop_reason = req.finish_reason, req.stop_reason
                o.timings = (req.queued_at, req.scheduled_at, req.num_preemptions)
                self._finish(req)
                any_finished = True
            outputs.append(o)
        if k != len(sampled):
            raise RuntimeError(f"runner returned {len(sampled)} tokens for {k} sampling sequences")
        if any_finished:
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return outputs

    @staticmethod
    def _check_stop(req: Request, token: int, num_out: int, max_model_len: int) -> bool:
        """vLLM's order: length caps first, then (past min_tokens) eos, then stop token ids. A grammar that
        has ended (it took its end-of-sequence token) stops the request even before min_tokens."""
        sp = req.sampling
        if num_out >= sp.max_tokens or req.num_tokens >= max_model_len:
            req.finish_reason = "length"
            return True
        if req.grammar is not None and req.grammar.ended:
            req.finish_reason = "stop"
            return True
        if num_out < sp.min_tokens:
            return False
        if token == req.eos_token_id and not sp.ignore_eos:
            req.finish_reason = "stop"
            return True
        if sp.stop_token_ids and token in sp.stop_token_ids:
            req.finish_reason, req.stop_reason = "stop", token
            return True
        return False

    def _finish(self, req: Request) -> None:
        c, reason = self.counters, req.finish_reason or "abort"
        c.finished += 1
        c.finished_by_reason[reason] = c.finished_by_reason.get(reason, 0) + 1
        if self.on_finish is not None:
            self.on_finish(req)
        self.kv.free(req)
        if req.lora_id:
            self.loras.unpin(req)
            self.loras.drop(req)
        req.status = RequestStatus.FINISHED
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)

    # ---- introspection --------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.parked or self.compiling
                    or (self.loras is not None and self.loras.waiting))

    @property
    def num_waiting_tokens(self) -> int:
        return self._waiting_tokens

    def stats(self) -> SchedulerStats:
        kv, c = self.kv, self.counters
        waiting = len(self.waiting) + len(self.parked) + len(self.compiling) + \
            (len(self.loras.waiting) if self.loras is not None else 0)
        return SchedulerStats(num_running=len(self.running), num_waiting=waiting,
                              kv_cache_usage=kv.usage, num_blocks=self.config.num_blocks,
                              block_size=self.config.block_size, prefix_cache_queries=kv.prefix_queries,
                              prefix_cache_hits=kv.prefix_hits, prompt_tokens=c.prompt_tokens,
                              generation_tokens=c.generation_tokens)
