"""Parsing and validation of an OpenAI Responses API request (``POST /v1/responses``): text in, text out.

Supported: ``input`` (a string, or message items with ``input_text``/``output_text`` parts), ``instructions``,
``max_output_tokens``, ``temperature``, ``top_p`` (and vLLM's extra sampling fields, as on chat), ``stream``,
``store``, ``previous_response_id``, ``metadata``, ``user``, ``text.format`` of type ``text``,
``parallel_tool_calls``, ``prompt_cache_key``. Refused with a 400 naming the field rather than answered
wrongly: tools and tool calls, images and files, reasoning effort, background mode, ``include``,
``top_logprobs``, ``truncation: auto``, structured text formats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import Fields
from lbd.engine.server.openai_protocol import CommonParams, sampling_from

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class ResponsesRequest:
    common: CommonParams
    input_messages: list[dict[str, str]]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    echo: dict[str, Any] = field(default_factory=dict)  # request fields the response object repeats


def _part_text(part: Any, param: str) -> str:
    pf = Fields(part, param)
    kind = pf.str("type", "input_text")
    if kind not in _TEXT_PARTS:
        raise bad_request(f"content part type {kind!r} is not supported (text only: input_text, output_text)",
                          pf.param("type"))
    pf.required("text")
    return pf.str("text")


def _message(item: Any, i: int) -> dict[str, str]:
    param = f"input[{i}]"
    f = Fields(item, param)
    kind = f.str("type", "message")
    if kind != "message":
        raise bad_request(f"input item type {kind!r} is not supported (message items with text only)",
                          f.param("type"))
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


def _input_messages(value: Any) -> list[dict[str, str]]:
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if isinstance(value, list) and value:
        return [_message(item, i) for i, item in enumerate(value)]
    raise bad_request("'input' must be a string or a non-empty list of input items", "input")


def _refuse_unsupported(f: Fields) -> None:
    if f.raw("tools"):
        raise bad_request("'tools' are not supported by this server's Responses API (text only)", "tools")
    choice = f.raw("tool_choice")
    if choice not in (None, "none", "auto"):
        raise bad_request("'tool_choice' can only be 'none' or 'auto' (no tools are supported)",
                          "tool_choice")
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
    text = f.obj("text")
    fmt = text.obj("format") if text is not None else None
    if fmt is not None and fmt.str("type", "text") != "text":
        raise bad_request("only text.format type 'text' is supported", "text.format.type")
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
    max_tokens = f.int("max_output_tokens", None, lo=1)
    common = CommonParams(model=f.str("model"), stream=f.bool("stream", False), include_usage=False,
                          continuous_usage=False, n=1, max_tokens=max_tokens, stop=[], include_stop=False,
                          skip_special_tokens=True, logprobs=None, sampling=sampling,
                          priority=f.int("priority", 0))
    echo = {"metadata": metadata or {}, "user": f.str("user"), "temperature": sampling.temperature,
            "top_p": sampling.top_p, "max_output_tokens": max_tokens,
            "parallel_tool_calls": f.bool("parallel_tool_calls", True),
            "tool_choice": f.raw("tool_choice") or "auto", "prompt_cache_key": f.str("prompt_cache_key")}
    return ResponsesRequest(common=common, input_messages=messages, instructions=f.str("instructions"),
                            previous_response_id=f.str("previous_response_id"), store=f.bool("store", True),
                            echo=echo)
