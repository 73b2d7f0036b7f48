"""The base of every enum on a wire: a value this version does not know decodes to ``UNKNOWN``.

msgspec and ``Enum(value)`` both call ``_missing_``, so a newer peer's new state reads as "unknown" instead
of failing the whole message. Being ``StrEnum``s, members compare equal to their wire strings.
"""

from __future__ import annotations

import enum


class TolerantEnum(enum.StrEnum):
    """Subclasses define ``UNKNOWN = "unknown"`` among their members."""

    @classmethod
    def _missing_(cls, value: object) -> TolerantEnum | None:
        return getattr(cls, "UNKNOWN", None)  # None: this enum has no UNKNOWN, so the value is an error
