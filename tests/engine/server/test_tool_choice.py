"""tool_choice read into a forced tool-call schema, and the "required" array read back into OpenAI's tool
calls: whole, and streamed in pieces of any size (each call announced once, with its id and name, then
argument text)."""

from __future__ import annotations

import pytest

from lbd.engine.server.errors import APIError
from lbd.engine.server.fields import Fields
from lbd.engine.server.json_scan import RequiredCallsScanner
from lbd.engine.server.tool_choice import ForcedTools, ToolCallStream, forced_tools, tool_calls

F = {"type": "object", "properties": {"x": {"type": "integer"}}, "$defs": {"D": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": F}},
         {"type": "function", "function": {"name": "g"}}]
TEXT = ('[ {"name": "f", "parameters": {"s": "a\\"}]", "n": [1, {"x": "}"}]}} ,'
        '{"name":"g","parameters":{}}, {"name": "f", "parameters": {"x": 1')  # cut inside the third call


def test_schemas_of_required_and_named() -> None:
    req = forced_tools(Fields({"tool_choice": "required", "parallel_tool_calls": False}), TOOLS)
    assert req.name is None and req.finish_reason == "tool_calls"
    assert req.schema["maxItems"] == 1 and req.schema["minItems"] == 1 and req.schema["$defs"] == F["$defs"]
    f_item, g_item = req.schema["items"]["anyOf"]
    assert f_item["properties"]["name"] == {"type": "string", "enum": ["f"]}
    assert "$defs" not in f_item["properties"]["parameters"]
    assert g_item["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = forced_tools(Fields({"tool_choice": {"type": "function", "function": {"name": "f"}}}), TOOLS)
    assert named == ForcedTools("f", F) and named.finish_reason == "stop"
    assert forced_tools(Fields({"tool_choice": "auto"}), TOOLS) is None
    assert forced_tools(Fields({}), TOOLS) is None


@pytest.mark.parametrize("body, tools, param", [
    ({"tool_choice": "required"}, None, "tool_choice"),
    ({"tool_choice": "sometimes"}, TOOLS, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {}}}, TOOLS, "tool_choice.function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "h"}}}, TOOLS, "tool_choice.function.name"),
    ({"tool_choice": "required"}, [{"type": "retrieval"}], "tools[0].type"),
    ({"tool_choice": "required"}, [{"type": "function", "function": {}}], "tools[0].function.name"),
])
def test_bad_tool_choices_name_the_field(body: dict, tools: list | None, param: str) -> None:
    with pytest.raises(APIError) as e:
        forced_tools(Fields(body), tools)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_whole_text_gives_the_calls_written_whole() -> None:
    calls = tool_calls(ForcedTools(None, {}), TEXT)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("f", '{"s": "a\\"}]", "n": [1, {"x": "}"}]}'), ("g", "{}")]
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in calls)
    named = tool_calls(ForcedTools("f", F), '{"x": 2}')
    assert named[0]["function"] == {"name": "f", "arguments": '{"x": 2}'}


@pytest.mark.parametrize("piece", [1, 2, 5, 11, len(TEXT)])
def test_streamed_pieces_of_any_size_give_the_same_calls(piece: int) -> None:
    stream = ToolCallStream(ForcedTools(None, {}))
    calls: dict[int, list[str]] = {}
    for k in range(0, len(TEXT), piece):
        for d in stream.feed(TEXT[k:k + piece]):
            if d["index"] in calls:
                assert "id" not in d and "name" not in d["function"]
            else:
                assert d["id"] and d["type"] == "function"
                calls[d["index"]] = [d["function"]["name"], ""]
            calls[d["index"]][1] += d["function"]["arguments"]
    assert calls == {0: ["f", '{"s": "a\\"}]", "n": [1, {"x": "}"}]}'], 1: ["g", "{}"], 2: ["f", '{"x": 1']}


def test_named_stream_announces_once() -> None:
    stream = ToolCallStream(ForcedTools("f", F))
    first, second = stream.feed('{"x"'), stream.feed(": 3}")
    assert first[0]["function"] == {"name": "f", "arguments": '{"x"'} and first[0]["id"]
    assert second == [{"index": 0, "function": {"arguments": ": 3}"}}]


def test_scanner_offsets_are_those_of_the_whole_text() -> None:
    s = RequiredCallsScanner()
    for ch in TEXT:
        s.feed(ch)
    assert [(c.name, TEXT[c.args_start:c.args_end] if c.args_end else None) for c in s.calls] == [
        ("f", '{"s": "a\\"}]", "n": [1, {"x": "}"}]}'), ("g", "{}"), ("f", None)]
