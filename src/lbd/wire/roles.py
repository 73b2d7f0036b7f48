"""Roles, as the programs name them on their command lines and in /status.

``NodeRole``: what an ``lbd serve`` node of a DP deployment is (``deployment.role`` in its /status): the
``head`` runs the registration service and the router, a ``headless`` node only ranks (``--headless``), a
``hybrid`` node its ranks and a router of its own (``--data-parallel-hybrid-lb``).

``RankRole``: what one DP rank does with a request: ``mixed`` serves whole requests (prefill and decode);
in a disaggregated deployment ``prefill`` ranks run prompts and hand their KV blocks to ``decode`` ranks
(``lbd supervise --prefill-ranks/--decode-ranks``). A role this version does not know decodes as
``unknown``.
"""

from __future__ import annotations

from lbd.wire.tolerant import TolerantEnum


class NodeRole(TolerantEnum):
    HEAD = "head"
    HEADLESS = "headless"
    HYBRID = "hybrid"
    UNKNOWN = "unknown"


class RankRole(TolerantEnum):
    MIXED = "mixed"  # prefill and decode of its own requests
    PREFILL = "prefill"  # prompts only: a KV producer (--kv-transfer-config kv_producer)
    DECODE = "decode"  # decodes of prompts prefilled elsewhere: a KV consumer
    UNKNOWN = "unknown"
