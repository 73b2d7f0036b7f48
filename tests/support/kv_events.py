"""Reading a rank's KV-event stream in tests: the token runs of the blocks it stored."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import zmq

from lbd.wire.kv_events import BlockStored, decode_batch


def wait_for_stored_run(sub: zmq.Socket, run: list[int], timeout: float = 10.0) -> list[list[int]]:
    """Read ``sub`` (a SUB socket with a receive timeout) until a BlockStored event's token run equals
    ``run`` or ``timeout`` passes; returns every stored run seen."""
    runs: list[list[int]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and run not in runs:
        try:
            _, _, payload = sub.recv_multipart()
        except zmq.Again:
            continue
        batch, _ = decode_batch(payload)
        runs += [ev.token_ids for ev in batch.events if isinstance(ev, BlockStored)]
    return runs


@contextlib.contextmanager
def subscribed(endpoint: str) -> Iterator[zmq.Socket]:
    """A SUB socket on ``endpoint`` (every topic, 200 ms receive timeout), given time to subscribe: a PUB
    drops what it sends before the subscription arrives."""
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 200)
        sub.connect(endpoint)
        time.sleep(0.5)
        yield sub
    finally:
        sub.close(linger=0)
        ctx.term()
