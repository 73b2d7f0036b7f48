"""The timing of the rank <-> coordinator wire, and how a receiver skips what a newer peer sends; the
messages themselves are ``lbd.wire.dp_messages`` (imported by both ends)."""

from __future__ import annotations

import logging

from lbd.wire.dp_messages import UnknownKind

JOIN_RESEND_S = 1.0  # a rank re-sends ``join`` this often until its generation forms
REPORT_INTERVAL_S = 0.1  # a rank sends ``report`` this often

_skipped: set[str] = set()


def log_unknown_kind(logger: logging.Logger, error: UnknownKind) -> None:
    """Log a message kind this version does not know (a newer peer's), once per kind: it is skipped."""
    if error.kind not in _skipped:
        _skipped.add(error.kind)
        logger.warning("skipping %s (a newer peer's?); further ones are skipped silently", error)
