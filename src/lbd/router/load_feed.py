"""Pushed telemetry: one SUB socket per router worker follows every rank's load stream
(``lbd.wire.load_state``), and a rank's scrape loop sleeps while its stream is fresh.

- A rank advertises its stream in its JSON telemetry; the first scrape that reads it ``adopt``s the rank: a
  subscriber socket of its own connects to that address (CURVE-secured when the stream is), and the
  publisher's ``instance`` is mapped to the endpoint.
- Each message is a full state: it becomes the endpoint's sample, as a scrape's would (``Fleet.observe``). A
  ``seq`` that skips is a gap (counted; the message itself resyncs). A new ``instance`` from a known stream
  address is a restarted rank: the router forgets what it had cached there and follows the new epoch.
- A rank that stays silent for ``STALE_BEATS`` heartbeats is marked stale, and its scrape loop wakes up and
  scrapes (the fallback, as for engines that do not publish: vLLM, SGLang) until messages come again; a
  sweep every quarter heartbeat finds them, so a silent rank is scraped within two heartbeats.
- While a stream is fresh its last state still holds (a change would have been sent), so the sweep keeps the
  endpoint's sample age (what the policies weigh against ``--stale-after-ms``) under a quarter heartbeat.
- Messages are attributed by the connection they came on, never by what they say: one SUB socket per
  stream address (a SUB socket cannot tell its peers apart, so each followed publisher gets its own), and a
  message counts only for the endpoints that advertised that address. A payload that names an ``instance``
  or ``stream`` of another connection, or a DP ``rank`` other than its endpoint's, is dropped and counted
  (``lbd_router_telemetry_push_refused_total{reason}``): a followed publisher can set its own load only, not
  another rank's, nor claim another's DP rank or make the router forget what it routed elsewhere. Nor can
  an endpoint advertise a stream (address, or instance) another endpoint is followed on (``advertised``:
  it is scraped instead). (A socket per rank costs a descriptor and a little memory each; at 1,000 pushed
  ranks the idle router's CPU and RSS were the same as with one shared socket, benchmarks/fleet_scale.py.)
- Staleness is exported: ``lbd_router_telemetry_push_age_seconds`` and the ``telemetry_push`` entry of each
  endpoint in /router/status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import msgspec
import zmq
from prometheus_client.core import CounterMetricFamily

from lbd.common.cluster import CLUSTER_TOKEN_ENV, secure_zmq_client
from lbd.router.kv.view import subscribe_address
from lbd.router.telemetry import Sample, lora_view
from lbd.wire.load_state import PURPOSE, TOPIC, BadLoadState, LoadState, decode_advertised, decode_state

if TYPE_CHECKING:
    from lbd.router.endpoints import Endpoint


class Table(Protocol):
    """What the feed needs of the router's endpoints (``lbd.router.endpoints.Fleet``, which records what
    the streams say)."""

    def restarted(self, ep: Endpoint, why: str) -> None: ...

    def observe(self, ep: Endpoint, sample: Sample, began_at: float) -> None: ...

    def sample_holds(self, ep: Endpoint, now: float) -> None: ...

log = logging.getLogger("lbd.router")
STALE_BEATS = 1.5  # silent this many heartbeats: stale (the sweep runs every SWEEP_BEATS)
SWEEP_BEATS = 0.25
_DRAIN_MAX = 512  # messages read between two returns to the event loop
MAX_MESSAGE_BYTES = 64 * 1024  # a load state is about 100 bytes
MAX_STREAMS = 65_536  # sockets in the feed's ZMQ context (one per followed stream address)


@dataclass(slots=True)
class Pushed:
    """One endpoint's stream as this worker follows it."""

    ep: Endpoint
    stream: str  # the advertised address (the rank's identity across restarts)
    connect: str  # where this worker connected
    instance: str
    heartbeat_s: float
    curve: bool
    last_seq: int = -1
    last_at: float = 0.0  # loop time of the last message (0: none yet)
    lag_s: float = 0.0  # arrival minus the publisher's ts, last message
    messages: int = 0
    gaps: int = 0
    restarts: int = 0
    stale: bool = True  # no fresh message: the scrape loop runs
    stale_count: int = 0
    stale_after_s: float = 0.0  # how long it had been silent when last marked stale
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class LoadFeed:
    def __init__(self, state: Table) -> None:
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.by_url: dict[str, Pushed] = {}
        self.by_instance: dict[str, Pushed] = {}
        self.by_stream: dict[str, Pushed] = {}
        # a context of its own: one socket per followed rank, past libzmq's default cap of 1,023 sockets
        self._ctx = zmq.Context(io_threads=1)
        self._ctx.set(zmq.MAX_SOCKETS, MAX_STREAMS)
        self._subs: dict[str, zmq.Socket] = {}  # connect address -> its own socket (attribution)
        self._curve: dict[str, bool] = {}  # connect address -> whether its socket is CURVE-secured
        self._token = os.environ.get(CLUSTER_TOKEN_ENV) or None
        self._tasks: list[asyncio.Task[None]] = []
        self.unknown = 0  # messages from no adopted instance (a restart not yet seen, a removed rank)
        self.bad = 0
        self.messages = 0
        # payloads whose claims disagree with their connection, by reason: instance, stream, rank; and
        # advertisements of another endpoint's stream (advertised)
        self.refused: dict[str, int] = {"instance": 0, "stream": 0, "rank": 0, "advertised": 0}
        metrics = getattr(state, "metrics", None)
        if metrics is not None:
            metrics.register(_Refused(self.refused))

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._sweep())]

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for connect in list(self._subs):
            self._close(connect)
        self._ctx.destroy(linger=0)

    # ---- endpoints ------------------------------------------------------------------------------------
    def adopt(self, ep: Endpoint, advertised: object) -> None:
        """``ep``'s telemetry advertised a stream: follow it (again, when it moved or restarted)."""
        adv = decode_advertised(advertised)
        if adv is None or adv.topic != TOPIC.decode():
            return
        connect = subscribe_address(adv.endpoint, ep.url)
        if connect is None:
            return
        if adv.curve and not self._token:
            return  # a secured stream and no token here: scrape this rank
        if self._taken(ep.url, connect, adv.endpoint, adv.instance):
            return  # another endpoint's stream: following it here would give that rank's load to this one
        rec = self.by_url.get(ep.url)
        if rec is not None and rec.instance == adv.instance and rec.connect == connect:
            return
        if rec is not None:
            self._forget(rec)
            # a new process, unless its restart was already handled (the supervisor's new pid, a
            # re-admission) after the old stream's last message: what was routed since must not be forgotten
            if rec.instance != adv.instance and rec.last_at > max(ep.forgot_at, 0.0):
                self.state.restarted(ep, "it advertises a new load stream")
        rec = Pushed(ep, adv.endpoint, connect, adv.instance, max(0.05, adv.heartbeat_s), adv.curve)
        self.by_url[ep.url] = self.by_instance[adv.instance] = self.by_stream[adv.endpoint] = rec
        self._socket(connect, adv.curve)
        log.info("telemetry of %s: following its load stream %s", ep.url, connect)

    def _taken(self, url: str, connect: str, stream: str, instance: str) -> bool:
        """Another endpoint follows this address, stream or instance already: counted, and ``url`` is
        scraped (a rank that reuses a gone one's address is followed once that endpoint is removed)."""
        for other in (self.by_stream.get(stream), self.by_instance.get(instance)):
            if other is not None and other.ep.url != url:
                break
        else:
            other = next((r for r in self.by_url.values() if r.connect == connect and r.ep.url != url), None)
            if other is None:
                return False
        self.refused["advertised"] += 1
        if self.refused["advertised"] == 1:
            log.warning("telemetry of %s advertises the load stream of %s (%s): scraping it instead", url,
                        other.ep.url, connect)
        return True

    def remove(self, url: str) -> None:
        rec = self.by_url.get(url)
        if rec is not None:
            self._forget(rec)

    def _forget(self, rec: Pushed) -> None:
        self.by_url.pop(rec.ep.url, None)
        if self.by_instance.get(rec.instance) is rec:
            del self.by_instance[rec.instance]
        if self.by_stream.get(rec.stream) is rec:
            del self.by_stream[rec.stream]
        if not any(r.connect == rec.connect for r in self.by_url.values()):
            self._close(rec.connect)
        rec.wake.set()

    def fresh(self, url: str) -> bool:
        rec = self.by_url.get(url)
        return rec is not None and not rec.stale

    async def until_stale(self, url: str) -> None:
        """Wait while ``url``'s stream is fresh (its scrape loop sleeps here)."""
        rec = self.by_url.get(url)
        if rec is None or rec.stale:
            return
        rec.wake.clear()
        await rec.wake.wait()

    # ---- the socket -----------------------------------------------------------------------------------
    def _socket(self, connect: str, curve: bool) -> zmq.Socket:
        """The SUB socket of one stream address (plain or CURVE), read straight from the event loop: its
        descriptor wakes the loop, and a read takes every message queued (up to ``_DRAIN_MAX``, then the loop
        runs other work first). Whatever arrives on it is that address's publisher's."""
        sock = self._subs.get(connect)
        if sock is not None and self._curve.get(connect) != curve:
            self._close(connect)  # the stream moved to (or off) CURVE at the same address
            sock = None
        if sock is None:
            sock = self._subs[connect] = self._ctx.socket(zmq.SUB)
            self._curve[connect] = curve
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger one drops that publisher
            sock.setsockopt(zmq.RCVHWM, 10_000)
            sock.setsockopt(zmq.IPV6, 1)
            sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
            if curve:
                secure_zmq_client(sock, self._token, PURPOSE)
            sock.connect(connect)
            self.loop.add_reader(sock.getsockopt(zmq.FD), self._drain, sock, connect)
        return sock

    def _close(self, connect: str) -> None:
        sock = self._subs.pop(connect, None)
        self._curve.pop(connect, None)
        if sock is None:
            return
        with contextlib.suppress(Exception):
            self.loop.remove_reader(sock.getsockopt(zmq.FD))
        sock.close(linger=0)

    def _drain(self, sock: zmq.Socket, connect: str) -> None:
        if sock.closed:
            return
        try:
            for _ in range(_DRAIN_MAX):
                if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    return  # the descriptor is edge-triggered: reading EVENTS re-arms it
                frames = sock.recv_multipart(zmq.NOBLOCK)
                if len(frames) == 2:
                    self.on_message(frames[1], connect)
        except zmq.ZMQError as e:
            if e.errno != zmq.EAGAIN:  # the socket is closing (or broken): wait for the descriptor again
                log.warning("load stream %s: read failed: %s", connect, e)
            return
        except Exception:  # one bad message must not end the stream for every rank
            log.exception("load stream %s: a message failed", connect)
        self.loop.call_soon(self._drain, sock, connect)  # more queued: after the loop's other work

    # ---- messages -------------------------------------------------------------------------------------
    def on_message(self, payload: bytes, connect: str) -> None:
        """One message that came on ``connect``'s socket: it counts for an endpoint that advertised that
        address, whatever its payload claims."""
        try:
            msg = decode_state(payload)
        except BadLoadState:
            self.bad += 1
            return
        rec = self.by_instance.get(msg.instance)
        if rec is not None and rec.connect != connect:
            self.refused["instance"] += 1  # another rank's epoch, named from this connection
            return
        if rec is None:
            rec = self.by_stream.get(msg.stream)
            if rec is None:
                self.unknown += 1
                return
            if rec.connect != connect:
                self.refused["stream"] += 1  # a restart of another rank, claimed from this connection
                return
            if rec.ep.rank is not None and msg.rank != rec.ep.rank:
                self.refused["rank"] += 1
                return
            self._new_epoch(rec, msg.instance)
        if rec.ep.rank is not None and msg.rank != rec.ep.rank:
            self.refused["rank"] += 1  # its endpoint is another DP rank (the supervisor's, or a pin's)
            return
        if msg.seq <= rec.last_seq:
            return  # a duplicate or one overtaken: the newer state is already applied
        if rec.last_seq >= 0 and msg.seq != rec.last_seq + 1:
            rec.gaps += 1
        rec.last_seq = msg.seq
        self.apply(rec, msg)

    def _new_epoch(self, rec: Pushed, instance: str) -> None:
        """A new publisher on a known stream address: the rank restarted, its cache is cold."""
        if self.by_instance.get(rec.instance) is rec:
            del self.by_instance[rec.instance]
        rec.instance, rec.last_seq = instance, -1
        rec.restarts += 1
        self.by_instance[instance] = rec
        self.state.restarted(rec.ep, "its load stream has a new instance")

    def apply(self, rec: Pushed, msg: LoadState) -> None:
        now = self.loop.time()
        ep = rec.ep
        rec.messages += 1
        self.messages += 1
        rec.last_at = now
        rec.lag_s = max(0.0, time.time() - msg.ts)
        rec.heartbeat_s = max(0.05, msg.heartbeat_s)
        if rec.stale:
            rec.stale = False
            log.debug("telemetry of %s: pushed (stream %s)", ep.url, rec.connect)
        sample = Sample(running=msg.running, waiting=msg.waiting, kv_usage=msg.kv_usage,
                        prefix_queries=msg.prefix_queries, prefix_hits=msg.prefix_hits,
                        block_size=msg.block_size, num_blocks=msg.num_blocks, prompt_tokens=msg.prompt_tokens,
                        generation_tokens=msg.generation_tokens, ranks={msg.rank}, models=set(ep.models),
                        lora=lora_view(msgspec.to_builtins(msg.lora)) if msg.lora is not None else None)
        self.state.observe(ep, sample, now)

    # ---- staleness ------------------------------------------------------------------------------------
    async def _sweep(self) -> None:
        while True:
            beat = min((r.heartbeat_s for r in self.by_url.values()), default=1.0)
            await asyncio.sleep(max(0.01, beat * SWEEP_BEATS))
            now = self.loop.time()
            for rec in self.by_url.values():
                if not rec.stale and now - rec.last_at <= STALE_BEATS * rec.heartbeat_s:
                    # a fresh stream sends every change: its last state still holds (the policies' age)
                    self.state.sample_holds(rec.ep, now)
                elif not rec.stale:
                    rec.stale = True
                    rec.stale_count += 1
                    rec.stale_after_s = now - rec.last_at
                    rec.wake.set()  # its scrape loop takes over
                    log.info("telemetry of %s: no load message for %.2fs; scraping it until they return",
                             rec.ep.url, now - rec.last_at)

    # ---- reporting ------------------------------------------------------------------------------------
    def status(self, url: str) -> dict[str, object] | None:
        rec = self.by_url.get(url)
        if rec is None:
            return None
        age = self.loop.time() - rec.last_at if rec.last_at else None
        return {"stream": rec.connect, "state": "stale" if rec.stale else "pushed",
                "age_s": None if age is None else round(age, 3), "lag_s": round(rec.lag_s, 4),
                "heartbeat_s": rec.heartbeat_s, "seq": rec.last_seq, "messages": rec.messages,
                "gaps": rec.gaps, "restarts": rec.restarts, "stale_count": rec.stale_count,
                "stale_after_s": round(rec.stale_after_s, 3)}

    def rows(self) -> Iterable[tuple[str, float, bool]]:
        """(endpoint, seconds since its last message or -1, stale) per followed stream."""
        now = self.loop.time()
        for url, rec in self.by_url.items():
            yield url, (now - rec.last_at) if rec.last_at else -1.0, rec.stale


class _Refused:
    """``lbd_router_telemetry_push_refused_total{reason}``: load messages dropped because their payload's
    claims disagree with the connection they came on (this worker)."""

    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        family = CounterMetricFamily(
            "lbd_router_telemetry_push_refused",
            "Pushed load messages dropped: their instance, stream or DP rank is not their connection's; "
            "advertised: an endpoint advertised another's stream (this worker).", labels=["reason"])
        for reason, n in self.counts.items():
            family.add_metric([reason], n)
        yield family
