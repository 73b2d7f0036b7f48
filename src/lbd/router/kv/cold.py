"""Route a prompt with a long new text before the router has tokenized all of it.

Exact routing needs a prompt's block chain, and tokenizing a long new system prompt adds its whole cost to
that request's time to first token, on the path of every cold prompt (benchmarks/RESULTS.md, "Cold prompts").
But a chain is only cached as a prefix: if no endpoint holds, or is computing, the first block that reaches
into the new text, none holds any later block either, and every endpoint's cached length is already known
exactly. So the router tokenizes only the text's head, inline, walks the chain that far, and when every
endpoint's match stops inside it, routes right away; the whole text is tokenized in a thread meanwhile. The
head is short first (``head_sizes``: the block reaching into the new text needs at most a block's tokens of
it), and longer (``HEAD_CHARS``) when some endpoint holds all of the short one (prompts that open alike);
when some endpoint holds all of the long one too, the text may be cached: the request waits for the whole
chain. At most ``MAX_BACKGROUND`` such tokenizations run at a time: a flood of new prompts
must not pile up CPU work behind the routes (unbounded, they grow the router's memory and its tail latency:
"Cold prompts"). A cold prompt arriving past that bound is routed on its head all the same and its text is
left untokenized (``HEAD_ONLY``): nothing is lost for exactness, since its endpoint's events will announce the
blocks it computes, and the next request carrying that text finds its head held (or pending) there, so it
tokenizes the text itself before it is routed (the second sight pays what the first skipped). Waiting for the
tokenization instead would cap a flood of unique long prompts at the tokenizer's rate per router worker
("Cold prompts").

Until the whole chain is known the prompt's length is an estimate (the new text at the characters per token
of the texts tokenized lately), and a short head may not reach the block that names the prompt's prefix for
the eviction charge (``lbd.policies.footprint``): the policy charges the placement without leaving the
prompt's own prefix out (a prefix cached nowhere is hot nowhere) and counts the prefix once the chain is
known (``Policy.on_chain_known``; never for a ``HEAD_ONLY`` prompt, whose next request counts it).

The thread starts ``BACKGROUND_DELAY_S`` after the route: on a node shared with engine ranks (``lbd serve
--data-parallel-size N``, a router beside its supervisor) it would otherwise take CPU from the rank's front
end just as that tokenizes the same prompt (started at once, at normal or at lowered priority, the thread
about doubles the latency the router adds to such a request: "Cold prompts"). Any prefill such a prompt starts
takes longer than that delay, so a request that waits on the tokenization (below) loses nothing it would not
wait for anyway.

What the early route leaves to do, ``Deferred`` does when the thread is done: the piece cache gets the new
text (the next turn of the conversation finds it), and the endpoint the request went to gets the rest of its
chain as pending, so a request sharing the prefix goes where it is being computed. Until then only the head
is pending there; a request whose new text is still being tokenized waits for that same tokenization
(``ColdStart.encoding``) instead of starting its own, and then sees the whole chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from lbd.router.kv.tokenize import Plan, RouterTokenizer

HEAD_CHARS = 1024  # the long head (see above); new texts longer than it are tokenized in a thread
SHORT_HEAD_CHARS = 160  # the short head at most
CHARS_A_TOKEN = 6  # the short head's characters per token it must reach (most text takes fewer)
BACKGROUND_DELAY_S = 0.02  # after the route, before the whole text is tokenized (see above)
MAX_BACKGROUND = 2  # tokenizations left running after their routes; past it, a prompt waits for its own


def head_sizes(before: int, block_sizes: Iterable[int]) -> tuple[int, int]:
    """Characters of the two heads of a new text after ``before`` tokens: the short one reaches the end
    of the block the text starts in (on every block size), the long one is ``HEAD_CHARS``."""
    needed = max(bs - before % bs for bs in block_sizes)
    return min(SHORT_HEAD_CHARS, 16 + CHARS_A_TOKEN * needed), HEAD_CHARS


@dataclass(slots=True)
class Deferred:
    """The whole-chain tokenization of a prompt routed on its head."""

    future: asyncio.Future[list[Sequence[int]]]
    plan: Plan
    on_done: list[Callable[[], None]] = field(default_factory=list)  # run once the plan is filled


HEAD_ONLY = "head-only"  # ``Routed.deferred`` (kv.lookup) of a prompt routed on its head and left untokenized


class ColdStart:
    """One router worker's tokenizations in flight, by new text (one per text, however many requests)."""

    def __init__(self) -> None:
        self.encoding: dict[str, asyncio.Future[list[Sequence[int]]]] = {}
        self.running = 0  # tokenizations started by early routes, not finished yet
        self.chars_per_token = 0.0  # of the new texts tokenized lately (0: none yet), for length estimates

    def has_room(self) -> bool:
        return self.running < MAX_BACKGROUND

    def waiting_on(self, plan: Plan) -> list[asyncio.Future[list[Sequence[int]]]]:
        """Tokenizations already running for this plan's new long pieces (``start`` registers no others)."""
        enc = self.encoding
        return [f for t in plan.missing if (f := enc.get(t)) is not None]

    def heads(
        self, tok: RouterTokenizer, plan: Plan, block_sizes: Iterable[int]
    ) -> Iterator[tuple[list[int], int, int]]:
        """(ids of the prompt up to a head of its first new piece; the head's own tokens and characters), for
        the short head and then the long one (``head_sizes``), while each is longer than the one before."""
        first = _first_new(plan) if tok.by_heads else None
        if first is None:
            return
        ids, piece = first
        tried = 0
        for chars in head_sizes(len(ids), block_sizes):
            head = tok.head(piece, chars)
            if head is None or len(head) <= tried:
                return
            tried = len(head)
            head_ids = tok.rust.encode(head, add_special_tokens=False).ids
            yield ids + head_ids, len(head_ids), len(head)

    def start(self, tok: RouterTokenizer, plan: Plan) -> Deferred:
        """Tokenize the plan's new pieces in a thread; the plan is filled (and the piece cache with it) on
        the loop as soon as they are done, whatever became of the request."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Sequence[int]]] = loop.create_future()

        def begin() -> None:
            job = loop.run_in_executor(None, tok.encode_missing, plan, True)
            job.add_done_callback(lambda j: _chain(j, future))

        loop.call_later(BACKGROUND_DELAY_S, begin)
        self.running += 1
        # Only the long texts: a request that shares a short one (the same question under another new
        # document) would otherwise wait for this whole tokenization to learn a few tokens.
        texts = [t for t in plan.missing if len(t) > HEAD_CHARS]
        for t in texts:
            self.encoding.setdefault(t, future)
        deferred = Deferred(future, plan)

        def filled(f: asyncio.Future[list[Sequence[int]]]) -> None:
            self.running -= 1
            for t in texts:
                if self.encoding.get(t) is f:
                    del self.encoding[t]
            if f.cancelled() or f.exception() is not None:
                return
            self._learn_ratio(plan.missing, f.result())
            tok.fill(plan, f.result())
            for fn in deferred.on_done:
                fn()

        future.add_done_callback(filled)
        return deferred

    def _learn_ratio(self, texts: Sequence[str], encoded: Sequence[Sequence[int]]) -> None:
        tokens = sum(len(ids) for ids in encoded)
        if tokens:
            ratio = sum(len(t) for t in texts) / tokens
            old = self.chars_per_token
            self.chars_per_token = ratio if old <= 0.0 else old + 0.2 * (ratio - old)

    def estimate_tokens(self, plan: Plan, head_ids: int, head_chars: int, known: int) -> int:
        """The prompt's length before the rest is tokenized: known ids plus the new text at the characters
        per token of the texts tokenized lately (before any, the head's)."""
        per_token = self.chars_per_token or (head_chars / head_ids if head_ids > 0 else 4.0)
        rest = plan.missing_chars - head_chars
        return known + head_ids + int(rest / max(per_token, 1.0))


def _first_new(plan: Plan) -> tuple[list[int], str] | None:
    """(the ids before the plan's first new piece, that piece), or None when nothing is new."""
    ids: list[int] = []
    for piece in plan.pieces:
        if isinstance(piece, str):
            return ids, piece
        ids += piece
    return None


def _chain(job: asyncio.Future[list[Sequence[int]]], future: asyncio.Future[list[Sequence[int]]]) -> None:
    if future.done():
        return
    if job.cancelled():
        future.cancel()
    elif (e := job.exception()) is not None:
        future.set_exception(e)
    else:
        future.set_result(job.result())
