"""Ranks by role: ``--prefill-ranks`` / ``--decode-ranks`` (local rank indices) make a node's ranks prefill
(KV producers) and decode (KV consumers) ranks of a disaggregated deployment; the rest stay ``mixed``.

Each role becomes the rank's ``--kv-transfer-config`` (``lbd.engine.config.kv_transfer``: ``kv_producer`` or
``kv_consumer`` over ``LbdConnector``), and ``/status`` names it (``lbd.wire.roles.RankRole``), where ``lbd
route --vllm-pd-disaggregation`` learns it.
"""

from __future__ import annotations

import argparse
import json

from lbd.wire.roles import RankRole

KV_ROLES = {RankRole.PREFILL: "kv_producer", RankRole.DECODE: "kv_consumer"}


class RoleError(ValueError):
    """A bad role flag (one line naming it)."""


def _indices(text: str | None, flag: str, local: int) -> set[int]:
    if not text:
        return set()
    try:
        out = {int(x) for x in text.split(",") if x.strip()}
    except ValueError:
        raise RoleError(f"{flag} takes local rank indices, e.g. {flag} 0,1; got {text!r}") from None
    bad = sorted(i for i in out if not 0 <= i < local)
    if bad:
        raise RoleError(f"{flag}: local rank(s) {bad} do not exist here (0..{local - 1})")
    return out


def plan_roles(ns: argparse.Namespace, local: int) -> list[RankRole]:
    """Each local rank's role from the flags; RoleError for overlaps, unknown ranks, or ranks that cannot
    take a role (another engine, a command, a flagged --kv-transfer-config)."""
    prefill = _indices(ns.prefill_ranks, "--prefill-ranks", local)
    decode = _indices(ns.decode_ranks, "--decode-ranks", local)
    if not prefill and not decode:
        return [RankRole.MIXED] * local
    both = sorted(prefill & decode)
    if both:
        raise RoleError(f"local rank(s) {both} are in both --prefill-ranks and --decode-ranks: give each "
                        "one role")
    if ns.rank_engine != "lbd" or ns.rank_command is not None:
        raise RoleError("--prefill-ranks/--decode-ranks set lbd engine ranks' --kv-transfer-config: with "
                        "--rank-engine vllm/sglang or --rank-command, pass the engine's own KV flags")
    if ns.kv_transfer_config is not None:
        raise RoleError("--prefill-ranks/--decode-ranks give each rank its --kv-transfer-config: drop "
                        "--kv-transfer-config")
    return [RankRole.PREFILL if i in prefill else RankRole.DECODE if i in decode else RankRole.MIXED
            for i in range(local)]


def role_flags(role: RankRole) -> list[str]:
    """The engine flags of ``role`` (none for ``mixed``)."""
    kv_role = KV_ROLES.get(role)
    if kv_role is None:
        return []
    return ["--kv-transfer-config", json.dumps({"kv_connector": "LbdConnector", "kv_role": kv_role})]
