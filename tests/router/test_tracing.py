"""Tracing: one trace spans the router and the engine, received by an in-process OTLP/HTTP collector (an
aiohttp server decoding ExportTraceServiceRequest protobufs with opentelemetry-proto)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from support import EngineServer, free_port

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _value(v):  # an OTLP AnyValue
    return getattr(v, v.WhichOneof("value"))


class Collector:
    """OTLP/HTTP traces receiver: POST /v1/traces, application/x-protobuf."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.spans: list[dict] = []

    async def start(self) -> Collector:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def traces(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest.FromString(await request.read())
        for rs in req.resource_spans:
            service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append({
                        "service": service, "name": s.name, "trace": s.trace_id.hex(),
                        "span": s.span_id.hex(), "parent": s.parent_span_id.hex(),
                        "attrs": {a.key: _value(a.value) for a in s.attributes},
                    })
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def wait(self, trace: str, count: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [s for s in self.spans if s["trace"] == trace]
            if len(got) >= count:
                return got
            await asyncio.sleep(0.05)
        raise TimeoutError(f"{count} spans of trace {trace} not received: {self.spans}")

    async def stop(self) -> None:
        await self.runner.cleanup()


async def test_one_trace_spans_router_and_engine(tiny_llama: Path, tmp_path: Path, start_router,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    collector = await Collector().start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # export every 50 ms (default 5 s)
    try:
        engine = await asyncio.to_thread(
            EngineServer, tiny_llama, "--device", "sim", "--max-model-len", "512",
            "--served-model-name", "tiny", "--data-parallel-rank", "0",
            "--otlp-traces-endpoint", collector.url, log=tmp_path / "engine.log")
        try:
            router = start_router("--upstreams", engine.base_url, "--policy", "round_robin",
                                  "--otlp-traces-endpoint", collector.url)
            await router.wait()
            body = {"model": "tiny", "prompt": "trace me", "max_tokens": 4}
            async with httpx.AsyncClient(timeout=30) as c:
                r = await c.post(router.url + "/v1/completions", json=body,
                                 headers={"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01", "tracestate": "k=v"})
                assert r.status_code == 200, r.text
                spans = await collector.wait(TRACE, 2)
                route = next(s for s in spans if s["name"] == "lbd.route")
                llm = next(s for s in spans if s["name"] == "llm_request")
                assert route["service"] == "lbd-router" and llm["service"] == "lbd-engine"
                assert route["parent"] == CLIENT_SPAN  # the client's trace is kept
                assert llm["parent"] == route["span"]  # router -> engine
                a = route["attrs"]
                assert (a["lbd.endpoint"], a["lbd.policy"], a["lbd.route_reason"], a["lbd.retries"]) == (
                    engine.base_url, "round_robin", "round_robin", 0)
                assert a["http.response.status_code"] == 200 and a["lbd.data_parallel_rank"] == 0
                e = llm["attrs"]
                assert e["gen_ai.usage.completion_tokens"] == 4 and e["gen_ai.usage.prompt_tokens"] > 0
                assert e["gen_ai.request.max_tokens"] == 4 and e["gen_ai.response.model"] == "tiny"
                for key in ("time_in_queue", "time_in_model_prefill", "time_in_model_decode",
                            "time_in_model_inference", "time_to_first_token", "e2e"):
                    assert e[f"gen_ai.latency.{key}"] >= 0.0, key
                assert e["gen_ai.latency.e2e"] >= e["gen_ai.latency.time_to_first_token"]
                # No traceparent from the client: the router starts the trace, the engine joins it.
                r = await c.post(router.url + "/v1/completions", json=body)
                assert r.status_code == 200
                deadline = time.monotonic() + 20
                while True:
                    fresh = [s for s in collector.spans if s["trace"] != TRACE]
                    roots = [s for s in fresh if s["name"] == "lbd.route" and not s["parent"]]
                    if roots and any(s["parent"] == roots[0]["span"] for s in fresh):
                        break
                    assert time.monotonic() < deadline, collector.spans
                    await asyncio.sleep(0.05)
                # Straight to the engine: it continues the caller's trace.
                other = "0af7651916cd43dd8448eb211c80319c"
                r = await c.post(engine.base_url + "/v1/completions", json=body,
                                 headers={"traceparent": f"00-{other}-b7ad6b7169203331-01"})
                assert r.status_code == 200
                (direct,) = await collector.wait(other, 1)
                assert direct["parent"] == "b7ad6b7169203331" and direct["name"] == "llm_request"
        finally:
            engine.close()
    finally:
        await collector.stop()
