"""One endpoint's KV-event stream, applied to its ``EndpointBlocks`` in sequence order.

- A SUB socket follows the publisher; a socket monitor reports each (re)connection and disconnection.
- On every connection the view is rebuilt from a fresh state: cleared, then the publisher's retained batches
  are replayed from sequence 0 over a DEALER on the replay endpoint (``[b"", start]`` out; ``[b"", topic, seq,
  payload]`` back until vLLM's end marker, seq -1; vLLM before 0.32 sent no topic frame: both are read).
  Live batches that arrive meanwhile wait in the SUB socket and are applied after it, skipping duplicates.
- A sequence gap (a dropped batch) is replayed from the first missing number; if the publisher no longer
  retains it, the view is cleared and marked partial (events lost: blocks it held before are unknown).
- A sequence number that goes back means a new publisher (the engine restarted): clear, replay from 0.
- A disconnection (the engine died) clears the view at once: a restarted rank's cache is cold.
AllBlocksCleared clears the view too. After each batch the endpoint's blocks are trimmed to their cap
(``EndpointBlocks.trim``). ``state`` is connecting, syncing, live or disconnected.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lbd.common.limits import PEER_MESSAGE_MAX_BYTES
from lbd.router.kv.index import EndpointBlocks
from lbd.wire.kv_events import AllBlocksCleared, BadPayload, BlockRemoved, BlockStored, decode_batch

log = logging.getLogger("lbd.router")
END_SEQ = -1
REPLAY_TIMEOUT_S = 5.0
_YIELD_EVERY = 256  # replayed batches applied between two returns to the event loop


@dataclass(slots=True)
class Source:
    """Where an endpoint publishes: subscribe and replay addresses (ZMQ), topic."""

    endpoint: str
    replay_endpoint: str | None
    topic: str = ""


@dataclass(slots=True)
class FeedStats:
    state: str = "connecting"
    last_seq: int = -1
    batches: int = 0
    events: dict[str, int] = field(default_factory=lambda: {"stored": 0, "removed": 0, "cleared": 0})
    gaps: int = 0
    resyncs: int = 0
    lost: int = 0  # times events were lost for good (the view went partial)
    partial: bool = False
    last_batch_at: float = 0.0  # time.time() a batch last arrived
    lag_s: float = 0.0  # arrival time minus the batch's ts, of the last live batch
    block_size: int = 0
    error: str = ""


class EventFeed:
    def __init__(self, name: str, source: Source, blocks: EndpointBlocks) -> None:
        self.name = name
        self.source = source
        self.blocks = blocks
        self.stats = FeedStats()
        self._ctx = zmq.asyncio.Context.instance()
        self._task: asyncio.Task[None] | None = None

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.blocks.clear()

    async def close(self) -> None:
        self.cancel()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    # ---- the loop -------------------------------------------------------------------------------------
    async def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, PEER_MESSAGE_MAX_BYTES)  # a larger one drops the publisher
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        if "[" in self.source.endpoint:
            sub.setsockopt(zmq.IPV6, 1)
        mon = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(mon, zmq.POLLIN)
        try:
            sub.connect(self.source.endpoint)
            while True:
                ready = dict(await poller.poll())
                if mon in ready:
                    await self._on_monitor(await mon.recv_multipart())
                if sub in ready:
                    await self._drain(sub)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let one endpoint's stream take the worker down
            log.exception("KV events of %s: feed failed", self.name)
            self.stats.state, self.stats.error = "failed", f"{type(e).__name__}: {e}"
            self.blocks.clear()
        finally:
            with contextlib.suppress(Exception):
                sub.disable_monitor()
            mon.close(linger=0)
            sub.close(linger=0)

    async def _on_monitor(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)["event"]
        if event == zmq.EVENT_CONNECTED:
            await self.resync("connected")
        elif event == zmq.EVENT_DISCONNECTED:
            self.blocks.clear()
            self.stats.state = "disconnected"
            log.info("KV events of %s: publisher gone; the endpoint's cache is taken as empty", self.name)

    async def _drain(self, sub: zmq.asyncio.Socket) -> None:
        for _ in range(_YIELD_EVERY):
            try:
                frames = await sub.recv_multipart(zmq.NOBLOCK)  # a done future: no wait
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats.error = f"a message of {len(frames)} frames (want topic, seq, payload)"
                continue
            await self.on_live(int.from_bytes(frames[1], "big"), frames[2])

    # ---- sequence logic -------------------------------------------------------------------------------
    async def on_live(self, seq: int, payload: bytes) -> None:
        st = self.stats
        if st.state in ("connecting", "disconnected"):
            return  # a resync on connection follows and replays this one too
        expected = st.last_seq + 1
        if seq < expected:
            await self.resync(f"sequence went back from {st.last_seq} to {seq}: a new publisher")
            return
        if seq > expected:
            st.gaps += 1
            first = await self._replay(expected)
            if first != expected and st.last_seq < seq - 1:
                self._lose(f"batches {expected}..{seq - 1} are no longer retained")
        if seq > st.last_seq:
            self._apply(seq, payload, live=True)

    async def resync(self, why: str) -> None:
        """Rebuild this endpoint's view from the publisher's retained batches."""
        st = self.stats
        st.resyncs += 1
        st.state = "syncing"
        self.blocks.clear()
        st.last_seq, st.partial = -1, False
        first = await self._replay(0)
        if first is not None and first > 0:
            self._lose(f"the publisher retains batches from {first} only")
        elif first is None and self.source.replay_endpoint is None:
            st.partial = True  # no replay endpoint: whatever was stored before now is unknown
        st.state = "live"
        log.info(
            "KV events of %s: in sync at seq %d (%s; %d blocks)",
            self.name,
            st.last_seq,
            why,
            len(self.blocks),
        )

    def _lose(self, why: str) -> None:
        st = self.stats
        st.lost += 1
        st.partial = True
        self.blocks.clear()
        log.warning("KV events of %s: %s; view cleared (partial until the cache turns over)", self.name, why)

    async def _replay(self, start: int) -> int | None:
        """Apply retained batches from ``start``; the first sequence number replayed (None: none)."""
        if self.source.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, PEER_MESSAGE_MAX_BYTES)
        first = None
        try:
            dealer.connect(self.source.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            n = 0
            while True:
                frames = await asyncio.wait_for(dealer.recv_multipart(), REPLAY_TIMEOUT_S)
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3:  # vLLM 0.32: topic, seq, payload
                    frames = frames[1:]
                if len(frames) != 2 or len(frames[0]) != 8:
                    continue
                seq = int.from_bytes(frames[0], "big", signed=True)
                if seq == END_SEQ:
                    return first
                first = seq if first is None else first
                if seq > self.stats.last_seq:
                    self._apply(seq, frames[1], live=False)
                n += 1
                if n % _YIELD_EVERY == 0:
                    await asyncio.sleep(0)
        except (TimeoutError, zmq.ZMQError) as e:
            self.stats.error = f"replay from {start}: {type(e).__name__} {e}".strip()
            return first
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes, live: bool) -> None:
        st = self.stats
        st.last_seq = seq
        try:
            batch, _ = decode_batch(payload)
        except BadPayload as e:
            st.error = f"batch {seq}: {e}"
            return
        st.batches += 1
        now = time.time()
        st.last_batch_at = now
        if live:
            st.lag_s = max(0.0, now - batch.ts)
        blocks, counts = self.blocks, st.events
        for ev in batch.events:
            kind = type(ev)
            if kind is BlockStored:
                counts["stored"] += 1
                blocks.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size,
                              ev.extra_keys)
                st.block_size = ev.block_size or st.block_size
            elif kind is BlockRemoved:
                counts["removed"] += 1
                blocks.removed(ev.block_hashes)
            elif kind is AllBlocksCleared:
                counts["cleared"] += 1
                blocks.clear()
        blocks.trim()  # over its cap, the endpoint lets go of its least recently stored blocks
