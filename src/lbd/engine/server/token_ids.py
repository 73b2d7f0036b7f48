"""``return_token_ids`` (vLLM's request field): the prompt's token ids and each choice's output token ids in
the answer, as ``prompt_token_ids`` and ``token_ids``.

A choice's ``token_ids`` in a streamed chunk are the tokens whose text is in the chunk, not the tokens the
core produced for it: text that could still start a stop string is held back, and its tokens are held back
with it; and text goes out in whole tokens (a token's text is not split across chunks). A router resuming a
broken stream elsewhere (``lbd.router.migration``) then resends exactly the tokens whose text the client has,
and the held-back tail is generated again, so a stop string that spans the switch is still found. A token that
decodes to no text by itself (part of a multi-byte character) goes out with the next token whose text does.
Logprobs still go out as the core produces them.
"""

from __future__ import annotations

from typing import NamedTuple

from lbd.engine.server.sequence import Delta
from lbd.wire.core_messages import TokenLogprobs


class Released(NamedTuple):
    """What goes out for one delta: text, and the tokens it completes with their logprobs and text offsets."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    offsets: list[int]


class EmittedIds:
    """Per choice: the output tokens not yet reported (id, where its text starts and ends, its logprobs), and
    the text held back with them."""

    __slots__ = ("_pending", "_sent", "_held")

    def __init__(self, n: int) -> None:
        self._pending: list[list[tuple[int, int, int, TokenLogprobs | None]]] = [[] for _ in range(n)]
        self._sent = [0] * n  # characters of each choice's text that went out
        self._held = [""] * n  # text ready to go out but for the rest of its token

    def take(self, delta: Delta) -> Released:
        """The text to send for ``delta`` and the tokens whose text it completes: the text is cut at the end
        of the last whole token, so no token's text goes out in part (all of it once the choice finished)."""
        i = delta.seq.index
        pending = self._pending[i]
        ids, offsets, lps = delta.token_ids, delta.offsets, delta.logprobs
        last = len(ids) - 1
        for k, token in enumerate(ids):
            end = offsets[k + 1] if k < last else delta.seq.detok.length
            pending.append((token, offsets[k], end, lps[k] if lps is not None and k < len(lps) else None))
        text = self._held[i] + delta.text
        if delta.finished:
            n, keep = len(pending), len(text)
        else:
            ready = self._sent[i] + len(text)
            n, cut = 0, self._sent[i]
            for k, (_, start, end, _) in enumerate(pending):
                if end > ready:
                    break
                if end > start:  # a token with text of its own ends a run (empty ones before it go with it)
                    n, cut = k + 1, end
            keep = cut - self._sent[i]
        out = pending[:n]
        del pending[:n]
        self._held[i] = text[keep:]
        self._sent[i] += keep
        got = [p[3] for p in out]
        return Released(text[:keep], [p[0] for p in out], got if got and got[0] is not None else None,
                        [p[1] for p in out])
