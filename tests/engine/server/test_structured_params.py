"""The structured-output fields read into one StructuredOutputs: OpenAI's response_format, vLLM's
structured_outputs and the older guided_* fields; what wins when several are given; key order kept."""

from __future__ import annotations

import json

import pytest

from lbd.engine.server.errors import APIError
from lbd.engine.server.fields import Fields
from lbd.engine.server.structured_params import structured_from
from lbd.wire.core_messages import StructuredOutputs

SCHEMA = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}


def read(body: dict) -> StructuredOutputs | None:
    return structured_from(Fields(body))


def test_each_field_reads_into_one_constraint() -> None:
    assert read({}) is None and read({"response_format": {"type": "text"}}) is None
    rf = read({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}})
    assert rf == StructuredOutputs("json", json.dumps(SCHEMA, separators=(",", ":")))
    assert list(json.loads(rf.spec)["properties"]) == ["z", "a"]  # the order the output's fields come in
    loose = read({"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "n", "schema": SCHEMA, "strict": False}}})
    assert loose.strict is False
    assert read({"response_format": {"type": "json_object"}}) == StructuredOutputs("json_object")
    assert read({"structured_outputs": {"choice": ["a", "b"], "disable_any_whitespace": True}}) == \
        StructuredOutputs("choice", '["a","b"]', disable_any_whitespace=True)
    assert read({"structured_outputs": {"json": json.dumps(SCHEMA)}}).kind == "json"
    assert read({"guided_regex": "a+"}) == StructuredOutputs("regex", "a+")
    assert read({"guided_grammar": "root ::= \"x\""}).kind == "grammar"
    assert read({"guided_json": SCHEMA}).kind == "json"


def test_response_format_overrides_structured_outputs_as_in_vllm() -> None:
    got = read({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True},
                "response_format": {"type": "json_object"}})
    assert got == StructuredOutputs("json_object", disable_any_whitespace=True)


@pytest.mark.parametrize("body, param", [
    ({"structured_outputs": {"regex": "a", "guided_choice": None}, "guided_regex": "b"}, "guided_regex"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": [1]}, "guided_json"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_shapes_name_the_field(body: dict, param: str) -> None:
    with pytest.raises(APIError) as e:
        read(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message
