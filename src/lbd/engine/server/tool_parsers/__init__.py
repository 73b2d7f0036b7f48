"""Tool-call parsers for ``tool_choice: "auto"`` (vLLM's ``--enable-auto-tool-choice --tool-call-parser
NAME``), under vLLM's names: each reads the calls a model writes in its own format out of its text, whole
(``extract``) or as it streams (``stream()``, fed piece by piece, then ``finish()``), into OpenAI's
``tool_calls``; what is not a call is content. The flag's choices are ``lbd.engine.config.args``'
``TOOL_CALL_PARSERS`` (a standard-library module); ``PARSERS`` holds the same names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from lbd.engine.server.tool_parsers import hermes, llama3_json
from lbd.engine.server.tool_parsers.calls import Extracted, StreamDelta


class ToolCallStream(Protocol):
    """One choice's parser state while it streams."""

    @property
    def called(self) -> bool: ...  # a call was announced

    def feed(self, text: str) -> StreamDelta: ...

    def finish(self) -> StreamDelta: ...


@dataclass(slots=True, frozen=True)
class ToolParser:
    name: str
    extract: Callable[[str], Extracted]
    stream: Callable[[], ToolCallStream]


PARSERS: dict[str, ToolParser] = {
    "hermes": ToolParser("hermes", hermes.extract, hermes.HermesStream),
    "llama3_json": ToolParser("llama3_json", llama3_json.extract, llama3_json.Llama3JsonStream),
}
