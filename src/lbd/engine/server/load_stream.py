"""The rank's pushed load state (``lbd.wire.load_state``): a PUB socket in the first front end, fed by the
core's stats as they arrive, so routers need not scrape /telemetry.

A message goes out when running, waiting, KV use or the block count change (at most one per
``MIN_INTERVAL_S``: a busy core reports every step) and at least every ``--load-heartbeat-s``. Sends never
block the event loop (PUB drops for a subscriber past its high-water mark; it sees a gap in ``seq``).

The socket binds loopback unless the rank serves beyond loopback (a named non-loopback address, or every
interface as `lbd serve` ranks of a group across machines do) and the cluster token is set: then it binds
what HTTP binds as a CURVE server keyed by the token, so only token holders (the routers `lbd serve` hands
the token to) can follow it, and a router on another machine follows it rather than scraping. Without a
token the stream stays on loopback (routers elsewhere scrape this rank; a named address says so once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time

import zmq

from lbd.common.cluster import CLUSTER_TOKEN_ENV, LOOPBACK, is_loopback, is_wildcard, secure_zmq_server
from lbd.wire.core_messages import SchedulerStats
from lbd.wire.load_state import PURPOSE, TOPIC, LoadState, encode_state

logger = logging.getLogger(__name__)
MIN_INTERVAL_S = 0.02  # a change is sent at most this often (the heartbeat sends the rest)


def stream_host(host: str | None, token: str | None) -> tuple[str, bool]:
    """(the address to bind, whether it is CURVE-secured) for a rank serving HTTP on ``host``."""
    if is_wildcard(host):  # every interface: CURVE there with the token, else loopback only
        return (("::" if host in ("::", "[::]") else "0.0.0.0"), True) if token else (LOOPBACK, False)
    if is_loopback(host):
        return LOOPBACK, False
    if not token:
        logger.warning("load stream: --host %s is not loopback and no cluster token is set (%s): the stream "
                       "stays on loopback, so routers on other machines scrape this rank", host,
                       CLUSTER_TOKEN_ENV)
        return LOOPBACK, False
    return host, True


class LoadPublisher:
    def __init__(self, rank: int, heartbeat_s: float, host: str | None = None) -> None:
        self.rank = rank
        self.heartbeat_s = heartbeat_s
        self.instance = secrets.token_hex(8)
        token = os.environ.get(CLUSTER_TOKEN_ENV) or None
        bind, self.curve = stream_host(host, token)
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(64)
        if self.curve:
            secure_zmq_server(self._pub, token, PURPOSE)
        if ":" in bind:
            self._pub.setsockopt(zmq.IPV6, 1)
        addr = f"[{bind}]" if ":" in bind else bind
        self._pub.bind(f"tcp://{addr}:0")
        port = self._pub.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
        self.endpoint = f"tcp://{addr}:{port}"
        self._seq = 0
        self._stats = SchedulerStats()
        self._sent_key: tuple[object, ...] | None = None
        self._last_sent = 0.0
        self._pending: asyncio.TimerHandle | None = None
        self._beat: asyncio.Task[None] | None = None
        logger.info("load stream: publishing on %s (heartbeat %.2fs%s)", self.endpoint, heartbeat_s,
                    ", CURVE" if self.curve else "")

    def advertised(self) -> dict[str, object]:
        return {"endpoint": self.endpoint, "instance": self.instance, "heartbeat_s": self.heartbeat_s,
                "topic": TOPIC.decode(), "curve": self.curve}

    def start(self) -> None:
        self._beat = asyncio.ensure_future(self._heartbeat())
        self._send()

    def update(self, stats: SchedulerStats) -> None:
        """The core's newest stats: sent now if what routers weigh changed (or soon, when just sent)."""
        self._stats = stats
        key = _key(stats)
        if key == self._sent_key or self._pending is not None:
            return
        wait = self._last_sent + MIN_INTERVAL_S - time.monotonic()
        if wait <= 0:
            self._send()
        else:
            self._pending = asyncio.get_running_loop().call_later(wait, self._send)

    def _send(self) -> None:
        self._pending = None
        s = self._stats
        msg = LoadState(self.instance, self._seq, time.time(), self.rank, s.num_running, s.num_waiting,
                        s.kv_cache_usage, s.num_blocks, s.block_size, s.prefix_cache_queries,
                        s.prefix_cache_hits, s.prompt_tokens, s.generation_tokens, self.heartbeat_s,
                        self.endpoint, s.lora)
        self._seq += 1
        self._sent_key = _key(s)
        self._last_sent = time.monotonic()
        try:
            self._pub.send_multipart((TOPIC, encode_state(msg)), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no room: subscribers see a gap in seq, and the next message carries the whole state

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(max(0.0, self._last_sent + self.heartbeat_s - time.monotonic()))
            if time.monotonic() - self._last_sent >= self.heartbeat_s * 0.99:
                self._send()

    def close(self) -> None:
        if self._beat is not None:
            self._beat.cancel()
        if self._pending is not None:
            self._pending.cancel()
        self._pub.close(linger=0)
        self._ctx.term()


def _key(s: SchedulerStats) -> tuple[object, ...]:
    """What routers weigh: a change of it is sent (the load, and where the adapters are)."""
    lora = s.lora
    where = (tuple(lora.device), tuple(lora.cpu), lora.free_slots, lora.evicts, tuple(lora.running),
             tuple(lora.waiting)) if lora is not None else None
    return (s.num_running, s.num_waiting, s.kv_cache_usage, s.num_blocks, where)
