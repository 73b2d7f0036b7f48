"""The one rule for ``X-data-parallel-rank``, used by the engine (which answers for one rank) and the router
(which pins to that rank's endpoint).

A plain non-negative integer in ASCII digits without sign or leading zeros (``0``, ``7``, ``12``); anything
else is a 400, and so is a repeated header (two values could only be resolved by guessing). Spaces and tabs
around the value are HTTP's optional whitespace, not part of the field value (RFC 9110 section 5.5), so
``" 1 "`` on the wire is ``1``; every HTTP parser we use strips the leading ones and this strips the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

RANK_HEADER = "X-data-parallel-rank"
_MAX_DIGITS = 9  # ranks are small; a longer value is garbage, not a rank


class RankHeaderError(ValueError):
    """The header is malformed; ``str(e)`` is the message for the 400 answer."""


def parse_rank(values: Sequence[str]) -> int | None:
    """The pinned rank from every value of the header seen in one request (None when absent)."""
    if not values:
        return None
    if len(values) > 1:
        raise RankHeaderError(f"{RANK_HEADER} was sent {len(values)} times: send it once")
    text = values[0].strip(" \t")
    if not text or len(text) > _MAX_DIGITS or not (text.isascii() and text.isdigit()) or \
            (text[0] == "0" and len(text) > 1):
        shown = values[0] if len(values[0]) <= 40 else values[0][:37] + "..."
        raise RankHeaderError(f"{RANK_HEADER} must be a plain non-negative integer (e.g. 0 or 3), "
                              f"got {shown!r}")
    return int(text)
