"""Where the KV-event publisher listens: the default endpoint binds the engine's --host (loopback when unset),
never every interface; endpoints given in the config are honoured as written, and a bind beyond loopback
warns that the stream carries prompt tokens."""

from __future__ import annotations

import logging
import os

import psutil
import pytest
import zmq

from lbd.engine.config.kv_events import DEFAULT_PORT, default_endpoint, parse_kv_events_config
from lbd.engine.kv_events.publisher import ZmqEventPublisher
from lbd.wire.kv_events import BlockStored
from support import free_port

WARNING = "carries every prompt's token ids"


def _listening() -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in psutil.Process(os.getpid()).net_connections("tcp")
            if c.status == psutil.CONN_LISTEN}


def _rank_on_free_port() -> tuple[int, int]:
    """A DP rank whose default port (5557 + rank) is free now: the tests never fight over 5557."""
    while True:
        port = free_port()
        if port > DEFAULT_PORT:
            return port - DEFAULT_PORT, port


def test_default_endpoint_follows_the_host() -> None:
    assert default_endpoint(None) == "tcp://127.0.0.1:5557"
    assert default_endpoint("0.0.0.0") == default_endpoint("::") == "tcp://127.0.0.1:5557"
    assert default_endpoint("10.1.2.3") == "tcp://10.1.2.3:5557"
    assert default_endpoint("fd00::2") == "tcp://[fd00::2]:5557"
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert not cfg.endpoint_given and "endpoint_given" not in cfg.to_dict()  # vLLM's keys only
    assert parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:9"}').endpoint_given


@pytest.mark.parametrize("host", [None, "127.0.0.1"])
def test_default_binds_loopback_or_the_host_and_publishes(host: str | None,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    rank, port = _rank_on_free_port()
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    with caplog.at_level(logging.WARNING, logger="lbd.engine.kv_events.publisher"):
        pub = ZmqEventPublisher(cfg, rank, None, host)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        assert ("127.0.0.1", port) in _listening()
        assert not [ip for ip, p in _listening() if p == port and ip != "127.0.0.1"]
        assert WARNING not in caplog.text
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        sub.setsockopt(zmq.RCVTIMEO, 200)
        for _ in range(50):  # PUB drops what it sends before the subscription arrives: resend until read
            pub.publish([BlockStored(block_hashes=[1], parent_block_hash=None, token_ids=[1, 2],
                                     block_size=2, lora_id=None, medium=None, lora_name=None)])
            try:
                topic, seq, payload = sub.recv_multipart()
                break
            except zmq.Again:
                continue
        else:
            raise AssertionError("no KV event reached a subscriber of the default endpoint")
        assert topic == b"" and len(seq) == 8 and payload
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.shutdown()


def test_an_explicit_wildcard_is_honoured_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}')
    with caplog.at_level(logging.WARNING, logger="lbd.engine.kv_events.publisher"):
        pub = ZmqEventPublisher(cfg, 0, None, "127.0.0.1")
    try:
        port = int(pub.endpoint.rpartition(":")[2])
        assert ("0.0.0.0", port) in _listening()
        assert WARNING in caplog.text and "tcp://*:0" in caplog.text
    finally:
        pub.shutdown()


def test_an_explicit_address_is_honoured_as_written(caplog: pytest.LogCaptureFixture) -> None:
    """A specific tcp address is connected to (vLLM's rule: the consumer binds), so nothing listens here;
    the replay socket always binds, and loopback binds say nothing."""
    sink, replay = free_port(), free_port()
    cfg = parse_kv_events_config(f'{{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:{sink}", '
                                 f'"replay_endpoint": "tcp://127.0.0.1:{replay}"}}')
    before = _listening()
    with caplog.at_level(logging.WARNING, logger="lbd.engine.kv_events.publisher"):
        pub = ZmqEventPublisher(cfg, 0, None, None)
    try:
        assert pub.endpoint == f"tcp://127.0.0.1:{sink}"
        added = _listening() - before
        assert added == {("127.0.0.1", replay)}
        assert WARNING not in caplog.text
    finally:
        pub.shutdown()
