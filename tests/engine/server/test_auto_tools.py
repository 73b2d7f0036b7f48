"""``tool_choice: "auto"`` on a real `python -m lbd.engine` with ``--enable-auto-tool-choice
--tool-call-parser hermes``, through the openai SDK. A tiny random-weight model writes no calls of its own, so
a ``structured_outputs`` regex (vLLM lets it stand beside "auto") makes it write hermes markup: content, then
``<tool_call>{...}</tool_call>``. The parser must turn that into ``tool_calls`` (finish reason
``tool_calls``) and content, whole and streamed as OpenAI streams them, with no markup in the content.
Without the flags "auto" (given, or on chat absent with tools, as vLLM reads it) is the Responses test
server's 400 (test_responses.py). The Responses API on the same server: function tools (forced, so the
grammar writes the calls) as ``function_call`` items, whole and streamed with OpenAI's events, the next turn
taking the call's output, and ``text.format`` json_schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from support import EngineServer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
             "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
WEATHER = (r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", "days": [1-7]\}\}'
           r"</tool_call>")
TIME = r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}</tool_call>'
TWO_CALLS = {"structured_outputs": {"regex": "Hi[a-z ]{0,6}" + WEATHER + TIME}}


@pytest.fixture(scope="module")
def client(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("auto-tools") / "engine.log"
    with EngineServer(tiny_llama, "--device", "cpu", "--max-model-len", "512", "--served-model-name", "tiny",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      "--structured-outputs-config.disable_any_whitespace", "true", log=log) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def _check(calls: list[tuple[str, str]]) -> None:
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    weather, time = (json.loads(args) for _, args in calls)
    assert set(weather) == {"city", "days"} and 1 <= weather["days"] <= 7 and time["zone"] in ("UTC", "CET")


def test_auto_whole_answer(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto",
                                       temperature=1.0, seed=5, max_tokens=200, extra_body=TWO_CALLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content.startswith("Hi") and "<tool_call>" not in choice.message.content
    _check([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    assert len({c.id for c in choice.message.tool_calls}) == 2
    one = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, seed=5, temperature=1,
                                         parallel_tool_calls=False, max_tokens=200, extra_body=TWO_CALLS)
    assert [c.function.name for c in one.choices[0].message.tool_calls] == ["get_weather"]


def test_auto_streamed_as_openai_streams(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, stream=True,
                                            temperature=1.0, seed=6, max_tokens=200, extra_body=TWO_CALLS)
    content, calls, finish, order = "", {}, None, []
    for chunk in stream:
        delta, finish = chunk.choices[0].delta, chunk.choices[0].finish_reason or finish
        if delta.content:
            assert not calls, "content after a call started"
            content += delta.content
        for d in delta.tool_calls or []:
            if d.index not in calls:  # the first delta: id, type and name
                assert d.id and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
                order.append(d.index)
            else:
                assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments
    assert finish == "tool_calls" and order == [0, 1]
    assert content.startswith("Hi") and "<" not in content
    _check([tuple(calls[i]) for i in order])


def test_text_without_markup_is_content(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                       extra_body={"structured_outputs": {"regex": "[a-z]{1,6}"}})
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content.isalpha()


ZONE = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}
RTOOLS = [{"type": "function", "name": "get_time", "parameters": ZONE},
          {"type": "function", "name": "get_city", "parameters": CITY}]
SCHEMAS = {"get_time": ZONE, "get_city": CITY}


def parsed(text: str) -> object:
    return json.loads(text, strict=False)  # xgrammar lets raw control characters into strings, as in vLLM


def test_responses_function_calls_and_the_next_turn(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="What time is it?", tools=RTOOLS, tool_choice="required",
                                parallel_tool_calls=False, temperature=1.0, max_output_tokens=150)
    assert r.status == "completed" and len(r.output) == 1 and r.tools[0].name == "get_time"
    call = r.output[0]
    assert call.type == "function_call" and call.status == "completed" and call.call_id
    jsonschema.validate(parsed(call.arguments), SCHEMAS[call.name])
    nxt = client.responses.create(model="tiny", previous_response_id=r.id, max_output_tokens=3, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}])
    assert nxt.output[0].type == "message" and nxt.output_text


def test_responses_streamed_named_call(client: openai.OpenAI) -> None:
    events = list(client.responses.create(
        model="tiny", input="Where?", tools=RTOOLS, tool_choice={"type": "function", "name": "get_city"},
        stream=True, temperature=1.0, max_output_tokens=150))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                *["response.function_call_arguments.delta"] * deltas,
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    added, done, final = events[2].item, events[-3], events[-1].response
    assert added.type == "function_call" and added.name == "get_city" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == args == final.output[0].arguments and final.output[0].call_id == added.call_id
    jsonschema.validate(parsed(args), CITY)


def test_responses_text_format_json_schema(client: openai.OpenAI) -> None:
    r = client.responses.create(model="tiny", input="A city, as JSON.", temperature=1, max_output_tokens=150,
                                text={"format": {"type": "json_schema", "name": "city", "schema": CITY,
                                                 "strict": True}})
    assert r.text.format.type == "json_schema"
    jsonschema.validate(parsed(r.output_text), CITY)
