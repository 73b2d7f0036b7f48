"""The supervisor's rank events (lbd.wire.events): kinds are an enum with the names the worker logs."""

from __future__ import annotations

from lbd.wire.events import RankEvent, RankEventKind


def test_event_kinds() -> None:
    assert {k.value for k in RankEventKind} == {"exited", "unhealthy", "startup_timeout", "command"}
    ev = RankEvent(None, RankEventKind.COMMAND, "drain")
    assert ev.kind is RankEventKind("command") and ev.generation is None and ev.detail == "drain"
