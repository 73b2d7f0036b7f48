"""LoRA adapters at the front end, vLLM's interface.

- A request picks an adapter by ``model`` (``FrontendState.check_model`` / ``adapter``); ``/v1/models`` lists
  each adapter as vLLM's card (``root`` its folder, ``parent`` its base model).
- ``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path", "load_inplace"}`` and ``POST
  /v1/unload_lora_adapter`` ``{"lora_name"}``, only when ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` is 1 or true
  (as in vLLM: otherwise the routes do not exist). The answers are vLLM's: 200 with a plain-text "Success:
  ..." line, 400 for a bad request or an adapter the engine refuses (the reason in the message), 404 for an
  unknown adapter or folder. The core reads and checks the adapter off its step loop (lbd.engine.lora);
  this front end learns the name once the core says it is loaded.

Adapters loaded through another front end of the same rank (``--api-server-count`` > 1) are not known here
until this one loads them too: each front end keeps its own list, as each vLLM API server does.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from typing import Any

from aiohttp import web

from lbd.engine.config.lora import LoraModule
from lbd.engine.server.errors import APIError
from lbd.engine.server.request_io import read_json, state_of

RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


_locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # name -> (lock, [holders and waiters])


@contextlib.asynccontextmanager
async def _name_lock(name: str) -> AsyncIterator[None]:
    """Loads and unloads of one adapter name in turn (as vLLM's per-name lock); the table keeps only names
    with a holder or a waiter."""
    lock, users = _locks.setdefault(name, (asyncio.Lock(), [0]))
    users[0] += 1
    try:
        async with lock:
            yield
    finally:
        users[0] -= 1
        if not users[0]:
            del _locks[name]


def runtime_updates_allowed() -> bool:
    return os.environ.get(RUNTIME_ENV, "0").strip().lower() in ("1", "true")


def lora_cards(state: Any) -> list[dict[str, Any]]:
    base = state.config.model.model_names[0]
    return [{"id": m.name, "object": "model", "created": int(state.started), "owned_by": "lbd",
             "root": m.path, "parent": m.base_model_name or base, "max_model_len": None, "permission": []}
            for m in state.loras.values()]


def _name(body: Any, key: str = "lora_name") -> str | None:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, str) and value else None


async def load_lora_adapter(request: web.Request) -> web.Response:
    state = state_of(request)
    body = await read_json(request)
    name, path = _name(body), _name(body, "lora_path")
    if name is None or path is None:
        raise APIError("Both 'lora_name' and 'lora_path' must be provided.", 400, err_type="InvalidUserInput")
    async with _name_lock(name):
        return await _load(state, body, name, path)


async def _load(state: Any, body: Any, name: str, path: str) -> web.Response:
    if name in state.config.model.model_names:
        raise APIError(f"The lora adapter '{name}' conflicts with a served base model.", 400,
                       err_type="InvalidUserInput")
    if name in state.loras and not (isinstance(body, dict) and body.get("load_inplace") is True):
        raise APIError(f"The lora adapter '{name}' has already been loaded. If you want to load the adapter "
                       "in place, set 'load_inplace' to True.", 400, err_type="InvalidUserInput")
    state.check_available()
    done = await state.client.lora_command("load", name, path)
    if done.status != 200:
        raise APIError(done.message, done.status)
    state.loras[name] = LoraModule(name, path)
    return web.Response(text=done.message)


async def unload_lora_adapter(request: web.Request) -> web.Response:
    state = state_of(request)
    name = _name(await read_json(request))
    if name is None:
        raise APIError("'lora_name' needs to be provided to unload a LoRA adapter.", 400,
                       err_type="InvalidUserInput")
    async with _name_lock(name):
        return await _unload(state, name)


async def _unload(state: Any, name: str) -> web.Response:
    if name not in state.loras:
        raise APIError(f"The lora adapter '{name}' cannot be found.", 404, err_type="NotFoundError")
    state.check_available()
    done = await state.client.lora_command("unload", name)
    state.loras.pop(name, None)  # gone from the core too (or never there: 404)
    if done.status not in (200, 404):
        raise APIError(done.message, done.status)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def add_lora_routes(app: web.Application) -> None:
    if runtime_updates_allowed():
        app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
        app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
