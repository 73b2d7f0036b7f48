"""An incremental reader of ``tool_choice: "required"`` output as it streams: the JSON array
``[{"name": ..., "parameters": {...}}, ...]`` (its grammar guarantees the shape; ``name`` comes first, the
schema's order). Fed text piece by piece, it keeps each call's name (once its string is closed) and where its
``parameters`` value starts and ends in the text, so a stream can announce a call as soon as its name is
known and send its arguments as they grow. Each character is read once.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

_SPACE = " \t\r\n"


@dataclass(slots=True)
class CallSpan:
    name: str | None = None
    args_start: int | None = None  # offset of the parameters value in the text
    args_end: int | None = None  # just past it; None while it is still being written


class RequiredCallsScanner:
    """``args_keys``: the keys whose value is a call's arguments (``parameters`` for ``"required"``; the tool
    parsers read ``arguments`` too). ``broken`` turns true on text that is not JSON (a bad string escape):
    the scanner then reads nothing more."""

    def __init__(self, args_keys: tuple[str, ...] = ("parameters",)) -> None:
        self.args_keys = args_keys
        self.broken = False
        self.text = ""
        self.calls: list[CallSpan] = []
        self._pos = 0
        self._depth = 0  # 1 inside the array, 2 inside a call object
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._string_depth = 0
        self._key: str | None = None  # the call object's last key
        self._want_value = False  # a ':' at depth 2 was read: the next token starts a value
        self._value_of: str | None = None  # the key whose value is being read at depth 2
        self._last_solid = 0  # offset just past the last character that is not whitespace

    def feed(self, text: str) -> None:
        self.text += text
        if self.broken:
            return
        t = self.text
        try:
            for i in range(self._pos, len(t)):
                self._read(t, i, t[i])
        except orjson.JSONDecodeError:
            self.broken = True
        self._pos = len(t)

    def _read(self, t: str, i: int, ch: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_string = False
                self._last_solid = i + 1
                self._string_closed(t, i)
            return
        if ch in _SPACE:
            return
        if self._depth == 2 and self._want_value:
            self._want_value = False
            self._value_of = self._key
            if self._key in self.args_keys and self.calls:
                self.calls[-1].args_start = i
        self._structural(i, ch)
        self._last_solid = i + 1

    def _structural(self, i: int, ch: str) -> None:
        if ch == '"':
            self._in_string, self._string_start, self._string_depth = True, i, self._depth
        elif ch in "{[":
            self._depth += 1
            if self._depth == 2:
                self.calls.append(CallSpan())
                self._value_of = None
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 2:  # a value object or array closed
                self._end_value(i + 1)
            elif self._depth == 1:  # the call object closed after a scalar value
                self._end_value(self._last_solid)
        elif self._depth == 2 and ch == ",":
            self._end_value(self._last_solid)
        elif self._depth == 2 and ch == ":":
            self._want_value = True

    def _end_value(self, end: int) -> None:
        if self._value_of in self.args_keys and self.calls and self.calls[-1].args_end is None:
            self.calls[-1].args_end = end
        self._value_of = None

    def _string_closed(self, t: str, i: int) -> None:
        if self._string_depth != 2:
            return
        value = orjson.loads(t[self._string_start:i + 1])
        if self._value_of is None:
            self._key = value
            return
        if self._value_of == "name" and self.calls:
            self.calls[-1].name = value
        self._end_value(i + 1)
