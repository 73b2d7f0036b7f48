"""``tool_choice: "auto"`` on a real `python -m lbd.engine` with ``--enable-auto-tool-choice
--tool-call-parser hermes``, through the openai SDK. A tiny random-weight model writes no calls of its own, so
a ``structured_outputs`` regex (vLLM lets it stand beside "auto") makes it write hermes markup: content, then
``<tool_call>{...}</tool_call>``. The parser must turn that into ``tool_calls`` (finish reason
``tool_calls``) and content, whole and streamed as OpenAI streams them, with no markup in the content.
The same markup without the flag (tools, no tool_choice) stays text; "auto" without it is the Responses test
server's 400 (test_responses.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

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
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes", log=log) as srv:
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
