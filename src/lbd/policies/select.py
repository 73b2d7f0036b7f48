"""The one entry the router calls: filter endpoints (model, health, drain, retry exclusions), apply a pin,
else ask the policy. Refusals carry the HTTP status and the message the client gets."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from lbd.policies.base import Decision, EndpointSnapshot, Policy, RequestFacts


@dataclass(slots=True, frozen=True)
class Refusal:
    status: int
    message: str
    reason: str  # metric label
    type: str = "ServiceUnavailableError"
    param: str | None = None


def _pinned(
    facts: RequestFacts,
    serving: list[EndpointSnapshot],
    everyone: Sequence[EndpointSnapshot],
    exclude: Collection[str],
    pin_fallback: bool,
) -> Decision | Refusal | None:
    rank = facts.pinned_rank
    targets = [e for e in serving if e.rank == rank]
    if not targets:
        known = sorted({e.rank for e in everyone if e.rank is not None})
        return Refusal(
            400,
            f"X-data-parallel-rank {rank} is not a known rank; known ranks: {known}",
            "pin_unknown_rank",
            "BadRequestError",
            "X-data-parallel-rank",
        )
    ready = [e for e in targets if e.healthy and not e.draining and e.key not in exclude]
    if ready:
        return Decision(min(ready, key=lambda e: e.inflight), "pinned", f"rank {rank}")
    if pin_fallback:
        return None  # the caller routes as if unpinned
    state = "draining" if any(e.draining for e in targets) else "unhealthy"
    if all(e.key in exclude for e in targets):
        state = "failing"
    return Refusal(
        503,
        f"pinned rank {rank} is {state}; not rerouting (start the router with --pin-fallback to allow it)",
        f"pin_{state}",
    )


def route(
    policy: Policy,
    facts: RequestFacts,
    endpoints: Sequence[EndpointSnapshot],
    exclude: Collection[str] = (),
    pin_fallback: bool = False,
) -> Decision | Refusal:
    """Choose an endpoint for ``facts`` or say why none can take it."""
    if not endpoints:
        return Refusal(503, "no upstream endpoints are configured or discovered yet", "no_endpoints")
    serving = [e for e in endpoints if e.serves(facts.model)]
    if not serving:
        return Refusal(
            404, f"The model `{facts.model}` does not exist.", "unknown_model", "NotFoundError", "model"
        )
    if facts.pinned_rank is not None:
        pinned = _pinned(facts, serving, endpoints, exclude, pin_fallback)
        if pinned is not None:
            return pinned
    ready = [e for e in serving if e.healthy and not e.draining]
    candidates = [e for e in ready if e.key not in exclude]
    if not candidates:
        if ready:
            return Refusal(503, "every other endpoint already failed this request", "retries_exhausted")
        ejected = sum(not e.healthy for e in serving)
        draining = sum(e.draining for e in serving)
        return Refusal(
            503,
            f"no endpoint is ready for model {facts.model!r} ({ejected} ejected, {draining} "
            f"draining of {len(serving)})",
            "all_unavailable",
        )
    decision = policy.choose(facts, candidates)
    if facts.pinned_rank is not None:
        decision.reason = "pin_fallback"
    return decision
