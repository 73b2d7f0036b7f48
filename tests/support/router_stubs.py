"""Small aiohttp upstreams that speak the engine's HTTP surface (vLLM metric names included), for raw-proxy
behaviour tests of the router. Behaviour against the engine itself is tested with real engines."""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field

from aiohttp import web

from support import free_port


@dataclass
class StubUpstream:
    rank: int = 0
    model: str = "stub-model"
    host: str = "127.0.0.1"
    port: int = field(default_factory=free_port)
    waiting: int = 0
    kv_usage: float = 0.0
    health_status: int = 200
    metrics_status: int = 200
    hang_health: bool = False
    answer_status: int | None = None  # force every completion to answer this status
    poison_status: int = 500  # a completion whose body holds b"poison" gets this status (a bad request)
    chunks: int = 3
    chunk_delay: float = 0.0
    header_delay: float = 0.0
    first_chunk_delay: float = 0.0
    die_after_chunks: int | None = None  # cut the connection after this many chunks
    advertise_telemetry: bool = False  # /metrics names a JSON /telemetry (as lbd's engines) this stub lacks
    # observations
    inflight: int = 0
    served: int = 0
    cancelled: int = 0
    scrapes: int = 0
    telemetry_gets: int = 0
    seen_headers: list = field(default_factory=list)
    seen_bodies: list[bytes] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self) -> StubUpstream:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/telemetry", self.telemetry)
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, self.host, self.port).start()
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    async def metrics(self, request: web.Request) -> web.Response:
        self.scrapes += 1
        if self.metrics_status != 200:
            return web.Response(status=self.metrics_status)
        lab = f'engine="{self.rank}",model_name="{self.model}"'
        text = (
            "# HELP vllm:num_requests_running Requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{{{lab}}} {float(self.inflight)}\n"
            f"vllm:num_requests_waiting{{{lab}}} {float(self.waiting)}\n"
            f"vllm:kv_cache_usage_perc{{{lab}}} {self.kv_usage}\n"
            f"vllm:prefix_cache_queries_total{{{lab}}} 100.0\n"
            f"vllm:prefix_cache_hits_total{{{lab}}} 25.0\n"
            f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",enable_prefix_caching="True",'
            f'num_gpu_blocks="1024",{lab}}} 1.0\n'
            f'vllm:time_to_first_token_seconds_bucket{{{lab},le="0.1"}} 3.0\n'
        )
        headers = {"X-LBD-Telemetry": "/telemetry"} if self.advertise_telemetry else None
        return web.Response(text=text, content_type="text/plain", headers=headers)

    async def telemetry(self, request: web.Request) -> web.Response:
        self.telemetry_gets += 1
        return web.Response(status=404)

    async def health(self, request: web.Request) -> web.Response:
        if self.hang_health:
            await asyncio.sleep(3600)
        return web.Response(status=self.health_status)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "owned_by": "stub", "max_model_len": 512}],
            }
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, 2, 3], "count": 3, "rank": self.rank})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        self.seen_headers.append(request.headers.copy())  # case-insensitive
        body = await request.read()
        self.seen_bodies.append(body)
        pin = request.headers.get("X-data-parallel-rank")
        if pin is not None and pin.strip().lstrip("-").isdigit() and int(pin) != self.rank:
            return web.json_response(
                {
                    "error": {
                        "message": f"this server is rank {self.rank}, not {pin}",
                        "type": "BadRequestError",
                        "param": None,
                        "code": 400,
                    }
                },
                status=400,
            )
        if b"poison" in body:
            return web.json_response(
                {"error": {"message": "internal error", "type": "InternalServerError", "param": None,
                           "code": self.poison_status}},
                status=self.poison_status,
            )
        if self.answer_status is not None:
            return web.json_response(
                {
                    "error": {
                        "message": "stub says no",
                        "type": "ServiceUnavailableError",
                        "param": None,
                        "code": self.answer_status,
                    }
                },
                status=self.answer_status,
            )
        self.inflight += 1
        try:
            if self.header_delay:
                await asyncio.sleep(self.header_delay)
            data = json.loads(body or b"{}")
            if not data.get("stream"):
                self.served += 1
                return web.json_response(
                    {
                        "id": "cmpl-stub",
                        "object": "text_completion",
                        "model": self.model,
                        "rank": self.rank,
                        "choices": [{"index": 0, "text": "hi", "finish_reason": "stop"}],
                    },
                    headers={"Connection": "keep-alive", "X-Stub": "1"},
                )
            return await self._stream(request)
        except (asyncio.CancelledError, ConnectionResetError):  # the router cut the stream (on a busy
            self.cancelled += 1  # machine a write can find the connection closed before the cancel lands)
            raise
        finally:
            self.inflight -= 1

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if self.first_chunk_delay:
            await asyncio.sleep(self.first_chunk_delay)
        for i in range(self.chunks):
            if self.die_after_chunks is not None and i >= self.die_after_chunks:
                assert request.transport is not None
                request.transport.abort()
                return resp
            event = {"id": "cmpl-stub", "rank": self.rank, "choices": [{"index": 0, "text": f"t{i}"}]}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
            if self.chunk_delay:
                await asyncio.sleep(self.chunk_delay)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        self.served += 1
        return resp


@dataclass
class StubSupervisor:
    """Serves a supervisor-like /status that a test edits (ranks appear, drain, restart, leave)."""

    port: int = field(default_factory=free_port)
    ranks: list[dict[str, object]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    async def start(self) -> StubSupervisor:
        app = web.Application()
        app.router.add_get("/status", self.status)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return self

    async def status(self, request: web.Request) -> web.Response:
        ready = any(r.get("state") == "ready" for r in self.ranks)
        return web.json_response({"ready": ready, "ranks": self.ranks})

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@contextlib.asynccontextmanager
async def stubs(n: int, **kw: object):
    ups = [await StubUpstream(rank=i, **kw).start() for i in range(n)]  # type: ignore[arg-type]
    try:
        yield ups
    finally:
        for u in ups:
            await u.stop()
