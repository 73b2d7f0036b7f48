"""Admission over the whole deployment: vLLM's ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` as its
internal load balancer applies them, across every rank the router sends to.

vLLM's front end counts its unfinished requests (waiting + running) and refuses one more past the limit, and
refuses while the prompts still in prefill add up to the token limit; both answer 503 so that clients and
balancers retry elsewhere. Here the router's own counters play that part, summed over every endpoint and
every router worker (the shared counters): in flight = dispatched - finished; the prefill backlog = the
estimated prompt tokens of requests that have not answered a first byte yet. Each request counts as one
(vLLM counts ``n`` > 1 as n; the router does not parse ``n``). Like vLLM's, the limit is approximate across
worker processes: two workers deciding in the same instant can both admit.
"""

from __future__ import annotations

from lbd.router.state import RouterState

# vLLM's own messages (vllm/exceptions.py: QueueOverflowError, MaxQueuedTokensError), so clients that match
# on them keep working.
QUEUE_FULL = ("The engine is currently busy and cannot accept new requests. "
              "Please try again later or on a different instance.")
TOKENS_FULL = ("The engine has reached its prefill token backlog limit. "
               "Please try again later or on a different instance.")


def admits(path: str) -> bool:
    """Requests that become engine requests (not /tokenize, /detokenize or the router's own paths)."""
    return path.startswith("/v1/")


def refusal(state: RouterState) -> tuple[str, str] | None:
    """(reason label, message) when a new request must get 503; None to admit it."""
    cfg = state.cfg
    max_reqs, max_tokens = cfg.max_num_queued_reqs, cfg.max_num_queued_tokens
    if max_reqs is None and max_tokens is None:
        return None
    inflight = backlog = 0
    for ep in state.order:
        d, f, _, dt, st = state.shared.sums(ep.slot)
        inflight += d - f
        backlog += dt - st
    if max_reqs is not None and inflight + 1 > max_reqs:
        return "max_num_queued_reqs", QUEUE_FULL
    if max_tokens is not None and backlog >= max_tokens:
        return "max_num_queued_tokens", TOKENS_FULL
    return None
