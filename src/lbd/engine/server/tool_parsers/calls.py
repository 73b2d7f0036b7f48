"""What every tool-call parser hands the chat formatter: a stream step (``StreamDelta``: content and OpenAI
tool-call deltas), a whole answer read at once (``Extracted``), and ``CallDeltas``, which turns a
``RequiredCallsScanner`` over a growing JSON text into OpenAI's deltas: per call a first delta with
``index``, ``id``, ``type`` and the function ``name`` (and the arguments so far), then argument text only.
Shared by the parsers of ``tool_choice: "auto"`` and by ``"required"`` (``server.tool_choice``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from lbd.engine.server.json_scan import RequiredCallsScanner


def call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def tool_call(name: str, arguments: str) -> dict[str, Any]:
    """One whole call as a non-streamed message carries it."""
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_text(value: Any) -> str:
    """A parsed arguments value as the text OpenAI's ``arguments`` holds (vLLM writes it with json.dumps)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(slots=True)
class StreamDelta:
    """One stream step of a parser: content text (never tool markup) and tool-call deltas."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)

    def __iadd__(self, other: StreamDelta) -> StreamDelta:
        self.content += other.content
        self.calls += other.calls
        return self


@dataclass(slots=True)
class Extracted:
    """A whole answer read by a parser: the calls found (empty: none) and the content left."""

    content: str | None
    calls: list[dict[str, Any]]


@dataclass(slots=True)
class CallDeltas:
    """OpenAI tool-call deltas read off a scanner as its text grows (``take`` returns the new ones)."""

    scanner: RequiredCallsScanner
    sent: list[int] = field(default_factory=list)  # argument characters sent, per announced call

    @property
    def announced(self) -> int:
        return len(self.sent)

    def take(self) -> list[dict[str, Any]]:
        out = []
        text = self.scanner.text
        for i, span in enumerate(self.scanner.calls):
            if span.name is None or span.args_start is None:
                break  # calls come in order: nothing later is ready
            args = text[span.args_start:span.args_end]
            if i >= len(self.sent):
                self.sent.append(len(args))
                out.append({"index": i, "id": call_id(), "type": "function",
                            "function": {"name": span.name, "arguments": args}})
            elif len(args) > self.sent[i]:
                out.append({"index": i, "function": {"arguments": args[self.sent[i]:]}})
                self.sent[i] = len(args)
        return out


def overlap(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ends ``text`` (the part of a tag that may still be
    arriving: held back rather than sent as content)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0
