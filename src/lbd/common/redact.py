"""Keep secrets out of what health ports and logs show: command lines, log lines, header values."""

from __future__ import annotations

import re
from collections.abc import Sequence

MASK = "***"
# Flag names that carry a secret as their value (paths such as --ssl-keyfile are not secrets).
_SECRET_FLAG = re.compile(r"^--?[\w-]*(api-key|api_key|token|secret|password|passwd|credential)[\w-]*$",
                          re.IGNORECASE)
_IN_TEXT = [
    (re.compile(r"(?i)\b(bearer)\s+[^\s\"',;]+"), r"\1 " + MASK),
    (re.compile(r"(?i)(--?[\w-]*(?:api[-_]key|token|secret|password)[\w-]*)(=|\s+)[^\s\"',;]+"),
     r"\1\2" + MASK),
    (re.compile(r"(?i)\b([A-Z0-9_]*(?:API_KEY|INTERNAL_KEY|TOKEN|SECRET|PASSWORD)[A-Z0-9_]*)=[^\s\"',;]+"),
     r"\1=" + MASK),
]


def secret_flag(flag: str) -> bool:
    return bool(_SECRET_FLAG.match(flag))


def redact_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the value of every secret flag (``--api-key K`` or ``--api-key=K``) masked."""
    out: list[str] = []
    mask_next = False
    for arg in argv:
        if mask_next:
            out.append(MASK)
            mask_next = False
            continue
        name, eq, _ = arg.partition("=")
        if secret_flag(name):
            if eq:
                out.append(f"{name}={MASK}")
            else:
                out.append(arg)
                mask_next = True
            continue
        out.append(arg)
    return out


def redact_text(text: str) -> str:
    """A log line with bearer tokens, secret flag values and secret env assignments masked."""
    for pattern, repl in _IN_TEXT:
        text = pattern.sub(repl, text)
    return text
