"""OpenTelemetry traces of the router (``--otlp-traces-endpoint``): one span per proxied request.

Off by default: then nothing here is imported and ``Proxy.handle`` takes the untraced path. On, each
proxied request gets a SERVER span ``lbd.route`` whose parent is the client's W3C ``traceparent`` when it
sent one (its trace id is kept), else a new trace. The router's own span context replaces the client's
``traceparent`` on the forwarded request, so the engine's ``llm_request`` span is its child: one trace from
client to engine.
Attributes: ``lbd.endpoint`` (the chosen endpoint), ``lbd.policy``, ``lbd.route_reason``, ``lbd.route_plugin``
(the plugin that decided), ``lbd.retries``, ``lbd.data_parallel_rank`` (when known), ``http.request.method``,
``url.path``, ``http.response.status_code``; P/D adds ``lbd.disagg`` and its prefill stage's
``lbd.pd.prefill_endpoint``, ``lbd.pd.prefill_reason`` and ``lbd.pd.prefill_plugin`` (lbd.router.disagg).
Exported over OTLP/HTTP by a background thread (BatchSpanProcessor); the
service name is ``$OTEL_SERVICE_NAME`` or ``lbd-router``.
"""

from __future__ import annotations

import os
from typing import Any

from lbd.common.otlp import traces_url
from lbd.policies import Decision
from lbd.router.messages import Request

TRACE_HEADERS = (b"traceparent", b"tracestate")


class RouteTrace:
    """One request's span, the header lines that carry it to the upstream, and what the proxy decided."""

    __slots__ = ("span", "lines", "retries")

    def __init__(self, span: Any, lines: bytes) -> None:
        self.span, self.lines, self.retries = span, lines, 0

    def decided(self, policy: str, d: Decision) -> None:
        attrs: dict[str, Any] = {"lbd.endpoint": d.endpoint.key, "lbd.policy": policy,
                                 "lbd.route_reason": d.reason, "lbd.route_plugin": d.plugin}
        if d.endpoint.rank is not None:
            attrs["lbd.data_parallel_rank"] = d.endpoint.rank
        self.span.set_attributes(attrs)


class RouterTracer:
    def __init__(self, endpoint: str) -> None:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = os.environ.get("OTEL_SERVICE_NAME", "lbd-router")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("lbd.router")
        self.propagator = TraceContextTextMapPropagator()
        self._in_context = trace.set_span_in_context
        self._server = trace.SpanKind.SERVER
        self._status, self._error = trace.Status, trace.StatusCode.ERROR

    def start(self, request: Request) -> RouteTrace:
        carrier = {}
        for name in ("traceparent", "tracestate"):
            value = request.headers.get(name)
            if value is not None:
                carrier[name] = value
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span("lbd.route", context=parent, kind=self._server,
                                      attributes={"http.request.method": request.method,
                                                  "url.path": request.path})
        out: dict[str, str] = {}
        self.propagator.inject(out, context=self._in_context(span))
        lines = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1")) for k, v in out.items())
        return RouteTrace(span, lines)

    def end(self, t: RouteTrace, status: int) -> None:
        t.span.set_attribute("lbd.retries", t.retries)
        t.span.set_attribute("http.response.status_code", status)
        if status >= 500 or status == 0:
            t.span.set_status(self._status(self._error, f"answered {status}" if status else "no answer"))
        t.span.end()

    def child(self, t: RouteTrace, name: str, attrs: dict[str, Any]) -> Any:
        """A span inside the request's (a move to another rank: lbd.router.migration); the caller ends it."""
        return self.tracer.start_span(name, context=self._in_context(t.span), attributes=attrs)

    def shutdown(self) -> None:
        self.provider.shutdown()
