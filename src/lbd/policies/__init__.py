"""Routing decisions: pure functions of (request facts, endpoint snapshots). No I/O, no clock reads.

Importing the package registers every policy; ``make_policy(name, **options)`` builds one by name.
"""

from __future__ import annotations

from lbd.policies import affinity, load, ttft  # noqa: F401  (registration)
from lbd.policies.base import (
    Decision,
    EndpointSnapshot,
    Policy,
    RequestFacts,
    available,
    make_policy,
    queue_score,
    register,
)
from lbd.policies.prefix import CHUNK_CHARS, PrefixIndex, chunk_hashes
from lbd.policies.select import Refusal, route
from lbd.policies.ttft import CHARS_PER_TOKEN

DEFAULT_POLICY = "predicted_ttft"

__all__ = [
    "CHARS_PER_TOKEN",
    "CHUNK_CHARS",
    "DEFAULT_POLICY",
    "Decision",
    "EndpointSnapshot",
    "Policy",
    "PrefixIndex",
    "Refusal",
    "RequestFacts",
    "available",
    "chunk_hashes",
    "make_policy",
    "queue_score",
    "register",
    "route",
]
