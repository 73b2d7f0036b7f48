"""The tolerant enum base (lbd.wire.tolerant)."""

from __future__ import annotations

import pytest

from lbd.wire.tolerant import TolerantEnum


class _Color(TolerantEnum):
    RED = "red"
    UNKNOWN = "unknown"


class _Strict(TolerantEnum):
    ONLY = "only"


def test_unknown_values() -> None:
    assert _Color("red") is _Color.RED and _Color("teal") is _Color.UNKNOWN and _Color.RED == "red"
    with pytest.raises(ValueError):
        _Strict("other")  # no UNKNOWN member: an error, as a plain enum
