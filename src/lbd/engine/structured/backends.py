"""The interface both grammar libraries are wrapped in (``compiler.load_backend`` picks one).

A ``Backend`` turns a request's ``StructuredOutputs`` into a compiled grammar (raising ``GrammarError`` with
the library's words when the schema, regex or grammar is bad) and a compiled grammar into a fresh ``Matcher``:
the per-request state that accepts each sampled token and fills the row of the next step's token bitmask
(xgrammar's layout, which llguidance shares: bit ``t % 32`` of int32 word ``t // 32`` set = token ``t``
allowed). The end-of-sequence token is allowed only where the grammar may end.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class GrammarError(ValueError):
    """A request's schema, regex, choice or grammar that its backend cannot compile: the message names it."""


class Matcher(Protocol):
    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it (state unchanged)."""

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into ``bitmask[row]``."""

    def is_terminated(self) -> bool:
        """The grammar has ended (it accepted its end-of-sequence token)."""


class Backend(Protocol):
    name: str

    def compile(self, kind: str, spec: str, strict: bool, compact: bool) -> Any:
        """The compiled grammar (raises GrammarError)."""

    def matcher(self, compiled: Any) -> Matcher: ...


_LIBRARY_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[08:48:34] /project/cpp/x.cc:94: "


def library_message(e: BaseException) -> str:
    """An exception's message without the library's timestamp and source position."""
    return _LIBRARY_PREFIX.sub("", str(e).strip()).strip()
