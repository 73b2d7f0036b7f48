"""Messages between a rank's core (a ZMQ DEALER) and the coordinator (a ROUTER at A:P+2), msgpack dicts.

rank -> coordinator (every message carries ``rank``):
  ``join``        {pid, last_generation}: wants into the next generation (re-sent each second until formed)
  ``joined``      {generation}: its process group of that generation is up
  ``lost``        {generation, reason}: a collective of that generation failed here
  ``report``      {generation, ready, waiting, running, wave_active}: about every 100 ms
  ``wave_start``  {generation, wave}: a request arrived while the group was paused
  ``wave_end``    {generation, wave}: the idle all-reduce ended the wave (every rank sends it)
coordinator -> rank:
  ``form``        {generation, size}: every rank has joined; create the process group now
  ``abort``       {generation, reason}: that generation is over; fail requests, leave, join the next (also
                  the answer to a report of a generation this coordinator does not know: it restarted)
  ``wave_start``  {generation, wave}: run (dummy) passes until the wave ends
"""

from __future__ import annotations

from typing import Any

import msgpack

JOIN, JOINED, LOST, REPORT = "join", "joined", "lost", "report"
WAVE_START, WAVE_END, FORM, ABORT = "wave_start", "wave_end", "form", "abort"
JOIN_RESEND_S = 1.0
REPORT_INTERVAL_S = 0.1


def pack(kind: str, **fields: Any) -> bytes:
    return msgpack.packb({"kind": kind, **fields}, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    msg = msgpack.unpackb(data, raw=False)
    if not isinstance(msg, dict) or not isinstance(msg.get("kind"), str):
        raise ValueError("not a DP message")
    return msg
