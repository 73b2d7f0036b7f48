"""Per-key token limits settled on the output actually produced (``lbd.router.auth``).

Admission charges a key's token bucket the prompt's estimate plus what the request may produce (its
``max_tokens``, else the path's default). When the answer ends, however it ends (whole, cut by the upstream,
or the client gone mid-stream), the bucket is charged the difference between the output tokens that reached
the client and that admission charge (``Bill.settle``): more is a debt (the bucket goes below zero and the
key's next request waits for it), less a refund (never past the bucket's size). Omitting ``max_tokens``
then costs exactly what the answer was.

What was produced is read from what goes to the client (``Meter``, fed by the client's ``Response`` only
for requests that have a bill, so a router without token limits pays nothing): the last ``usage``
``completion_tokens`` (``output_tokens`` for responses and messages) in the answer, which a whole answer
always has and a stream has when it asked for it (``stream_options.include_usage``); else a stream's
events that carried text (each carries at least one token). A stream the router tracks for migration
(``lbd.router.resumable.Move``) counts its token ids exactly; the larger count is charged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from lbd.router.auth import Bucket

# the usage counts of chat/completions (completion_tokens) and responses/messages (output_tokens), followed
# by a non-digit so a number split between two writes is read whole from the next one. A quote inside a
# JSON string is escaped, so neither pattern can match generated text.
_USAGE = re.compile(rb'"(?:completion_tokens|output_tokens)":\s*(\d+)(?=\D)')
# an event with text: a non-empty string under a key that carries output (chat deltas, completions text,
# reasoning, tool-call arguments, responses/messages deltas)
_TEXT = re.compile(rb'"(?:content|text|reasoning_content|reasoning|arguments|delta|partial_json)":"[^"]')
_CARRY = 64  # bytes kept from one write to the next: longer than any match


@dataclass(slots=True)
class Meter:
    """Counts the output in the bytes written to one client (``feed`` per write)."""

    usage: int | None = None  # the last usage count seen
    texts: int = 0  # events with text
    _carry: bytes = b""

    def feed(self, data: bytes) -> None:
        carry = self._carry
        buf = carry + data if carry else data
        for m in _USAGE.finditer(buf):
            self.usage = int(m.group(1))
        skip = len(carry)
        self.texts += sum(1 for m in _TEXT.finditer(buf) if m.end() > skip)  # (the carry's were counted)
        self._carry = buf[-_CARRY:]

    @property
    def produced(self) -> int:
        """The output tokens that reached the client: the answer's usage, else its events with text."""
        return self.usage if self.usage is not None else self.texts


@dataclass(slots=True)
class Bill:
    """One admitted request's charge on its key's token bucket, settled when its answer ends."""

    bucket: Bucket
    charged: int  # output tokens charged at admission
    meter: Meter = field(default_factory=Meter)
    settled: bool = False

    def settle(self, now: float, ids: int = 0) -> int:
        """Charge the bucket what was produced (the meter's count, or ``ids``, a tracked stream's token ids,
        if more) less what admission charged; returns what was produced. Once only."""
        produced = max(self.meter.produced, ids)
        if not self.settled:
            self.settled = True
            self.bucket.adjust(now, produced - self.charged)
        return produced
