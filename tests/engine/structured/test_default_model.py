"""The openai SDK against `lbd serve`'s default model (SmolLM2-135M-Instruct, real weights, xgrammar with its
default whitespace): ``chat.completions.parse`` with a pydantic model parses into the model, and a streamed
``tool_choice="required"`` answer is calls of a declared tool with valid arguments. One of each here;
``benchmarks/structured_parse.py`` runs the issue's 20 of each."""

from __future__ import annotations

from typing import Annotated

import jsonschema
import openai
import orjson
import pytest
from pydantic import BaseModel, Field

from support import EngineServer

pytestmark = pytest.mark.slow

Short = Annotated[str, Field(max_length=40)]


class City(BaseModel):
    """Bounded strings and lists, as real schemas are."""

    name: Short
    country: Short
    population_millions: float
    landmarks: Annotated[list[Short], Field(max_length=3)]


def test_sdk_parse_returns_the_pydantic_object(tmp_path) -> None:
    with EngineServer(None, "--device", "cpu", log=tmp_path / "engine.log") as srv:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        for i, city in enumerate(("Paris",)):  # one of each here (suite time); the benchmark runs 20
            r = client.chat.completions.parse(
                model="SmolLM2-135M-Instruct", response_format=City, max_tokens=300, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Describe {city} as JSON."}])
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            assert isinstance(r.choices[0].message.parsed, City)
        calls = streamed_calls(client, "What is the weather in Oslo for the next 3 days?")
        assert calls and all(name == "get_weather" for name, _ in calls)
        for _, arguments in calls:
            jsonschema.validate(orjson.loads(arguments), WEATHER["function"]["parameters"])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather forecast of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}


def streamed_calls(client: openai.OpenAI, question: str) -> list[tuple[str, str]]:
    """(name, arguments) of each call of a streamed tool_choice="required" answer."""
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": question}], tools=[WEATHER],
        tool_choice="required", stream=True, max_tokens=300, temperature=0.7, seed=0)
    calls: dict[int, list[str]] = {}
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            call = calls.setdefault(d.index, [d.function.name or "", ""])
            call[1] += d.function.arguments or ""
    return [(name, args) for name, args in calls.values()]
