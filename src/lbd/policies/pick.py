"""The pickers (lowest score with equal ones in turn, round robin, power of two choices) and the load-gap
arithmetic the bounded-stickiness filters share."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from lbd.policies.plugin import Context, Detail, Env, Picker
from lbd.policies.registry import plugin

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


def stale_note(ep: Any, stale_s: float) -> str:
    return "" if ep.fresh(stale_s) else " (stale telemetry: router in-flight only)"


class _Turns(Picker):
    """A turn counter, shared by every pick of the profile: equal scores take turns, so a burst of cold
    requests spreads instead of piling onto the first endpoint."""

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.turn = 0

    def reset(self) -> None:
        self.turn = 0


@plugin
class Lowest(_Turns):
    """The lowest summed score; equal ones (within ``eps``) each in turn."""

    name = "lowest"
    help = "the lowest weighted score; ties take turns"
    uses_load = False

    def __init__(self, env: Env, eps: float = TIE_EPS) -> None:
        super().__init__(env)
        self.eps = eps

    def pick(self, ctx: Context, kept: list[int], totals: list[float] | None) -> int:
        turn = self.turn + ctx.turns_before
        if ctx.rotates:
            self.turn = turn + 1
        if totals is None:
            return kept[turn % len(kept)]
        if len(kept) == len(totals):  # (every endpoint: the usual case, no index lists)
            bound = min(totals) + self.eps
            low = [i for i, v in enumerate(totals) if v <= bound]
        else:
            bound = min([totals[i] for i in kept]) + self.eps
            low = [i for i in kept if totals[i] <= bound]
        return low[turn % len(low)]


@plugin
class RoundRobin(_Turns):
    """Each endpoint in turn, whatever the scores."""

    name = "round_robin"
    help = "each endpoint in turn, ignoring scores and load"
    uses_load = False

    def pick(self, ctx: Context, kept: list[int], totals: list[float] | None) -> int:
        turn = self.turn
        self.turn = turn + 1
        ctx.memo[self] = (turn, len(kept))
        return kept[turn % len(kept)]

    def reason(self, ctx: Context, pick: int) -> str:
        return "round_robin"

    def detail(self, ctx: Context, pick: int) -> Detail:
        turn, n = ctx.memo[self]
        return lambda: f"turn {turn} of {n}"


@plugin
class PowerOfTwo(Picker):
    """Two kept endpoints at random (seeded), the lower scored of them."""

    name = "p2c"
    help = "two endpoints at random, the lower scored of them"

    def __init__(self, env: Env) -> None:
        super().__init__(env)
        self.seed = env.seed
        self._rng = random.Random(env.seed)

    def reset(self) -> None:
        self._rng = random.Random(self.seed)

    def pick(self, ctx: Context, kept: list[int], totals: list[float] | None) -> int:
        if len(kept) == 1:
            ctx.memo[self] = None
            return kept[0]
        i, j = self._rng.sample(range(len(kept)), 2)
        scores = totals if totals is not None else [0.0] * len(ctx.pool)
        si, sj = scores[kept[i]], scores[kept[j]]
        pick, other = (kept[i], sj) if si <= sj else (kept[j], si)
        ctx.memo[self] = (min(si, sj), other)
        return pick

    def reason(self, ctx: Context, pick: int) -> str:
        return "p2c" if ctx.memo[self] is not None else "only_choice"

    def detail(self, ctx: Context, pick: int) -> Detail:
        pair = ctx.memo[self]
        if pair is None:
            return ""
        return f"score {pair[0]:.0f} vs {pair[1]:.0f}{stale_note(ctx.pool[pick], ctx.stale_s)}"
