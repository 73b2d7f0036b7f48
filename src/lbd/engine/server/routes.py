"""The small endpoints: models, tokenize/detokenize, health, ping, version, load, metrics, telemetry."""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from lbd.engine import metrics
from lbd.engine.server.errors import APIError, bad_request
from lbd.engine.server.fields import Fields
from lbd.engine.server.lora_routes import add_lora_routes, lora_cards
from lbd.engine.server.openai_protocol import check_prompt_chars, parse_message
from lbd.engine.server.request_io import read_json, state_of
from lbd.engine.server.streaming import json_response
from lbd.engine.tokenizer import ChatTemplateError
from lbd.wire.dp import DPState
from lbd.wire.status import EngineStatus, encode

MAX_DETOKENIZE_CONTEXTS = 4  # /detokenize takes up to this many contexts' worth of ids

try:
    _VERSION = version("lbd")
except PackageNotFoundError:  # running from a source tree that was never installed
    _VERSION = "0.0.0+unknown"


async def models(request: web.Request) -> web.Response:
    state = state_of(request)
    state.check_available()  # as /health: listed only when a request for them would be served
    data = [{"id": name, "object": "model", "created": int(state.started), "owned_by": "lbd",
             "root": state.info.model_path, "parent": None, "max_model_len": state.info.max_model_len,
             # the tokenizer's fingerprint (/tokenizer_info's): a router resumes a stream only on a rank with
             # the same one (lbd.router.continuation.RankFacts)
             "lbd_tokenizer": state.forwarded.fingerprint,
             "permission": []} for name in state.config.model.model_names]
    data.extend(lora_cards(state))
    return json_response({"object": "list", "data": data})


async def health(request: web.Request) -> web.Response:
    state_of(request).check_healthy()
    return web.Response(status=200)


async def status(request: web.Request) -> web.Response:
    """This rank at a glance; ``dp`` is its MoE DP group's status (null for an independent rank)."""
    state = state_of(request)
    client = state.client
    ready = client.alive and not state.draining and state.dp_state in (None, DPState.READY)
    body = EngineStatus(rank=state.config.rank, pid=state.pid, core_pid=client.core_pid, ready=ready,
                        dp=client.dp)
    return web.Response(body=encode(body), content_type="application/json")


async def version_info(request: web.Request) -> web.Response:
    return json_response({"version": _VERSION})


async def load(request: web.Request) -> web.Response:
    return json_response({"server_load": state_of(request).in_flight})


TELEMETRY_PATH = "/telemetry"
TELEMETRY_HEADER = "X-LBD-Telemetry"  # on /metrics: where the cheap JSON view of the same numbers is


async def metrics_text(request: web.Request) -> web.Response:
    resp = web.Response(body=metrics.render())
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    resp.headers[TELEMETRY_HEADER] = TELEMETRY_PATH
    return resp


async def telemetry(request: web.Request) -> web.Response:
    """The numbers a router reads from /metrics, as JSON under vLLM's metric names (without ``vllm:``).

    Rendering /metrics aggregates every process's multiprocess files into a large text, which costs the rank
    CPU on every scrape, and routers scrape often. This answer is the core's last ``SchedulerStats`` (at most
    100 ms old while it has work; ``age_s`` says how old), a few hundred bytes. /metrics advertises it with
    the ``X-LBD-Telemetry`` header, so routers that know the header switch to it and others never see it."""
    state = state_of(request)
    client = state.client
    s = client.stats
    age = asyncio.get_running_loop().time() - client.last_heard if client.last_heard else None
    stream = state.load_stream.advertised() if state.load_stream is not None else None
    return json_response({
        "engine": state.config.rank, "model_names": state.config.model.model_names, "pid": state.pid,
        "num_requests_running": s.num_running, "num_requests_waiting": s.num_waiting,
        "kv_cache_usage_perc": s.kv_cache_usage, "block_size": s.block_size, "num_gpu_blocks": s.num_blocks,
        "prefix_cache_queries_total": s.prefix_cache_queries, "prefix_cache_hits_total": s.prefix_cache_hits,
        "prompt_tokens_total": s.prompt_tokens, "generation_tokens_total": s.generation_tokens,
        "server_load": state.in_flight, "age_s": age, "load_stream": stream,
        "lora": msgspec.to_builtins(s.lora) if s.lora is not None else None,
    })


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    f = Fields(await read_json(request))
    state.check_model(f.str("model"))
    tok = state.tokenizer
    if f.has("messages"):
        messages = f.raw("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("'messages' must be a non-empty list", "messages")
        parsed = [parse_message(m, i) for i, m in enumerate(messages)]
        check_prompt_chars(sum(len(m["content"]) for m in parsed), state.limits, "messages")
        try:
            tools = f.raw("tools")  # (vLLM's /tokenize renders them too, as chat does)
            text = tok.render_chat(parsed, f.bool("add_generation_prompt", True),
                                   f.bool("continue_final_message", False),
                                   tools if isinstance(tools, list) else None)
        except ChatTemplateError as e:
            raise bad_request(str(e), "messages") from e
        ids = await state.offload.encode(text, f.bool("add_special_tokens", False))
    else:
        prompt = f.required("prompt")
        if not isinstance(prompt, str):
            raise bad_request("'prompt' must be a string", "prompt")
        check_prompt_chars(len(prompt), state.limits, "prompt")
        ids = await state.offload.encode(prompt, f.bool("add_special_tokens", True))
    body: dict[str, Any] = {"count": len(ids), "max_model_len": state.info.max_model_len, "tokens": ids,
                            "token_strs": None}
    if f.bool("return_token_strs", False):
        body["token_strs"] = [tok.rust.id_to_token(i) for i in ids]
    return json_response(body)


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    f = Fields(await read_json(request))
    state.check_model(f.str("model"))
    raw = f.required("tokens")
    most = MAX_DETOKENIZE_CONTEXTS * state.info.max_model_len
    if isinstance(raw, list) and len(raw) > most:
        raise APIError(f"at most {most} tokens per request ({MAX_DETOKENIZE_CONTEXTS} x max_model_len), got "
                       f"{len(raw)}", 400, "tokens")
    ids = f.int_list("tokens", lo=0)
    limit = max(state.info.vocab_size, state.tokenizer.vocab_size)
    bad = [t for t in ids if t >= limit]
    if bad:
        raise APIError(f"token ids outside the vocabulary (size {limit}): {bad[:8]}", 400, "tokens")
    return json_response({"prompt": await state.offload.decode(ids)})


def add_routes(app: web.Application) -> None:
    from lbd.engine.server.cache_routes import add_cache_routes
    from lbd.engine.server.chat import chat_completions
    from lbd.engine.server.completions import completions
    from lbd.engine.server.responses import create_response, delete_response, get_response

    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/ping", health)
    app.router.add_post("/ping", health)
    app.router.add_get("/status", status)
    app.router.add_get("/version", version_info)
    app.router.add_get("/load", load)
    app.router.add_get("/metrics", metrics_text)
    app.router.add_get(TELEMETRY_PATH, telemetry)
    add_cache_routes(app)
    add_lora_routes(app)
