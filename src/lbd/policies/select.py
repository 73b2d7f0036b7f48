"""The one entry the router calls: the gate (model, pin, health, retry exclusions: ``filters.GATE``), then
the profile's own filters, scorers and picker. Refusals carry the HTTP status and the client's message.

A P/D stage passes its own gate (``roles.stage_gate``: the same plus its role as a rule) and its profile (the
prefill profile, or the router's own for the decode stage): the same entry decides both stages."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from lbd.policies.base import Decision, EndpointSnapshot, Refusal, RequestFacts
from lbd.policies.filters import GATE
from lbd.policies.plugin import Context, Filter
from lbd.policies.profile import Profile

__all__ = ["Refusal", "route"]


def route(
    policy: Profile,
    facts: RequestFacts,
    endpoints: Sequence[EndpointSnapshot],
    exclude: Collection[str] = (),
    pin_fallback: bool = False,
    gate: Sequence[Filter] = GATE,
) -> Decision | Refusal:
    """Choose an endpoint for ``facts`` or say why none can take it; ``gate``: the filters that may refuse
    (the router's gate; a P/D stage's adds its role)."""
    if not endpoints:
        return Refusal(503, "no upstream endpoints are configured or discovered yet", "no_endpoints")
    ctx = Context(facts, endpoints, policy.stale_s, exclude, pin_fallback)
    if (gate is not GATE or facts.pinned_rank is not None or exclude or facts.avoid
            or not _all_pass(endpoints, facts.model)):
        kept = list(range(len(endpoints)))
        for rule in gate:
            out = rule.filter(ctx, kept)
            if out.__class__ is not list:
                return out  # type: ignore[return-value]  (a pin settled it, or a refusal)
            kept = out  # type: ignore[assignment]
        if len(kept) < len(endpoints):
            ctx.pool = [endpoints[i] for i in kept]
    decision = policy.decide(ctx)
    if facts.pinned_rank is not None:  # the pinned rank is out and --pin-fallback let it go elsewhere
        decision.reason, decision.plugin = "pin_fallback", "pinned_rank"
    return decision


def _all_pass(endpoints: Sequence[EndpointSnapshot], model: str | None) -> bool:
    """Whether every endpoint serves ``model`` and is ready: then (no pin, no exclusions: the usual request)
    the gate would keep them all, and is skipped."""
    for e in endpoints:
        if not e.healthy or e.draining or (model is not None and e.models and model not in e.models):
            return False
    return True
