"""The proxy handler: the request path as named steps, admit -> facts -> flow -> decide -> attempt -> relay.

- ``admit``: refuse early what cannot be routed (a body over the limit, one that does not parse, a key over
  its rate limit, full queues); else the request with its parsed facts (``RoutedRequest``).
- ``facts``: what the exact view knows (each endpoint's cached prefix, the exact prompt length) and the
  headers to forward.
- ``flow``: flow control (``lbd.router.flow``, unless --flow-control off): while the pool is saturated the
  request waits in the router, by priority band and fair share of its tenant, or is answered 429/503.
- ``decide``: a half-open endpoint's trial, else the policy's choice among the endpoints this request may go
  to (``lbd.policies.route``), or the client's refusal.
- ``attempt``: one try on the chosen endpoint; ``relay`` (``lbd.router.relay``) passes its answer through.

A response's status and headers reach the client only when the upstream's first body bytes do, so an upstream
that dies or answers 503 before that can still be retried on another endpoint ("before any byte reached the
client"); when no other endpoint can take it, the retry waits (within --retry-budget-s) for one to serve
again. Any other 5xx is the engine's answer to this request and goes back to the client as it is: a request
that makes every engine fail (a deterministic 500) is not replayed on every rank. A client that goes away
cancels the handler (``lbd.router.server`` cancels the task of a connection that closes): its slot is
released in ``finally`` and the upstream connection is closed, which makes the engine abort the request and
free its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable
from typing import TYPE_CHECKING

import orjson

from lbd.common.auth import ApiKey
from lbd.common.limits import PeerReadTooLarge, read_upstream
from lbd.policies import Decision, Refusal, route
from lbd.policies.filters import GATE
from lbd.router.admission import Admission
from lbd.router.auth import Gate
from lbd.router.endpoints import Endpoint
from lbd.router.flow.control import FlowControl
from lbd.router.headers import REQUEST_DROP, REQUEST_DROP_UNPINNED, TRACE_HEADERS, HeaderRewriter
from lbd.router.messages import Request, Response
from lbd.router.relay import Relay
from lbd.router.routed import Attempt, ClientGone, Failure, Refused, RoutedRequest
from lbd.router.state import RouterState
from lbd.router.upstream import Response as UpstreamResponse
from lbd.router.upstream import UpstreamError

if TYPE_CHECKING:
    from lbd.router.adapter_loader import AdapterLoader
    from lbd.router.disagg import Disagg
    from lbd.router.migration import Migrator
    from lbd.router.resumable import Move
    from lbd.router.tracing import RouterTracer, RouteTrace

log = logging.getLogger("lbd.router")

_WAIT_POLL_S = 0.05  # a retry waiting for an endpoint to serve again looks this often
_WAIT_GRACE_S = 1.0  # ... and gives up this soon when no endpoint is out (so none is coming back)
_JSON = b"Content-Type: application/json\r\n"
_ERROR_TYPES = {502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}


def send_error(
    out: Response, status: int, message: str, etype: str, param: str | None = None, headers: bytes = b""
) -> None:
    """An OpenAI-style error answer; ``headers``: extra serialized header lines."""
    body = orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": status}})
    out.send(status, _JSON + headers, body)


class Proxy:
    def __init__(self, state: RouterState, gate: Gate | None = None,
                 tracer: RouterTracer | None = None) -> None:
        self.state = state
        self.tracer = tracer
        self._headers = HeaderRewriter()
        self.relay = Relay(state, self._headers)
        self.cfg = state.cfg
        self.gate = gate
        self.loop = asyncio.get_running_loop()
        # Credentials: the router's own key for the engines replaces the client's; without one the client's
        # Authorization is passed on only with --forward-authorization.
        cfg = self.cfg
        key = cfg.upstream_api_key
        self._auth = b"Authorization: Bearer %s\r\n" % key.encode("latin-1") if key else b""
        drop_auth = frozenset({b"authorization"}) if key or not cfg.forward_authorization else frozenset()
        self._drop = REQUEST_DROP | drop_auth
        self._drop_unpinned = REQUEST_DROP_UNPINNED | drop_auth
        self._admission = Admission(state, gate, self.loop)
        self.flow: FlowControl | None = None  # flow control by tenant and priority (lbd.router.flow)
        if cfg.flow.mode != "off":
            self.flow = FlowControl(state.snapshots, cfg.stale_after_s, cfg.flow, state.shared.flows)
        # adapters loaded on demand (--lora-modules; lbd.router.adapter_loader): who may take one, the load
        self.adapters: AdapterLoader | None = None
        if cfg.lora_modules:
            from lbd.router.adapter_loader import AdapterLoader

            self.adapters = AdapterLoader(state, cfg.lora_modules, self._auth)
        self.disagg: Disagg | None = None
        if cfg.pd_disaggregation:  # only a P/D router loads the two stages (cold start)
            from lbd.router.disagg import Disagg

            self.disagg = Disagg(state)

    @functools.cached_property
    def migrator(self) -> Migrator:
        """Mid-stream migration, loaded with the first request that uses it (cold start)."""
        from lbd.router.migration import Migrator

        return Migrator(self.state, self.tracer)

    # ---- entry --------------------------------------------------------------------------------------
    def handle(self, request: Request, out: Response, key: ApiKey | None = None) -> Awaitable[None]:
        """Proxy one request; ``key``: the caller's API key (checked by the app), for its rate limits. Returns
        the handler's coroutine (untraced: no extra coroutine level, nothing allocated for tracing)."""
        if self.tracer is None:
            return self._handle(request, out, key, None)
        return self._traced(request, out, key, self.tracer)

    async def _traced(self, request: Request, out: Response, key: ApiKey | None,
                      tracer: RouterTracer) -> None:
        trace = tracer.start(request)
        try:
            await self._handle(request, out, key, trace)
        finally:
            tracer.end(trace, out.status)

    async def _handle(self, request: Request, out: Response, key: ApiKey | None,
                      trace: RouteTrace | None) -> None:
        """Admit, then route; a request its key's token limit charged settles on the output it got."""
        rr = self.admit(request, key, trace)
        if isinstance(rr, Refused):
            return self._refuse(out, rr)
        bill = rr.bill
        if bill is None:
            return await self._route(rr, out, key)
        out.meter = bill.meter  # what reaches the client settles its key's token charge (lbd.router.metering)
        try:
            await self._route(rr, out, key)
        finally:  # whatever ended it: a whole answer, a cut stream, the client gone (a cancelled task)
            move = rr.move
            bill.settle(self.loop.time(), len(move.out_ids) if move is not None else 0)

    async def _route(self, rr: RoutedRequest, out: Response, key: ApiKey | None = None) -> None:
        """The steps after admit: facts, then flow control (lbd.router.flow: it may hold the request while
        the pool is saturated, or answer instead), then the rest (``_send``)."""
        if self.cfg.migration_limit:
            self.migrator.prepare(rr)
        pending = self.facts(rr)
        if pending is not None:
            await pending
        flow = self.flow
        if flow is None:
            return await self._send(rr, out)
        ticket = await flow.enter(rr, out, key)
        if isinstance(ticket, Refused):
            return self._refuse(out, ticket)
        try:
            await self._send(rr, out)
        finally:  # whatever ended it: its tokens are served and charged to its flow
            flow.leave(ticket, rr.move)

    async def _send(self, rr: RoutedRequest, out: Response) -> None:
        """[P/D,] decide, attempt, and the retries: a try that failed before any byte reached the client is
        tried again elsewhere while --max-retries and --retry-budget-s allow; a broken stream moves."""
        if self.disagg is not None:
            await self.disagg.prepare(rr)
        failure: Failure | None = None
        for n in range(self.cfg.max_retries + 1):
            decision = self.decide(rr, n, failure is not None)
            if decision is None:  # a retry, and no endpoint can take it now: wait for one
                decision = await self._wait_for_endpoint(rr)
                if decision is None:
                    break
            elif isinstance(decision, Refused):
                return self._refuse(out, decision)
            # the request's LoRA adapter loaded there first, if it must be (lbd.router.adapter_loader)
            failure = None if self.adapters is None else await self.adapters.prepare(rr, decision)
            failure = failure or await self.attempt(rr, out, decision)
            if failure is None or not self._retry(rr, failure, decision, n):
                break
        if failure is not None:
            return self._failure_response(out, failure, rr.reply_headers)
        move = rr.move
        if move is not None and move.broken is not None:  # failed mid-stream: resume elsewhere
            await self.migrator.resume(self, rr, out)
        if move is not None and move.done:
            self._answered(rr, move)

    def _answered(self, rr: RoutedRequest, move: Move) -> None:
        """A whole streamed chat answer with its token ids: the exact view tokenizes it ahead of the
        conversation's next turn (lbd.router.kv.answers)."""
        exact = self.state.exact
        if exact is not None and move.kind == "chat" and move.impossible is None and move.ids_ok and rr.data:
            exact.answered(rr.facts, rr.data, move.out_ids)

    # ---- admit --------------------------------------------------------------------------------------
    def admit(self, request: Request, key: ApiKey | None = None,
              trace: RouteTrace | None = None) -> RoutedRequest | Refused:
        """The request with its id and parsed facts, or its refusal (lbd.router.admission)."""
        return self._admission.admit(request, key, trace)

    # ---- facts --------------------------------------------------------------------------------------
    def facts(self, rr: RoutedRequest) -> Awaitable[None] | None:
        """The exact view's facts: each exact endpoint's cached prefix and the exact prompt length (an
        awaitable while a long new prompt is tokenized off the event loop); and the headers to forward."""
        rr.headers = self._forward_headers(rr.request, rr.rid_header, trace=rr.trace)
        exact = self.state.exact
        if exact is not None and rr.data is not None:
            return exact.annotate(rr, rr.data)
        return None

    def _forward_headers(self, request: Request, rid_header: bytes, unpinned: bool = False,
                         trace: RouteTrace | None = None) -> bytes:
        """The client's headers for the upstream (lbd.router.headers; its credentials only as __init__ says),
        our request id, our key for the engines, our trace context."""
        drop = self._drop_unpinned if unpinned else self._drop
        if trace is None:
            return self._headers.request(request.headers, drop) + rid_header + self._auth
        return (self._headers.request(request.headers, drop | TRACE_HEADERS) + rid_header + self._auth
                + trace.lines)

    # ---- decide -------------------------------------------------------------------------------------
    def decide(self, rr: RoutedRequest, n: int, retrying: bool = False) -> Decision | Refused | None:
        """Where try ``n`` goes: a half-open endpoint's trial (first try only), else the policy's choice among
        the endpoints that are not full (--max-streams-per-endpoint) and did not fail this request. Refused:
        the client's answer. None: a retry found no endpoint (it may wait for one)."""
        state, cap, pd = self.state, self.cfg.max_streams_per_endpoint, rr.pd
        gate = GATE if pd is None else pd.gate
        trial = None
        if n == 0:
            # live in-flight counts (--max-streams-per-endpoint); a sample of a large fleet (policies.sample)
            snaps = state.snapshots_for(rr.facts)
            full = [e.key for e in snaps if e.inflight >= cap]  # (usually none)
            rr.exclude = []
            if gate is GATE:  # (a P/D decode stage's trial could be a rank of the other role)
                trial = state.outliers.trial_for(rr.facts)
        else:  # a retry: the endpoints as they are now, less those full at first and those that failed it
            snaps, full = state.snapshots(), rr.full
        if self.adapters is not None:  # ranks that could load the request's adapter on demand
            snaps = self.adapters.widen(rr.facts, snaps)
        if trial is not None:
            rr.snaps, rr.full = snaps, full
            decision: Decision | Refusal = Decision(state.snapshot(trial),
                                                    "half_open_trial", plugin="outlier")
        else:
            exclude = [*full, *rr.exclude] if n else full
            decision = route(state.policy, rr.facts, snaps, exclude, self.cfg.pin_fallback, gate)
            if n == 0:
                if isinstance(decision, Refusal) and len(snaps) < len(state.order):
                    # the sample could not serve it: decide over every endpoint
                    snaps = state.snapshots()
                    snaps = snaps if self.adapters is None else self.adapters.widen(rr.facts, snaps)
                    full = [e.key for e in snaps if e.inflight >= cap]
                    decision = route(state.policy, rr.facts, snaps, full, self.cfg.pin_fallback, gate)
                rr.snaps, rr.full = snaps, full
        if isinstance(decision, Refusal):
            return None if retrying else self._refusal(rr, decision)
        if rr.trace is not None:
            rr.trace.decided(self.cfg.policy, decision)
        rr.sent_to = decision.endpoint.key
        return decision

    def _refusal(self, rr: RoutedRequest, refusal: Refusal) -> Refused:
        """The policy's refusal as the client's answer (full endpoints: a 503 to retry in a second)."""
        self.state.metrics.decision(self.cfg.policy, refusal.reason)
        if rr.full and refusal.reason in ("retries_exhausted", "pin_failing"):
            cap = self.cfg.max_streams_per_endpoint
            return Refused(503, f"every endpoint that can take this request has {cap} requests in flight "
                           "(--max-streams-per-endpoint)", "ServiceUnavailableError", None,
                           rr.reply_headers + b"Retry-After: 1\r\n")
        return Refused(refusal.status, refusal.message, refusal.type, refusal.param, rr.reply_headers)

    async def _wait_for_endpoint(self, rr: RoutedRequest) -> Decision | None:
        """A retryable failure and no other endpoint can take the request now (e.g. an MoE group re-forming
        after a member died: every member is out until the group serves again): wait, within
        --retry-budget-s, for one to serve. An endpoint that failed this request counts again once it has
        been out and back (ejected or unroutable, then re-admitted). None: the budget ran out."""
        began = self.loop.time()
        deadline = rr.t0 + self.cfg.retry_budget_s
        exclude = rr.exclude
        while self.loop.time() < deadline:
            await asyncio.sleep(_WAIT_POLL_S)
            snaps = self.state.snapshots()
            snaps = snaps if self.adapters is None else self.adapters.widen(rr.facts, snaps)
            out = False
            for snap in snaps:
                if not snap.healthy or snap.draining:
                    out = True
                    if snap.key in exclude:
                        exclude.remove(snap.key)
            decision = route(self.state.policy, rr.facts, snaps, exclude, self.cfg.pin_fallback, rr.gate)
            if not isinstance(decision, Refusal):
                if rr.trace is not None:
                    rr.trace.decided(self.cfg.policy, decision)
                return decision
            # every endpoint is in and has failed this request: nothing to wait for (after a moment for
            # the supervisors' word that one of them is out)
            if decision.status != 503 or (not out and self.loop.time() - began > _WAIT_GRACE_S):
                return None
        return None

    def _retry(self, rr: RoutedRequest, failure: Failure, d: Decision, n: int) -> bool:
        """Whether try ``n`` (it failed) is tried again: retryable, tries and --retry-budget-s left. If so the
        endpoint it failed on is excluded (the retry's decision takes the snapshots again)."""
        out_of_budget = self.loop.time() - rr.t0 > self.cfg.retry_budget_s
        if not failure.retryable or n == self.cfg.max_retries or out_of_budget:
            return False
        self.state.metrics.retries.labels(failure.kind).inc()
        if rr.trace is not None:
            rr.trace.retries += 1
        rr.exclude.append(d.endpoint.key)
        log.info("request %s: %s on %s; retrying elsewhere", rr.request_id,
                 failure.kind, d.endpoint.key)
        return True

    # ---- attempt ------------------------------------------------------------------------------------
    async def attempt(self, rr: RoutedRequest, out: Response, d: Decision) -> Failure | None:
        """One try on ``d``'s endpoint: dispatch, send, relay the answer. None when an answer (or the start of
        one) reached the client; a Failure when nothing did."""
        state = self.state
        ep = state.endpoints.get(d.endpoint.key)
        pool = state.pools.get(d.endpoint.key)
        if ep is None or pool is None:  # removed between the snapshot and now
            return Failure(503, f"endpoint {d.endpoint.key} left", "upstream_gone", True)
        a, body, headers = self._dispatch(rr, ep, d)
        move = rr.move
        target = rr.request.raw_path
        if move is not None and move.resuming:  # a continuation (lbd.router.migration)
            body, target = move.body, move.path
        status = "client_gone"
        upstream: UpstreamResponse | None = None
        try:
            try:
                upstream = await pool.request(
                    rr.request.method, target, headers, body, self.cfg.response_timeout_s
                )
            except (UpstreamError, OSError) as e:  # (TimeoutError is an OSError)
                failure = self._unanswered(ep, e)
            else:
                if upstream.status == 503:
                    failure = await self._overloaded(ep, upstream)
                else:
                    if upstream.status >= 500:  # the engine's answer to this request: passed on as it is
                        state.fail(ep, "request", f"answered {upstream.status}")
                        state.metrics.upstream_errors.labels(ep.url, "5xx").inc()
                    else:
                        state.succeeded(ep, "request")
                    failure = await self.relay.relay(out, a, upstream, rr.reply_headers, move)
            status = str(failure.status if failure is not None else out.status)
            return failure
        except ClientGone:
            state.metrics.disconnects.labels(ep.url).inc()
            return None
        except asyncio.CancelledError:
            if a.abandoned and not a.started:  # the outlier check ejected the endpoint: try another
                a.task.uncancel()  # type: ignore[union-attr]
                status = "abandoned"
                return Failure(504, f"upstream {ep.url} sent no first byte and was ejected", "outlier", True)
            state.metrics.disconnects.labels(ep.url).inc()
            raise
        finally:
            self._attempt_over(rr, a, upstream, status)

    def _dispatch(self, rr: RoutedRequest, ep: Endpoint, d: Decision) -> tuple[Attempt, bytes, bytes]:
        """Count the request on ``ep`` (shared counters, the policy, the exact view's pending blocks, the
        outlier checks' waiting list); returns the attempt and the body and headers to send there."""
        state = self.state
        facts = rr.facts
        now = self.loop.time()
        a = Attempt(ep, d, int(state.policy.charge_tokens(facts, d.endpoint)), now, asyncio.current_task())
        state.shared.dispatch(ep.slot, a.charge)
        state.policy.on_dispatch(facts, ep.url)
        body = rr.forward_body
        if state.exact is not None and facts.block_keys is not None:
            a.pending = state.exact.dispatched(ep.url, rr, state.policy.on_chain_known)
            body = state.exact.body_for(ep.url, rr.request.path, rr.prompt_ids, body)  # ids, if ep takes them
        state.metrics.dispatched(self.cfg.policy, d.reason, now - rr.t0)
        state.outliers.sent(ep, a, now, trial=d.reason == "half_open_trial")
        headers = rr.headers
        if d.reason == "pin_fallback":  # the pinned rank is out: the header would make the other rank say 400
            headers = self._forward_headers(rr.request, rr.rid_header, unpinned=True, trace=rr.trace)
        return a, body, headers

    def _unanswered(self, ep: Endpoint, e: Exception) -> Failure:
        """No response headers: a timeout (not retried: the request may be running there) or a connection
        that failed or closed (retried)."""
        if isinstance(e, TimeoutError):
            self.state.fail(ep, "request", "no response headers in time")
            timeout = self.cfg.response_timeout_s
            return Failure(504, f"upstream {ep.url} sent no response headers within {timeout:g}s "
                           "(--response-timeout-s)", "response_timeout", False)
        kind = "upstream_gone" if isinstance(e, UpstreamError) else "connect"
        self.state.fail(ep, "request", f"{kind}: {e}")
        self.state.metrics.upstream_errors.labels(ep.url, kind).inc()
        return Failure(502, f"upstream {ep.url} failed: {e}", kind, True)

    async def _overloaded(self, ep: Endpoint, upstream: UpstreamResponse) -> Failure:
        """A 503: admission control (queue limits), a draining rank or a dead core; back-pressure, not a
        health signal, and retryable (the request never started there)."""
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                data = await read_upstream(upstream, what=f"{ep.url}'s 503 answer")
        except (TimeoutError, UpstreamError, PeerReadTooLarge):
            data = b""
        self.state.metrics.upstream_errors.labels(ep.url, "503").inc()
        ctype = upstream.content_type or "application/json"
        return Failure(503, f"upstream {ep.url} answered 503", "overloaded", True, data or None, ctype)

    def _attempt_over(self, rr: RoutedRequest, a: Attempt, upstream: UpstreamResponse | None,
                      status: str) -> None:
        """Release what the attempt holds, whatever ended it."""
        state = self.state
        ep = a.ep
        if upstream is not None:
            upstream.close()  # gives a fully read connection back to the pool, closes any other
        if not a.started:
            state.shared.start(ep.slot, a.charge)
            if a.pending is not None:
                state.exact.settle(a.pending, False)  # type: ignore[union-attr]
        state.outliers.ended(ep, a)
        state.shared.finish(ep.slot)
        state.metrics.request(ep.url, status, self.loop.time() - rr.t0)

    # ---- answers instead of an upstream's --------------------------------------------------------------
    def _refuse(self, out: Response, r: Refused) -> None:
        self.state.metrics.request("none", str(r.status), None)
        send_error(out, r.status, r.message, r.type, r.param, r.headers)

    def _failure_response(self, out: Response, f: Failure, headers: bytes) -> None:
        if f.body is not None:
            out.send(
                f.status, b"%sContent-Type: %s\r\n" % (headers, f.content_type.encode("latin-1")), f.body
            )
            return
        send_error(out, f.status, f.message, _ERROR_TYPES.get(f.status, "InternalServerError"), None, headers)
