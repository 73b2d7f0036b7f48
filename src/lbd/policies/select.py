"""The one entry the router calls: the gate (model, pin, health, retry exclusions: ``filters.GATE``), then
the profile's own filters, scorers and picker. Refusals carry the HTTP status and the client's message."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from lbd.policies.base import Decision, EndpointSnapshot, Refusal, RequestFacts
from lbd.policies.filters import GATE
from lbd.policies.plugin import Context
from lbd.policies.profile import Profile

__all__ = ["Refusal", "route"]


def route(
    policy: Profile,
    facts: RequestFacts,
    endpoints: Sequence[EndpointSnapshot],
    exclude: Collection[str] = (),
    pin_fallback: bool = False,
) -> Decision | Refusal:
    """Choose an endpoint for ``facts`` or say why none can take it."""
    if not endpoints:
        return Refusal(503, "no upstream endpoints are configured or discovered yet", "no_endpoints")
    ctx = Context(facts, endpoints, policy.stale_s, exclude, pin_fallback)
    kept = list(range(len(endpoints)))
    for gate in GATE:
        out = gate.filter(ctx, kept)
        if not isinstance(out, list):
            return out  # a pin settled it, or a refusal
        kept = out
    candidates = endpoints if len(kept) == len(endpoints) else [endpoints[i] for i in kept]
    decision = policy.choose(facts, candidates)
    if facts.pinned_rank is not None:  # the pinned rank is out and --pin-fallback let it go elsewhere
        decision.reason, decision.plugin = "pin_fallback", "pinned_rank"
    return decision
