"""OpenTelemetry traces of the engine (``--otlp-traces-endpoint``, vLLM's flag): one span per request.

Off by default, and then nothing here is imported and a request pays one ``is None`` test. On, each finished
HTTP request becomes a SERVER span named ``llm_request`` (vLLM's name and attribute names), started at the
request's arrival and ended when its answer is complete, whose parent is the W3C ``traceparent`` the request
carried (``lbd route`` sends its own span's; a client's is kept when no router is in between). Attributes:
``gen_ai.request.id``, ``gen_ai.response.model``, ``gen_ai.request.max_tokens``/``temperature``/``top_p``/
``n``, ``gen_ai.usage.prompt_tokens``/``completion_tokens``/``num_sequences``, and the latencies
``gen_ai.latency.time_to_first_token``, ``e2e``, ``time_in_queue``, ``time_in_model_prefill``,
``time_in_model_decode``, ``time_in_model_inference`` (seconds, of the first sequence), plus
``lbd.data_parallel_rank`` and ``lbd.finish_reason``.

Export: OTLP over HTTP/protobuf in a background thread (BatchSpanProcessor); see ``lbd.common.otlp`` for the
URL and the protocol check. The service name is ``$OTEL_SERVICE_NAME`` or ``lbd-engine``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from lbd.common.otlp import traces_url
from lbd.engine.server.request_metrics import phases

if TYPE_CHECKING:
    from lbd.engine.server.openai_protocol import CommonParams
    from lbd.engine.server.sequence import Sequence


class TracedRequest(Protocol):
    """What a span is made of: one HTTP request's generation (``lbd.engine.server.generate.Generation``)."""

    id: str
    arrival: float  # monotonic
    arrival_wall: float
    common: CommonParams
    seqs: list[Sequence]

    @property
    def prompt_tokens(self) -> int: ...

    @property
    def completion_tokens(self) -> int: ...

class RequestTracer:
    def __init__(self, endpoint: str, rank: int) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        service = os.environ.get("OTEL_SERVICE_NAME", "lbd-engine")
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=traces_url(endpoint))))
        self.tracer = self.provider.get_tracer("lbd.engine")
        self.propagator = TraceContextTextMapPropagator()
        self.rank = rank
        self._kind, self._status, self._error = SpanKind.SERVER, Status, StatusCode.ERROR

    def request_done(self, headers: Mapping[str, str], gen: TracedRequest, model: str,
                     error: str | None) -> None:
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        parent = self.propagator.extract(carrier) if carrier else None
        span = self.tracer.start_span("llm_request", context=parent, kind=self._kind,
                                      start_time=int(gen.arrival_wall * 1e9),
                                      attributes=self._attrs(gen, model))
        if error is not None:
            span.set_status(self._status(self._error, error))
        span.end()

    def _attrs(self, gen: TracedRequest, model: str) -> dict[str, Any]:
        sp, seq = gen.common.sampling, gen.seqs[0]
        attrs: dict[str, Any] = {
            "gen_ai.request.id": gen.id, "gen_ai.response.model": model,
            "gen_ai.request.temperature": sp.temperature, "gen_ai.request.top_p": sp.top_p,
            "gen_ai.request.n": gen.common.n, "gen_ai.usage.num_sequences": len(gen.seqs),
            "gen_ai.usage.prompt_tokens": gen.prompt_tokens, "gen_ai.usage.completion_tokens":
                gen.completion_tokens,
            "gen_ai.latency.e2e": time.monotonic() - gen.arrival, "lbd.data_parallel_rank": self.rank,
            "lbd.finish_reason": ",".join(str(s.finish_reason) for s in gen.seqs),
        }
        if gen.common.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = gen.common.max_tokens
        if seq.first_time:
            attrs["gen_ai.latency.time_to_first_token"] = seq.first_time - gen.arrival
        times = phases(seq)
        if times is not None:
            (attrs["gen_ai.latency.time_in_queue"], attrs["gen_ai.latency.time_in_model_prefill"],
             attrs["gen_ai.latency.time_in_model_decode"],
             attrs["gen_ai.latency.time_in_model_inference"]) = times
        return attrs

    def shutdown(self) -> None:
        """Export what is buffered (the process exits without interpreter teardown)."""
        self.provider.shutdown()
