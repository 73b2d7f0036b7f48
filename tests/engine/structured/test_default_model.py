"""The openai SDK's ``chat.completions.parse`` with a pydantic model against `lbd serve`'s default model
(SmolLM2-135M-Instruct, real weights, xgrammar with its default whitespace): the answer parses into the
model. A couple of requests here; ``benchmarks/structured_parse.py`` runs the issue's 20."""

from __future__ import annotations

from typing import Annotated

import openai
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
        for i, city in enumerate(("Paris", "Tokyo")):
            r = client.chat.completions.parse(
                model="SmolLM2-135M-Instruct", response_format=City, max_tokens=300, temperature=0.7, seed=i,
                messages=[{"role": "user", "content": f"Describe {city} as JSON."}])
            assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
            assert isinstance(r.choices[0].message.parsed, City)
