"""Resizing a node at run time: ``POST /scale`` on a health port (``lbd supervise``'s, ``lbd serve``'s), what
it answers, and the record ``/status`` shows as ``scaling`` while the resize runs and after it.

The request names the new number of local ranks; the answer (and ``/status``'s ``scaling``) says from what
to what, which global ranks were added, which are being removed, and where the resize stands:
``running`` (ranks starting, or draining), ``done``, or ``failed`` (with ``error``: added ranks that never
became ready are removed again). A resize to the current size answers ``done`` at once, changing nothing.
"""

from __future__ import annotations

import msgspec
from msgspec import field

from lbd.wire.codec import json_decoder

RUNNING, DONE, FAILED = "running", "done", "failed"  # ScaleResult.state
MAX_BODY_BYTES = 4096  # a ScaleRequest is a few bytes; a health port reads no more than this


class ScaleRequest(msgspec.Struct, forbid_unknown_fields=True):
    """POST /scale's body: the node's new number of local ranks (>= 1)."""

    data_parallel_size_local: int


class ScaleResult(msgspec.Struct):
    """One resize: POST /scale's answer, and ``scaling`` in /status (mutable: the node updates it)."""

    previous: int = 0  # local ranks before
    target: int = 0  # local ranks asked for
    added: list[int] = field(default_factory=list)  # global DP ranks started
    removing: list[int] = field(default_factory=list)  # global DP ranks draining, then stopped
    state: str = RUNNING  # running | done | failed (a value this version does not know: read as text)
    error: str | None = None
    started_at: float | None = None  # unix time
    finished_at: float | None = None


class ScaleRequestError(ValueError):
    """The body is not a ScaleRequest; ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


FIELD = "data_parallel_size_local"


def decode_request(body: bytes) -> ScaleRequest:
    """The request, or ScaleRequestError naming the field: a JSON object whose one field is an int >= 1."""
    if len(body) > MAX_BODY_BYTES:
        raise ScaleRequestError(f"the body is over {MAX_BODY_BYTES} bytes", None)
    try:
        req = json_decoder(ScaleRequest).decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        if "unknown field" in text:
            raise ScaleRequestError(f"{text}: the body is {{\"{FIELD}\": N}}", None) from None
        raise ScaleRequestError(f"{FIELD} must be an integer >= 1 ({text})", FIELD) from None
    except msgspec.DecodeError as e:
        raise ScaleRequestError(f"the body is not JSON ({e}): send {{\"{FIELD}\": N}}", None) from None
    if req.data_parallel_size_local < 1:
        raise ScaleRequestError(f"{FIELD} must be an integer >= 1, got {req.data_parallel_size_local}", FIELD)
    return req


def decode_result(body: bytes) -> ScaleResult:
    """Raises ValueError when ``body`` is not a ScaleResult."""
    return json_decoder(ScaleResult).decode(body)


def encode(obj: msgspec.Struct) -> bytes:
    return msgspec.json.encode(obj)
