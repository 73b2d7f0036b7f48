"""A policy is a named profile: filters, weighted scorers and a picker, run in that order.

``choose`` gets the endpoints the router's gate let through (``lbd.policies.select``): the profile's
filters narrow the ones it may pick (a filter that would keep none is skipped), every scorer scores all of
them (a filter's reason may compare the pick with one it dropped), the weighted sums go to the picker, and
the plugin that decided names the decision. The router calls the learning hooks here; the profile passes
them to its learned state (``Learned``), which ``reset`` forgets in one call.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lbd.policies.base import Decision, EndpointSnapshot, RequestFacts
from lbd.policies.plugin import Context, Env, Filter, Learned, Picker, Plugin, Scorer


class Profile:
    """Filters, (scorer, weight) pairs and a picker under one name."""

    def __init__(self, name: str, env: Env, filters: Sequence[Filter],
                 scorers: Sequence[tuple[Scorer, float]], picker: Picker, help: str = "") -> None:
        self.name, self.help = name, help
        self.stale_s, self.seed = env.stale_s, env.seed
        self.filters = tuple(filters)
        self.scorers = tuple((s, float(w)) for s, w in scorers if w != 0.0)  # weight 0: off
        self.picker = picker
        self.learned: tuple[Learned, ...] = tuple(env.learned.values())
        parts: list[Plugin] = [*self.filters, *(s for s, _ in self.scorers), picker]
        # What the router prepares for this profile (it hashes text, reads its counters, only if one reads it)
        self.uses_prefix_hashes = any(p.uses_prefix_hashes for p in parts)
        self.exact_aware = any(p.exact_aware for p in parts)
        self.uses_load = any(p.uses_load for p in parts)
        self._parts = parts
        self._claimers = [i for i, (s, _) in enumerate(self.scorers) if s.claims]
        self._chargers = [s for s, _ in self.scorers if type(s).charge_tokens is not Scorer.charge_tokens]
        self._annotators = [s for s, _ in self.scorers if type(s).annotate is not Scorer.annotate]
        self._claiming = (*self.filters, picker)  # asked before the scorers
        self.decided: dict[tuple[str, str], int] = {}  # (plugin, reason) -> decisions (/router/status)

    # ---- the decision ------------------------------------------------------------------------------
    def choose(self, facts: RequestFacts, endpoints: Sequence[EndpointSnapshot]) -> Decision:
        """The endpoint for ``facts`` among ``endpoints`` (non-empty: the gate's survivors)."""
        return self.decide(Context(facts, endpoints, self.stale_s))

    def decide(self, ctx: Context) -> Decision:
        """The decision for ``ctx`` (its pool: the gate's survivors). Runs on every request."""
        kept = list(range(len(ctx.pool)))
        for f in self.filters:
            out = f.filter(ctx, kept)
            if out:
                kept = out
        ctx.kept = kept
        totals: list[float] | None = None
        raw: list[list[float]] = []
        for scorer, w in self.scorers:
            vals = scorer.score(ctx)
            raw.append(vals)
            if totals is None:
                totals = vals if w == 1.0 else [w * v for v in vals]
            elif w == 1.0:
                totals = [t + v for t, v in zip(totals, vals, strict=True)]
            else:
                totals = [t + w * v for t, v in zip(totals, vals, strict=True)]
        ctx.totals = totals
        pick = self.picker.pick(ctx, kept, totals)
        who, reason = self._decider(ctx, pick, kept, raw)
        detail = who.detail(ctx, pick)
        if detail is None:  # the decider has no numbers of its own: the first scorer's describe the pick
            detail = next((d for s, _ in self.scorers if (d := s.detail(ctx, pick)) is not None), "")
        decision = Decision(ctx.pool[pick], reason, detail, plugin=who.name)
        for scorer in self._annotators:
            scorer.annotate(ctx, pick, decision)
        key = (who.name, reason)
        self.decided[key] = self.decided.get(key, 0) + 1
        return decision

    def _decider(self, ctx: Context, pick: int, kept: list[int],
                 raw: list[list[float]]) -> tuple[Plugin, str]:
        """The first plugin that claims the decision: filters, the picker, then the scorers, the one whose
        weighted score put the pick furthest ahead of the runner-up first."""
        for p in self._claiming:
            reason = p.reason(ctx, pick)
            if reason:
                return p, reason
        order = self._claimers
        if len(order) > 1 and ctx.totals is not None and len(kept) > 1:
            totals = ctx.totals
            runner = min((i for i in kept if i != pick), key=totals.__getitem__)
            order = sorted(order, key=lambda j: self.scorers[j][1] * (raw[j][pick] - raw[j][runner]))
        for j in order:
            reason = self.scorers[j][0].reason(ctx, pick)
            if reason:
                return self.scorers[j][0], reason
        return self.picker, self.picker.name

    # ---- the router's hooks ------------------------------------------------------------------------
    def charge_tokens(self, facts: RequestFacts, ep: EndpointSnapshot) -> float:
        """Prefill tokens this request adds to ``ep``'s queue until its first byte (a scorer's estimate, else
        the whole prompt)."""
        for s in self._chargers:
            tokens = s.charge_tokens(facts, ep)
            if tokens is not None:
                return tokens
        return float(facts.prompt_tokens)

    def on_dispatch(self, facts: RequestFacts, key: str) -> None:
        for state in self.learned:
            state.on_dispatch(facts, key)

    def on_chain_known(self, facts: RequestFacts, key: str, head_blocks: int) -> None:
        for state in self.learned:
            state.on_chain_known(facts, key, head_blocks)

    def on_first_byte(self, decision: Decision, ttft_s: float) -> None:
        for state in self.learned:
            state.on_first_byte(decision, ttft_s)

    def forget(self, key: str) -> None:
        for state in self.learned:
            state.forget(key)

    def reset(self) -> None:
        """Forget everything every plugin learned (indexes, rates, footprints) and the picker's turn."""
        for state in self.learned:
            state.reset()
        self.picker.reset()
        self.decided.clear()

    # ---- what it is --------------------------------------------------------------------------------
    @property
    def index(self) -> Any:
        """The approximate prefix index the profile learns, if any (``sample.holder_keys`` reads it)."""
        for state in self.learned:
            index = getattr(state, "index", None)
            if index is not None:
                return index
        return None

    def describe(self) -> dict[str, Any]:
        """The profile's plugins and its decisions so far by deciding plugin (``/router/status``)."""
        return {
            "name": self.name,
            "filters": [f.name for f in self.filters],
            "scorers": [{"plugin": s.name, "weight": w} for s, w in self.scorers],
            "picker": self.picker.name,
            "learned": sorted(type(s).__name__ for s in self.learned),
            "decided": {f"{p}/{r}": n for (p, r), n in sorted(self.decided.items())},
        }

    def __getattr__(self, name: str) -> Any:
        """A setting or learned number of one of its plugins or its learned state, read through the profile
        (``p.rate``, ``p.gap_abs``, ``p.footprint``: what the one-block policies held as attributes)."""
        if name.startswith("_"):
            raise AttributeError(name)
        for holder in (*self.__dict__.get("_parts", ()), *self.__dict__.get("learned", ())):
            if name in getattr(holder, "__dict__", ()) or hasattr(type(holder), name) and not callable(
                    getattr(type(holder), name)):
                return getattr(holder, name)
        raise AttributeError(f"profile {self.__dict__.get('name')!r} has no setting {name!r}")
