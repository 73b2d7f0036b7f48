"""vLLM's ZMQ publisher, made so the engine's step never waits on it.

Wire: a PUB socket sends ``[topic, seq (8-byte big-endian), payload]`` per step that changed the cache, the
payload a msgpack ``KVEventBatch`` (``lbd.wire.kv_events``). Sequence numbers start at 0 with each
process. An optional ROUTER replay socket answers a request frame holding a start sequence (8 bytes,
big-endian; from a REQ socket or a DEALER that sends an empty delimiter first) with every retained batch from
there on, each as ``[topic, seq, payload]``, then vLLM's end marker ``["", -1 (8 bytes, signed), ""]``. The
last ``buffer_steps`` batches are retained.

Sockets are bound when the endpoint is a wildcard (``tcp://*:P``, ``::``) or ipc/inproc, else connected
(vLLM's rule); ``tcp://*:0`` takes a port from the OS. With no endpoint in the config the PUB socket is bound
on the engine's ``--host`` (loopback when that is unset or a wildcard: ``default_endpoint``), since the stream
carries every prompt's token ids; any bind beyond loopback logs a warning saying so.

The step hands each batch to a queue (never blocking: when ``max_queue_size`` batches are already waiting the
batch is dropped and its sequence number skipped, so subscribers see a gap) and a thread encodes, sends (PUB
never blocks: past ``hwm`` a slow subscriber loses messages, which it sees as a gap too) and serves replays.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque

import zmq

from lbd.common.cluster import is_loopback
from lbd.engine.config.kv_events import KVEventsConfig, default_endpoint, offset_endpoint_port
from lbd.engine.kv_events.recorder import EventRecorder
from lbd.wire.kv_events import KVEventBatch, encode_batch

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _warn_if_open(endpoint: str) -> None:
    """A tcp bind beyond loopback: anyone who reaches it reads every prompt's token ids."""
    if not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://"):].rpartition(":")[0].strip("[]")
    if host != "*" and is_loopback(host):
        return
    logger.warning("KV events: %s is bound beyond loopback: the stream carries every prompt's token ids to "
                   "any subscriber that reaches it (bind a private address, or loopback when the router is "
                   "on this machine)", endpoint)


class ZmqEventPublisher:
    def __init__(self, cfg: KVEventsConfig, rank: int, advertise_host: str | None = None,
                 bind_host: str | None = None) -> None:
        self.rank = rank
        self.cfg = cfg
        self._topic = cfg.topic.encode()
        self._ctx = zmq.Context(io_threads=1)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.set_hwm(cfg.hwm)
        self._replay: zmq.Socket | None = None
        try:
            endpoint = cfg.endpoint if cfg.endpoint_given else default_endpoint(bind_host)
            self.endpoint = self._open(self._pub, offset_endpoint_port(endpoint, rank), advertise_host,
                                       bind_only=not cfg.endpoint_given)
            self.replay_endpoint: str | None = None
            replay = offset_endpoint_port(cfg.replay_endpoint, rank)
            if replay is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 0)  # a replay is bounded by buffer_steps: never drop one
                self.replay_endpoint = self._open(self._replay, replay, advertise_host, bind_only=True)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise OSError(f"--kv-events-config: cannot open the KV-event sockets ({e})") from e
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._next_seq = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s), topic %r", self.endpoint,
                    self.replay_endpoint or "off", cfg.topic)

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str | None, host: str | None, bind_only: bool = False) -> str:
        assert endpoint is not None
        if "[" in endpoint or "::" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if not (_binds(endpoint) or bind_only):
            sock.connect(endpoint)  # the consumer binds (vLLM's "connect volatile" convention)
            return endpoint
        sock.bind(endpoint)
        _warn_if_open(endpoint)
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            port = sock.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2]
            bound = endpoint[: -len(":0")]
            if host and bound.endswith("*"):
                bound = bound[:-1] + host
            return f"{bound}:{port}"
        return endpoint

    # ---- the step's side ------------------------------------------------------------------------------
    def publish(self, events: list) -> None:
        """Queue one step's events; never blocks (a full queue drops the batch: subscribers see a gap)."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, KVEventBatch(ts=time.time(), events=events,
                                                      data_parallel_rank=self.rank)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("KV events: publisher queue full (max_queue_size=%d); %d batches dropped",
                               self.cfg.max_queue_size, self.dropped)

    def advertised(self) -> dict[str, object]:
        """The resolved config, as vLLM's ``/kv_event_sources`` shows it."""
        out = self.cfg.to_dict()
        out.update(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        return out

    # ---- the thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        pub, replay, topic = self._pub, self._replay, self._topic
        while True:
            if replay is not None and replay.poll(0):
                try:
                    self._serve_replay(replay)
                except zmq.ZMQError as e:
                    logger.warning("KV events: replay failed: %s", e)
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                break
            seq, batch = item
            payload = encode_batch(batch)
            seq_bytes = seq.to_bytes(8, "big")
            try:
                pub.send_multipart((topic, seq_bytes, payload), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # no room for a subscriber: it sees the gap and replays
            self._buffer.append((seq, payload))

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: ignoring a malformed replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


class KVEvents:
    """What the core holds: the recorder the cache manager fills and the publisher it flushes to."""

    def __init__(self, cfg: KVEventsConfig, rank: int, block_size: int, host: str | None = None) -> None:
        self.recorder = EventRecorder(block_size)
        # ``host``: the engine's --host when it names one address (None: unset or a wildcard)
        self.publisher = ZmqEventPublisher(cfg, rank, host or os.environ.get("VLLM_HOST_IP") or None, host)

    def flush(self) -> None:
        """Once per step: the step's events, if any, become one batch."""
        if self.recorder.events:
            self.publisher.publish(self.recorder.take())

    def advertised(self) -> dict[str, object]:
        return self.publisher.advertised()

    def close(self) -> None:
        self.flush()
        self.publisher.shutdown()
