"""The request side of the exact view: a prompt tokenized once, its block chain walked once over the index.

``annotate`` gives a request's facts the exact cached length on every endpoint whose view is exact (and the
exact prompt length); ``dispatched`` marks the blocks the chosen endpoint will compute as pending there (and,
with several workers, in shared memory) until ``settle`` after the first byte, so a request sharing the
prefix goes where it is being computed. A prompt with a long new text is routed on its head when the index
proves the rest is cached nowhere (``cold``); its chain's tail becomes pending when its tokenization ends
(past ``cold.MAX_BACKGROUND`` running tokenizations the text is left untokenized: only its head is pending).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from lbd.policies import RequestFacts
from lbd.router.kv.answers import AnswersAhead, conversational
from lbd.router.kv.cold import HEAD_ONLY, ColdStart, Deferred
from lbd.router.kv.endpoint import EndpointView
from lbd.router.kv.forward import ExactPrompt, forwardable
from lbd.router.kv.index import BlockIndex, ChainMemo, chain_keys
from lbd.router.kv.shared_pending import SharedPending, checkpoints
from lbd.router.kv.tokenize import NotTokenizable, Plan, RouterTokenizer

log = logging.getLogger("lbd.router")
OFFLOAD_CHARS = 4096  # new prompt text longer than this is tokenized in a thread
SETTLE_S = 0.5  # a dispatched prefix stays pending this long after the first byte (its events are due)


@dataclass(slots=True, eq=False)
class Pending:
    """The blocks one dispatched request computes on one endpoint (and its shared checkpoints)."""

    view: EndpointView
    keys: list[int]  # chain[start:] (its tail is added when a prompt routed on its head is tokenized)
    start: int  # chain position of keys[0]
    marks: list[int]
    settled: bool = False


OnChain = Callable[[RequestFacts, str, int], None]  # (facts with the whole chain, endpoint, head blocks)


class Routed(Protocol):
    """A request as the lookup reads and annotates it (``lbd.router.routed.RoutedRequest``): the policies'
    facts, and beside them the lookup's own bookkeeping, which no policy reads."""

    facts: RequestFacts
    deferred: Deferred | str | None  # routed on its head: its tokenization still running, or HEAD_ONLY
    prompt_ids: ExactPrompt | None  # the prompt's ids, for ranks that take them (kv.forward)


class Lookup:
    def __init__(
        self, views: dict[str, EndpointView], index: BlockIndex, shared: SharedPending | None, stale_s: float
    ) -> None:
        self.views = views  # the exact view's own dict: endpoints come and go there
        self.index = index
        self.shared = shared
        self.stale_s = stale_s
        self.cold = ColdStart()
        self.answers = AnswersAhead()
        self.head_mismatches = 0  # prompts whose head tokenized unlike their whole text (warned once)
        self._chains: dict[int, ChainMemo] = {}  # block size -> memo of prompts' block keys

    def complete(self) -> bool:
        """Every endpoint has an exact view (no request needs the approximate index)."""
        views = self.views.values()
        return bool(views) and all(v.exact(self.stale_s) for v in views)

    # ---- annotate ---------------------------------------------------------------------------------------
    def annotate(self, req: Routed, data: dict[str, Any]) -> Awaitable[None] | None:
        """Set ``req.facts.prompt_tokens`` and ``cached_tokens`` for exact endpoints (exact, or an estimate of
        the length for a prompt routed on its head); returns an awaitable when a long new prompt text must be
        tokenized off the event loop first."""
        views = self._tokenizing(req.facts.model)
        if not views:
            return None
        tok = views[0].tokenizer
        assert tok is not None
        try:
            plan = tok.plan_request(data)
        except NotTokenizable:
            return None
        if plan is None:
            return None
        fp = tok.fingerprint if tok.fingerprint and forwardable(data) else None
        if plan.missing_chars > OFFLOAD_CHARS:
            running = self.cold.waiting_on(plan)
            if running:
                return self._annotate_after(req, tok, data, views, running, fp)
            if self._route_early(req, tok, plan, views):
                return None
            return self._annotate_later(req, tok, plan, views, fp)
        if plan.missing:
            tok.fill(plan, tok.encode_missing(plan))
        self._lookup(req, plan.pieces, views, fp)
        return None

    def _tokenizing(self, model: str | None) -> list[EndpointView]:
        """The exact views serving ``model`` that share the first one's tokenizer (the one requests use)."""
        views = [v for v in self.views.values() if v.exact(self.stale_s) and _serves(v, model)]
        return [v for v in views if v.tokenizer is views[0].tokenizer] if views else views

    def answered(self, facts: RequestFacts, data: dict[str, Any], ids: Sequence[int]) -> bool:
        """A streamed chat answer ended with these output ids: tokenize it ahead of the conversation's next
        turn (``kv.answers``); False when it is not."""
        views = self._tokenizing(facts.model) if conversational(data, facts.session_key) else []
        tok = views[0].tokenizer if views else None
        return tok is not None and self.answers.warm(tok, data, ids)

    async def _annotate_later(
        self, req: Routed, tok: RouterTokenizer, plan: Plan, views: list[EndpointView], fp: str | None
    ) -> None:
        encoded = await asyncio.get_running_loop().run_in_executor(None, tok.encode_missing, plan, True)
        tok.fill(plan, encoded)
        self._lookup(req, plan.pieces, views, fp)

    async def _annotate_after(
        self, req: Routed, tok: RouterTokenizer, data: dict[str, Any], views: list[EndpointView],
        running: list[asyncio.Future[list[Sequence[int]]]], fp: str | None,
    ) -> None:
        """Another request's tokenization of this prompt's new text is running: wait for it (its piece
        cache then has the text, and its endpoint the whole chain as pending), then look up as usual."""
        await asyncio.gather(*running, return_exceptions=True)
        plan = tok.plan_request(data)
        if plan is None:
            return
        if plan.missing:  # other new text beside the shared one (a new turn), or that tokenization failed
            await self._annotate_later(req, tok, plan, views, fp)
        else:
            self._lookup(req, plan.pieces, views, fp)

    def _route_early(self, req: Routed, tok: RouterTokenizer, plan: Plan, views: list[EndpointView]) -> bool:
        """Route on the first new piece's head when no endpoint's match reaches its end (see ``cold``): the
        short head first, the long one when some endpoint holds all of the short one."""
        for head in self.cold.heads(tok, plan, {v.block_size for v in views}):
            proof = self._cold_proof(head[0], views)
            if proof is not None:
                break
        else:
            return False  # no head, or some endpoint holds all of the longest: the rest may be there too
        _, head_tokens, head_chars = head
        cached, keys_by_size, pending = proof
        known = sum(len(p) for p in plan.pieces if not isinstance(p, str))
        facts = req.facts
        facts.prompt_tokens = self.cold.estimate_tokens(plan, head_tokens, head_chars, known)
        facts.cached_tokens = cached
        facts.pending_tokens = pending or None
        facts.block_keys = keys_by_size
        facts.chain_partial = True
        req.deferred = self.cold.start(tok, plan) if self.cold.has_room() else HEAD_ONLY
        return True

    def _cold_proof(
        self, ids: list[int], views: list[EndpointView]
    ) -> tuple[dict[str, int], dict[int, list[int]], dict[str, int]] | None:
        """(each endpoint's cached tokens, the head's chain per block size, the pending part of the cached)
        when no endpoint holds or computes all of the head's chain; else None."""
        cached: dict[str, int] = {}
        pending: dict[str, int] = {}
        keys_by_size: dict[int, list[int]] = {}
        for bs, group in _by_block_size(views).items():
            keys = chain_keys(ids, bs)
            if not keys:
                return None
            depth = self._depths(keys, group)
            if any(d >= len(keys) for d in depth.values()):
                return None
            self._cached(keys, group, depth, bs, cached, pending)
            keys_by_size[bs] = keys
        return cached, keys_by_size, pending

    def _lookup(self, req: Routed, pieces: list[Any], views: list[EndpointView], fp: str | None) -> None:
        n = sum(len(p) for p in pieces)
        facts = req.facts
        facts.prompt_tokens = n
        if fp is not None:
            req.prompt_ids = ExactPrompt(pieces, fp)
        cached: dict[str, int] = {}
        pending: dict[str, int] = {}
        keys_by_size: dict[int, list[int]] = {}
        for bs, group in _by_block_size(views).items():
            keys = keys_by_size[bs] = self._chain(bs, pieces, n)
            self._cached(keys, group, self._depths(keys, group), bs, cached, pending)
        facts.cached_tokens = cached
        facts.pending_tokens = pending or None
        facts.block_keys = keys_by_size

    def _cached(self, keys: list[int], group: list[EndpointView], depth: dict[int, int], bs: int,
                cached: dict[str, int], pending: dict[str, int]) -> None:
        """Each endpoint's cached tokens into ``cached``, and where part of them is only pending (sent there
        to compute, not announced yet) that part into ``pending``."""
        held_depth = self.index.held_depth
        for v in group:
            d = depth.get(v.blocks.bit, 0)
            cached[v.url] = d * bs
            if d:
                h = held_depth(keys, v.blocks.bit, d)
                if h < d:
                    pending[v.url] = (d - h) * bs

    def _chain(self, bs: int, pieces: list[Any], n: int) -> list[int]:
        # the engine always computes the last prompt token: a fully cached prompt still recomputes it
        memo = self._chains.get(bs)
        if memo is None:
            memo = self._chains[bs] = ChainMemo(bs)
        return memo.keys(pieces)[: (n - 1) // bs]

    def _depths(self, keys: list[int], group: list[EndpointView]) -> dict[int, int]:
        bits = 0
        for v in group:
            bits |= v.blocks.bit
        depth = self.index.match(keys, bits)
        if self.shared is not None:
            self._shared_depths(keys, group, depth)
        return depth

    def _shared_depths(self, keys: list[int], group: list[EndpointView], depth: dict[int, int]) -> None:
        """Raise ``depth`` where another worker sent a request computing these blocks (its checkpoints)."""
        assert self.shared is not None
        mine = {v.slot: v for v in group if v.slot >= 0}
        for pos in reversed(checkpoints(0, len(keys))):
            if not mine:
                return
            for slot in self.shared.slots(keys[pos]):
                v = mine.pop(slot, None)
                if v is not None and depth.get(v.blocks.bit, 0) < pos + 1:
                    depth[v.blocks.bit] = pos + 1

    # ---- pending blocks ---------------------------------------------------------------------------------
    def dispatched(self, url: str, req: Routed, on_chain: OnChain | None = None) -> Pending | None:
        """``req`` went to ``url``: the blocks it will compute there are pending until ``settle``. A request
        routed on its head gets its whole chain in ``req.facts`` when its tokenization ends, and then
        ``on_chain(facts, url, head_blocks)`` (``Policy.on_chain_known``)."""
        facts = req.facts
        view = self.views.get(url)
        if view is None or not facts.block_keys or facts.cached_tokens is None:
            return None
        bs = view.block_size
        chain = facts.block_keys.get(bs)
        if not chain:
            return None
        start = facts.cached_tokens.get(url, 0) // bs
        token = Pending(view, chain[start:], start, [])
        self.index.add_pending(token.keys, view.blocks.bit)
        self._mark(token, chain, start)
        deferred = req.deferred  # None, HEAD_ONLY or a Deferred: routed on its head
        if deferred is not None:
            view.routed_on_head += 1
        if deferred is HEAD_ONLY:
            view.head_only += 1
        elif isinstance(deferred, Deferred):
            if deferred.future.done():
                self._extend(token, deferred, chain, facts, on_chain)
            else:
                deferred.on_done.append(lambda: self._extend(token, deferred, chain, facts, on_chain))
        return token

    def _mark(self, token: Pending, chain: list[int], start: int) -> None:
        if self.shared is None or token.view.slot < 0:
            return
        have = set(token.marks)
        new = [k for p in checkpoints(start, len(chain)) if (k := chain[p]) not in have]
        self.shared.add(new, token.view.slot)
        token.marks += new

    def _extend(
        self, token: Pending, deferred: Deferred, head: list[int], facts: RequestFacts,
        on_chain: OnChain | None,
    ) -> None:
        """The prompt routed on ``head`` is tokenized: the rest of its chain is pending there too (unless its
        first byte came first), its facts get the whole chain, and the policy hears of it."""
        view = token.view
        if self.views.get(view.url) is not view:
            return
        pieces = deferred.plan.pieces
        n = sum(len(p) for p in pieces)
        chain = self._chain(view.block_size, pieces, n)
        if chain[: len(head)] != head:  # the head check at load time is a sample, not a proof
            self.head_mismatches += 1
            if self.head_mismatches == 1:
                log.warning("a prompt's head tokenized unlike its whole text: it was routed on a wrong "
                            "chain (a cache miss at worst); its blocks are not marked pending")
            return
        if facts.chain_partial:  # (the first of a retried request's tries to get here)
            facts.prompt_tokens, facts.chain_partial = n, False
            facts.block_keys = {**(facts.block_keys or {}), view.block_size: chain}
        if on_chain is not None:
            on_chain(facts, view.url, len(head))
        if token.settled:
            return
        rest = chain[len(head):]
        self.index.add_pending(rest, view.blocks.bit)
        token.keys += rest
        self._mark(token, chain, token.start)

    def settle(self, token: Pending, first_byte: bool) -> None:
        """The request's first byte arrived (its events are due: drop the entry soon) or it failed."""
        token.settled = True
        view, keys, marks = token.view, token.keys, token.marks

        def drop() -> None:
            if self.views.get(view.url) is view:  # the endpoint's bit may belong to another one now
                self.index.remove_pending(keys, view.blocks.bit)
            if marks and self.shared is not None:
                self.shared.remove(marks, view.slot)

        if first_byte:
            asyncio.get_running_loop().call_later(SETTLE_S, drop)
        else:
            drop()


def _by_block_size(views: list[EndpointView]) -> dict[int, list[EndpointView]]:
    out: dict[int, list[EndpointView]] = {}
    for v in views:
        out.setdefault(v.block_size, []).append(v)
    return out


def _serves(view: EndpointView, model: str | None) -> bool:
    models = view.models()
    return model is None or not models or model in models
