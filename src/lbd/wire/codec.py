"""Decoders built on first use, once per type: building one resolves the type's annotations, which costs
milliseconds a type, and a program that never reads a wire should not pay for it at start."""

from __future__ import annotations

import functools
from typing import Any

import msgspec


@functools.cache
def json_decoder(kind: Any) -> msgspec.json.Decoder:
    return msgspec.json.Decoder(kind)


@functools.cache
def msgpack_decoder(kind: Any) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)
