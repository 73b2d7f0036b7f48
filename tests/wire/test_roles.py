"""Roles (lbd.wire.roles): lbd serve's node roles as its flags name them; unknown roles decode tolerantly."""

from __future__ import annotations

import msgspec

from lbd.wire.roles import NodeRole, RankRole


class _Holder(msgspec.Struct):
    node: NodeRole
    rank: RankRole = RankRole.MIXED


def test_roles_round_trip_and_tolerate_new_ones() -> None:
    held = _Holder(NodeRole.HEADLESS)
    assert msgspec.json.decode(msgspec.json.encode(held), type=_Holder) == held
    assert msgspec.json.encode(held) == b'{"node":"headless","rank":"mixed"}'
    newer = msgspec.json.decode(b'{"node":"router-only","rank":"encode"}', type=_Holder)
    assert (newer.node, newer.rank) == (NodeRole.UNKNOWN, RankRole.UNKNOWN)
    pd = [msgspec.json.decode(b'{"node":"head","rank":"%s"}' % r, type=_Holder).rank
          for r in (b"prefill", b"decode")]
    assert pd == [RankRole.PREFILL, RankRole.DECODE]
