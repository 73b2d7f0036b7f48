"""The DP coordinator process on its ZMQ wire (lbd.engine.dp.coordinator): a message it cannot read or of a
kind it does not know (a newer rank's) is skipped with a log line, and it goes on serving the group."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack

from lbd.wire.dp_messages import Abort, Form, Join, Joined
from support.dp import Group, RankConn


def test_coordinator_skips_bad_and_unknown_messages_and_goes_on(tmp_path: Path) -> None:
    group = Group(1, tmp_path)
    with group.coordinator():
        rank = RankConn(group)
        try:
            rank.send(b"\xc1 not msgpack")
            rank.send(msgpack.packb({"kind": "drain", "rank": 0, "generation": 1, "deadline_s": 5}))
            rank.send(msgpack.packb({"kind": "drain", "rank": 0}))  # logged once per kind
            rank.send(msgpack.packb({"kind": "joined", "rank": 0, "generation": "one"}))
            rank.send(msgpack.packb({"kind": "join", "rank": 0, "pid": os.getpid(), "newer_field": [1]}))
            assert rank.recv() == Form(generation=1, size=1)
            rank.send(Joined(rank=0, generation=1))
            rank.send(Join(rank=0, pid=os.getpid() + 1))  # it restarted: generation 1 is aborted
            abort = rank.recv()
            assert isinstance(abort, Abort) and abort.generation == 1 and "restarted" in abort.reason
            assert rank.recv() == Form(generation=2, size=1)
        finally:
            rank.close()
    log = (tmp_path / "coordinator.log").read_text()
    assert log.count("skipping unknown DP message kind 'drain'") == 1
    assert log.count("dropping a bad message") == 2 and "bad DP 'joined' message" in log
