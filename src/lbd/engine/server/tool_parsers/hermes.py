"""vLLM's ``hermes`` tool-call parser (Hermes 2 Pro, Qwen 2.5/3 and other ChatML models): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text.

Content is the text before the first ``<tool_call>``; text between and after calls is dropped, as vLLM does.
Streaming sends content until a tag starts (a tail that may be the tag's beginning is held back), then each
call's deltas as its JSON grows; the tags never reach the client. A whole answer whose calls do not all parse
is returned as content with no calls (vLLM's rule); a stream that announced no call ends by sending what it
held back as content.
"""

from __future__ import annotations

import json
import re

from lbd.engine.server.json_scan import RequiredCallsScanner
from lbd.engine.server.tool_parsers.calls import (
    CallDeltas,
    Extracted,
    StreamDelta,
    arguments_text,
    overlap,
    tool_call,
)

START, END = "<tool_call>", "</tool_call>"
_REGION = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


def extract(text: str) -> Extracted:
    if START not in text:
        return Extracted(text, [])
    calls = []
    for closed, open_ in _REGION.findall(text):
        try:
            obj = json.loads(closed or open_)
        except ValueError:
            return Extracted(text, [])
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return Extracted(text, [])
        calls.append(tool_call(obj["name"], arguments_text(obj["arguments"])))
    return Extracted(text[:text.index(START)] or None, calls)


class HermesStream:
    """One choice's text, fed as it streams."""

    def __init__(self) -> None:
        self.deltas = CallDeltas(RequiredCallsScanner(("arguments",)))
        self.deltas.scanner.feed("[")  # the calls' bodies read as the items of one array
        self._mode = "content"  # "content" before the first tag, "call" inside one, "between" after one
        self._buf = ""  # text not yet placed
        self._text = ""  # everything fed
        self._sent = 0  # characters of it sent as content

    @property
    def called(self) -> bool:
        return self.deltas.announced > 0

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        self._buf += text
        content = []
        while self._buf:
            tag = START if self._mode != "call" else END
            at = self._buf.find(tag)
            cut = at if at >= 0 else len(self._buf) - overlap(self._buf, tag)
            piece, self._buf = self._buf[:cut], self._buf[cut + (len(tag) if at >= 0 else 0):]
            if self._mode == "content":
                content.append(piece)
            elif self._mode == "call":
                self.deltas.scanner.feed(piece)
            if at < 0:
                break
            self._mode = "between" if self._mode == "call" else "call"
        out = "".join(content)
        self._sent += len(out)
        return StreamDelta(out, self.deltas.take())

    def finish(self) -> StreamDelta:
        """The end of the answer: what was held back goes out as content when no call came of it."""
        if self.called or self._sent == len(self._text):
            return StreamDelta()
        rest = self._text[self._sent:]
        self._sent = len(self._text)
        return StreamDelta(rest)
