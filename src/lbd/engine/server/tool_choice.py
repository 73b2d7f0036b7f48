"""``tool_choice`` ``"required"`` and a named function on chat: the answer is constrained to tool calls by a
JSON schema (the structured-outputs machinery, lbd.engine.structured), then read back into OpenAI's
``tool_calls``, as vLLM does.

- named (``{"type": "function", "function": {"name": F}}``): the output is F's arguments (its ``parameters``
  schema); one call of F, finish reason ``stop`` (OpenAI's and vLLM's rule for a named call).
- ``"required"``: the output is a JSON array of ``{"name": ..., "parameters": ...}``, one item schema per
  declared tool (at most one item with ``parallel_tool_calls: false``); finish reason ``tool_calls``.

Streams carry each call as OpenAI sends one: a first delta with the call's ``id``, ``type``, ``name`` and the
arguments so far, then argument text only (``ToolCallStream``; for ``"required"`` it reads the array as it
grows). ``"none"`` and ``"auto"`` leave the output unconstrained; under ``"auto"`` the server's tool-call
parser (``--enable-auto-tool-choice --tool-call-parser NAME``, ``server.tool_parsers``) reads calls out of
the text (``auto_parser`` says which, or refuses ``"auto"`` without the flags as vLLM does, on chat also
when ``tool_choice`` is absent: vLLM takes that for ``"auto"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import Fields
from lbd.engine.server.json_scan import RequiredCallsScanner
from lbd.engine.server.tool_parsers.calls import CallDeltas, call_id, tool_call

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True, frozen=True)
class ForcedTools:
    """Tool calls the output must be: ``name`` the named function, None for ``"required"``."""

    name: str | None
    schema: dict[str, Any]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"


def forced_tools(f: Fields, tools: list[Any] | None) -> ForcedTools | None:
    """``tool_choice`` read against ``tools``; None when the output is not forced to be tool calls."""
    choice = f.raw("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    functions = _functions(tools)
    if choice == "required":
        if not functions:
            raise bad_request("tool_choice 'required' needs at least one tool in 'tools'", "tool_choice")
        return ForcedTools(None, _required_schema(functions, f.bool("parallel_tool_calls", True)))
    if not isinstance(choice, dict):
        raise bad_request("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    name = Fields(choice, "tool_choice").obj("function")
    name = name.str("name") if name is not None else None
    if name is None:
        raise bad_request("'tool_choice.function.name' is a required field", "tool_choice.function.name")
    if name not in functions:
        raise bad_request(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice.function.name")
    return ForcedTools(name, functions[name] or EMPTY_PARAMETERS)


def _functions(tools: list[Any] | None) -> dict[str, dict[str, Any] | None]:
    """Each function tool's name and parameters schema (None: takes no parameters)."""
    out: dict[str, dict[str, Any] | None] = {}
    for i, tool in enumerate(tools or []):
        tf = Fields(tool, f"tools[{i}]")
        if tf.str("type", "function") != "function":
            raise bad_request(f"tools[{i}].type must be 'function'", tf.param("type"))
        fn = tf.obj("function")
        if fn is None:
            raise bad_request(f"'tools[{i}].function' is a required field", tf.param("function"))
        name = fn.str("name")
        if not name:
            raise bad_request(f"'tools[{i}].function.name' is a required field", fn.param("name"))
        params = fn.raw("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"'tools[{i}].function.parameters' must be a JSON schema object",
                              fn.param("parameters"))
        out[name] = params
    return out


def _required_schema(functions: dict[str, dict[str, Any] | None], parallel: bool) -> dict[str, Any]:
    """An array of calls, each ``{"name": <a tool>, "parameters": <its schema>}``; the tools' ``$defs`` move
    to the top, where their ``#/$defs/...`` references point."""
    defs: dict[str, Any] = {}
    items = []
    for name, params in functions.items():
        params = dict(params or EMPTY_PARAMETERS)
        defs.update(params.pop("$defs", {}))
        items.append({"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                       "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def tool_calls(forced: ForcedTools, text: str) -> list[dict[str, Any]]:
    """The answer's calls, arguments as the model wrote them (for ``"required"``: the calls written whole;
    one cut by max_tokens is left out, as the stream sends it only in part)."""
    if forced.name is not None:
        return [tool_call(forced.name, text)]
    scanner = RequiredCallsScanner()
    scanner.feed(text)
    return [tool_call(span.name, text[span.args_start:span.args_end]) for span in scanner.calls
            if span.name is not None and span.args_start is not None and span.args_end is not None]


@dataclass(slots=True)
class ToolCallStream:
    """One choice's streamed text turned into OpenAI's tool-call deltas."""

    forced: ForcedTools
    deltas: CallDeltas = field(default_factory=lambda: CallDeltas(RequiredCallsScanner()))
    announced: bool = False  # named: the call's first delta (id, name) went out

    def feed(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        if self.forced.name is not None:
            if self.announced:
                return [{"index": 0, "function": {"arguments": text}}]
            self.announced = True
            return [{"index": 0, "id": call_id(), "type": "function",
                     "function": {"name": self.forced.name, "arguments": text}}]
        self.deltas.scanner.feed(text)
        return self.deltas.take()


AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def auto_parser(f: Fields, tools: list[Any] | None, parser: str | None,
                absent_is_auto: bool = False) -> str | None:
    """The tool-call parser that reads this answer (``tool_choice`` ``"auto"``, or absent with ``tools``),
    or None. ``parser`` is the server's (``--tool-call-parser`` with ``--enable-auto-tool-choice``; None
    without): an explicit ``"auto"`` then gets vLLM's 400, and so does an absent one where it means "auto"
    (``absent_is_auto``: chat, where vLLM reads tools without ``tool_choice`` as "auto"; the Responses API
    keeps such a request as text with the tools in the prompt). ``"auto"`` without tools is nothing to
    parse."""
    choice = f.raw("tool_choice")
    if not tools or choice not in (None, "auto"):
        return None
    if parser is None and (choice == "auto" or absent_is_auto):
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    return parser
