"""Connection and request limits, one set of flags with one meaning on every server (engine front end and
supervisor health port on aiohttp, the router on its own httptools server). The README's limits table lists
them with what a client sees when it hits one.
"""

from __future__ import annotations

import argparse
import logging
import resource
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
