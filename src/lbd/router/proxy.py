"""The proxy handler: read the body once (bounded), decide, forward, pass the answer through chunk by chunk.

A response's status and headers reach the client only when the upstream's first body bytes do, so an upstream
that dies or answers 503 before that can still be retried on another endpoint ("before any byte reached the
client"); when no other endpoint can take it, the retry waits (within --retry-budget-s) for one to serve
again. Any other 5xx is the engine's answer to this request and goes back to the client as it is: a request
that makes every engine fail (a deterministic 500) is not replayed on every rank. Once a byte went out, no
retry: a failure mid-stream ends the stream with a clear error (an SSE error event, or a cut connection for a
sized body). A client that goes away cancels the handler (``lbd.router.server`` cancels the task of a
connection that closes): its slot is released in ``finally`` and the upstream connection is closed, which
makes the engine abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from lbd.common.auth import ApiKey
from lbd.common.limits import PeerReadTooLarge, read_upstream
from lbd.policies import Decision, Refusal, RequestFacts, route
from lbd.router import admission
from lbd.router.auth import Gate, requested_tokens, retry_after
from lbd.router.endpoints import Endpoint
from lbd.router.facts import BadRequest, parse_request, path_facts
from lbd.router.headers import REQUEST_DROP, REQUEST_DROP_UNPINNED, TRACE_HEADERS, HeaderRewriter
from lbd.router.kv.forward import FIELD as FORWARDED_IDS
from lbd.router.kv.forward import strip_client_copy
from lbd.router.messages import Request, Response, serialize_headers
from lbd.router.state import RouterState
from lbd.router.upstream import Response as UpstreamResponse
from lbd.router.upstream import UpstreamError

if TYPE_CHECKING:
    from lbd.router.tracing import RouterTracer, RouteTrace

log = logging.getLogger("lbd.router")

_WAIT_POLL_S = 0.05  # a retry waiting for an endpoint to serve again looks this often
_WAIT_GRACE_S = 1.0  # ... and gives up this soon when no endpoint is out (so none is coming back)
_SMALL_BODY = 1 << 20  # sized answers up to this are read whole and sent in one write
_JSON = b"Content-Type: application/json\r\n"


def send_error(
    out: Response, status: int, message: str, etype: str, param: str | None = None, headers: bytes = b""
) -> None:
    """An OpenAI-style error answer; ``headers``: extra serialized header lines."""
    body = orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": status}})
    out.send(status, _JSON + headers, body)


@dataclass(slots=True)
class Failure:
    """An attempt that failed before any byte reached the client."""

    status: int
    message: str
    kind: str  # metric label: connect, upstream_gone, overloaded, upstream_5xx, response_timeout
    retryable: bool
    body: bytes | None = None  # an upstream's own error body, passed through if no retry is left
    content_type: str = "application/json"


class Proxy:
    def __init__(self, state: RouterState, gate: Gate | None = None,
                 tracer: RouterTracer | None = None) -> None:
        self.state = state
        self.tracer = tracer
        self._hash_prefix = state.policy.uses_prefix_hashes
        self._headers = HeaderRewriter()
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
        # Request ids: 32 hex digits like uuid4().hex, a random per-process half and a counter (a uuid4 per
        # request costs more than the rest of the id handling together).
        self._rid_prefix = os.urandom(8).hex().encode()
        self._rid_count = itertools.count()
        self._admission = (self.cfg.max_num_queued_reqs, self.cfg.max_num_queued_tokens) != (None, None)

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
        t0 = self.loop.time()
        rid = request.headers.get("X-Request-Id")
        if rid:
            rid_header = b"X-Request-Id: %s\r\n" % rid.encode("latin-1")  # headers decode as latin-1
        else:
            rid_header = b"X-Request-Id: %s%016x\r\n" % (self._rid_prefix, next(self._rid_count))
        if request.too_large:
            limit = self.cfg.max_request_body_bytes
            size = f"of {request.content_length} bytes " if request.content_length is not None else ""
            return self._refuse(
                out,
                413,
                f"request body {size}is over the {limit}-byte limit (--max-request-body-bytes)",
                "RequestTooLargeError",
                rid_header,
            )
        body = request.body
        exact = self.state.exact
        try:
            if request.method == "POST":
                # text prefix hashes: only for a policy that reads them and lacks exact views of all
                text = self._hash_prefix and (
                    exact is None or not (self.state.policy.exact_aware and exact.complete()))
                facts, data = parse_request(body, request.headers, self.cfg.session_header, text)
            else:
                facts, data = path_facts(request.path, request.headers), None
        except BadRequest as e:
            return self._refuse(out, 400, e.message, "BadRequestError", rid_header, e.param)
        if data is not None and FORWARDED_IDS in data:  # only the router's own (signed) ids reach a rank
            body = strip_client_copy(data)
        if key is not None and self.gate is not None and self.gate.limits_on:
            tokens = facts.prompt_tokens + (requested_tokens(body) if self.gate.counts_tokens else 0)
            wait = self.gate.admit(key, tokens, t0)
            if wait > 0.0:
                self.state.metrics.rate_limited.labels(key.name).inc()
                after = retry_after(wait)
                return self._refuse(
                    out, 429, f"rate limit of API key {key.name} exceeded: retry in {after} s",
                    "RateLimitError", rid_header + b"Retry-After: %d\r\n" % after,
                )
        if self._admission and request.method == "POST" and admission.admits(request.path):
            refused = admission.refusal(self.state)
            if refused is not None:
                self.state.metrics.decision(self.cfg.policy, refused[0])
                return self._refuse(out, 503, refused[1], "ServiceUnavailableError", rid_header)
        if exact is not None and data is not None:
            pending = exact.annotate(facts, data)  # exact cached lengths from the engines' KV events
            if pending is not None:
                await pending
        headers = self._forward_headers(request, rid_header, trace=trace)
        snaps = self.state.snapshots()  # live in-flight counts: --max-streams-per-endpoint needs them
        cap = self.cfg.max_streams_per_endpoint
        exclude = [e.key for e in snaps if e.inflight >= cap]  # full (usually none)
        full = len(exclude)
        failure: Failure | None = None
        for attempt in range(self.cfg.max_retries + 1):
            trial = self.state.outliers.trial_for(facts) if attempt == 0 else None
            if trial is not None:
                decision: Decision | Refusal = Decision(
                    trial.snapshot(self.state.shared, self.loop.time()), "half_open_trial"
                )
            else:
                decision = route(self.state.policy, facts, snaps, exclude, self.cfg.pin_fallback)
            if isinstance(decision, Refusal):
                if failure is None:
                    self.state.metrics.decision(self.cfg.policy, decision.reason)
                    if full and decision.reason in ("retries_exhausted", "pin_failing"):
                        return self._refuse(
                            out, 503, f"every endpoint that can take this request has {cap} requests in "
                            "flight (--max-streams-per-endpoint)", "ServiceUnavailableError",
                            rid_header + b"Retry-After: 1\r\n",
                        )
                    return self._refuse(
                        out, decision.status, decision.message, decision.type, rid_header, decision.param
                    )
                decision = await self._wait_for_endpoint(facts, exclude, t0)
                if decision is None:
                    break
            if trace is not None:
                trace.decided(self.cfg.policy, decision)
            failure = await self._attempt(request, out, decision, facts, body, headers, rid_header, t0, trace)
            if failure is None:
                return
            out_of_budget = self.loop.time() - t0 > self.cfg.retry_budget_s
            if not failure.retryable or attempt == self.cfg.max_retries or out_of_budget:
                break
            self.state.metrics.retries.labels(failure.kind).inc()
            if trace is not None:
                trace.retries += 1
            exclude.append(decision.endpoint.key)
            snaps = self.state.snapshots()
            log.info(
                "request %s: %s on %s; retrying elsewhere",
                rid_header[14:-2].decode("latin-1"),
                failure.kind,
                decision.endpoint.key,
            )
        assert failure is not None
        self._failure_response(out, failure, rid_header)

    async def _wait_for_endpoint(self, facts: RequestFacts, exclude: list[str], t0: float) -> Decision | None:
        """A retryable failure and no other endpoint can take the request now (e.g. an MoE group re-forming
        after a member died: every member is out until the group serves again): wait, within
        --retry-budget-s, for one to serve. An endpoint that failed this request counts again once it has
        been out and back (ejected or unroutable, then re-admitted). None: the budget ran out."""
        began = self.loop.time()
        deadline = t0 + self.cfg.retry_budget_s
        while self.loop.time() < deadline:
            await asyncio.sleep(_WAIT_POLL_S)
            snaps = self.state.snapshots()
            out = False
            for snap in snaps:
                if not snap.healthy or snap.draining:
                    out = True
                    if snap.key in exclude:
                        exclude.remove(snap.key)
            decision = route(self.state.policy, facts, snaps, exclude, self.cfg.pin_fallback)
            if not isinstance(decision, Refusal):
                return decision
            # every endpoint is in and has failed this request: nothing to wait for (after a moment for
            # the supervisors' word that one of them is out)
            if decision.status != 503 or (not out and self.loop.time() - began > _WAIT_GRACE_S):
                return None
        return None

    def _refuse(
        self, out: Response, status: int, message: str, etype: str, headers: bytes, param: str | None = None
    ) -> None:
        self.state.metrics.request("none", str(status), None)
        send_error(out, status, message, etype, param, headers)

    def _failure_response(self, out: Response, f: Failure, headers: bytes) -> None:
        if f.body is not None:
            out.send(
                f.status, b"%sContent-Type: %s\r\n" % (headers, f.content_type.encode("latin-1")), f.body
            )
            return
        etype = {502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
        send_error(out, f.status, f.message, etype.get(f.status, "InternalServerError"), None, headers)

    def _forward_headers(self, request: Request, rid_header: bytes, unpinned: bool = False,
                         trace: RouteTrace | None = None) -> bytes:
        """The client's headers for the upstream (lbd.router.headers; its credentials only as __init__ says),
        our request id, our key for the engines, our trace context."""
        drop = self._drop_unpinned if unpinned else self._drop
        if trace is None:
            return self._headers.request(request.headers, drop) + rid_header + self._auth
        return (self._headers.request(request.headers, drop | TRACE_HEADERS) + rid_header + self._auth
                + trace.lines)

    # ---- one try on one endpoint --------------------------------------------------------------------
    async def _attempt(
        self,
        request: Request,
        out: Response,
        d: Decision,
        facts: RequestFacts,
        body: bytes,
        headers: bytes,
        rid_header: bytes,
        t0: float,
        trace: RouteTrace | None,
    ) -> Failure | None:
        """None when an answer (or the start of one) reached the client."""
        state = self.state
        ep = state.endpoints.get(d.endpoint.key)
        pool = state.pools.get(d.endpoint.key)
        if ep is None or pool is None:  # removed between the snapshot and now
            return Failure(503, f"endpoint {d.endpoint.key} left", "upstream_gone", True)
        now = self.loop.time()
        a = _Attempt(ep, d, int(state.policy.charge_tokens(facts, d.endpoint)), now, asyncio.current_task())
        state.shared.dispatch(ep.slot, a.charge)
        state.policy.on_dispatch(facts, ep.url)
        if state.exact is not None and facts.block_keys is not None:
            a.pending = state.exact.dispatched(ep.url, facts)
            body = state.exact.body_for(ep.url, request.path, facts.prompt_ids, body)  # ids, if ep takes them
        state.metrics.dispatched(self.cfg.policy, d.reason, now - t0)
        ep.waiting[a] = now
        if d.reason == "half_open_trial":
            ep.trial = a
        status = "client_gone"
        upstream: UpstreamResponse | None = None
        if d.reason == "pin_fallback":  # the pinned rank is out: the header would make the other rank say 400
            headers = self._forward_headers(request, rid_header, unpinned=True, trace=trace)
        try:
            try:
                upstream = await pool.request(
                    request.method, request.raw_path, headers, body, self.cfg.response_timeout_s
                )
            except TimeoutError:
                state.fail(ep, "request", "no response headers in time")
                status = "504"
                return Failure(
                    504,
                    f"upstream {ep.url} sent no response headers within "
                    f"{self.cfg.response_timeout_s:g}s (--response-timeout-s)",
                    "response_timeout",
                    False,
                )
            except (UpstreamError, OSError) as e:
                kind = "upstream_gone" if isinstance(e, UpstreamError) else "connect"
                state.fail(ep, "request", f"{kind}: {e}")
                state.metrics.upstream_errors.labels(ep.url, kind).inc()
                status = "502"
                return Failure(502, f"upstream {ep.url} failed: {e}", kind, True)
            if upstream.status == 503:
                failure = await self._overloaded(ep, upstream)
                status = "503"
                return failure
            if upstream.status >= 500:
                state.fail(ep, "request", f"answered {upstream.status}")
                state.metrics.upstream_errors.labels(ep.url, "5xx").inc()
            else:
                ep.record_success("request")
            failure = await self._relay(out, a, upstream, rid_header)
            status = str(failure.status if failure is not None else out.status)
            return failure
        except _ClientGone:
            state.metrics.disconnects.labels(ep.url).inc()
            return None
        except asyncio.CancelledError:
            if a.abandoned and not a.started:  # the outlier check ejected the endpoint: try another
                a.task.uncancel()  # type: ignore[union-attr]
                status = "abandoned"
                return Failure(
                    504, f"upstream {ep.url} sent no first byte and was ejected", "outlier", True
                )
            state.metrics.disconnects.labels(ep.url).inc()
            raise
        finally:
            if upstream is not None:
                upstream.close()  # gives a fully read connection back to the pool, closes any other
            if not a.started:
                state.shared.start(ep.slot, a.charge)
                if a.pending is not None:
                    state.exact.settle(a.pending, False)  # type: ignore[union-attr]
            state.outliers.ended(ep, a)
            state.shared.finish(ep.slot)
            state.metrics.request(ep.url, status, self.loop.time() - t0)

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

    def _response_headers(self, upstream: UpstreamResponse, d: Decision, rid_header: bytes) -> bytes:
        """The upstream's headers for the client (lbd.router.headers), plus ours."""
        parts = self._headers.response(upstream.raw_headers)
        parts.append(rid_header)
        if self.cfg.debug_headers:
            extra = (("x-lbd-endpoint", d.endpoint.key), ("x-lbd-route-reason", d.line()))
            parts.append(serialize_headers(extra))
        return b"".join(parts)

    async def _relay(
        self, out: Response, a: _Attempt, upstream: UpstreamResponse, rid_header: bytes
    ) -> Failure | None:
        """Pass the answer through; a failure before its first byte is still retryable."""
        idle = self.cfg.stream_idle_timeout_s
        length = upstream.content_length
        # sized and small, or already whole (a 204 or 304 has no body: it must not be sent as a chunked one)
        small = (length is not None and length <= _SMALL_BODY and not upstream.chunked) or upstream.complete
        try:
            first = upstream.take_whole() if small else None
            if first is None:
                first = await (upstream.read(idle) if small else upstream.read_chunk(idle))
        except (UpstreamError, TimeoutError) as e:
            gone = not isinstance(e, TimeoutError)
            self.state.fail(a.ep, "request", f"{type(e).__name__} before the first byte")
            what = (
                "closed the connection" if gone else f"sent nothing for {idle:g}s (--stream-idle-timeout-s)"
            )
            return Failure(
                502 if gone else 504,
                f"upstream {a.ep.url} {what} before the first byte",
                "upstream_gone" if gone else "stream_idle_timeout",
                gone,
            )
        a.started = True
        self.state.outliers.answered(a.ep, a, self.loop.time())
        self.state.shared.start(a.ep.slot, a.charge)
        if a.pending is not None:
            self.state.exact.settle(a.pending, True)  # type: ignore[union-attr]
        if not small and "text/event-stream" in upstream.content_type:
            # only a stream's first event is a time to first token (a whole answer includes its decode)
            self.state.policy.on_first_byte(a.decision, self.loop.time() - a.dispatched_at)
        headers = self._response_headers(upstream, a.decision, rid_header)
        try:
            if small:
                out.send(upstream.status, headers, first)
                return None
            out.start(upstream.status, headers, length)
        except ConnectionResetError:
            raise _ClientGone() from None
        await self._pump(out, upstream, first, a.ep.url, idle)
        return None

    async def _pump(
        self, out: Response, upstream: UpstreamResponse, chunk: bytes, url: str, idle: float
    ) -> None:
        """Copy the stream; a gap of ``idle`` s (waiting on the upstream or on a slow client) ends it."""
        task = asyncio.current_task()
        assert task is not None
        dog = _Watchdog(self.loop, idle, task)
        try:
            while chunk:
                try:
                    await out.write(chunk)
                except ConnectionResetError:
                    raise _ClientGone() from None
                dog.last = self.loop.time()
                chunk = await upstream.read_chunk()
        except asyncio.CancelledError:
            if not dog.fired:
                raise
            task.uncancel()
            await self._end_broken_stream(out, upstream, url, TimeoutError())
            return
        except UpstreamError as e:
            await self._end_broken_stream(out, upstream, url, e)
            return
        finally:
            dog.cancel()
        try:
            out.end()
        except ConnectionResetError:
            raise _ClientGone() from None

    async def _end_broken_stream(
        self, out: Response, upstream: UpstreamResponse, url: str, e: BaseException
    ) -> None:
        """After bytes went out no retry is possible: end the stream with a clear error."""
        what = "stalled" if isinstance(e, TimeoutError) else "failed"
        self.state.metrics.upstream_errors.labels(url, "mid_stream").inc()
        log.warning("upstream %s %s mid-stream: %s", url, what, type(e).__name__)
        sse = "text/event-stream" in upstream.content_type and upstream.content_length is None
        if sse and not out.backed_up:  # (a client that stopped reading would never take the error event)
            err = {
                "error": {
                    "message": f"upstream {what} mid-stream ({type(e).__name__}); the response is incomplete",
                    "type": "BadGatewayError",
                    "param": None,
                    "code": 502,
                }
            }
            try:
                await out.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
                out.end()
                return
            except ConnectionResetError:
                raise _ClientGone() from None
        # A sized or non-SSE body: cut the connection so the client cannot take a truncated body for whole.
        out.abort()
        raise _ClientGone()


class _Watchdog:
    """Cancels ``task`` once ``last`` (loop time, set by the caller per event) is ``idle`` s old.

    One timer per stream, moved only when it fires early: per event the caller just stores the time, where
    rescheduling a timeout per chunk (asyncio.timeout) cancelled and created a timer handle per token."""

    __slots__ = ("loop", "idle", "task", "last", "fired", "_handle")

    def __init__(self, loop: asyncio.AbstractEventLoop, idle: float, task: asyncio.Task[object]) -> None:
        self.loop, self.idle, self.task = loop, idle, task
        self.last = loop.time()
        self.fired = False
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + idle, self._check)

    def _check(self) -> None:
        due = self.last + self.idle
        if self.loop.time() < due:
            self._handle = self.loop.call_at(due, self._check)
            return
        self._handle = None
        self.fired = True
        self.task.cancel()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


@dataclass(slots=True, eq=False)
class _Attempt:
    ep: Endpoint
    decision: Decision
    charge: int
    dispatched_at: float
    task: asyncio.Task[None] | None
    started: bool = False
    pending: object = None  # the exact view's token for the blocks this request computes
    abandoned: bool = False

    def abandon(self) -> None:
        """Cancel the wait for a first byte (the outlier check ejected the endpoint); it is retried."""
        if not self.abandoned and not self.started and self.task is not None:
            self.abandoned = True
            self.task.cancel()


class _ClientGone(Exception):
    """The client is gone (or the connection was cut on purpose) after the answer began."""
