"""Reading requests: the shared state, the body as JSON (with the size limit), the DP-rank header."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from engine.server.errors import APIError, bad_request
from engine.server.state import FrontendState

STATE = web.AppKey("state", FrontendState)
RANK_HEADER = "X-data-parallel-rank"


def state_of(request: web.Request) -> FrontendState:
    return request.app[STATE]


def checked_state(request: web.Request) -> FrontendState:
    """The state, after refusing requests this server cannot take (draining, core dead, other DP rank)."""
    state = state_of(request)
    check_rank(request, state)
    state.check_available()
    return state


def check_rank(request: web.Request, state: FrontendState) -> None:
    value = request.headers.get(RANK_HEADER)
    if value is None:
        return
    try:
        rank = int(value)
    except ValueError:
        return  # vLLM ignores a header that is not an integer
    if rank != state.args.rank:
        raise APIError(f"{RANK_HEADER} {rank} does not match this server's data parallel rank "
                       f"{state.args.rank}", 400, RANK_HEADER)


async def read_json(request: web.Request) -> Any:
    limit = request.app[STATE].args.max_request_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise _too_large(None, limit) from e
    if not body:
        raise bad_request("request body is empty: send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else "more"
    return APIError(f"request body of {got} exceeds the {limit}-byte limit (--max-request-body-bytes)", 413)
