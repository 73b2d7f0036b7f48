"""``--kv-events-config``: vLLM's JSON keys and defaults, parsed and checked with the standard library only
(``args`` validates the flag with it; the supervisor reads it too).

Keys (vLLM's ``KVEventsConfig``): ``enable_kv_cache_events`` (false), ``publisher`` ("zmq" when enabled,
else "null"), ``endpoint`` ("tcp://*:5557"), ``replay_endpoint`` (none), ``buffer_steps`` (10000 batches kept
for replay), ``hwm`` (100000, the PUB socket's high-water mark), ``max_queue_size`` (100000 batches waiting
for the publisher thread), ``topic`` (""). Every DP rank offsets the tcp ports by its rank, as vLLM does
(``tcp://*:5557`` is port 5557 + rank; port 0 lets the OS pick).

One default differs from vLLM's on purpose: the stream carries every prompt's token ids, so when the config
names no ``endpoint`` the publisher binds port 5557 on the engine's ``--host`` (loopback when ``--host`` is
unset or a wildcard), not on every interface. An endpoint given in the config is honoured as written (a
wildcard or another address beyond loopback is bound with a warning saying what the stream carries).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

PUBLISHERS = ("null", "zmq")


@dataclass(slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    # False when the flag's JSON named no ``endpoint`` (parse_kv_events_config): the default then binds the
    # engine's --host; a config built in code keeps the endpoint it holds
    endpoint_given: bool = dataclasses.field(default=True, repr=False)

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        del out["endpoint_given"]
        return out


_FIELDS = {f.name: f for f in dataclasses.fields(KVEventsConfig) if f.name != "endpoint_given"}
DEFAULT_PORT = 5557


def default_endpoint(host: str | None) -> str:
    """The endpoint when the config names none: port 5557 on ``host`` (the engine's specific --host), else
    loopback."""
    if host is None or host in ("", "*", "0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"tcp://{host}:{DEFAULT_PORT}"


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """The flag's JSON object; ValueError naming the key at fault."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-events-config is not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(raw, dict):
        raise ValueError("--kv-events-config must be a JSON object, e.g. "
                         '\'{"enable_kv_cache_events": true, "publisher": "zmq"}\'')
    unknown = sorted(set(raw) - set(_FIELDS))
    if unknown:
        raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(_FIELDS)}")
    checks = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str,
              "replay_endpoint": (str, type(None)), "buffer_steps": int, "hwm": int, "max_queue_size": int,
              "topic": str}
    for key, value in raw.items():
        want = checks[key]
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            raise ValueError(f"--kv-events-config: {key} has the wrong type ({type(value).__name__})")
    cfg = KVEventsConfig(**raw)
    cfg.endpoint_given = "endpoint" in raw
    if "publisher" not in raw:  # vLLM: zmq when enabled, null otherwise
        cfg.publisher = "zmq" if cfg.enable_kv_cache_events else "null"
    if cfg.publisher not in PUBLISHERS:
        raise ValueError(f"--kv-events-config: publisher {cfg.publisher!r} is not one of {list(PUBLISHERS)}")
    for key in ("buffer_steps", "max_queue_size"):
        if getattr(cfg, key) <= 0:
            raise ValueError(f"--kv-events-config: {key} must be positive, got {getattr(cfg, key)}")
    if cfg.hwm < 0:
        raise ValueError(f"--kv-events-config: hwm must be >= 0, got {cfg.hwm}")
    if cfg.active:
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(cfg, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"--kv-events-config: {key} {value!r} must be a tcp://, ipc:// or inproc:// "
                                 "ZMQ address")
    return cfg


def offset_endpoint_port(endpoint: str | None, rank: int) -> str | None:
    """vLLM's per-DP-rank endpoint: tcp port + rank (port 0 stays 0), inproc name + ``_dp<rank>``; ipc
    endpoints cannot be offset (vLLM refuses them for ranks above 0, and so do we)."""
    if not endpoint or rank == 0:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        head, sep, port = endpoint.rpartition(":")
        if not sep or not port.isdigit():
            return endpoint
        return endpoint if int(port) == 0 else f"{head}:{int(port) + rank}"
    raise ValueError(f"KV-event endpoint {endpoint!r} of DP rank {rank} cannot be offset per rank: use a "
                     "tcp:// endpoint (its port is offset by the rank) or inproc://")
