"""What a routing decision sees (request facts, endpoint snapshots) and returns (a Decision).

Decisions are pure: no I/O and no clock reads. Everything time-dependent (the age of a scrape) arrives
already computed in the snapshot; randomness comes from a seeded generator a plugin owns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class RequestFacts:
    """What the router parsed out of one request. Treat as read-only; not frozen because a frozen
    dataclass's __init__ costs three times as much (every request).

    ``cached_tokens`` is exact where the router follows an endpoint's KV-cache events: the prompt tokens that
    endpoint holds in its prefix cache, by endpoint key (then ``prompt_tokens`` is exact too). Endpoints
    missing from it (or all, when it is None) are judged by the approximate text-prefix index."""

    model: str | None = None
    prefix_hashes: tuple[int, ...] = ()  # chained hashes of fixed-size chunks of the request text
    session_key: str | None = None
    pinned_rank: int | None = None
    prompt_tokens: int = 0  # estimate (characters / 4), or exact when the router tokenized the request
    cached_tokens: dict[str, int] | None = None
    # of cached_tokens, the part only pending there: blocks the router sent that endpoint to compute whose
    # KV events have not come yet (a request still in prefill there computes them); absent: none
    pending_tokens: dict[str, int] | None = None
    block_keys: dict[int, list[int]] | None = None  # the prompt's KV block chain per block size (exact view)
    chain_partial: bool = False  # block_keys is only the head of the chain (routed on its head: kv.cold)
    # endpoints to pass over while another is left (the gate's ``avoid``): the ranks flow control finds
    # crowded with this request's class when it lets it through to preempt (lbd.router.flow)
    avoid: frozenset[str] = frozenset()


@dataclass(slots=True, frozen=True)
class LoraView:
    """Where one rank's LoRA adapters are (issue 44): the names resident in its device slots and in its CPU
    cache, its free slots, its slot count, and whether the view is complete (``exact``: lbd's engines report
    every resident adapter; vLLM's ``lora_requests_info`` names only adapters with running or waiting
    requests, so an idle resident adapter looks absent there and ``free_slots`` is only a bound). ``known``:
    every adapter the rank serves (its /v1/models cards with a ``parent``, and what its telemetry names).
    ``load_s``: the rank's mean adapter load time in seconds, as it reports it (0: not reported). ``busy``:
    adapters with running or waiting requests there (in a slot, or on their way to one). ``evicts``: the
    adapter a load there would take a slot from ("" none: a slot is free or every one is in use; None: not
    reported, as on vLLM)."""

    device: frozenset[str] = frozenset()
    cpu: frozenset[str] = frozenset()
    free_slots: int = 0
    max_loras: int = 0
    exact: bool = True
    known: frozenset[str] = frozenset()
    load_s: float = 0.0
    busy: frozenset[str] = frozenset()
    evicts: str | None = None


@dataclass(slots=True)
class EndpointSnapshot:
    """One rank endpoint as the router sees it at decision time.

    ``running``/``waiting``/``kv_usage`` come from the last scrape, ``age_s`` old (inf: never scraped).
    ``delta`` is the router's net dispatches since that scrape began (dispatched minus finished, over every
    router worker), so a burst between scrapes is counted. ``inflight`` is exact router-side in-flight;
    ``unstarted``/``unstarted_tokens`` are the router's requests there that have not produced a byte yet.
    """

    key: str
    rank: int | None = None
    models: frozenset[str] = frozenset()
    healthy: bool = True
    draining: bool = False
    inflight: int = 0
    delta: int = 0
    unstarted: int = 0
    unstarted_tokens: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    prefix_hit_rate: float = 0.0
    block_size: int = 16
    num_blocks: int = 0
    age_s: float = math.inf
    telemetry_seq: int = 0  # telemetry samples taken in from it (scrapes or pushes): which view is newer
    tokens_per_s: float = 0.0  # prompt + generated tokens per second (lbd.common.throughput)
    offered_tokens_per_s: float | None = None  # of the work arriving there (the same); None: not known
    role: str = "mixed"  # prefill, decode or mixed (P/D: --prefill/--decode, or a supervisor's /status)
    lora: LoraView | None = None  # its adapters (--enable-lora ranks' telemetry); None: none reported

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models

    def fresh(self, stale_s: float) -> bool:
        return self.age_s <= stale_s


@dataclass(slots=True)
class Decision:
    """The chosen endpoint, a low-cardinality ``reason`` (a metric label), the ``plugin`` that decided and a
    human ``detail`` line.

    ``detail`` may be a function that builds the line: most decisions are never explained to anyone (only
    ``--debug-headers`` and logs read it), and formatting the numbers on every request costs more than the
    rest of a cheap policy's decision."""

    endpoint: EndpointSnapshot
    reason: str
    detail: str | Callable[[], str] = ""
    cost_tokens: float = 0.0  # predicted_ttft: prefill tokens it expected ahead of and in this request
    predicted_s: float = 0.0
    plugin: str = ""  # the registered name of the filter, scorer or picker that decided
    # predicted_ttft: what the estimate was made of on the chosen endpoint (prefill tokens, running requests,
    # requests queued ahead), for the learning hook to weigh against the first byte's time
    load: tuple[float, float, float] | None = None

    def explain(self) -> str:
        """The detail line (built now if it was deferred)."""
        if callable(self.detail):
            self.detail = self.detail()
        return self.detail

    def line(self) -> str:
        """``reason (plugin): detail``: the x-lbd-route-reason header."""
        detail = self.explain()
        head = f"{self.reason} ({self.plugin})" if self.plugin else self.reason
        return f"{head}: {detail}" if detail else head


def queue_score(ep: EndpointSnapshot, stale_s: float) -> float:
    """vLLM's internal-LB score (waiting x 4 + running) plus the router's net dispatches since the scrape.

    With stale or missing telemetry only the router's exact in-flight count is trusted.
    """
    if not ep.fresh(stale_s):
        return float(ep.inflight)
    return max(0.0, 4.0 * ep.waiting + ep.running + ep.delta, float(ep.inflight))


def queue_scores(endpoints: Sequence[EndpointSnapshot], stale_s: float) -> list[float]:
    """The scorer most policies start from: ``queue_score`` per endpoint."""
    return [queue_score(e, stale_s) for e in endpoints]


@dataclass(slots=True, frozen=True)
class Refusal:
    """No endpoint can take the request: the HTTP status and message the client gets, and a metric label."""

    status: int
    message: str
    reason: str  # metric label
    type: str = "ServiceUnavailableError"
    param: str | None = None
