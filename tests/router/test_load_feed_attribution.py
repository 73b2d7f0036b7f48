"""Pushed load state is attributed by the connection it came on (lbd.router.load_feed), in process over a
real RouterState: a payload naming another endpoint's instance, stream or DP rank changes nothing there, and
an endpoint that advertises another's stream (address or instance) is not followed on it (it is scraped)."""

from __future__ import annotations

import asyncio
import time

from lbd.router.config import parse_args
from lbd.router.load_feed import LoadFeed
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState
from lbd.wire.load_state import LoadState, encode_state

A, B = "http://127.0.0.1:18001", "http://127.0.0.1:18002"
STREAM_A, STREAM_B = "tcp://127.0.0.1:51001", "tcp://127.0.0.1:51002"


def _msg(instance: str, rank: int, running: int, stream: str, seq: int = 0) -> bytes:
    return encode_state(LoadState(instance, seq, time.time(), rank, running, stream=stream))


def test_messages_and_advertisements_count_for_their_own_endpoint() -> None:
    async def run() -> None:
        state = RouterState(parse_args(["--upstreams", A, "--kv-events", "off"]), SharedCounters(1, 16))
        a, b = state.add(A, "static", 0), state.add(B, "static", 1)
        feed = LoadFeed(state)
        try:
            feed.adopt(a, {"endpoint": STREAM_A, "instance": "aaaa", "heartbeat_s": 1.0})
            # b advertises a's address, or a's instance on its own address: not followed there
            feed.adopt(b, {"endpoint": STREAM_A, "instance": "bbbb", "heartbeat_s": 1.0})
            feed.adopt(b, {"endpoint": STREAM_B, "instance": "aaaa", "heartbeat_s": 1.0})
            assert B not in feed.by_url and feed.refused["advertised"] == 2
            assert feed.by_instance["aaaa"].ep is a and feed.by_stream[STREAM_A].ep is a
            feed.adopt(b, {"endpoint": STREAM_B, "instance": "bbbb", "heartbeat_s": 1.0})
            assert feed.by_url[B].connect == STREAM_B

            # on b's connection: a's instance, a's stream with a new instance (a fake restart), DP rank 0
            feed.on_message(_msg("aaaa", 0, 99, STREAM_A, seq=5), STREAM_B)
            feed.on_message(_msg("cccc", 0, 99, STREAM_A), STREAM_B)
            feed.on_message(_msg("bbbb", 0, 99, STREAM_B), STREAM_B)
            assert (feed.refused["instance"], feed.refused["stream"], feed.refused["rank"]) == (1, 1, 1)
            assert a.sample is None and b.sample is None and feed.by_url[A].restarts == 0
            # each on its own connection: taken
            feed.on_message(_msg("aaaa", 0, 3, STREAM_A), STREAM_A)
            feed.on_message(_msg("bbbb", 1, 4, STREAM_B), STREAM_B)
            assert a.sample is not None and b.sample is not None
            assert (a.sample.running, b.sample.running) == (3, 4)
            # a restart is taken from the rank's own connection only
            feed.on_message(_msg("dddd", 0, 2, STREAM_A), STREAM_A)
            assert feed.by_url[A].restarts == 1 and a.sample.running == 2
            text = state.metrics.render().decode()
            assert 'lbd_router_telemetry_push_refused_total{reason="instance"} 1.0' in text
            assert 'lbd_router_telemetry_push_refused_total{reason="advertised"} 2.0' in text
        finally:
            await feed.close()

    asyncio.run(run())
