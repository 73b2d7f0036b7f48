"""Filters: the router's gate (in front of every profile) and the load filters profiles use.

The gate (``GATE``, run by ``select.route`` in this order) keeps the endpoints that serve the model, honours
a pin (it settles the request, or refuses it), keeps the ready ones (healthy, not draining), drops those
that already failed this request and passes over those it should avoid. When one leaves nothing it refuses,
saying why (``avoid`` never does). A profile's filters
(``load_gap``, ``kv_room``, and the affinity ones) narrow a preference instead: none refuses.
"""

from __future__ import annotations

from lbd.policies.base import Decision, Refusal
from lbd.policies.pick import gap_bound
from lbd.policies.plugin import Context, Env, Filter
from lbd.policies.registry import plugin


@plugin
class ServesModel(Filter):
    name = "serves_model"
    help = "endpoints serving the request's model (none: 404)"
    uses_load = False

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Refusal:
        model, pool = ctx.facts.model, ctx.pool
        if model is None:
            return kept
        out = [i for i in kept if pool[i].serves(model)]
        if out:
            return out
        return Refusal(404, f"The model `{model}` does not exist.", "unknown_model", "NotFoundError", "model")


@plugin
class PinnedRank(Filter):
    """A request pinned to a rank (X-data-parallel-rank) goes there, to its endpoint with the fewest in
    flight; when that rank cannot take it: a 400 (unknown rank), a 503, or (``pin_fallback``) no pin."""

    name = "pinned_rank"
    help = "a pinned request to its rank (settles the decision) or a refusal; --pin-fallback: unpinned"
    uses_load = False

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Decision | Refusal:
        rank = ctx.facts.pinned_rank
        if rank is None:
            return kept
        pool = ctx.pool
        targets = [pool[i] for i in kept if pool[i].rank == rank]
        if not targets:
            known = sorted({e.rank for e in pool if e.rank is not None})
            return Refusal(400, f"X-data-parallel-rank {rank} is not a known rank; known ranks: {known}",
                           "pin_unknown_rank", "BadRequestError", "X-data-parallel-rank")
        exclude = ctx.exclude
        ready = [e for e in targets if e.healthy and not e.draining and e.key not in exclude]
        if ready:
            return Decision(min(ready, key=lambda e: e.inflight), "pinned", f"rank {rank}", plugin=self.name)
        if ctx.pin_fallback:
            return kept  # routed as if unpinned (select.route names the decision pin_fallback)
        state = "draining" if any(e.draining for e in targets) else "unhealthy"
        if all(e.key in exclude for e in targets):
            state = "failing"
        return Refusal(503, f"pinned rank {rank} is {state}; not rerouting (start the router with "
                       "--pin-fallback to allow it)", f"pin_{state}")


@plugin
class Ready(Filter):
    name = "ready"
    help = "healthy endpoints that are not draining (none: 503)"
    uses_load = False

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Refusal:
        pool = ctx.pool
        out = [i for i in kept if pool[i].healthy and not pool[i].draining]
        if out:
            return out
        ejected = sum(not pool[i].healthy for i in kept)
        draining = sum(pool[i].draining for i in kept)
        return Refusal(503, f"no endpoint is ready for model {ctx.facts.model!r} ({ejected} ejected, "
                       f"{draining} draining of {len(kept)})", "all_unavailable")


@plugin
class NotExcluded(Filter):
    name = "not_excluded"
    help = "endpoints that did not fail this request already (none: 503)"
    uses_load = False

    def filter(self, ctx: Context, kept: list[int]) -> list[int] | Refusal:
        exclude, pool = ctx.exclude, ctx.pool
        if not exclude:
            return kept
        out = [i for i in kept if pool[i].key not in exclude]
        return out or Refusal(503, "every other endpoint already failed this request", "retries_exhausted")


@plugin
class Avoid(Filter):
    """Pass over the endpoints the request's facts ask it to avoid (``RequestFacts.avoid``), unless that
    leaves none: a preference, never a refusal."""

    name = "avoid"
    help = "pass over the endpoints the request should avoid (flow control's crowded ranks) while any is left"
    uses_load = False

    def filter(self, ctx: Context, kept: list[int]) -> list[int]:
        avoid, pool = ctx.facts.avoid, ctx.pool
        if not avoid:
            return kept
        return [i for i in kept if pool[i].key not in avoid] or kept


_ENV = Env()
GATE: tuple[Filter, ...] = (ServesModel(_ENV), PinnedRank(_ENV), Ready(_ENV), NotExcluded(_ENV), Avoid(_ENV))


@plugin
class LoadGap(Filter):
    """Bounded stickiness: drop endpoints whose queue score is past the least one by ``gap_abs`` plus
    ``gap_rel`` of it, so no affinity outweighs a large load gap. ``exact_exempt``: endpoints the exact view
    knows stay (their estimate already holds the queue ahead and the true cost of a miss)."""

    name = "load_gap"
    help = "drop endpoints whose load is past the least by a gap (exact-view endpoints exempt)"
    exact_aware = True

    def __init__(self, env: Env, gap_abs: float = 8.0, gap_rel: float = 0.5, exact_exempt: bool = True,
                 eps: float = 1e-6) -> None:
        super().__init__(env)
        self.gap_abs, self.gap_rel, self.exact_exempt, self.eps = gap_abs, gap_rel, exact_exempt, eps

    def filter(self, ctx: Context, kept: list[int]) -> list[int]:
        scores = ctx.queue()
        bound = gap_bound(scores, self.gap_abs, self.gap_rel)
        exact = ctx.facts.cached_tokens if self.exact_exempt else None
        pool = ctx.pool
        out = [i for i in kept if scores[i] <= bound or (exact and pool[i].key in exact)]
        ctx.memo[self] = len(out) < len(kept)
        return out

    def reason(self, ctx: Context, pick: int) -> str | None:
        totals = ctx.totals
        if ctx.memo.get(self) and totals is not None and totals[pick] > min(totals) + self.eps:
            return "load_gap"  # a better scored endpoint was past the gap
        return None


@plugin
class KvRoom(Filter):
    """Drop endpoints whose (fresh) KV cache is at least ``kv_full`` used: a rank that full preempts. When
    every endpoint is that full, keep them all."""

    name = "kv_room"
    help = "drop endpoints whose KV cache is nearly full (all full: keep all)"

    def __init__(self, env: Env, kv_full: float = 0.98) -> None:
        super().__init__(env)
        self.kv_full = kv_full

    def filter(self, ctx: Context, kept: list[int]) -> list[int]:
        pool, stale_s, full = ctx.pool, self.stale_s, self.kv_full
        out = [i for i in kept if not (pool[i].fresh(stale_s) and pool[i].kv_usage >= full)]
        ctx.memo[self] = not out
        return out or kept

    def reason(self, ctx: Context, pick: int) -> str | None:
        return "kv_all_full" if ctx.memo.get(self) else None
