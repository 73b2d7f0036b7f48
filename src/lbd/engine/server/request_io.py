"""Reading requests: the shared state, the body as JSON (with the size limit), the DP-rank header."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from lbd.common.rank_header import RANK_HEADER, RankHeaderError, parse_rank
from lbd.engine.server.errors import APIError, bad_request
from lbd.engine.server.state import FrontendState

STATE = web.AppKey("state", FrontendState)


def state_of(request: web.Request) -> FrontendState:
    return request.app[STATE]


def checked_state(request: web.Request) -> FrontendState:
    """The state, after refusing requests this server cannot take (draining, core dead, other DP rank)."""
    state = state_of(request)
    check_rank(request, state)
    state.check_available()
    return state


def check_rank(request: web.Request, state: FrontendState) -> None:
    """The one rule of lbd.common.rank_header; a rank other than ours is a 400 too."""
    try:
        rank = parse_rank(request.headers.getall(RANK_HEADER, ()))
    except RankHeaderError as e:
        raise APIError(str(e), 400, RANK_HEADER) from None
    if rank is not None and rank != state.config.rank:
        raise APIError(f"{RANK_HEADER} {rank} does not match this server's data parallel rank "
                       f"{state.config.rank}", 400, RANK_HEADER)


async def read_json(request: web.Request) -> Any:
    """The body as JSON, within --max-request-body-bytes and --body-read-timeout-s. A body aiohttp cannot
    decode (a bad or unknown Content-Encoding) is the client's error: 400, never 500."""
    server = request.app[STATE].config.server
    limit = server.max_request_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(request.content_length, limit)
    try:
        async with asyncio.timeout(server.body_read_timeout_s):
            body = await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise _too_large(None, limit) from e
    except TimeoutError:
        raise APIError(f"request body not received within {server.body_read_timeout_s:g} s "
                       "(--body-read-timeout-s)", 408, close=True) from None
    except (HttpProcessingError, RequestPayloadError) as e:  # e.g. a body its Content-Encoding cannot decode
        why = getattr(e, "message", None) or str(e) or type(e).__name__
        # where the body's bytes end is unknown now: answer, then close the connection
        raise APIError(f"cannot read the request body: {why}", 400, close=True) from None
    if not body:
        raise bad_request("request body is empty: send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"request body is not valid JSON: {e}") from e


def _too_large(size: int | None, limit: int) -> APIError:
    got = f"{size} bytes" if size is not None else "more"
    return APIError(f"request body of {got} exceeds the {limit}-byte limit (--max-request-body-bytes)", 413)
