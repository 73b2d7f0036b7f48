"""llguidance (``--structured-outputs-config.backend guidance``): a grammar is checked against the tokenizer
and built into a matcher on the compile thread; each request gets a copy of that matcher (microseconds on the
step loop, where building one takes about a millisecond). ``grammar`` takes Lark or GBNF text, as vLLM's
guidance backend does."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
import llguidance.hf
import llguidance.torch

from lbd.engine.structured.backends import GrammarError, library_message

if TYPE_CHECKING:
    import torch

    from lbd.engine.config.structured import StructuredOutputsConfig

_FORMATS = {"json": "json_schema", "json_object": "json_schema", "regex": "regex", "choice": "choice",
            "grammar": "grammar"}


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say (strict,
    or disable_additional_properties: no properties beyond the schema's, as xgrammar's strict mode)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GuidanceMatcher:
    __slots__ = ("m",)

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.m = matcher

    def accept(self, token_id: int) -> bool:
        return self.m.consume_token(token_id)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.m, bitmask, row)

    def is_terminated(self) -> bool:
        return self.m.is_stopped()


class GuidanceBackend:
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 config: StructuredOutputsConfig) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self.compact = config.disable_any_whitespace
        self.closed = config.disable_additional_properties

    def compile(self, kind: str, spec: str, strict: bool, compact: bool) -> llguidance.LLMatcher:
        """A matcher at the grammar's start, which requests copy (raises GrammarError)."""
        return llguidance.LLMatcher(self.tokenizer, self._grammar(kind, spec, strict, compact))

    def _grammar(self, kind: str, spec: str, strict: bool, compact: bool) -> str:
        if kind not in _FORMATS:
            raise GrammarError(f"unknown structured output kind {kind!r}")
        if kind == "json_object":
            spec = '{"type": "object"}'
        if kind == "json" and (strict or self.closed):
            spec = json.dumps(closed_objects(json.loads(spec)))
        try:
            grammar = llguidance.grammar_from(_FORMATS[kind], spec)
            if kind in ("json", "json_object") and (compact or self.compact):
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    spec, defaults={"whitespace_flexible": False})
            error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(library_message(e)) from None
        if error:
            raise GrammarError(library_message(RuntimeError(error)))
        return grammar

    def matcher(self, compiled: llguidance.LLMatcher) -> GuidanceMatcher:
        return GuidanceMatcher(compiled.deep_copy())
