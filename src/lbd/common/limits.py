"""Connection and request limits, one set of flags with one meaning on every server (engine front end and
supervisor health port on aiohttp, the router on its own httptools server). The README's limits table lists
them with what a client sees when it hits one. Also the caps on what this process reads from its peers
(``read_capped`` and its aiohttp and router-client forms).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import resource
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def parse_bytes(text: str) -> int:
    """Parse 4GiB, 512MiB, 1e9 or a plain integer (every CLI that takes a byte size)."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    low = text.strip().lower()
    for suffix, mult in units.items():
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * mult)
    return int(float(low))


@dataclass(slots=True, frozen=True)
class Limits:
    max_request_line_bytes: int = 8190
    max_header_bytes: int = 8190  # one header line (name and value)
    max_headers: int = 100
    max_head_bytes: int = 64 * 1024  # the whole head: request line and every header
    max_request_body_bytes: int = 32 * 1024 * 1024
    header_read_timeout_s: float = 10.0  # first byte of a request head to its end
    body_read_timeout_s: float = 60.0  # end of the head to the end of the body
    keep_alive_timeout_s: float = 75.0  # an idle connection between requests
    max_connections: int = 4096  # open client connections per process


DEFAULTS = Limits()
_FIELDS = tuple(Limits.__dataclass_fields__)


def add_limit_arguments(parser: argparse.ArgumentParser | Any) -> None:
    d = DEFAULTS
    g = parser.add_argument_group("connection limits") if isinstance(parser, argparse.ArgumentParser) \
        else parser
    g.add_argument("--max-request-line-bytes", type=parse_bytes, default=d.max_request_line_bytes,
                   help="longer request lines (method + URL) get 414 (router) or 400, then a close")
    g.add_argument("--max-header-bytes", type=parse_bytes, default=d.max_header_bytes,
                   help="a longer header line gets 431 (router) or 400, then a close")
    g.add_argument("--max-headers", type=int, default=d.max_headers,
                   help="more request headers than this get 431 (router) or 400, then a close")
    g.add_argument("--max-head-bytes", type=parse_bytes, default=d.max_head_bytes,
                   help="a larger request head (request line + all headers) gets 431, then a close")
    g.add_argument("--max-request-body-bytes", type=parse_bytes, default=d.max_request_body_bytes,
                   help="larger request bodies get 413")
    g.add_argument("--header-read-timeout-s", type=float, default=d.header_read_timeout_s,
                   help="a request head not complete this long after its first byte gets 408 and a close")
    g.add_argument("--body-read-timeout-s", type=float, default=d.body_read_timeout_s,
                   help="a request body not complete this long after its head gets 408 and a close")
    g.add_argument("--keep-alive-timeout-s", type=float, default=d.keep_alive_timeout_s,
                   help="idle keep-alive connections are closed after this long")
    g.add_argument("--max-connections", type=int, default=d.max_connections,
                   help="open client connections per process; more get 503 and a close")


def limits_from(obj: Any) -> Limits:
    """The limits held by an argparse namespace or an args dataclass with the same field names."""
    return Limits(**{name: getattr(obj, name) for name in _FIELDS})


def check_limits(limits: Limits) -> str | None:
    """Why these limits are impossible (one line naming the flag), or None."""
    for name in _FIELDS:
        if not getattr(limits, name) > 0:
            return f"--{name.replace('_', '-')} must be positive, got {getattr(limits, name)}"
    return None


def raise_open_files_limit(max_connections: int, reserve: int = 1024) -> int:
    """Lift the soft RLIMIT_NOFILE towards the hard one so ``max_connections`` clients fit with room for
    upstream connections and files; returns the soft limit now in force (a warning if it is too low)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max_connections + reserve
    if soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    if soft < want:
        log.warning("open-file limit %d is below --max-connections %d + %d: connections may fail with "
                    "EMFILE before the cap answers 503 (raise ulimit -n)", soft, max_connections, reserve)
    return soft


# ---- reading answers from peers -------------------------------------------------------------------------
# Every answer read from another process (a rank's /metrics, /health, /v1/models, /tokenizer_info; a
# supervisor's or node's /status; a probe) is capped in size as well as in time: a peer that answers with an
# endless or huge body costs the reader at most the cap in memory, and its reason shows where the reader
# reports the peer's state.
PEER_READ_MAX_BYTES = 8 << 20  # metrics, status, health, model lists: a large vLLM /metrics is ~1 MiB
PEER_FILE_MAX_BYTES = 64 << 20  # a tokenizer.json (the largest vocabularies' are ~20 MiB)
PEER_MESSAGE_MAX_BYTES = 64 << 20  # one ZMQ message of a peer's stream (a KV-event batch); zmq.MAXMSGSIZE


class PeerReadTooLarge(ConnectionError):
    """A peer's answer went over its cap; the connection is dropped (an OSError, so every reader that
    handles a failed connection handles this too)."""


def peer_read_cap(path: str) -> int:
    """The size cap of an answer from ``path`` of a peer: tokenizer files get the larger one."""
    return PEER_FILE_MAX_BYTES if path.split("?", 1)[0].endswith("/tokenizer.json") else PEER_READ_MAX_BYTES


async def read_capped(read_chunk: Callable[[], Awaitable[bytes]], max_bytes: int,
                      declared: int | None = None, what: str = "answer") -> bytes:
    """The body that ``read_chunk`` yields (b"" ends it), refused with PeerReadTooLarge as soon as its
    declared length or the bytes read so far pass ``max_bytes``."""
    if declared is not None and declared > max_bytes:
        raise PeerReadTooLarge(f"{what} declares {declared} bytes, over the {max_bytes}-byte cap")
    parts: list[bytes] = []
    size = 0
    while chunk := await read_chunk():
        size += len(chunk)
        if size > max_bytes:
            raise PeerReadTooLarge(f"{what} is over the {max_bytes}-byte cap")
        parts.append(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


async def read_aiohttp(resp: Any, max_bytes: int = PEER_READ_MAX_BYTES, timeout_s: float | None = None,
                       what: str | None = None) -> bytes:
    """An aiohttp ``ClientResponse``'s body within ``max_bytes`` and ``timeout_s`` (None: the session's
    own total timeout alone); an answer over the cap closes the connection."""
    label = what or f"the answer of {resp.url}"
    try:
        async with asyncio.timeout(timeout_s):
            return await read_capped(resp.content.readany, max_bytes, resp.content_length, label)
    except PeerReadTooLarge:
        resp.close()
        raise


async def read_upstream(resp: Any, max_bytes: int = PEER_READ_MAX_BYTES, timeout_s: float | None = None,
                        what: str = "answer") -> bytes:
    """The router's own client (lbd.router.upstream ``Response``): its body within ``max_bytes`` and within
    ``timeout_s`` in all (not per wait: a peer trickling a byte at a time cannot hold the read longer); the
    caller closes ``resp`` (a body not read to its end closes the connection)."""
    whole = resp.take_whole() if resp.content_length is None or resp.content_length <= max_bytes else None
    if whole is not None:  # all of it has arrived (the usual small answer): no coroutine
        if len(whole) > max_bytes:
            raise PeerReadTooLarge(f"{what} is over the {max_bytes}-byte cap")
        return whole
    async with asyncio.timeout(timeout_s):
        return await read_capped(resp.read_chunk, max_bytes, resp.content_length, what)
