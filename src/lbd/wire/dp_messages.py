"""The messages between an MoE DP rank's core (a ZMQ DEALER, ``lbd.engine.dp.rank``) and the DP coordinator
(a ROUTER at A:P+2, ``lbd.engine.dp.coordinator``): one msgspec Struct per kind, msgpack maps whose ``kind``
field names the type.

rank -> coordinator (``RankMessage``: every one carries ``rank``):
  ``join``        Join: wants into the next generation (re-sent each second until formed)
  ``joined``      Joined: its process group of that generation is up
  ``lost``        Lost: a collective of that generation failed here
  ``report``      Report: its load, about every 100 ms
  ``wave_start``  WaveStarted: a request arrived while the group was paused
  ``wave_end``    WaveEnded: the idle all-reduce ended the wave (every rank sends it)
coordinator -> rank (``CoordinatorMessage``: every one carries ``generation``):
  ``form``        Form: every rank has joined; create the process group now
  ``abort``       Abort: that generation is over; fail requests, leave, join the next (also the answer to a
                  report of a generation this coordinator does not know: it restarted)
  ``wave_start``  StartWave: run (dummy) passes until the wave ends
  ``reform``      Reform: the group re-forms at ``size`` ranks: leave that generation together at the next
                  idle check of a wave (members ``>= size`` drain out; the others re-place their experts and
                  join the next generation, keeping their requests)

``encode`` makes a message's bytes; ``decode_from_rank`` and ``decode_from_coordinator`` read one back.
Compatibility: unknown fields are skipped and a missing field with a default takes it; a kind this version
does not know (a newer peer's) raises ``UnknownKind`` so the receiver can skip it, and anything else that is
not a message of that direction raises ValueError. Standard library and msgspec only.
"""

from __future__ import annotations

from typing import Any

import msgspec

# ---- rank -> coordinator -----------------------------------------------------------------------------------


class RankMessage(msgspec.Struct, tag_field="kind"):
    """The base of what a rank sends: who sent it."""

    rank: int


class Join(RankMessage, tag="join"):
    pid: int  # the rank's core process (a new pid: it restarted)
    last_generation: int = 0  # the generation it last was in (a restarted coordinator numbers on after it)


class Joined(RankMessage, tag="joined"):
    generation: int


class Lost(RankMessage, tag="lost"):
    generation: int
    reason: str = ""


class Report(RankMessage, tag="report"):
    generation: int = 0
    ready: bool = False  # it is in a formed group (of ``generation``)
    waiting: int = 0
    running: int = 0
    wave_active: bool = False


class WaveStarted(RankMessage, tag="wave_start"):
    generation: int
    wave: int


class WaveEnded(RankMessage, tag="wave_end"):
    generation: int
    wave: int


# ---- coordinator -> rank -----------------------------------------------------------------------------------


class CoordinatorMessage(msgspec.Struct, tag_field="kind"):
    """The base of what the coordinator sends: the generation it is about."""

    generation: int


class Form(CoordinatorMessage, tag="form"):
    size: int


class Abort(CoordinatorMessage, tag="abort"):
    reason: str = ""


class StartWave(CoordinatorMessage, tag="wave_start"):
    wave: int


class Reform(CoordinatorMessage, tag="reform"):
    size: int


RANK_MESSAGES = (Join, Joined, Lost, Report, WaveStarted, WaveEnded)
COORDINATOR_MESSAGES = (Form, Abort, StartWave, Reform)


class UnknownKind(ValueError):
    """A well-formed message of a kind this version does not know (a newer peer's): skip it."""

    def __init__(self, kind: str) -> None:
        super().__init__(f"unknown DP message kind {kind[:32]!r}")
        self.kind = kind


class _Kind(msgspec.Struct):
    kind: str


_ENCODER = msgspec.msgpack.Encoder()
_KIND = msgspec.msgpack.Decoder(_Kind)
_FROM_RANK = msgspec.msgpack.Decoder(Join | Joined | Lost | Report | WaveStarted | WaveEnded)
_FROM_COORDINATOR = msgspec.msgpack.Decoder(Form | Abort | StartWave | Reform)


def encode(msg: RankMessage | CoordinatorMessage) -> bytes:
    """A message's bytes (a msgpack map with its ``kind``)."""
    return _ENCODER.encode(msg)


def decode_from_rank(data: bytes) -> RankMessage:
    """A rank's message; UnknownKind for a kind this version does not know, ValueError for anything else
    that is not a rank's message."""
    return _decode(_FROM_RANK, RANK_MESSAGES, data)


def decode_from_coordinator(data: bytes) -> CoordinatorMessage:
    """The coordinator's message; UnknownKind for a kind this version does not know, ValueError for anything
    else that is not a coordinator's message."""
    return _decode(_FROM_COORDINATOR, COORDINATOR_MESSAGES, data)


def _decode(decoder: msgspec.msgpack.Decoder, known: tuple[type[msgspec.Struct], ...], data: bytes) -> Any:
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        try:
            kind = _KIND.decode(data).kind  # a map with a string kind: is it one this version knows?
        except msgspec.DecodeError:
            raise ValueError(f"not a DP message: {e}") from None
        if kind not in {cls.__struct_config__.tag for cls in known}:
            raise UnknownKind(kind) from None
        raise ValueError(f"bad DP {kind[:32]!r} message: {e}") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"not a DP message: {e}") from None
