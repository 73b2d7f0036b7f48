"""Who may use the router and how fast: API keys (``--api-key``, ``--api-key-file`` re-read on SIGHUP) checked
in constant time (``lbd.common.auth``), and per-key token buckets for requests/s and tokens/s.

Tokens are charged on admission: the prompt's estimate (characters / 4, as the policies use) plus the
request's output cap, ``max_tokens`` (``max_completion_tokens``, ``max_output_tokens``) times ``n``. A request
that names no cap is charged what it may produce by default: 16 tokens for /v1/completions (the engines'
default), ``UNCAPPED_OUTPUT_TOKENS`` for a chat or a response (which run to the end of the context). When the
answer ends the charge is settled on the output actually produced (``lbd.router.metering``): an answer
longer than its charge leaves the bucket in debt, a shorter one gets the rest back, so omitting the cap
neither makes output free nor costs more than the output. Paths that generate nothing (/tokenize...) are
charged their prompt only. A bucket holds ``rate x
--rate-limit-burst-s`` (at least one request's worth). A request is admitted when its bucket holds its cost (a
full bucket for one larger than the bucket) and then pays in full, leaving a larger one's bucket in debt: a
caller over its rate gets 429 with ``Retry-After`` (whole seconds until its bucket has room), and a big
request is never refused forever. With ``--workers N`` each worker enforces rate / N (the kernel spreads
connections evenly among workers).
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from lbd.common.auth import ApiKey, KeyRing, make_key, read_key_file

log = logging.getLogger("lbd.router")
UPSTREAM_KEY_ENV = "LBD_UPSTREAM_API_KEY"
ROUTER_KEYS_ENV = "LBD_ROUTER_API_KEYS"  # client keys, one per line (how lbd serve hands its --api-key over)
UNCAPPED_OUTPUT_TOKENS = 2048  # what a chat or response without max_tokens is charged for its output
COMPLETIONS_DEFAULT_TOKENS = 16  # /v1/completions' max_tokens when the request names none (vLLM's, ours)
GENERATING = {"/v1/chat/completions": UNCAPPED_OUTPUT_TOKENS, "/v1/completions": COMPLETIONS_DEFAULT_TOKENS,
              "/v1/responses": UNCAPPED_OUTPUT_TOKENS, "/v1/messages": UNCAPPED_OUTPUT_TOKENS}


def add_auth_arguments(p: argparse.ArgumentParser) -> None:
    """`lbd route` flags of this module (keys, credentials towards the engines, rate limits)."""
    g = p.add_argument_group("authentication and rate limits")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=[],
        metavar="KEY",
        help="client keys (Authorization: Bearer <key>) required on every path but /health, /readyz and "
        f"/metrics; also ${ROUTER_KEYS_ENV}, one per line",
    )
    g.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        help="client keys, one per line: <key> [name=<name>] [rps=<req/s>] [tps=<tokens/s>]; re-read on "
        "SIGHUP",
    )
    g.add_argument(
        "--forward-authorization",
        action="store_true",
        help="pass the client's Authorization header on to the engines (default: dropped)",
    )
    g.add_argument(
        "--upstream-api-key",
        default=None,
        help=f"key the router sends to the engines (their --api-key); also ${UPSTREAM_KEY_ENV}",
    )
    g.add_argument(
        "--rate-limit-rps", type=float, default=0.0, help="requests/s per key (token bucket; 0: no limit)"
    )
    g.add_argument(
        "--rate-limit-tps",
        type=float,
        default=0.0,
        help="tokens/s per key: prompt (estimated) + max_tokens charged on admission (without max_tokens: "
        f"{UNCAPPED_OUTPUT_TOKENS}, 16 on /v1/completions), settled on the output produced when the answer "
        "ends (0: no limit)",
    )
    g.add_argument(
        "--rate-limit-burst-s",
        type=float,
        default=1.0,
        help="bucket size in seconds of the rate: how far a key may burst above it",
    )


@dataclass(slots=True)
class Bucket:
    rate: float  # per second
    capacity: float
    level: float
    stamp: float

    @classmethod
    def full(cls, rate: float, burst_s: float, now: float, unit: float = 1.0) -> Bucket:
        capacity = max(rate * burst_s, unit)
        return cls(rate, capacity, capacity, now)

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, now: float, cost: float) -> float:
        """Seconds until ``cost`` may be taken (0: now). Refills first."""
        self.refill(now)
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost

    def adjust(self, now: float, tokens: float) -> None:
        """Charge ``tokens`` more after the fact (a debt may take the level below zero: the next request
        waits) or, negative, give them back (never past the capacity). Refills first."""
        self.refill(now)
        self.level = min(self.capacity, self.level - tokens)


@dataclass(slots=True)
class _Limits:
    requests: Bucket | None
    tokens: Bucket | None


class Gate:
    """Keys and rate limits of one router worker."""

    def __init__(self, keys: list[str], key_file: Path | None, rps: float, tps: float, burst_s: float,
                 workers: int = 1) -> None:
        self._static = [make_key(k) for k in keys]
        self.key_file = key_file
        self.rps, self.tps, self.burst_s, self.workers = rps, tps, burst_s, max(1, workers)
        self.ring = KeyRing(self._static)
        self._limits: dict[str, _Limits] = {}
        if key_file is not None:
            self.ring = KeyRing([*self._static, *read_key_file(key_file)])

    @property
    def enabled(self) -> bool:
        return bool(self.ring)

    @property
    def counts_tokens(self) -> bool:
        return self.tps > 0 or any(k.tps for k in self.ring.keys)

    @property
    def limits_on(self) -> bool:
        return self.rps > 0 or self.tps > 0 or any(k.rps or k.tps for k in self.ring.keys)

    def reload(self) -> None:
        """Re-read --api-key-file (SIGHUP); on an error the previous keys stay."""
        if self.key_file is None:
            return
        try:
            keys = read_key_file(self.key_file)
        except (OSError, ValueError) as e:
            log.error("cannot reload %s: %s (keeping the previous keys)", self.key_file, e)
            return
        self.ring = KeyRing([*self._static, *keys])
        self._limits.clear()  # limits may have changed; buckets start full
        log.info("API key file read: %d keys", len(keys))

    def identify(self, authorization: bytes | None) -> ApiKey | None:
        return self.ring.check_header(authorization)

    def admit(self, key: ApiKey, tokens: float, now: float | None = None) -> float:
        """0 when ``key`` may send a request of ``tokens`` now (it is charged), else the seconds to wait."""
        now = time.monotonic() if now is None else now
        lim = self._limits.get(key.name)
        if lim is None:
            lim = self._limits[key.name] = self._buckets(key, now)
        wait = 0.0
        if lim.requests is not None:
            wait = lim.requests.wait(now, 1.0)
        if lim.tokens is not None:
            wait = max(wait, lim.tokens.wait(now, tokens))
        if wait > 0.0:
            return wait
        if lim.requests is not None:
            lim.requests.take(1.0)
        if lim.tokens is not None:
            lim.tokens.take(tokens)
        return 0.0

    def token_bucket(self, key: ApiKey) -> Bucket | None:
        """``key``'s token bucket (after ``admit``), settled on its answers' output (lbd.router.metering)."""
        lim = self._limits.get(key.name)
        return lim.tokens if lim is not None else None

    def _buckets(self, key: ApiKey, now: float) -> _Limits:
        rps = (key.rps or self.rps) / self.workers
        tps = (key.tps or self.tps) / self.workers
        return _Limits(Bucket.full(rps, self.burst_s, now) if rps > 0 else None,
                       Bucket.full(tps, self.burst_s, now, unit=1.0) if tps > 0 else None)


def retry_after(wait_s: float) -> int:
    return max(1, math.ceil(wait_s))


def requested_tokens(body: bytes, path: str | None = None) -> int:
    """The output a request may produce: its cap (``max_tokens``, ``max_completion_tokens`` or
    ``max_output_tokens``) times ``n``; without a cap, the path's default (``GENERATING``; a ``path`` of None
    is taken for a chat); 0 on a path that generates nothing or a body that is not a JSON object."""
    uncapped = UNCAPPED_OUTPUT_TOKENS if path is None else GENERATING.get(path.partition("?")[0], 0)
    if not uncapped:
        return 0
    try:
        data = orjson.loads(body) if body else None
    except orjson.JSONDecodeError:
        return 0
    if not isinstance(data, dict):
        return 0
    value = next((data[k] for k in ("max_completion_tokens", "max_tokens", "max_output_tokens")
                  if data.get(k) is not None), None)
    n = data.get("n", 1)
    times = n if isinstance(n, int) and not isinstance(n, bool) and 0 < n <= 128 else 1
    if value is None:
        return uncapped * times
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        return 0  # the engine refuses it: nothing is produced
    return value * times
