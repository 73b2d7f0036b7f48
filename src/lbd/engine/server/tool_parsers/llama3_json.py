"""vLLM's ``llama3_json`` tool-call parser (Llama 3.1-3.3 with JSON tool calling): the answer is a call
``{"name": ..., "parameters": {...}}`` (or ``"arguments"``), several separated by ``; ``, optionally after
``<|python_tag|>``.

A whole answer: every top-level JSON object in it must be a call (a ``name`` and ``parameters`` or
``arguments``); then they are the calls and there is no content, else the whole text is content (vLLM's
rule). A stream is a call stream when its text starts with ``{`` or ``<|python_tag|>`` (leading whitespace
aside), content otherwise; a call stream that announced no call by its end sends its text as content.
"""

from __future__ import annotations

import json

from lbd.engine.server.json_scan import RequiredCallsScanner
from lbd.engine.server.tool_parsers.calls import CallDeltas, Extracted, StreamDelta, arguments_text, tool_call

BOT = "<|python_tag|>"
_KEYS = ("parameters", "arguments")
_DECODER = json.JSONDecoder()


def extract(text: str) -> Extracted:
    if BOT not in text and "{" not in text:
        return Extracted(text, [])
    calls = []
    end = -1
    for start, ch in enumerate(text):
        if ch != "{" or start <= end:
            continue
        try:
            obj, stop = _DECODER.raw_decode(text, start)
        except ValueError:
            return Extracted(text, [])
        end = stop - 1
        if not _is_call(obj):
            return Extracted(text, [])
        args = obj["arguments"] if "arguments" in obj else obj["parameters"]
        calls.append(tool_call(obj["name"], arguments_text(args)))
    return Extracted(None, calls) if calls else Extracted(text, [])


def _is_call(obj: object) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get("name"), str) and any(k in obj for k in _KEYS)


class Llama3JsonStream:
    """One choice's text, fed as it streams."""

    def __init__(self) -> None:
        self.deltas = CallDeltas(RequiredCallsScanner(_KEYS))
        self._mode = "undecided"  # until the first character that is not whitespace: "content" or "calls"
        self._text = ""

    @property
    def called(self) -> bool:
        return self.deltas.announced > 0

    def feed(self, text: str) -> StreamDelta:
        self._text += text
        if self._mode == "content":
            return StreamDelta(text)
        if self._mode == "calls":
            self.deltas.scanner.feed(text)
            return StreamDelta("", self.deltas.take())
        head = self._text.lstrip()
        if not head or (BOT.startswith(head) and head != BOT):
            return StreamDelta()  # not known yet: hold it
        if head.startswith(BOT) or head.startswith("{"):
            self._mode = "calls"
            body = head[len(BOT):] if head.startswith(BOT) else head
            self.deltas.scanner.feed("[" + body)  # the calls read as the items of one array
            return StreamDelta("", self.deltas.take())
        self._mode = "content"
        return StreamDelta(self._text)

    def finish(self) -> StreamDelta:
        """The end of the answer: held text goes out as content when no call came of it."""
        if self._mode == "content" or self.called:
            return StreamDelta()
        self._mode = "content"
        return StreamDelta(self._text)
