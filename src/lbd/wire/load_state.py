"""A rank's load state, pushed: the numbers a router otherwise scrapes from /metrics, on a ZMQ PUB stream.

One typed contract for any engine that wants to be routed without being scraped (lbd's engine and its
``--device sim`` ranks implement it; vLLM and SGLang are scraped).

**Where.** The rank binds a ZMQ PUB socket and advertises it in its JSON telemetry (``GET /telemetry``, the
path ``/metrics`` names in its ``X-LBD-Telemetry`` header) as ``"load_stream": LoadStream`` (below). A router
that scrapes the rank once learns the stream, subscribes, and stops scraping while the stream stays fresh.

**Frames.** Each message is two frames: the topic ``lbd.load`` (``TOPIC``) and the payload, one ``LoadState``
encoded as a msgpack array (positional, the field order below; a newer publisher may append fields, a reader
ignores what it does not know).

**Full states with a sequence number, not deltas.** Every message carries the whole state (a dozen numbers,
about 100 bytes), so every message is a resync point: a lost message (a gap in ``seq``) costs nothing but
freshness, and a subscriber that joins late needs no snapshot. Deltas would save nothing measurable at this
size and would need a replay channel to heal a gap.

**Epochs.** ``instance`` is random per publisher process and ``seq`` starts at 0 with it: a new ``instance``
on a known ``stream`` address is a restarted rank (its cache is cold), a ``seq`` that skips is a gap.

**When.** On every change of ``running``, ``waiting``, ``kv_usage`` or ``num_blocks`` (coalesced: at most one
message per ``min_interval_s``), and at least every ``heartbeat_s`` (an idle rank still proves it is alive).
lbd's router marks a rank that stays silent for 1.5 heartbeats stale (so it is scraped within two) and reads
its telemetry by scraping until messages come again.

**Security.** The stream binds loopback unless the rank serves on a named non-loopback address and a
cluster token is set (``LBD_CLUSTER_TOKEN``); it is then a CURVE server with the key pair derived from the
token (``lbd.common.cluster.secure_zmq_server``, purpose ``PURPOSE``) and ``LoadStream.curve`` says so.

| field | meaning (vLLM's /metrics name) |
|---|---|
| instance | random hex, fixed for the publisher's life (the epoch) |
| seq | 0, 1, 2... per instance |
| ts | the publisher's wall clock (``time.time()``) when sent |
| rank | the DP rank (``engine`` label) |
| running, waiting | num_requests_running, num_requests_waiting |
| kv_usage | kv_cache_usage_perc (0..1) |
| num_blocks, block_size | cache_config_info's num_gpu_blocks, block_size |
| prefix_queries, prefix_hits | prefix_cache_queries_total, prefix_cache_hits_total (tokens, cumulative) |
| prompt_tokens, generation_tokens | prompt_tokens_total, generation_tokens_total (cumulative) |
| heartbeat_s | the publisher's heartbeat interval |
| stream | the address the rank advertises for this stream (identifies the rank across restarts) |
| lora | an ``--enable-lora`` rank's adapters (``LoraState``: on device, in CPU, free slots), else None |

``lora`` is None on ranks without adapters and from publishers older than the field (shorter arrays).

A change of the adapters' residency (device or CPU) is a change too: it is sent like a change of load.
"""

from __future__ import annotations

import msgspec

from lbd.wire.core_messages import LoraState

TOPIC = b"lbd.load"
PURPOSE = "lbd-load-state"  # the CURVE key pair's purpose (lbd.common.cluster.derive)
ADVERTISED_KEY = "load_stream"  # the /telemetry field that advertises the stream


class LoadState(msgspec.Struct, array_like=True, gc=False):
    instance: str
    seq: int
    ts: float
    rank: int = 0
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    num_blocks: int = 0
    block_size: int = 16
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    heartbeat_s: float = 1.0
    stream: str = ""
    lora: LoraState | None = None


class LoadStream(msgspec.Struct, gc=False):
    """The advertisement, a map inside /telemetry's JSON."""

    endpoint: str  # where to connect (tcp://host:port)
    instance: str
    heartbeat_s: float
    topic: str = TOPIC.decode()
    curve: bool = False  # a CURVE server: connect with the cluster token's client keys


class BadLoadState(ValueError):
    """A payload that is not a LoadState."""


_encoder = msgspec.msgpack.Encoder()
_decoder: msgspec.msgpack.Decoder | None = None


def encode_state(state: LoadState) -> bytes:
    return _encoder.encode(state)


def decode_state(payload: bytes) -> LoadState:
    """The LoadState in ``payload``; BadLoadState when it is not one (fields past ours are ignored)."""
    global _decoder
    if _decoder is None:
        _decoder = msgspec.msgpack.Decoder(LoadState)
    try:
        return _decoder.decode(payload)
    except msgspec.ValidationError as e:
        if "Expected `array` of length <=" in str(e):  # a newer publisher's extra fields
            return _decode_longer(payload)
        raise BadLoadState(str(e)) from None
    except msgspec.DecodeError as e:
        raise BadLoadState(f"not msgpack: {e}") from None


def _decode_longer(payload: bytes) -> LoadState:
    raw = msgspec.msgpack.decode(payload)
    n = len(LoadState.__struct_fields__)
    try:
        return msgspec.convert(raw[:n], LoadState)
    except (msgspec.ValidationError, TypeError) as e:
        raise BadLoadState(str(e)) from None


def decode_advertised(value: object) -> LoadStream | None:
    """The ``load_stream`` field of a /telemetry answer, or None when absent or malformed."""
    if not isinstance(value, dict):
        return None
    try:
        return msgspec.convert(value, LoadStream)
    except msgspec.ValidationError:
        return None
