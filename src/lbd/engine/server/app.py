"""One front-end process: the aiohttp app on a SO_REUSEPORT listener, connected to the core over ZMQ."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from aiohttp import web

from lbd.common.aio_guard import GuardedAppRunner
from lbd.common.auth import PUBLIC_PATHS, KeyRing, engine_keys
from lbd.common.internal_key import signer_from
from lbd.common.limits import limits_from, raise_open_files_limit
from lbd.common.tls import server_context
from lbd.engine.config.slices import FrontendConfig
from lbd.engine.procutil import freeze_startup_heap
from lbd.engine.server.cache_routes import tokenizer_info_body
from lbd.engine.server.core_client import CoreClient
from lbd.engine.server.errors import APIError, error_response
from lbd.engine.server.forwarded import ForwardedPrompts, fingerprint
from lbd.engine.server.offload import Offload
from lbd.engine.server.request_io import STATE
from lbd.engine.server.responses_store import RESPONSES_DIR_ENV, ResponseStore
from lbd.engine.server.routes import add_routes
from lbd.engine.server.state import FrontendState
from lbd.engine.tokenizer import Tokenizer
from lbd.wire.dp import DPState

logger = logging.getLogger(__name__)
PID_HEADER = "x-lbd-frontend-pid"
DP_STATE_HEADER = "X-lbd-dp-state"


@web.middleware
async def _errors(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(APIError(f"{e.reason}: {request.method} {request.path}", e.status))
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        logger.exception("unhandled error in %s %s", request.method, request.path)
        return error_response(APIError(f"internal error: {type(e).__name__}: {e}", 500))


def _auth(keys: KeyRing):
    """--api-key: every path but the probes' and scrapers' (lbd.common.auth.PUBLIC_PATHS) needs a key."""

    @web.middleware
    async def check_key(request: web.Request, handler) -> web.StreamResponse:
        if request.method != "OPTIONS" and request.path not in PUBLIC_PATHS and \
                keys.check_header(request.headers.get("Authorization")) is None:
            resp = error_response(APIError("missing or wrong API key: send Authorization: Bearer <key>", 401))
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        return await handler(request)

    return check_key


def build_app(state: FrontendState, keys: KeyRing | None = None) -> web.Application:
    middlewares = [_errors] + ([_auth(keys)] if keys else [])
    app = web.Application(client_max_size=state.config.server.max_request_body_bytes, middlewares=middlewares)
    app[STATE] = state
    pid = str(state.pid)

    async def tag(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[PID_HEADER] = pid  # shows which front end served it (--api-server-count > 1)
        dp_state = state.dp_state
        if dp_state is not None and dp_state is not DPState.READY:  # alive, waiting for its MoE DP group
            response.headers[DP_STATE_HEADER] = dp_state.value

    app.on_response_prepare.append(tag)
    add_routes(app)
    return app


class Frontend:
    """Lifecycle of one front end: connect + wait for the core, listen, drain, close. It takes the front end's
    slices (``lbd.engine.config.slices.frontend_config``), never the whole command line."""

    def __init__(self, config: FrontendConfig, model_path: str | Path, address: str, core_pid: int | None,
                 index: int = 0) -> None:
        self.config = config
        self.model_path = str(model_path)
        self.client = CoreClient(address, core_pid, config.observability.profile_steps)
        self.index = index
        self.state: FrontendState | None = None
        self.offload: Offload | None = None
        self.keys = engine_keys(config.server.api_key, dict(os.environ))
        self._runner: web.AppRunner | None = None

    async def connect(self, hello_timeout: float) -> None:
        """Load the tokenizer and wait until the core answers (it may still be loading the model)."""
        from lbd.engine.metrics import FrontendMetrics

        self.client.start()
        model, rank = self.config.model, self.config.rank
        tokenizer = await asyncio.to_thread(Tokenizer, model.tokenizer or self.model_path,
                                            model.chat_template)
        self.offload = Offload(tokenizer)
        await self.offload.warm()
        info = await self.client.hello(hello_timeout)
        metrics = FrontendMetrics(model.model_name, rank, info.max_model_len)
        forwarded = ForwardedPrompts(fingerprint(tokenizer_info_body(tokenizer)), info.vocab_size,
                                     metrics.forwarded_prompts, signer_from(os.environ))
        self.state = FrontendState(self.config, info, tokenizer, self.client, metrics, self.offload,
                                   self._response_store(), forwarded, self.index)
        endpoint = self.config.observability.otlp_traces_endpoint
        if endpoint:
            from lbd.engine.server.tracing import RequestTracer

            self.state.tracer = RequestTracer(endpoint, rank)
        heartbeat = self.config.observability.load_heartbeat_s
        if heartbeat > 0:
            from lbd.engine.server.load_stream import LoadPublisher

            pub = self.state.load_stream = LoadPublisher(rank, heartbeat, self.config.server.host)
            self.client.on_stats = pub.update
            pub.start()

    def _response_store(self) -> ResponseStore:
        """This front end's share of the rank's response store (see responses_store)."""
        server = self.config.server
        share = server.api_server_count
        entries = -(-server.responses_store_max_entries // share)
        store_bytes = server.responses_store_max_bytes // share
        return ResponseStore(os.environ.get(RESPONSES_DIR_ENV), entries, store_bytes)

    async def listen(self) -> None:
        assert self.state is not None, "connect() first"
        server = self.config.server
        limits = limits_from(server)
        raise_open_files_limit(limits.max_connections)
        self._runner = GuardedAppRunner(build_app(self.state, self.keys), limits, handler_cancellation=True,
                                        shutdown_timeout=server.shutdown_timeout, access_log=None)
        await self._runner.setup()
        tls = server_context(server.ssl_certfile, server.ssl_keyfile, server.ssl_ca_certs,
                             server.ssl_cert_reqs)
        site = web.TCPSite(self._runner, server.host, server.port, reuse_port=True, backlog=2048,
                           ssl_context=tls)
        await site.start()
        freeze_startup_heap()
        logger.info("front end %d (pid %d) listening on %s://%s:%d%s", self.index, os.getpid(),
                    "https" if tls else "http", server.host or "*", server.port,
                    f", {len(self.keys)} API key(s) required" if self.keys else "")

    async def drain(self) -> None:
        """Close the listener, answer 503 to new requests, let in-flight ones finish (--shutdown-timeout);
        streams still open then end with a retryable 503 error event (a router resumes each on another
        rank) rather than a cut connection, within aiohttp's second wait of the same length."""
        if self.state is not None:
            self.state.draining = True
            if self.state.in_flight:
                logger.info("draining %d in-flight requests (up to %.0fs)", self.state.in_flight,
                            self.config.server.shutdown_timeout)
            state = self.state
            asyncio.get_running_loop().call_later(self.config.server.shutdown_timeout, setattr, state,
                                                  "streams_ending", True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def close(self) -> None:
        if self.offload is not None:
            self.offload.close()
        if self.state is not None and self.state.load_stream is not None:
            self.client.on_stats = None
            self.state.load_stream.close()
        await self.client.close()
        if self.state is not None and self.state.tracer is not None:
            await asyncio.to_thread(self.state.tracer.shutdown)
