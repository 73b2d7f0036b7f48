"""The proxy handler: read the body once (bounded), decide, forward, pass the answer through chunk by chunk.

A response's status and headers reach the client only when the upstream's first body bytes do, so an upstream
that dies or answers 503 before that can still be retried on another endpoint ("before any byte reached the
client"). After that no retry: a failure mid-stream ends the stream with a clear error (an SSE error event, or
a cut connection for a sized body). A client that goes away cancels the handler (aiohttp handler
cancellation): its slot is released in ``finally`` and the upstream connection is closed, which makes the
engine abort the request and free its KV blocks.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from dataclasses import dataclass

import orjson
from aiohttp import web

from lbd.router.endpoints import Endpoint
from lbd.router.facts import PIN_HEADER, BadRequest, parse_facts, pinned_rank
from lbd.router.state import RouterState
from lbd.router.upstream import Response, UpstreamError
from policies import Decision, Refusal, RequestFacts, route

log = logging.getLogger("lbd.router")

_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# Request headers are forwarded as the client's raw bytes (no decode/encode per header).
_HOP_REQ = frozenset(h.encode() for h in _HOP | {"x-request-id"})
_HOP_REQ_UNPINNED = _HOP_REQ | {PIN_HEADER.lower().encode()}
_RESP_DROP = _HOP | {"date", "server", "x-request-id"}
_SMALL_BODY = 1 << 20  # sized answers up to this are read whole and sent as one Response


def error_response(
    status: int, message: str, etype: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = orjson.dumps({"error": {"message": message, "type": etype, "param": param, "code": status}})
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


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
    def __init__(self, state: RouterState) -> None:
        self.state = state
        self.cfg = state.cfg
        self.loop = asyncio.get_running_loop()
        # Request ids: 32 hex digits like uuid4().hex, a random per-process half and a counter (a uuid4 per
        # request costs more than the rest of the id handling together).
        self._rid_prefix = os.urandom(8).hex()
        self._rid_count = itertools.count()

    # ---- entry --------------------------------------------------------------------------------------
    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t0 = self.loop.time()
        rid = request.headers.get("X-Request-Id") or f"{self._rid_prefix}{next(self._rid_count):016x}"
        rid_header = {"X-Request-Id": rid}
        limit = self.cfg.max_request_body_bytes
        if request.content_length is not None and request.content_length > limit:
            return self._refuse(
                413,
                f"request body of {request.content_length} bytes is over the {limit}-byte "
                "limit (--max-request-body-bytes)",
                "RequestTooLargeError",
                rid_header,
            )
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(
                413,
                f"request body is over the {limit}-byte limit (--max-request-body-bytes)",
                "RequestTooLargeError",
                rid_header,
            )
        try:
            if request.method == "POST":
                facts = parse_facts(body, request.headers, self.cfg.session_header)
            else:
                facts = RequestFacts(pinned_rank=pinned_rank(request.headers))
        except BadRequest as e:
            return self._refuse(400, e.message, "BadRequestError", rid_header, e.param)
        headers = self._forward_headers(request, rid)
        target = request.raw_path
        exclude: list[str] = []
        failure: Failure | None = None
        for attempt in range(self.cfg.max_retries + 1):
            decision = route(self.state.policy, facts, self.state.snapshots(), exclude, self.cfg.pin_fallback)
            if isinstance(decision, Refusal):
                if failure is None:
                    self.state.metrics.decision(self.cfg.policy, decision.reason)
                    return self._refuse(
                        decision.status, decision.message, decision.type, rid_header, decision.param
                    )
                break
            result = await self._attempt(request, decision, facts, body, headers, target, rid, t0)
            if not isinstance(result, Failure):
                return result
            failure = result
            out_of_budget = self.loop.time() - t0 > self.cfg.retry_budget_s
            if not failure.retryable or attempt == self.cfg.max_retries or out_of_budget:
                break
            self.state.metrics.retries.labels(failure.kind).inc()
            exclude.append(decision.endpoint.key)
            log.info("request %s: %s on %s; retrying elsewhere", rid, failure.kind, decision.endpoint.key)
        assert failure is not None
        return self._failure_response(failure, rid_header)

    def _refuse(
        self, status: int, message: str, etype: str, headers: dict[str, str], param: str | None = None
    ) -> web.Response:
        self.state.metrics.requests.labels("none", str(status)).inc()
        return error_response(status, message, etype, param, headers)

    def _failure_response(self, f: Failure, headers: dict[str, str]) -> web.Response:
        if f.body is not None:
            return web.Response(
                status=f.status, body=f.body, headers={**headers, "Content-Type": f.content_type}
            )
        etype = {502: "BadGatewayError", 503: "ServiceUnavailableError", 504: "GatewayTimeoutError"}
        return error_response(f.status, f.message, etype.get(f.status, "InternalServerError"), None, headers)

    def _forward_headers(
        self, request: web.BaseRequest, rid: str, drop: frozenset[bytes] = _HOP_REQ
    ) -> bytes:
        """The client's raw headers minus hop-by-hop ones, serialized once (Host and Content-Length are added
        by the pool); the request id is set to ours."""
        parts = [b"%s: %s\r\n" % kv for kv in request.raw_headers if kv[0].lower() not in drop]
        parts.append(b"X-Request-Id: %s\r\n" % rid.encode("utf-8", "surrogateescape"))
        return b"".join(parts)

    # ---- one try on one endpoint --------------------------------------------------------------------
    async def _attempt(
        self,
        request: web.BaseRequest,
        d: Decision,
        facts: RequestFacts,
        body: bytes,
        headers: bytes,
        target: str,
        rid: str,
        t0: float,
    ) -> web.StreamResponse | Failure:
        state = self.state
        ep = state.endpoints.get(d.endpoint.key)
        pool = state.pools.get(d.endpoint.key)
        if ep is None or pool is None:  # removed between the snapshot and now
            return Failure(503, f"endpoint {d.endpoint.key} left", "upstream_gone", True)
        a = _Attempt(ep, d, int(state.policy.charge_tokens(facts, d.endpoint)), self.loop.time())
        state.shared.dispatch(ep.slot, a.charge)
        state.policy.on_dispatch(facts, ep.url)
        state.metrics.decision(self.cfg.policy, d.reason)
        status = "client_gone"
        upstream: Response | None = None
        if d.reason == "pin_fallback":  # the pinned rank is out: the header would make the other rank say 400
            headers = self._forward_headers(request, rid, _HOP_REQ_UNPINNED)
        try:
            try:
                upstream = await pool.request(
                    request.method, target, headers, body, self.cfg.response_timeout_s
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
            if upstream.status >= 500:
                failure = await self._upstream_5xx(ep, upstream)
                status = str(failure.status)
                return failure
            ep.record_success("request")
            answer = await self._relay(request, a, upstream, rid)
            status = str(answer.status)
            return answer
        except _ClientGone as gone:
            state.metrics.disconnects.labels(ep.url).inc()
            return gone.response
        except asyncio.CancelledError:
            state.metrics.disconnects.labels(ep.url).inc()
            raise
        finally:
            if upstream is not None:
                upstream.close()  # gives a fully read connection back to the pool, closes any other
            if not a.started:
                state.shared.start(ep.slot, a.charge)
            state.shared.finish(ep.slot)
            self._count(ep, status, self.loop.time() - t0)

    def _count(self, ep: Endpoint, status: str, seconds: float) -> None:
        """requests_total and the latency histogram, with the labelled children cached on the endpoint."""
        children = ep.metric_children
        counter = children.get(status)
        if counter is None:
            counter = children[status] = self.state.metrics.requests.labels(ep.url, status)
        counter.inc()
        hist = children.get("latency")
        if hist is None:
            hist = children["latency"] = self.state.metrics.latency.labels(ep.url)
        hist.observe(seconds)

    async def _upstream_5xx(self, ep: Endpoint, upstream: Response) -> Failure:
        try:
            async with asyncio.timeout(self.cfg.connect_timeout_s):
                data = await upstream.read()
        except (TimeoutError, UpstreamError):
            data = b""
        if upstream.status == 503:
            # admission control (queue limits) or a draining rank: back-pressure, not a health signal
            self.state.metrics.upstream_errors.labels(ep.url, "503").inc()
            kind = "overloaded"
        else:
            self.state.fail(ep, "request", f"answered {upstream.status}")
            self.state.metrics.upstream_errors.labels(ep.url, "5xx").inc()
            kind = "upstream_5xx"
        ctype = upstream.content_type or "application/json"
        return Failure(
            upstream.status, f"upstream {ep.url} answered {upstream.status}", kind, True, data or None, ctype
        )

    def _response_headers(self, upstream: Response, d: Decision, rid: str) -> list[tuple[str, str]]:
        out = [kv for kv in upstream.headers if kv[0].lower() not in _RESP_DROP]
        out.append(("X-Request-Id", rid))
        if self.cfg.debug_headers:
            out.append(("x-lbd-endpoint", d.endpoint.key))
            out.append(("x-lbd-route-reason", d.line()))
        return out

    async def _relay(
        self, request: web.BaseRequest, a: _Attempt, upstream: Response, rid: str
    ) -> web.StreamResponse | Failure:
        """Pass the answer through; a failure before its first byte is still retryable."""
        idle = self.cfg.stream_idle_timeout_s
        length = upstream.content_length
        small = length is not None and length <= _SMALL_BODY and not upstream.chunked
        try:
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
        self.state.shared.start(a.ep.slot, a.charge)
        if not small and "text/event-stream" in upstream.content_type:
            # only a stream's first event is a time to first token (a whole answer includes its decode)
            self.state.policy.on_first_byte(a.decision, self.loop.time() - a.dispatched_at)
        headers = self._response_headers(upstream, a.decision, rid)
        if small:
            return web.Response(status=upstream.status, body=first, headers=headers)
        out = web.StreamResponse(status=upstream.status, headers=headers)
        if length is not None:
            out.content_length = length
        try:
            await out.prepare(request)
        except ConnectionResetError:
            raise _ClientGone(out) from None
        await self._pump(request, out, upstream, first, a.ep.url, idle)
        return out

    async def _pump(
        self,
        request: web.BaseRequest,
        out: web.StreamResponse,
        upstream: Response,
        chunk: bytes,
        url: str,
        idle: float,
    ) -> None:
        try:
            async with asyncio.timeout(idle) as timer:
                while chunk:
                    try:
                        await out.write(chunk)
                    except ConnectionResetError:
                        raise _ClientGone(out) from None
                    timer.reschedule(self.loop.time() + idle)
                    chunk = await upstream.read_chunk()
        except (UpstreamError, TimeoutError) as e:
            await self._end_broken_stream(request, out, upstream, url, e)
            return
        try:
            await out.write_eof()
        except ConnectionResetError:
            raise _ClientGone(out) from None

    async def _end_broken_stream(
        self,
        request: web.BaseRequest,
        out: web.StreamResponse,
        upstream: Response,
        url: str,
        e: BaseException,
    ) -> None:
        """After bytes went out no retry is possible: end the stream with a clear error."""
        what = "stalled" if isinstance(e, TimeoutError) else "failed"
        self.state.metrics.upstream_errors.labels(url, "mid_stream").inc()
        log.warning("upstream %s %s mid-stream: %s", url, what, type(e).__name__)
        try:
            if "text/event-stream" in upstream.content_type:
                err = {
                    "error": {
                        "message": f"upstream {what} mid-stream ({type(e).__name__}); the response is "
                        "incomplete",
                        "type": "BadGatewayError",
                        "param": None,
                        "code": 502,
                    }
                }
                await out.write(b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
                await out.write_eof()
                return
        except ConnectionResetError:
            raise _ClientGone(out) from None
        # A sized or non-SSE body: cut the connection so the client cannot take a truncated body for whole.
        if request.transport is not None:
            request.transport.abort()
        raise _ClientGone(out)


@dataclass(slots=True)
class _Attempt:
    ep: Endpoint
    decision: Decision
    charge: int
    dispatched_at: float
    started: bool = False


class _ClientGone(Exception):
    """The client is gone (or the connection was cut on purpose): hand aiohttp the started response."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__()
        self.response = response
