"""A request's structured-output constraint: vLLM's and OpenAI's fields read into one ``StructuredOutputs``.

Three ways to ask, as vLLM takes them: OpenAI's ``response_format`` (``json_object``, ``json_schema`` with
``schema`` and ``strict``), vLLM's ``structured_outputs`` object (exactly one of ``json``, ``regex``,
``choice``, ``grammar``, ``json_object``; and ``disable_any_whitespace``) and the older ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields. ``response_format`` overrides the
``structured_outputs`` constraint (vLLM's rule); two kinds at once otherwise are a 400. Shapes are checked
here; whether the schema, regex or grammar compiles is the core's to say (a 400 naming the problem, before
any output). What lbd does not do is refused by name: ``structural_tag``, ``whitespace_pattern``, a
per-request backend.
"""

from __future__ import annotations

from typing import Any

import orjson

from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import Fields
from lbd.wire.core_messages import StructuredOutputs

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}
_REFUSED = {"guided_whitespace_pattern": "whitespace_pattern",
            "guided_decoding_backend": "a per-request backend"}
MAX_CHOICES = 4096


def structured_from(f: Fields) -> StructuredOutputs | None:
    """The request's constraint, or None (plain text)."""
    for name, what in _REFUSED.items():
        if f.has(name):
            raise bad_request(f"'{name}' is not supported ({what}): the server's --structured-outputs-config "
                              "applies", name)
    from_format = _response_format(f)
    so = f.obj("structured_outputs")
    guided = [name for name in _GUIDED if f.has(name)]
    if so is not None and guided:
        raise bad_request(f"use either 'structured_outputs' or '{guided[0]}', not both", guided[0])
    if len(guided) > 1:
        raise bad_request(f"only one guided_* field may be given, got {guided}", guided[1])
    compact = bool(so and so.bool("disable_any_whitespace", False))
    if from_format is not None:
        return _compact(from_format, compact)
    if so is not None:
        return _from_object(so, compact)
    if guided:
        return _spec(_GUIDED[guided[0]], f.raw(guided[0]), guided[0])
    return None


def _compact(spec: StructuredOutputs, compact: bool) -> StructuredOutputs:
    if not compact:
        return spec
    return StructuredOutputs(spec.kind, spec.spec, spec.strict, True)


def _response_format(f: Fields) -> StructuredOutputs | None:
    rf = f.obj("response_format")
    if rf is None:
        return None
    kind = rf.str("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs("json_object")
    if kind == "json_schema":
        js = rf.obj("json_schema")
        if js is None:
            raise bad_request("response_format type 'json_schema' needs a 'json_schema' object",
                              "response_format.json_schema")
        schema = js.raw("schema")
        if schema is None:
            schema = {}  # OpenAI: the schema is optional (any JSON)
        spec = _spec("json", schema, js.param("schema"))
        strict = js.bool("strict", None)
        return spec if strict is None else StructuredOutputs("json", spec.spec, strict)
    if kind == "structural_tag":
        raise bad_request("response_format type 'structural_tag' is not supported", "response_format.type")
    raise bad_request(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      "response_format.type")


def _from_object(so: Fields, compact: bool) -> StructuredOutputs:
    for name in ("structural_tag", "whitespace_pattern"):
        if so.has(name):
            raise bad_request(f"'{so.param(name)}' is not supported", so.param(name))
    given = [k for k in _KINDS if so.has(k)]
    if len(given) != 1:
        raise bad_request(f"'structured_outputs' needs exactly one of {list(_KINDS)}, got {given or 'none'}",
                          "structured_outputs")
    kind = given[0]
    if kind == "json_object":
        if so.bool("json_object") is not True:
            raise bad_request("'structured_outputs.json_object' must be true", so.param(kind))
        return _compact(StructuredOutputs("json_object"), compact)
    return _compact(_spec(kind, so.raw(kind), so.param(kind)), compact)


def _spec(kind: str, value: Any, param: str) -> StructuredOutputs:
    if kind == "json":
        return StructuredOutputs("json", _schema_text(value, param))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad_request(f"'{param}' must be a non-empty list of strings", param)
        if len(value) > MAX_CHOICES:
            raise bad_request(f"'{param}' has {len(value)} choices; at most {MAX_CHOICES} are allowed", param)
        return StructuredOutputs("choice", orjson.dumps(value).decode())
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{param}' must be a non-empty string", param)
    return StructuredOutputs(kind, value)


def _schema_text(value: Any, param: str) -> str:
    """A JSON schema as text, keeping its key order (the order the output's properties come in)."""
    if isinstance(value, str):
        try:
            value = orjson.loads(value)
        except orjson.JSONDecodeError as e:
            raise bad_request(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(value, dict | bool):
        raise bad_request(f"'{param}' must be a JSON schema (an object)", param)
    return orjson.dumps(value).decode()
