"""Parsing and validation of an OpenAI Responses API request (``POST /v1/responses``).

Supported: ``input`` (a string, or items: messages with ``input_text``/``output_text`` parts,
``function_call`` and ``function_call_output``), ``instructions``, ``max_output_tokens``, ``temperature``,
``top_p`` (and vLLM's extra sampling fields, as on chat), ``stream``, ``store``, ``previous_response_id``,
``metadata``, ``user``, ``text.format`` (``text``, ``json_object``, ``json_schema``: chat's
``response_format``), function ``tools`` with ``tool_choice`` (``none``, ``auto``, ``required``,
``{"type": "function", "name": F}``: chat's machinery, server.tool_choice) and ``parallel_tool_calls``,
``prompt_cache_key``. Refused with a 400 naming the field rather than answered wrongly: tools other than
functions, images and files, reasoning effort, background mode, ``include``, ``top_logprobs``,
``truncation: auto``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import Fields
from lbd.engine.server.openai_protocol import CommonParams, sampling_from
from lbd.engine.server.structured_params import structured_from
from lbd.engine.server.tool_choice import ForcedTools, forced_tools
from lbd.wire.core_messages import StructuredOutputs

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class ResponsesRequest:
    common: CommonParams
    input_messages: list[dict[str, Any]]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats
    tools: list[dict[str, Any]] | None = None  # in chat's shape (the chat template's and tool_choice's)
    tool_choice: Any = None  # in chat's shape
    forced: ForcedTools | None = None  # tool_choice "required" or a named function


def _part_text(part: Any, param: str) -> str:
    pf = Fields(part, param)
    kind = pf.str("type", "input_text")
    if kind not in _TEXT_PARTS:
        raise bad_request(f"content part type {kind!r} is not supported (text only: input_text, output_text)",
                          pf.param("type"))
    pf.required("text")
    return pf.str("text")


def _message(item: Any, i: int) -> dict[str, Any]:
    param = f"input[{i}]"
    f = Fields(item, param)
    kind = f.str("type", "message")
    if kind in ("function_call", "function_call_output"):
        return _call_item(f, kind)
    if kind != "message":
        raise bad_request(f"input item type {kind!r} is not supported (message, function_call and "
                          "function_call_output items)", f.param("type"))
    role = f.required("role")
    if role not in _ROLES:
        raise bad_request(f"'{param}.role' must be one of {', '.join(_ROLES)}, got {role!r}", f.param("role"))
    content = f.required("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "".join(_part_text(p, f"{param}.content[{j}]") for j, p in enumerate(content))
    else:
        raise bad_request(f"'{param}.content' must be a string or a list of content parts",
                          f.param("content"))
    return {"role": role, "content": text}


def _call_item(f: Fields, kind: str) -> dict[str, Any]:
    """A function call the model made (an assistant message with ``tool_calls``) or its result (a ``tool``
    message), as chat templates take them."""
    call_id = f.required("call_id")
    if not isinstance(call_id, str):
        raise bad_request(f"'{f.param('call_id')}' must be a string", f.param("call_id"))
    if kind == "function_call_output":
        output = f.required("output")
        if not isinstance(output, str):
            raise bad_request(f"'{f.param('output')}' must be a string", f.param("output"))
        return {"role": "tool", "tool_call_id": call_id, "content": output}
    name, arguments = f.required("name"), f.required("arguments")
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise bad_request(f"'{f.param('name')}' and '{f.param('arguments')}' must be strings",
                          f.param("name"))
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}


def _input_messages(value: Any) -> list[dict[str, Any]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value:
        out: list[dict[str, Any]] = []
        for i, item in enumerate(value):
            m = _message(item, i)
            last = out[-1] if out else None
            if m.get("tool_calls") and last is not None and last.get("tool_calls"):
                last["tool_calls"] = last["tool_calls"] + m["tool_calls"]  # parallel calls: one message
            else:
                out.append(m)
        return out
    raise bad_request("'input' must be a string or a non-empty list of input items", "input")


def _tools(f: Fields) -> list[dict[str, Any]] | None:
    """Function tools (Responses' flat shape) in chat's shape."""
    raw = f.raw("tools")
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise bad_request("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(raw):
        tf = Fields(tool, f"tools[{i}]")
        kind = tf.str("type", "function")
        if kind != "function":
            raise bad_request(f"tool type {kind!r} is not supported (function tools only)", tf.param("type"))
        name = tf.str("name")
        if not name:
            raise bad_request(f"'tools[{i}].name' is a required field", tf.param("name"))
        fn: dict[str, Any] = {"name": name}
        for key in ("description", "parameters"):
            if tf.raw(key) is not None:
                fn[key] = tf.raw(key)
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name": F}`` in chat's shape; the strings are the same."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _text_format(f: Fields) -> StructuredOutputs | None:
    """``text.format`` read as chat's ``response_format``."""
    text = f.obj("text")
    fmt = text.obj("format") if text is not None else None
    kind = fmt.str("type", "text") if fmt is not None else "text"
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return structured_from(Fields({"response_format": {"type": "json_object"}}))
    if kind != "json_schema":
        raise bad_request(f"text.format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "text.format.type")
    schema = fmt.raw("schema")
    if schema is not None and not isinstance(schema, dict):
        raise bad_request("'text.format.schema' must be a JSON schema (an object)", "text.format.schema")
    js = {"name": fmt.str("name") or "response", "schema": schema or {}}
    if fmt.bool("strict", None) is not None:
        js["strict"] = fmt.bool("strict")
    return structured_from(Fields({"response_format": {"type": "json_schema", "json_schema": js}}))


def _refuse_unsupported(f: Fields) -> None:
    if f.bool("background", False):
        raise bad_request("'background' mode is not supported", "background")
    if f.raw("include"):
        raise bad_request("'include' is not supported", "include")
    if f.int("top_logprobs", 0, lo=0):
        raise bad_request("'top_logprobs' is not supported on /v1/responses", "top_logprobs")
    if f.str("truncation", "disabled") != "disabled":
        raise bad_request("only truncation 'disabled' is supported", "truncation")
    reasoning = f.obj("reasoning")
    if reasoning is not None and (reasoning.has("effort") or reasoning.has("summary")):
        raise bad_request("'reasoning' is not supported by this model", "reasoning")
    if f.has("conversation"):
        raise bad_request("'conversation' is not supported (use previous_response_id)", "conversation")


def parse_responses(body: Any) -> ResponsesRequest:
    f = Fields(body)
    _refuse_unsupported(f)
    messages = _input_messages(f.required("input"))
    metadata = f.raw("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad_request("'metadata' must be an object", "metadata")
    sampling = sampling_from(f)
    sampling.structured = _text_format(f)
    tools = _tools(f)
    choice = _chat_tool_choice(f.raw("tool_choice"))
    parallel = f.bool("parallel_tool_calls", True)
    forced = forced_tools(Fields({"tool_choice": choice, "parallel_tool_calls": parallel}), tools)
    if forced is not None:
        if sampling.structured is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with a "
                              "structured text.format", "tool_choice")
        sampling.structured = StructuredOutputs("json", orjson.dumps(forced.schema).decode())
    max_tokens = f.int("max_output_tokens", None, lo=1)
    common = CommonParams(model=f.str("model"), stream=f.bool("stream", False), include_usage=False,
                          continuous_usage=False, n=1, max_tokens=max_tokens, stop=[], include_stop=False,
                          skip_special_tokens=True, logprobs=None, sampling=sampling,
                          priority=f.int("priority", 0))
    echo = {"metadata": metadata or {}, "user": f.str("user"), "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_output_tokens": max_tokens,
            "parallel_tool_calls": parallel, "tool_choice": f.raw("tool_choice") or "auto",
            "prompt_cache_key": f.str("prompt_cache_key"), "tools": f.raw("tools") or [],
            "text": {"format": (f.obj("text") or Fields({})).raw("format") or {"type": "text"}}}
    return ResponsesRequest(common=common, input_messages=messages, instructions=f.str("instructions"),
                            previous_response_id=f.str("previous_response_id"), store=f.bool("store", True),
                            echo=echo, tools=tools, tool_choice=choice, forced=forced)
