"""A Responses API answer whose text may hold tool calls (function ``tools`` with a forced ``tool_choice``,
or "auto" read by the server's tool-call parser): its output items and, streamed, their events.

Items come in order, each opened when its first text arrives and closed before the next opens: a
``message`` for the content (``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``.done`` events), then one ``function_call`` item per call
(``response.output_item.added`` with its ``call_id`` and ``name``, ``response.function_call_arguments.delta``
..., ``response.function_call_arguments.done``, ``response.output_item.done``), as OpenAI streams them. A
whole answer is read at once by the same parser (chat's rules: server.tool_choice, server.tool_parsers).
"""

from __future__ import annotations

import uuid
from typing import Any

from lbd.engine.server.tool_choice import ForcedTools, ToolCallStream, tool_calls
from lbd.engine.server.tool_parsers import ToolParser
from lbd.engine.server.tool_parsers.calls import StreamDelta


class _ForcedStream:
    """``tool_choice`` "required" or named, streamed: the whole text is calls."""

    def __init__(self, forced: ForcedTools) -> None:
        self._calls = ToolCallStream(forced)
        self.called = False

    def feed(self, text: str) -> StreamDelta:
        calls = self._calls.feed(text)
        self.called = self.called or bool(calls)
        return StreamDelta("", calls)

    def finish(self) -> StreamDelta:
        return StreamDelta()


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class OutputItems:
    """One answer's items (``feed`` for a stream, ``read`` for a whole text; then ``items``)."""

    def __init__(self, msg_id: str, forced: ForcedTools | None, auto: ToolParser | None,
                 parallel: bool) -> None:
        self.msg_id = msg_id
        self.forced, self.auto, self.parallel = forced, auto, parallel
        self._stream = _ForcedStream(forced) if forced is not None else auto.stream() if auto else None
        self._text: list[str] = []  # the message's content
        self._msg_index: int | None = None  # the message item's output_index once opened
        self._calls: list[dict[str, Any]] = []  # function_call items, in order
        self._open: int | None = None  # the output_index of the item still open

    # ---- a whole answer -------------------------------------------------------------------------------
    def read(self, text: str) -> None:
        if self.forced is not None:
            content, calls = None, tool_calls(self.forced, text)
        elif self.auto is not None:
            found = self.auto.extract(text)
            content, calls = found.content, found.calls
        else:
            content, calls = text, []
        if content:
            self._msg_index = 0
            self._text.append(content)
        for call in calls if self.parallel else calls[:1]:
            fn = call["function"]
            self._calls.append({**self._call_item(call["id"], fn["name"], self._next_index()),
                                "arguments": fn["arguments"]})

    # ---- a stream -------------------------------------------------------------------------------------
    def feed(self, text: str, finished: bool) -> list[dict[str, Any]]:
        assert self._stream is not None
        step = self._stream.feed(text)
        if finished:
            step += self._stream.finish()
        events = self._content_events(step.content) if step.content else []
        for d in step.calls:
            if not self.parallel and d["index"] > 0:
                continue
            if d["index"] >= len(self._calls):
                events += self._close()
                events += self._open_call(d["id"], d["function"]["name"])
            args = d["function"].get("arguments") or ""
            if args:
                item = self._calls[d["index"]]
                item["arguments"] += args
                events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                               "output_index": item["output_index"], "delta": args})
        return events

    def closing(self, cut: bool) -> list[dict[str, Any]]:
        """The events that close the item still open."""
        return self._close(cut)

    def _content_events(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._msg_index is None:
            self._msg_index = self._open = self._next_index()
            events = [{"type": "response.output_item.added", "output_index": self._msg_index,
                       "item": {"id": self.msg_id, "type": "message", "status": "in_progress",
                                "role": "assistant", "content": []}},
                      {"type": "response.content_part.added", "item_id": self.msg_id,
                       "output_index": self._msg_index, "content_index": 0, "part": text_part("")}]
        self._text.append(text)
        events.append({"type": "response.output_text.delta", "item_id": self.msg_id,
                       "output_index": self._msg_index, "content_index": 0, "delta": text, "logprobs": []})
        return events

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        item = self._call_item(call_id, name, self._next_index())
        self._calls.append(item)
        self._open = item["output_index"]
        return [{"type": "response.output_item.added", "output_index": item["output_index"],
                 "item": {**self._public(item), "status": "in_progress"}}]

    def _close(self, cut: bool = False) -> list[dict[str, Any]]:
        index, self._open = self._open, None
        if index is None:
            return []
        if index == self._msg_index:
            text, where = "".join(self._text), {"item_id": self.msg_id, "output_index": index,
                                                "content_index": 0}
            return [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                    {"type": "response.content_part.done", **where, "part": text_part(text)},
                    {"type": "response.output_item.done", "output_index": index, "item": self._message(cut)}]
        item = next(c for c in self._calls if c["output_index"] == index)
        return [{"type": "response.function_call_arguments.done", "item_id": item["id"],
                 "output_index": index, "name": item["name"], "arguments": item["arguments"]},
                {"type": "response.output_item.done", "output_index": index,
                 "item": self._public(item, cut)}]

    # ---- the items ------------------------------------------------------------------------------------
    def items(self, cut: bool) -> list[dict[str, Any]]:
        """Every item; the last one is incomplete when max_output_tokens cut the answer."""
        out = [self._message(cut and not self._calls)] if self._msg_index is not None else []
        return out + [self._public(c, cut and c is self._calls[-1]) for c in self._calls]

    @property
    def content(self) -> str:
        return "".join(self._text)

    def history(self) -> dict[str, Any]:
        """The assistant's turn as the next turn's chat template takes it."""
        calls = [{"id": c["call_id"], "type": "function",
                  "function": {"name": c["name"], "arguments": c["arguments"]}} for c in self._calls]
        return {"role": "assistant", "content": self.content, **({"tool_calls": calls} if calls else {})}

    def _next_index(self) -> int:
        return len(self._calls) + (self._msg_index is not None)

    def _message(self, cut: bool) -> dict[str, Any]:
        return {"id": self.msg_id, "type": "message", "status": "incomplete" if cut else "completed",
                "role": "assistant", "content": [text_part(self.content)]}

    @staticmethod
    def _call_item(call_id: str, name: str, index: int) -> dict[str, Any]:
        return {"id": "fc_" + uuid.uuid4().hex, "call_id": call_id, "name": name, "arguments": "",
                "output_index": index}

    @staticmethod
    def _public(item: dict[str, Any], cut: bool = False) -> dict[str, Any]:
        return {"id": item["id"], "type": "function_call", "status": "incomplete" if cut else "completed",
                "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
