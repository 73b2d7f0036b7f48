"""Resume a stream on another rank when its upstream fails after the first byte went to the client.

A failure mid-stream is a reset or EOF before ``[DONE]``, a gap of --stream-idle-timeout-s, or an SSE error
event the rank marks retryable (code 502, 503 or 504: lbd's engine sends 503 when its core died, a draining
rank cuts or fails its streams the same way). Instead of ending the stream with an error event (what
``lbd.router.relay`` does, and what --migration-limit 0 keeps), the router continues the same request on
another rank that the policy picks (the failed one excluded, the request's prefix facts as they were, so a
rank that holds the conversation's blocks is preferred), up to --migration-limit moves.

Knowing what was streamed: the router asks the rank for token ids (vLLM's ``return_token_ids`` field, which
lbd's engine implements too: ``prompt_token_ids`` with the first chunk, each choice's ``token_ids``) and
strips them from what the client sees unless the client asked for them. The ids counted are those of events
written to the client whole; lbd's engine reports a token only once its text went out (text held back for a
possible stop string is held back with its tokens, ``lbd.engine.server.token_ids``), so that text is generated
again on the new rank and a stop string spanning the switch is still found. (A vLLM rank reports ids as it
produces them: with stop strings, held-back text can be lost at a switch there.) The prompt's ids are the
rank's own rendering (``prompt_token_ids``), for chat too: the router's template is not needed, and a rank
that returns no ids makes the request one that cannot be resumed, said so in the error event.

The continuation (``lbd.router.continuation``) is a completions token prompt; its chunks are rewritten as the
original stream's (its ``id``, ``created``, ``model``; chat deltas; usage over the whole request; logprobs'
offsets), and the client sees one ``[DONE]``. A chat with tools goes on as the same chat told the output ids
sent (``lbd_resumed_output_token_ids``), so the new rank's tool-call parser, and the grammar of a forced
``tool_choice``, go on where the first rank's were. Greedy decoding continues token for token; seeded sampling
continues with the same seed on the new rank, so the sample can differ from an unbroken run: the move's log
line says so.

Where a continuation may go: ids mean text only under the tokenizer that made them, so the first rank's
``/v1/models`` card for the model (``continuation.RankFacts``, learned when the rank joined) is kept with the
stream, and the continuation goes only to ranks whose card has the same ``lbd_tokenizer`` fingerprint (lbd's
engine publishes it, the one of ``/tokenizer_info``); a first rank with no fingerprint (vLLM) passes its
stream only to ranks with none either, of the same engine and model ``root``. A rank whose context is shorter
than the answer needs is left out too; none left within --retry-budget-s ends the stream with the reason. A
chat with no ``max_tokens`` continues with the first rank's context length less prompt and output (what it
would have had), unknown context: not resumed. Frequency and presence penalties, structured outputs and tool
chats move only between lbd ranks (``lbd_resumed_output_tokens`` and ``lbd_resumed_output_token_ids`` make
the sent tokens count as output there, and advance the request's grammar over them; a rank that finds them
outside the grammar answers 400, which ends the stream). A stream cut after its finish reason is not
resumed: it gets its usage chunk if it asked for one and missed it, and its ``[DONE]``.

Non-streamed requests need no token ids: a rank sends a non-streamed answer whole when it is done, so a
failure while it generates is a failure before the first byte, which the proxy already retries on another
rank (from the start: nothing reached the client). Only a body over the relay's whole-read size can break
mid-answer, and those are cut as before. Pinned requests (X-data-parallel-rank) move only with
--migrate-pinned.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, Protocol

from lbd.policies import Decision, Refusal, route
from lbd.router.continuation import (
    RankFacts,
    impossible,
    kind_of,
    left,
    needs_lbd,
    rank_facts,
    with_token_ids,
)
from lbd.router.messages import Response
from lbd.router.relay import CAUSES, error_event
from lbd.router.resumable import DONE, Move
from lbd.router.routed import Failure, RoutedRequest
from lbd.router.state import RouterState

if TYPE_CHECKING:
    from lbd.router.tracing import RouterTracer

log = logging.getLogger("lbd.router")
GAPS_KEPT = 1024  # the last moves' gaps from failure to the next token, for /router/status's p50/p99
_POLL_S = 0.05


class Attempts(Protocol):
    """What runs one try of a request on one endpoint (lbd.router.proxy.Proxy)."""

    async def attempt(self, rr: RoutedRequest, out: Response, d: Decision) -> Failure | None: ...


class Migrator:
    """Makes each eligible request's ``Move`` and runs its moves (--migration-limit, --migrate-pinned)."""

    def __init__(self, state: RouterState, tracer: RouterTracer | None = None) -> None:
        self.state, self.cfg, self.tracer = state, state.cfg, tracer
        self.loop = state.loop
        self.tally: dict[str, dict[str, int]] = {}  # reason -> outcome -> moves (/router/status)
        self.gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)  # failure -> next token, s

    def prepare(self, rr: RoutedRequest) -> None:
        """A ``Move`` for a streamed chat or completion that may move; its body asks for token ids."""
        data = rr.data
        if data is None or not data.get("stream") or rr.request.method != "POST":
            return
        kind = kind_of(rr.request.path)
        if kind is None or (rr.facts.pinned_rank is not None and not self.cfg.migrate_pinned):
            return
        why = impossible(kind, data)
        if why is None:
            rr.ids_body = with_token_ids(rr.body)
        rr.move = Move(kind, data, data.get("return_token_ids") is True, why)

    def status(self) -> dict[str, Any]:
        gaps = sorted(self.gaps)
        return {"limit": self.cfg.migration_limit, "moves": self.tally,
                "gap_s": {"count": len(gaps), "p50": _quantile(gaps, 0.5), "p99": _quantile(gaps, 0.99)}}

    def count(self, reason: str, outcome: str) -> None:
        self.state.metrics.migrations.labels(reason, outcome).inc()
        by = self.tally.setdefault(reason, {})
        by[outcome] = by.get(outcome, 0) + 1

    async def resume(self, proxy: Attempts, rr: RoutedRequest, out: Response) -> None:
        """Move the broken stream until it ends, the client goes, or no move is left."""
        move: Move = rr.move
        while move.broken is not None:
            reason = move.broken
            if move.finished:  # cut after its finish reason: whole already
                self.count(reason, "finished")
                return await self._finish(out, move, move.tail())
            why, outcome = self._why_not(move)
            if why is not None:
                self.count(reason, outcome)
                return await self._end(out, move, why)
            assert move.prompt_ids is not None and move.origin is not None
            ctx = move.origin.max_model_len
            todo = left(move.kind, move.data, len(move.prompt_ids), len(move.out_ids), ctx)
            if todo is None:
                self.count(reason, "impossible")
                why = "it cannot be resumed on another rank: a chat with no max_tokens on a rank whose " \
                      "/v1/models gives no max_model_len (its limit is unknown)"
                return await self._end(out, move, why)
            if todo <= 0:  # every token was sent, its finish reason was cut off
                self.count(reason, "finished")
                return await self._finish(out, move, move.ending() + move.tail())
            d = await self._decide(rr, move, len(move.prompt_ids) + len(move.out_ids) + todo)
            if d is None:
                self.count(reason, "no_endpoint")
                return await self._end(out, move, "no other rank could take it within --retry-budget-s "
                                                  "(it needs one with the same tokenizer and context)")
            move.resume_on(todo)
            self._note(rr, move, reason, d)
            span = None
            if self.tracer is not None and rr.trace is not None:
                span = self.tracer.child(
                    rr.trace,
                    "lbd.migrate",
                    {
                        "lbd.migration.reason": reason,
                        "lbd.migration.from": move.failed_key,
                        "lbd.endpoint": d.endpoint.key,
                        "lbd.migration.tokens_sent": move.before,
                    },
                )
            try:
                failure = await proxy.attempt(rr, out, d)
            finally:
                if span is not None:
                    span.end()
            self._after(move, reason, failure, d)
            if failure is not None and not failure.retryable:
                return await self._end(out, move, failure.message)

    def _after(self, move: Move, reason: str, failure: Failure | None, d: Decision) -> None:
        if move.gap is not None:
            self.count(reason, "resumed")
            self.state.metrics.migration_gap.observe(move.gap)
            self.gaps.append(move.gap)
            return
        self.count(reason, "failed")
        if failure is not None:
            move.broken, move.failed_key, move.failed_url = failure.kind, d.endpoint.key, d.endpoint.key

    def _why_not(self, move: Move) -> tuple[str | None, str]:
        if move.impossible is not None:
            return f"it cannot be resumed on another rank: {move.impossible}", "impossible"
        if move.broken == "oversized":
            return "it cannot be resumed on another rank: an event over the size cap", "impossible"
        if move.prompt_ids is None or not move.ids_ok:
            return (
                "it cannot be resumed on another rank: the rank returned no token ids (return_token_ids)"
            ), "impossible"
        origin = move.origin_facts()
        if origin is None:
            return ("it cannot be resumed on another rank: the router has not learned the rank's model "
                    "(its /v1/models card), so not which ranks share its tokenizer"), "impossible"
        lbd_only = needs_lbd(move.data)
        if lbd_only is not None and origin.engine != "lbd":
            why = (f"it cannot be resumed on another rank: {lbd_only}, which only lbd's engine takes from a "
                   "continuation (the rank is not lbd's)")
            return why, "impossible"
        limit = self.cfg.migration_limit
        if move.moves >= limit:
            return f"it was moved {move.moves} times already (--migration-limit {limit})", "limit"
        return None, ""

    def _note(self, rr: RoutedRequest, move: Move, reason: str, d: Decision) -> None:
        data = move.data
        sampled = data.get("temperature", 1.0) not in (0, 0.0) and data.get("top_k") != 1
        rid = rr.request_id
        log.info(
            "request %s: %s on %s after %d tokens; resuming on %s (move %d)%s",
            rid,
            reason,
            move.failed_key,
            move.before,
            d.endpoint.key,
            move.moves,
            f"; sampled (seed {data.get('seed')}): the continuation is not bit-reproducible"
            if sampled
            else "",
        )

    async def _decide(self, rr: RoutedRequest, move: Move, need: int) -> Decision | None:
        """The policy's choice for the continuation, the failed ranks excluded, and the ranks whose ids or
        context differ (``unfit``); waits (within --retry-budget-s from the failure) while none can take it,
        e.g. an MoE group re-forming."""
        state, cfg = self.state, self.cfg
        if move.failed_key and move.failed_key not in rr.exclude:
            rr.exclude.append(move.failed_key)
        facts = rr.facts
        pinned = facts.pinned_rank is not None
        if pinned:  # (--migrate-pinned) the pinned rank failed it: the policy picks among the others
            facts = dataclasses.replace(facts, pinned_rank=None)
        deadline = move.broke_at + cfg.retry_budget_s
        while True:
            snaps = state.snapshots()
            d = route(state.policy, facts, snaps, rr.exclude + self._unfit(move, need), cfg.pin_fallback,
                      rr.gate)  # (P/D: a decode stage's continuation stays on decode ranks)
            if not isinstance(d, Refusal):
                break
            if self.loop.time() >= deadline:
                return None
            await asyncio.sleep(_POLL_S)
            for snap in snaps:  # an excluded rank that went out counts again once it is back
                out = not snap.healthy or snap.draining
                if out and snap.key in rr.exclude:
                    rr.exclude.remove(snap.key)
        if rr.trace is not None:
            rr.trace.decided(cfg.policy, d)
        return Decision(d.endpoint, "pin_fallback", d.detail) if pinned else d

    def _unfit(self, move: Move, need: int) -> list[str]:
        """Endpoints the continuation may not go to: another tokenizer than the first rank's (its ids would
        mean other text), an engine that cannot carry its penalties or grammar, or a context shorter than
        ``need``."""
        origin = move.origin or RankFacts()
        model, pen = move.data.get("model"), needs_lbd(move.data) is not None
        out = []
        for key, ep in self.state.endpoints.items():
            there = rank_facts(ep.model_cards, model)
            if not there.takes_ids_of(origin, pen) or (there.max_model_len or need) < need:
                out.append(key)
        return out

    async def _finish(self, out: Response, move: Move, tail: bytes) -> None:
        """A stream cut after its answer was whole: what it still lacks, and its one ``[DONE]``."""
        try:
            await out.write(tail + DONE)
            out.end()
        except ConnectionResetError:
            out.abort()

    async def _end(self, out: Response, move: Move, why: str) -> None:
        """The stream ends with an error event: what failed (as without a move) and why it was not resumed."""
        what, cause = CAUSES.get(move.broken or "", ("failed", move.broken))
        message = f"upstream {what} mid-stream ({cause}); the response is incomplete: {why}"
        where = move.failed_url or move.failed_key
        log.warning("upstream %s %s mid-stream (%s), not resumed: %s", where, what, cause, why)
        if out.backed_up:
            out.abort()
            return
        try:
            await out.write(error_event(message))
            out.end()
        except ConnectionResetError:
            out.abort()


def _quantile(ordered: list[float], q: float) -> float | None:
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 4) if ordered else None
