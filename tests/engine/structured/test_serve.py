"""Structured outputs over HTTP on `python -m lbd.engine` (a tiny random-weight model: the grammar alone makes
the text valid): OpenAI's ``response_format``, vLLM's ``structured_outputs`` and the older ``guided_*``
fields on chat and completions, streamed and not; bad constraints get a 400 naming the problem and leave the
server serving; ``max_tokens`` inside the grammar ends with ``length``.

The server is a pipeline-parallel rank (PP 2, so two batches in flight): the core fills each step's token
mask from the matchers when it submits the batch (a request is not scheduled again before its token comes
back, so its matcher is up to date), the Step message carries the mask and the last stage's TP rank 0
applies it before sampling (with TP the same worker samples, after gathering the logits). The one-device
runner is covered in process (test_engine_core.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from support import EngineServer

SCHEMA = {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "sunny": {"type": "boolean"},
                         "temps": {"type": "array", "maxItems": 4,
                                   "items": {"type": "integer", "minimum": -40, "maximum": 50}}},
          "required": ["city", "sunny", "temps"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "The weather, as JSON."}]
# compact JSON: the tiny server runs with --structured-outputs-config.disable_any_whitespace true (random
# weights would otherwise spend their tokens on whitespace between the fields)
FLAGS = ("--device", "cpu", "--max-model-len", "512", "--served-model-name", "tiny",
         "--pipeline-parallel-size", "2", "--structured-outputs-config.disable_any_whitespace", "true")


def parsed(text: str) -> object:
    return json.loads(text, strict=False)  # xgrammar lets raw control characters into strings, as in vLLM


@pytest.fixture(scope="module")
def server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    with EngineServer(tiny_llama, *FLAGS, log=tmp_path_factory.mktemp("structured") / "engine.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: EngineServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_json_schema_on_random_weights_is_valid_json(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=FORMAT, n=3,
                                       temperature=1.0, seed=7, max_tokens=300)
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(parsed(choice.message.content), SCHEMA)


NOTES = {"type": "object", "required": ["notes"],
         "properties": {"notes": {"type": "array", "minItems": 4, "maxItems": 4,
                                  "items": {"type": "string", "maxLength": 8}}}}


def test_strings_are_whole_utf8_and_hold_max_length_streamed_or_not(client: openai.OpenAI) -> None:
    """Random weights write strings byte by byte: the text is UTF-8 without U+FFFD (the grammar emits none)
    and each string holds maxLength counted in characters, the same text streamed and not. Before the UTF-8
    guard (structured.utf8), choice 3 of this seed carried an encoded surrogate xgrammar let through: three
    U+FFFD in the client's text, 10 characters in an 8-character string."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Notes, as JSON."}], "n": 4, "seed": 20,
            "temperature": 1.0, "max_tokens": 300, "response_format": {
                "type": "json_schema", "json_schema": {"name": "notes", "schema": NOTES, "strict": True}}}
    whole = [c.message.content for c in client.chat.completions.create(**body).choices]
    streamed = [""] * 4
    for chunk in client.chat.completions.create(**body, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
    assert streamed == whole
    for text in whole:
        assert "\ufffd" not in text, text
        jsonschema.validate(parsed(text), NOTES)


def test_regex_choice_grammar_and_json_object_on_every_field(client: openai.OpenAI) -> None:
    regex = r"[a-z]{3}-\d{2}"
    r = client.completions.create(model="tiny", prompt="code:", max_tokens=50, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, r.choices[0].text, re.ASCII) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=1.0,
                                       extra_body={"guided_choice": ["sunny", "rainy day"]})
    assert r.choices[0].message.content in ("sunny", "rainy day")
    r = client.completions.create(model="tiny", prompt="x", max_tokens=60, temperature=1.0, seed=2,
                                  extra_body={"guided_grammar": 'root ::= "a" ("b" | "cd")+ "."'})
    assert re.fullmatch(r"a(b|cd)+\.", r.choices[0].text)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300, stream=True,
                                            temperature=1.0, seed=3, response_format={"type": "json_object"})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(parsed(text), dict), text


def test_max_tokens_inside_the_grammar_ends_with_length(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=FORMAT, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body, status, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     400, "objekt"),
    ({"structured_outputs": {"regex": "a(b"}}, 400, "parenthesis"),
    ({"guided_grammar": "root ::= missing"}, 400, "missing"),
    ({"guided_choice": []}, 400, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, 400, "exactly one"),
    ({"response_format": {"type": "structural_tag"}}, 400, "structural_tag"),
    ({"guided_decoding_backend": "outlines"}, 400, "guided_decoding_backend"),
    ({"response_format": {"type": "json_schema"}}, 400, "json_schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_get_400_naming_the_problem(server: EngineServer, body: dict, status: int, words: str,
                                                    stream: bool) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, "stream": stream, **body})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_the_server_still_serves_after_bad_constraints(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                              "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city", "days"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(parsed(arguments), PARAMS[name])  # a KeyError: not a declared tool


def test_tool_choice_required_and_named(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                       temperature=1.0, seed=11, max_tokens=300)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls])
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=12,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       max_tokens=300)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop" and call.function.name == "get_time"
    check_calls([(call.function.name, call.function.arguments)])


def test_streamed_required_tool_calls_arrive_as_openai_deltas(client: openai.OpenAI) -> None:
    """The first delta of a call carries its id, type and name; later ones argument text only."""
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, stream=True,
                                            tool_choice="required", temperature=1.0, seed=13, max_tokens=300)
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            assert not choice.delta.content
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    assert d.id and d.type == "function" and d.function.name
                    calls[d.index] = [d.function.name, ""]
                else:
                    assert d.id is None and d.function.name is None
                calls[d.index][1] += d.function.arguments or ""
    assert finish == "tool_calls" and sorted(calls) == list(range(len(calls)))
    check_calls([(name, args) for name, args in calls.values()])


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}], "tool_choice": "required"},
     "tools[0].function.parameters"),
])
def test_bad_tool_choices_name_the_field(server: EngineServer, body: dict, param: str) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": MESSAGES, "max_tokens": 5, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_resumed_stream_continues_its_grammar_past_the_output_it_had(server: EngineServer) -> None:
    """lbd's router resumes a broken stream as a completion whose prompt ends with the output sent, their
    count in ``lbd_resumed_output_tokens``: the grammar starts past them and the greedy answer goes on token
    for token as the unbroken one; output the grammar refuses gets a 400 naming the field, before any byte."""
    url = server.base_url + "/v1/completions"
    base = {"model": "tiny", "temperature": 0, "max_tokens": 300, "response_format": FORMAT,
            "return_token_ids": True}
    whole = httpx.post(url, json=base | {"prompt": "The weather, as JSON:"}, timeout=60).json()["choices"][0]
    prompt, out = whole["prompt_token_ids"], whole["token_ids"]
    assert whole["finish_reason"] == "stop" and len(out) > 8, whole
    k = len(out) // 2
    cont = base | {"prompt": prompt + out[:k], "lbd_resumed_output_tokens": k, "max_tokens": 300 - k}
    rest = httpx.post(url, json=cont, timeout=60).json()["choices"][0]
    assert rest["token_ids"] == out[k:] and rest["finish_reason"] == "stop"
    jsonschema.validate(parsed(whole["text"]), SCHEMA)
    bad = cont | {"prompt": prompt + out[1:k], "lbd_resumed_output_tokens": k - 1, "stream": True}
    r = httpx.post(url, json=bad, timeout=60)  # JSON does not start past its "{"
    assert r.status_code == 400 and "lbd_resumed_output_tokens" in r.json()["error"]["message"], r.text


def chat_chunks(server: EngineServer, body: dict) -> tuple[list[dict], dict]:
    """A streamed chat's chunks (their choice 0) and its usage."""
    out, usage = [], {}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                out += chunk["choices"][:1]
                usage = chunk.get("usage") or usage
    return out, usage


def test_a_resumed_tool_chat_goes_on_where_its_stream_was(server: EngineServer) -> None:
    """lbd's router resumes a tool chat as the same chat with ``lbd_resumed_output_token_ids`` (the output ids
    the client has): the forced grammar starts past them and the formatter reads their text first, so the
    stream goes on with the call's arguments (no role delta, no second id or name) and the deltas before the
    break and after it are the unbroken stream's. Every token id is in some chunk (a token whose text gave
    the client nothing yet goes with the next chunk). Output the grammar refuses, or a request that is not
    one stream, gets a 400."""
    base = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "stream": True,
            "parallel_tool_calls": False, "temperature": 0, "max_tokens": 200, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    whole, usage = chat_chunks(server, base)
    deltas = [(c["token_ids"], c["delta"].get("tool_calls") or []) for c in whole[1:]]  # after the role's
    ids = [t for chunk_ids, _ in deltas for t in chunk_ids]
    assert len(ids) == usage["completion_tokens"] > 10, usage
    cut = next(i for i, (_, calls) in enumerate(deltas) if calls) + 3  # 3 chunks into the arguments
    sent = [t for chunk_ids, _ in deltas[:cut] for t in chunk_ids]
    resumed = base | {"lbd_resumed_output_token_ids": sent}
    rest, _ = chat_chunks(server, resumed | {"max_tokens": 200 - len(sent)})
    assert "role" not in rest[0]["delta"] and all(not c["delta"].get("content") for c in rest)
    assert [t for c in rest for t in c["token_ids"]] == ids[len(sent):]
    later = [d for c in rest for d in c["delta"].get("tool_calls") or []]
    assert later and all("id" not in d and "name" not in d["function"] for d in later), later
    args = "".join(d["function"]["arguments"] for _, calls in deltas for d in calls)
    before = "".join(d["function"]["arguments"] for _, calls in deltas[:cut] for d in calls)
    assert before + "".join(d["function"]["arguments"] for d in later) == args
    assert rest[-1]["finish_reason"] == whole[-1]["finish_reason"] == "tool_calls"
    nothing, _ = chat_chunks(server, base | {"lbd_resumed_output_token_ids": []})  # cut before any token
    assert "role" not in nothing[0]["delta"] and [t for c in nothing for t in c["token_ids"]] == ids
    url = server.base_url + "/v1/chat/completions"
    for bad, words in ((resumed | {"lbd_resumed_output_token_ids": sent[1:]}, "not output this json grammar"),
                       (resumed | {"stream": False, "stream_options": None}, "needs stream"),
                       (resumed | {"lbd_resumed_output_tokens": 2}, "both")):
        r = httpx.post(url, json=bad, timeout=60)
        assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
