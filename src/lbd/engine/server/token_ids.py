"""``return_token_ids`` (vLLM's request field): the prompt's token ids and each choice's output token ids in
the answer, as ``prompt_token_ids`` and ``token_ids``.

A choice's ``token_ids`` in a streamed chunk are the tokens whose text is in the text sent so far, not the
tokens the core produced for that chunk: text that could still start a stop string is held back, and its
tokens are held back with it. A router resuming a broken stream elsewhere (``lbd.router.migration``) then
resends exactly the tokens whose text the client has, and the held-back tail is generated again, so a stop
string that spans the switch is still found. A token that decodes to no text by itself (part of a multi-byte
character) goes out with the next token whose text does.
"""

from __future__ import annotations

from lbd.engine.server.sequence import Delta


class EmittedIds:
    """Per choice: the output token ids not yet reported, with the offset where each one's text ends."""

    __slots__ = ("_pending", "_sent")

    def __init__(self, n: int) -> None:
        self._pending: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]  # (id, start, end)
        self._sent = [0] * n  # characters of each choice's text that went out

    def take(self, delta: Delta) -> list[int]:
        """The ids whose text is complete in what went out with ``delta`` (all of them once it finished)."""
        i = delta.seq.index
        pending = self._pending[i]
        ids, offsets = delta.token_ids, delta.offsets
        last = len(ids) - 1
        for k, token in enumerate(ids):
            pending.append((token, offsets[k], offsets[k + 1] if k < last else delta.seq.detok.length))
        self._sent[i] += len(delta.text)
        if delta.finished:
            out = [t for t, _, _ in pending]
            pending.clear()
            return out
        sent = self._sent[i]
        n = 0
        for k, (_, start, end) in enumerate(pending):
            if end > sent:
                break
            if end > start:  # a token with text of its own ends a run (empty ones before it go with it)
                n = k + 1
        out = [t for t, _, _ in pending[:n]]
        del pending[:n]
        return out
