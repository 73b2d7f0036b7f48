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


def gap_bound(loads: Sequence[float], abs_gap: float, rel_gap: float) -> float:
    """The load-gap filter's bound: the highest load ``within_gap`` of the least one. An endpoint that holds
    a prefix is preferred only while its load stays under it (not far busier than the least loaded)."""
    least = min(loads)
    return least + abs_gap + rel_gap * least


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

    # (lowest and lowest_among rotate inline: they run on every request)
    def lowest(self, scores: Sequence[float], eps: float = TIE_EPS) -> int:
        """The index of the lowest of ``scores``; among equal ones, each in turn."""
        low = ties(scores, eps)
        turn = self.turn
        self.turn = turn + 1
        return low[turn % len(low)]

    def lowest_among(self, indices: Sequence[int], scores: Sequence[float], eps: float = TIE_EPS) -> int:
        """The index (one of ``indices``, into ``scores``) of the lowest score among ``indices``."""
        low = ties([scores[i] for i in indices], eps)
        turn = self.turn
        self.turn = turn + 1
        return indices[low[turn % len(low)]]
