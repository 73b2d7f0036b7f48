"""The parts every policy shares, written once: a load-gap filter and the picker.

A policy is built the way llm-d's scheduler builds one: filters (which endpoints may be chosen), scorers (a
number per endpoint, lower is better) and a picker (the lowest score; equal scores take turns, so a burst of
cold requests spreads instead of piling onto the first endpoint). Scorers are the policies' own (and
``base.queue_score``); the filter and the picker here work on plain numbers and indices, nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence

TIE_EPS = 1e-9  # scores this close count as equal


def ties(values: Sequence[float], eps: float = TIE_EPS) -> list[int]:
    """Indices whose value equals the minimum (within ``eps``)."""
    low = min(values)
    return [i for i, v in enumerate(values) if v <= low + eps]


def within_gap(load: float, least: float, abs_gap: float, rel_gap: float) -> bool:
    """Bounded stickiness: ``load`` may exceed the least load by ``abs_gap`` plus ``rel_gap`` of it."""
    return load <= least + abs_gap + rel_gap * least


def near_least(loads: Sequence[float], abs_gap: float, rel_gap: float) -> list[bool]:
    """The load-gap filter: per endpoint, whether its load is within the gap of the least one (so an
    endpoint that holds a prefix or owns a session is preferred only while it is not far busier)."""
    least = min(loads)
    bound = least + abs_gap + rel_gap * least  # within_gap, with the bound computed once
    return [s <= bound for s in loads]


class Picker:
    """Picks the lowest score; equal scores rotate (one turn counter per policy, shared by all its picks)."""

    __slots__ = ("turn",)

    def __init__(self) -> None:
        self.turn = 0

    def next_turn(self) -> int:
        """The turn number, advanced (round robin reads it directly)."""
        turn = self.turn
        self.turn = turn + 1
        return turn

    def rotate(self, candidates: Sequence[int]) -> int:
        """One of ``candidates``, each in turn."""
        pick = candidates[self.turn % len(candidates)]
        self.turn += 1
        return pick

    def lowest(self, scores: Sequence[float], eps: float = TIE_EPS) -> int:
        """The index of the lowest of ``scores``; among equal ones, each in turn."""
        return self.rotate(ties(scores, eps))

    def lowest_among(self, indices: Sequence[int], scores: Sequence[float], eps: float = TIE_EPS) -> int:
        """The index (one of ``indices``, into ``scores``) of the lowest score among ``indices``."""
        return indices[self.rotate(ties([scores[i] for i in indices], eps))]
