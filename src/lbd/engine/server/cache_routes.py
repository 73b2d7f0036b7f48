"""What routers need to know about this rank's prefix cache: where its KV events are published, and the
tokenizer that turns requests into the token ids its block keys are made of.

GET  /kv_event_sources   vLLM's: ``{"<dp rank>": <resolved KV-events config>}``; ``{}`` when events are off.
GET  /tokenizer_info     vLLM's shape (the tokenizer's config, ``tokenizer_class``, ``chat_template``) plus
                         ``special_tokens_map`` and ``tokenizer_json_sha256``. vLLM serves it only with
                         ``--enable-tokenizer-info-endpoint``; lbd always does (a model's tokenizer and
                         template are not secrets, and `lbd route` learns them here to tokenize as this rank
                         does).
                         ``prompt_token_ids`` says the rank takes a router's token ids with a request
                         (lbd.engine.server.forwarded) and the fingerprint they must carry; with
                         ``?key_proof=`` (a router's proof of the internal key) its ``key`` says whether
                         that proof verified (``match``), and nothing else of the key.
GET  /tokenizer.json     the tokenizer itself (the `tokenizers` library's JSON), for routers that tokenize.
POST /reset_prefix_cache vLLM's development endpoint (only with ``VLLM_SERVER_DEV_MODE=1``): forget every
                         cached block (the rank publishes AllBlocksCleared); 409 while requests hold blocks.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from aiohttp import web

from lbd.engine.server.errors import APIError
from lbd.engine.server.forwarded import FIELD
from lbd.engine.server.request_io import state_of
from lbd.engine.server.streaming import json_response
from lbd.engine.tokenizer import Tokenizer

_DROPPED_KEYS = frozenset({"vocab_file", "merges_file", "tokenizer_file", "name_or_path", "chat_template"})
_json_cache: dict[int, tuple[bytes, str]] = {}  # id(Tokenizer) -> (tokenizer.json, its sha256)


def _plain(value: Any) -> Any:
    """JSON-able copy of tokenizer config values (AddedToken objects become their text)."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 1 << 63:
        return float(value)  # e.g. model_max_length = 1e30: beyond JSON's safe integers
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def tokenizer_json(tok: Tokenizer) -> tuple[bytes, str]:
    hit = _json_cache.get(id(tok))
    if hit is None:
        data = tok.rust.to_str().encode()
        hit = _json_cache[id(tok)] = (data, hashlib.sha256(data).hexdigest())
    return hit


async def kv_event_sources(request: web.Request) -> web.Response:
    state = state_of(request)
    sources = state.info.extra.get("kv_events")
    return json_response({str(state.config.rank): sources} if sources else {})


def tokenizer_info_body(tok: Tokenizer) -> dict[str, Any]:
    """What /tokenizer_info describes (its fingerprint keys forwarded prompt ids: server.forwarded)."""
    body = {k: _plain(v) for k, v in tok.hf.init_kwargs.items() if k not in _DROPPED_KEYS}
    body["tokenizer_class"] = type(tok.hf).__name__
    template = tok.hf.chat_template
    if isinstance(template, str) and template:
        body["chat_template"] = template
    body["special_tokens_map"] = _plain(tok.hf.special_tokens_map)
    body["tokenizer_json_sha256"] = tokenizer_json(tok)[1]
    return body


async def tokenizer_info(request: web.Request) -> web.Response:
    state = state_of(request)
    body = tokenizer_info_body(state.tokenizer)
    # whether the caller's proof of the internal key verified: nothing to check a guess against offline
    key = state.forwarded.key_answer(request.query.get("key_proof"))
    body["prompt_token_ids"] = {"field": FIELD, "fingerprint": state.forwarded.fingerprint, "key": key}
    return json_response(body)


async def tokenizer_file(request: web.Request) -> web.Response:
    data, sha = tokenizer_json(state_of(request).tokenizer)
    return web.Response(body=data, content_type="application/json", headers={"ETag": f'"{sha}"'})


async def reset_prefix_cache(request: web.Request) -> web.Response:
    if os.environ.get("VLLM_SERVER_DEV_MODE") != "1":
        raise APIError("POST /reset_prefix_cache is a development endpoint: start the engine with "
                       "VLLM_SERVER_DEV_MODE=1 to enable it", 404)
    state = state_of(request)
    state.check_available()
    if not await state.client.reset_prefix_cache():
        raise APIError("the prefix cache cannot be reset while requests hold KV blocks: retry when idle", 409)
    return json_response({"reset": True})


def add_cache_routes(app: web.Application) -> None:
    app.router.add_get("/kv_event_sources", kv_event_sources)
    app.router.add_get("/tokenizer_info", tokenizer_info)
    app.router.add_get("/tokenizer.json", tokenizer_file)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
