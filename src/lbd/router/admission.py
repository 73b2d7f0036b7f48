"""The request path's first step, ``Admission.admit``: refuse early what cannot be routed, else the request
with its id and parsed facts.

Admission over the whole deployment (``refusal``) applies vLLM's ``--max-num-queued-reqs`` /
``--max-num-queued-tokens`` as its internal load balancer does, across every rank the router sends to.

vLLM's front end counts its unfinished requests (waiting + running) and refuses one more past the limit, and
refuses while the prompts still in prefill add up to the token limit; both answer 503 so that clients and
balancers retry elsewhere. Here the router's own counters play that part, summed over every endpoint and
every router worker (the shared counters): in flight = dispatched - finished; the prefill backlog = the
estimated prompt tokens of requests that have not answered a first byte yet. Each request counts as one
(vLLM counts ``n`` > 1 as n; the router does not parse ``n``). Like vLLM's, the limit is approximate across
worker processes: two workers deciding in the same instant can both admit.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from typing import TYPE_CHECKING

from lbd.common.auth import ApiKey
from lbd.policies import RequestFacts
from lbd.router.auth import Gate, requested_tokens, retry_after
from lbd.router.facts import BadRequest, parse_request, path_facts
from lbd.router.kv.forward import FIELD as FORWARDED_IDS
from lbd.router.kv.forward import strip_client_copy
from lbd.router.messages import Request
from lbd.router.metering import Bill
from lbd.router.routed import Refused, RoutedRequest
from lbd.router.state import RouterState

if TYPE_CHECKING:
    from lbd.router.tracing import RouteTrace

# vLLM's own messages (vllm/exceptions.py: QueueOverflowError, MaxQueuedTokensError), so clients that match
# on them keep working.
QUEUE_FULL = ("The engine is currently busy and cannot accept new requests. "
              "Please try again later or on a different instance.")
TOKENS_FULL = ("The engine has reached its prefill token backlog limit. "
               "Please try again later or on a different instance.")

# a client's kv_transfer_params would steer a rank's KV leases and pulls (ARCHITECTURE.md, "P/D trust model")
CLIENT_KV_PARAMS = ("kv_transfer_params are set by the router's prefill/decode stages, never by a client: "
                    "drop the field (a trusted proxy that runs vLLM's two stages itself talks to the ranks)")


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


class Admission:
    """Admits one router worker's requests: request ids, parsing, the keys' rate limits, the queue limits."""

    def __init__(self, state: RouterState, gate: Gate | None, loop: asyncio.AbstractEventLoop) -> None:
        self.state = state
        self.cfg = state.cfg
        self.gate = gate
        self.loop = loop
        self._hash_prefix = state.policy.uses_prefix_hashes
        # Request ids: 32 hex digits like uuid4().hex, a random per-process half and a counter (a uuid4 per
        # request costs more than the rest of the id handling together).
        self._rid_prefix = os.urandom(8).hex().encode()
        self._rid_count = itertools.count()
        self._queue_limits = (self.cfg.max_num_queued_reqs, self.cfg.max_num_queued_tokens) != (None, None)

    def admit(self, request: Request, key: ApiKey | None = None,
              trace: RouteTrace | None = None) -> RoutedRequest | Refused:
        """Refuse early what cannot be routed: a body over --max-request-body-bytes (413), one that does not
        parse (400), ``key`` over its rate limit (429), full deployment queues (503). Else the request with
        its id, arrival time and parsed facts."""
        t0 = self.loop.time()
        rid = request.headers.get("X-Request-Id")
        if rid:
            rid_header = b"X-Request-Id: %s\r\n" % rid.encode("latin-1")  # headers decode as latin-1
        else:
            rid_header = b"X-Request-Id: %s%016x\r\n" % (self._rid_prefix, next(self._rid_count))
        if request.too_large:
            limit = self.cfg.max_request_body_bytes
            size = f"of {request.content_length} bytes " if request.content_length is not None else ""
            message = f"request body {size}is over the {limit}-byte limit (--max-request-body-bytes)"
            return Refused(413, message, "RequestTooLargeError", None, rid_header)
        body = request.body
        try:
            if request.method == "POST":
                exact = self.state.exact
                # text prefix hashes: only for a policy that reads them and lacks exact views of all
                text = self._hash_prefix and (
                    exact is None or not (self.state.policy.exact_aware and exact.complete()))
                facts, data = parse_request(body, request.headers, self.cfg.session_header, text)
            else:
                facts, data = path_facts(request.path, request.headers), None
        except BadRequest as e:
            return Refused(400, e.message, "BadRequestError", e.param, rid_header)
        if data is not None and data.get("kv_transfer_params") is not None:  # P/D's own (lbd.router.disagg)
            return Refused(400, CLIENT_KV_PARAMS, "BadRequestError", "kv_transfer_params", rid_header)
        if data is not None and FORWARDED_IDS in data:  # only the router's own (signed) ids reach a rank
            body = strip_client_copy(data)
        bill = None
        if key is not None and self.gate is not None and self.gate.limits_on:
            limited = self._rate_limit(request, key, facts, t0, rid_header)
            if isinstance(limited, Refused):
                return limited
            bill = limited
        if self._queue_limits and request.method == "POST" and admits(request.path):
            queues_full = refusal(self.state)
            if queues_full is not None:
                self.state.metrics.decision(self.cfg.policy, queues_full[0])
                if bill is not None:  # nothing will be produced
                    bill.settle(t0)
                return Refused(503, queues_full[1], "ServiceUnavailableError", None, rid_header)
        rr = RoutedRequest(request, body, rid_header, t0, facts, data, trace)
        rr.bill = bill
        return rr

    def _rate_limit(self, request: Request, key: ApiKey, facts: RequestFacts, t0: float,
                    rid_header: bytes) -> Refused | Bill | None:
        """The key's request and token rate limits (lbd.router.auth): its refusal, or, for a request that
        generates under a token limit, the bill its answer's output settles (lbd.router.metering)."""
        assert self.gate is not None
        output = requested_tokens(request.body, request.path) if self.gate.counts_tokens else 0
        tokens = facts.prompt_tokens + output
        wait = self.gate.admit(key, tokens, t0)
        if wait <= 0.0:
            bucket = self.gate.token_bucket(key) if output else None
            return Bill(bucket, output) if bucket is not None else None
        self.state.metrics.rate_limited.labels(key.name).inc()
        after = retry_after(wait)
        message = f"rate limit of API key {key.name} exceeded: retry in {after} s"
        return Refused(429, message, "RateLimitError", None, rid_header + b"Retry-After: %d\r\n" % after)
