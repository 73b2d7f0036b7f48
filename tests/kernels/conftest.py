"""The ``isa`` fixture: a test that takes it runs once per instruction-set level of the C kernels
(``lbd.kernels.cpu.build.LEVELS``), each on that level's build. A level the CPU lacks skips with the
instruction set it misses; one above ``LBD_CPU_ISA`` (set to make this machine behave as a smaller one) skips
naming the cap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from lbd.kernels.cpu import build


def _marks(level: str) -> list[pytest.MarkDecorator]:
    lacks = build.missing(level)
    if lacks:
        return [pytest.mark.skip(reason=f"this CPU lacks {', '.join(lacks)}")]
    if level not in build.available():
        return [pytest.mark.skip(reason=f"LBD_CPU_ISA={build.cap()} caps the level below {level}")]
    return []


@pytest.fixture(params=[pytest.param(level, marks=_marks(level), id=level) for level in build.LEVELS])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """The level this test runs the C kernels at (``build.using``)."""
    with build.using(request.param):
        yield request.param
