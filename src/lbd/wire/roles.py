"""Roles, as the programs name them on their command lines and in /status.

``NodeRole``: what an ``lbd serve`` node of a DP deployment is (``deployment.role`` in its /status): the
``head`` runs the registration service and the router, a ``headless`` node only ranks (``--headless``), a
``hybrid`` node its ranks and a router of its own (``--data-parallel-hybrid-lb``).

``RankRole``: what one DP rank does with a request. Every rank today serves whole requests (prefill and
decode); the enum is where a disaggregated deployment's roles would be named, and decodes a role this
version does not know as ``unknown``.
"""

from __future__ import annotations

from lbd.wire.tolerant import TolerantEnum


class NodeRole(TolerantEnum):
    HEAD = "head"
    HEADLESS = "headless"
    HYBRID = "hybrid"
    UNKNOWN = "unknown"


class RankRole(TolerantEnum):
    MIXED = "mixed"  # prefill and decode of its own requests: every rank today
    UNKNOWN = "unknown"
