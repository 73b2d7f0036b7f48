"""The Responses API on the engine: the openai SDK (stream and not), previous_response_id across the rank's
front ends, refusals, and the bounded store. A sim engine (real front ends, scheduler and ZMQ) keeps it fast.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import orjson
import pytest

from lbd.engine.server.responses_store import ResponseStore
from support import EngineServer

MODEL = "tiny"


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    log = tmp_path_factory.mktemp("responses") / "engine.log"
    with EngineServer(tiny_llama, "--device", "sim", "--max-model-len", "512", "--served-model-name", MODEL,
                      "--api-server-count", "2", "--data-parallel-rank", "3", "--data-parallel-size", "4",
                      log=log) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


def test_sdk_create_and_stream(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="Hello", instructions="Be brief.", max_output_tokens=5)
    assert r.id.startswith("resp_r3-") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # sim never stops
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    assert r.usage.output_tokens == 5 and r.usage.total_tokens == r.usage.input_tokens + 5
    assert r.instructions == "Be brief." and r.max_output_tokens == 5 and r.store is True
    events = list(client.responses.create(model=MODEL, input="Stream", max_output_tokens=4, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * 4,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-4].text == text and events[-1].response.output_text == text
    assert events[0].response.status == "in_progress" and events[-1].response.status == "incomplete"


def _on_each_front_end(server: EngineServer, method: str, path: str, **kw) -> dict[str, httpx.Response]:
    """The same request over fresh connections until both front ends (SO_REUSEPORT) answered it."""
    seen: dict[str, httpx.Response] = {}
    for _ in range(64):
        with httpx.Client(base_url=server.base_url, timeout=30) as c:  # a new connection each time
            r = c.request(method, path, **kw)
        seen.setdefault(r.headers["x-lbd-frontend-pid"], r)
        if len(seen) == 2:
            return seen
    raise AssertionError(f"one front end answered 64 connections: {list(seen)}")


def test_previous_response_id_and_get_work_on_every_front_end(server: EngineServer,
                                                              client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=3)
    body = {"model": MODEL, "input": "And again.", "previous_response_id": first.id, "max_output_tokens": 2}
    for r in _on_each_front_end(server, "POST", "/v1/responses", json=body).values():
        assert r.status_code == 200, r.text
        follow = r.json()
        assert follow["previous_response_id"] == first.id
        assert follow["usage"]["input_tokens"] > first.usage.input_tokens + first.usage.output_tokens
    for r in _on_each_front_end(server, "GET", f"/v1/responses/{first.id}").values():
        assert r.status_code == 200 and r.json()["output"][0]["content"][0]["text"] == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=1, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": "auto"}, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function",
                                                                                 "name": "g"}},
     "tool_choice.function.name"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s", "schema": 3}}},
     "text.format.schema"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x " * 600}, "input"),
])
def test_refusals_name_the_field(server: EngineServer, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/responses", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_tool_choice_auto_without_the_flags_is_vllms_400(server: EngineServer) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    messages = [{"role": "user", "content": "x"}]
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": MODEL, "messages": messages, "tools": tools, "tool_choice": "auto"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert r.json()["error"]["message"] == ('"auto" tool choice requires --enable-auto-tool-choice and '
                                            "--tool-call-parser to be set")
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={  # no tool_choice: "auto"
        "model": MODEL, "messages": messages, "tools": tools, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith('"auto" tool choice requires')
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={  # "none": the text
        "model": MODEL, "messages": messages, "tools": tools, "tool_choice": "none", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_store_evicts_its_oldest_within_both_bounds(tmp_path: Path) -> None:
    a = ResponseStore(tmp_path, max_entries=2, max_bytes=10_000)
    b = ResponseStore(tmp_path, max_entries=2, max_bytes=10_000)  # another front end of the rank
    for i in range(3):
        a.put(f"resp_r0-{i}", {"response": {"id": i}, "messages": []})
    assert a.get("resp_r0-0") is None and b.get("resp_r0-1") == {"response": {"id": 1}, "messages": []}
    big = {"response": {}, "messages": [{"role": "user", "content": "x" * 4000}]}
    b.put("resp_r0-big1", big)
    b.put("resp_r0-big2", big)
    b.put("resp_r0-big3", big)  # 3 x ~4 KB > 10 KB: the first big one goes
    assert b.get("resp_r0-big1") is None and b.get("resp_r0-big3") == big
    assert a.get("resp_r0-2") is not None  # b evicts only its own
    b.put("resp_r0-huge", {"messages": ["x" * 20_000]})  # larger than the whole store: not kept
    assert b.get("resp_r0-huge") is None and b.get("resp_r0-big2") is not None
    assert a.get("../etc/passwd") is None and not a.delete("resp_/x") and a.get("resp_r0-nope") is None
    off = ResponseStore(tmp_path / "off", max_entries=0, max_bytes=10)
    off.put("resp_r0-x", {"response": {}})
    assert not off.enabled and off.get("resp_r0-x") is None
    assert orjson.loads((tmp_path / "resp_r0-2.json").read_bytes())["response"] == {"id": 2}
