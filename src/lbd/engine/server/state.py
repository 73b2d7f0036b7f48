"""What every handler of one front-end process shares."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from lbd.engine.config.lora import LoraModule
from lbd.engine.config.slices import FrontendConfig
from lbd.engine.metrics import FrontendMetrics
from lbd.engine.server.core_client import CoreClient
from lbd.engine.server.errors import APIError
from lbd.engine.server.offload import Offload
from lbd.engine.server.openai_protocol import Limits
from lbd.engine.server.responses_store import ResponseStore
from lbd.engine.tokenizer import Tokenizer
from lbd.wire.core_messages import CoreInfo
from lbd.wire.dp import DPState

if TYPE_CHECKING:
    from lbd.engine.server.forwarded import ForwardedPrompts
    from lbd.engine.server.load_stream import LoadPublisher
    from lbd.engine.server.tracing import RequestTracer


@dataclass(slots=True)
class FrontendState:
    """One front end's slices, what the core said about itself at hello, and the parts the handlers share
    (tokenizer, core client, metrics, offload worker, response store)."""

    config: FrontendConfig  # the slices this front end reads (lbd.engine.config.slices)
    info: CoreInfo
    tokenizer: Tokenizer
    client: CoreClient
    metrics: FrontendMetrics
    offload: Offload
    responses: ResponseStore
    forwarded: ForwardedPrompts  # a router's prompt token ids (lbd.engine.server.forwarded)
    index: int = 0  # which front end of this rank (0 runs in the launcher)
    pid: int = field(default_factory=os.getpid)
    started: float = field(default_factory=time.time)
    in_flight: int = 0
    draining: bool = False
    streams_ending: bool = False  # past --shutdown-timeout: open streams end with a retryable 503 (app.drain)
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    load_stream: LoadPublisher | None = None  # the pushed load state (--load-heartbeat-s)
    loras: dict[str, LoraModule] = field(default_factory=dict)  # adapters by name (server.lora_routes)

    def __post_init__(self) -> None:
        self.loras = {m.name: m for m in self.config.lora.modules}

    @property
    def limits(self) -> Limits:
        return Limits(max_model_len=self.info.max_model_len, max_logprobs=self.config.server.max_logprobs,
                      vocab_size=self.info.vocab_size,
                      max_prompt_chars=self.info.max_model_len * self.tokenizer.max_chars_per_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.info.eos_token_id if self.info.eos_token_id is not None else self.tokenizer.eos_token_id

    def check_model(self, model: str | None) -> str:
        """The served name to answer with; 404 for a model this server does not serve."""
        if model is None:
            return self.config.model.model_name
        if model not in self.config.model.model_names and model not in self.loras:
            raise APIError(f"The model `{model}` does not exist.", 404, "model", "NotFoundError")
        return model

    def adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names, or None for the base model."""
        return model if model is not None and model in self.loras else None

    @property
    def dp_state(self) -> DPState | None:
        """The state of this rank's MoE DP group; None for an independent rank."""
        dp = self.client.dp
        return dp.state if dp is not None else None

    def check_available(self) -> None:
        if self.draining:
            raise APIError("The server is shutting down.", 503)
        if not self.client.alive:
            raise APIError(f"The engine core is not running: {self.client.dead_reason}", 503)
        dp = self.client.dp
        if dp is not None and dp.state is not DPState.READY:
            raise APIError(dp.unavailable, 503)

    def check_healthy(self) -> None:
        """/health: available, and the core not stalled. A core with work sends outputs or stats at least
        every 100 ms, so requests in flight and no word from it for --health-stall-timeout-s is a stuck step,
        a hung collective or a stopped process; the supervisor then restarts the rank."""
        self.check_available()
        limit = self.config.server.health_stall_timeout_s
        if limit > 0:
            silent = self.client.silence(asyncio.get_running_loop().time())
            if silent > limit:
                raise APIError(f"The engine core made no progress for {silent:.1f} s with "
                               f"{self.client.in_flight} requests in flight (--health-stall-timeout-s "
                               f"{limit:g}).", 503)
