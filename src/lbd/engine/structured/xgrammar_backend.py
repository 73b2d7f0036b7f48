"""xgrammar (the default backend): grammars compiled against the tokenizer, one GrammarMatcher per request,
kept to valid UTF-8 by ``utf8.Utf8Table`` (xgrammar lets encoded surrogates through)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

import xgrammar as xgr

from lbd.engine.structured.backends import GrammarError, library_message
from lbd.engine.structured.utf8 import ACCEPT, Utf8Table

if TYPE_CHECKING:
    import torch

    from lbd.engine.config.structured import StructuredOutputsConfig

ANY_OBJECT = '{"type": "object"}'  # response_format json_object: a JSON object (OpenAI's contract)


def choice_ebnf(choices: list[str]) -> str:
    """EBNF whose only sentences are ``choices`` (JSON string escapes are xgrammar's too)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class XGrammarMatcher:
    """xgrammar's matcher and the request's UTF-8 state: a token the grammar takes but that would break the
    text's UTF-8 is refused, and masked out of the rows it fills."""

    __slots__ = ("m", "utf8", "state")

    def __init__(self, compiled: xgr.CompiledGrammar, utf8: Utf8Table) -> None:
        self.m = xgr.GrammarMatcher(compiled)
        self.utf8 = utf8
        self.state = ACCEPT

    def accept(self, token_id: int) -> bool:
        after = self.utf8.step(self.state, token_id)
        if after < 0 or not self.m.accept_token(token_id):
            return False
        self.state = after
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        self.utf8.restrict(self.state, bitmask, row)

    def is_terminated(self) -> bool:
        return self.m.is_terminated()


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int | None,
                 config: StructuredOutputsConfig) -> None:
        stop = None if eos_token_id is None else [eos_token_id]
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop)
        # our own cache (lbd.engine.structured.compiler) keeps compiled grammars: xgrammar's would be a copy
        threads = min(8, os.cpu_count() or 1)
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.compact = config.disable_any_whitespace
        self.utf8 = Utf8Table(info.decoded_vocab, [*info.special_token_ids, *info.stop_token_ids], vocab_size)

    def compile(self, kind: str, spec: str, strict: bool, compact: bool) -> xgr.CompiledGrammar:
        try:
            return self._compile(kind, spec, strict, compact or self.compact)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(library_message(e)) from None

    def _compile(self, kind: str, spec: str, strict: bool, compact: bool) -> xgr.CompiledGrammar:
        c = self.compiler
        if kind == "json":
            return c.compile_json_schema(spec, any_whitespace=not compact, strict_mode=strict)
        if kind == "json_object":  # not strict: any properties (strict mode would allow only {})
            return c.compile_json_schema(ANY_OBJECT, any_whitespace=not compact, strict_mode=False)
        if kind == "regex":
            return c.compile_regex(spec)
        if kind == "choice":
            return c.compile_grammar(choice_ebnf(json.loads(spec)))
        if kind == "grammar":
            return c.compile_grammar(spec)
        raise GrammarError(f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: xgr.CompiledGrammar) -> XGrammarMatcher:
        return XGrammarMatcher(compiled, self.utf8)
