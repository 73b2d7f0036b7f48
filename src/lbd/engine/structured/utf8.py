"""Keeps xgrammar's output valid UTF-8: a per-request UTF-8 state and, per state, the tokens that may follow.

xgrammar (0.2.x) matches text as UTF-8 bytes and refuses overlong forms, stray continuation bytes and code
points past U+10FFFF, but it takes the encoded UTF-16 surrogates U+D800-U+DFFF (``ED A0..BF xx``), which are
not UTF-8: a model writing a string byte by byte (random weights do, real ones rarely) can put them into a
JSON string. A decoder turns each such sequence into U+FFFD characters, so the client's text has characters
the grammar never counted (a ``maxLength`` string arrives longer) and bytes no UTF-8 text holds.
llguidance refuses them (no guard there).

``Utf8Table`` walks every token's bytes through the UTF-8 automaton once (on the grammar thread, when the
backend loads) from each of its states: where the token leaves it, or that it breaks the text. A matcher
keeps its request's state and refuses a token that breaks it. The rows it fills are AND-ed with the state's
mask only in the states where some token breaks the text by a surrogate alone (``xgrammar_lenient``: every
other break xgrammar refuses itself, which test_engine_core checks byte by byte): for most vocabularies
that is only the state after an ``ED`` lead byte, so between whole characters the guard costs nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# The automaton's states: between characters, then the continuation bytes a started character still needs.
ACCEPT, NEED1, NEED2, AFTER_E0, AFTER_ED, NEED3, AFTER_F0, AFTER_F4 = range(8)
STATES = 8
_BROKEN = STATES  # a sink: the bytes so far are not UTF-8

_LEADS = (  # (first byte range, state after it) from ACCEPT (RFC 3629's table of well-formed sequences)
    (range(0x00, 0x80), ACCEPT), (range(0xC2, 0xE0), NEED1), (range(0xE0, 0xE1), AFTER_E0),
    (range(0xE1, 0xED), NEED2), (range(0xED, 0xEE), AFTER_ED), (range(0xEE, 0xF0), NEED2),
    (range(0xF0, 0xF1), AFTER_F0), (range(0xF1, 0xF4), NEED3), (range(0xF4, 0xF5), AFTER_F4))
_CONTINUATIONS = (  # (state, continuation bytes it takes, state after)
    (NEED1, range(0x80, 0xC0), ACCEPT), (NEED2, range(0x80, 0xC0), NEED1),
    (AFTER_E0, range(0xA0, 0xC0), NEED1), (AFTER_ED, range(0x80, 0xA0), NEED1),
    (NEED3, range(0x80, 0xC0), NEED2), (AFTER_F0, range(0x90, 0xC0), NEED2),
    (AFTER_F4, range(0x80, 0x90), NEED2))


def transitions(xgrammar_lenient: bool = False) -> np.ndarray:
    """[STATES + 1, 256] next state by (state, byte); ``_BROKEN`` is absorbing. ``xgrammar_lenient``: what
    xgrammar 0.2 takes, i.e. UTF-8 plus the surrogates (``ED`` followed by any continuation byte)."""
    table = np.full((STATES + 1, 256), _BROKEN, dtype=np.int8)
    for span, state in _LEADS:
        table[ACCEPT, span.start:span.stop] = state
    for state, span, after in _CONTINUATIONS:
        table[state, span.start:span.stop] = after
    if xgrammar_lenient:
        table[AFTER_ED, 0x80:0xC0] = NEED1
    return table


def token_steps(vocab: Sequence[bytes], no_bytes: Iterable[int], table: np.ndarray) -> np.ndarray:
    """[len(vocab), STATES] the state each token leaves each state in by ``table`` (``_BROKEN``: it breaks
    the text). ``no_bytes``: tokens that are no text (end of sequence, padding): they change no state."""
    steps = np.tile(np.arange(STATES, dtype=np.int8), (len(vocab), 1))
    lengths = np.array([len(b) for b in vocab], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    flat = np.frombuffer(b"".join(vocab), dtype=np.uint8)
    skip = [i for i in no_bytes if i < len(vocab)]
    lengths[skip] = 0
    for pos in range(int(lengths.max(initial=0))):
        rows = np.flatnonzero(lengths > pos)
        steps[rows] = table[steps[rows], flat[starts[rows] + pos][:, None]]
    return steps


class Utf8Table:
    """Per UTF-8 state: the state each token leads to, and (where xgrammar would let a token break the text)
    a bitmask row of the tokens that do not break it (xgrammar's layout; ids past ``vocab`` are the
    grammar's)."""

    def __init__(self, vocab: Sequence[bytes], no_bytes: Iterable[int], vocab_size: int) -> None:
        no_bytes = list(no_bytes)
        steps = token_steps(vocab, no_bytes, transitions())
        lenient = token_steps(vocab, no_bytes, transitions(xgrammar_lenient=True))
        self.next = [steps[:, s].tolist() for s in range(STATES)]
        words = (vocab_size + 31) // 32
        self.masks: list[np.ndarray | None] = []
        for s in range(STATES):
            ok = np.ones(words * 32, dtype=bool)
            ok[:len(vocab)] = steps[:, s] != _BROKEN
            if not (~ok[:len(vocab)] & (lenient[:, s] != _BROKEN)).any():  # xgrammar refuses them all
                self.masks.append(None)
                continue
            bits = np.packbits(ok.reshape(words, 32), axis=1, bitorder="little")  # bit t % 32 of word t // 32
            self.masks.append(bits.view("<i4").reshape(words).astype(np.int32))

    def step(self, state: int, token_id: int) -> int:
        """The state after ``token_id`` (-1: it breaks the text); ids past the vocabulary change nothing."""
        row = self.next[state]
        after = row[token_id] if token_id < len(row) else state
        return -1 if after == _BROKEN else after

    def restrict(self, state: int, bitmask: torch.Tensor, row: int) -> None:
        """Clear the bits of ``bitmask[row]`` whose tokens would break the text from ``state``."""
        mask = self.masks[state]
        if mask is not None:  # numpy's in-place AND on the row is ~5x torch's on one row of a CPU tensor
            words = bitmask[row].numpy()
            np.bitwise_and(words, mask, out=words)
