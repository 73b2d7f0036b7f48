"""Bounded decisions at fleet scale: which endpoints a request's decision looks at.

Up to ``SAMPLE_ABOVE`` eligible endpoints the policy sees every one (8 or 64 ranks decide exactly as before).
Beyond, it sees a sample: ``SAMPLE_K`` endpoints drawn at random (power-of-k choices: the least loaded of k
random picks is close to the least loaded of all, and keeps a burst from piling onto one endpoint that every
router worker thinks is idlest) plus the endpoints that hold the request's prefix (``holder_keys``: the
exact view's cached prefixes, the text-prefix index's holders), at most ``HOLDERS_MAX`` of them. The cost of a
decision then grows with k, not with the fleet. Whoever builds the snapshots falls back to every endpoint when
the sample cannot serve the request (no endpoint of the sample serves the model, or all are out).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from lbd.policies.base import RequestFacts

if TYPE_CHECKING:
    from lbd.policies.profile import Profile

SAMPLE_ABOVE = 64
SAMPLE_K = 16
HOLDERS_MAX = 16


def holder_keys(policy: Profile, facts: RequestFacts, limit: int = HOLDERS_MAX,
                rng: random.Random | None = None) -> list[str]:
    """Keys of the endpoints holding the request's prefix: the exact view's longest cached prefixes first,
    then the text-prefix index's holders (a random ``limit`` of them when more hold it)."""
    out: list[str] = []
    cached = facts.cached_tokens
    if cached:
        out = heapq.nlargest(limit, (k for k, v in cached.items() if v > 0), key=cached.__getitem__)
    index = policy.index  # the profile's learned text-prefix index, if any
    hashes = facts.prefix_hashes
    if index is not None and hashes and len(out) < limit:
        held = index.holders(hashes)
        room = limit - len(out)
        if len(held) > room:
            out += (rng or random).sample(sorted(held), room)
        else:
            out += held
    return out


def sample_indices(n: int, k: int, rng: random.Random) -> Sequence[int]:
    """``k`` distinct indices of ``n`` (all of them when n <= k)."""
    return range(n) if n <= k else rng.sample(range(n), k)
