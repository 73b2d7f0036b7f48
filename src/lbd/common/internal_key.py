"""The internal key: what lets a rank tell its own router's requests from a client's.

A router that tokenized a prompt sends the ids with the request (``lbd_prompt_token_ids``, see
lbd.engine.server.forwarded), and a rank that runs them skips its own tokenization. Ids are trusted data:
wrong ones among a front end's verified prompts turn forwarding off for every tenant. So a rank takes them
only signed with its internal key: an HMAC-SHA256 over the ids' JSON text and the tokenizer fingerprint, which
only a holder of the key can make. The key itself never travels: the rank advertises an id of it (an HMAC
of a fixed label, which reveals nothing of the key) in ``/tokenizer_info``, and a router signs ids only for
ranks whose id matches its own key's; any other rank gets no ids (never a request it would refuse).

The key comes from ``$LBD_INTERNAL_KEY`` (never a flag: command lines show in ``ps``). ``lbd serve`` makes
one per deployment (derived from ``$LBD_CLUSTER_TOKEN`` when nodes share one, else random per node) and
hands it to its supervisor (the ranks) and its router; ``lbd supervise`` passes its own to its ranks. A rank
without a key refuses the field with a 400: there is no router whose ids it could tell from a client's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

INTERNAL_KEY_ENV = "LBD_INTERNAL_KEY"
_ID_LABEL = b"lbd internal key id"
_DERIVE_LABEL = b"lbd internal key"


class IdsSigner:
    """Signs (router) and checks (rank) forwarded prompt ids with one internal key."""

    __slots__ = ("_key", "key_id")

    def __init__(self, key: str) -> None:
        self._key = key.encode("utf-8", "surrogateescape")
        self.key_id = hmac.new(self._key, _ID_LABEL, hashlib.sha256).hexdigest()[:32]

    def sign(self, ids_json: bytes, fingerprint: str) -> str:
        """The signature of ids written as ``[1,2,3]`` (orjson's text, no spaces) with ``fingerprint``."""
        mac = hmac.new(self._key, ids_json, hashlib.sha256)
        mac.update(b"\n" + fingerprint.encode("ascii", "replace"))
        return mac.hexdigest()

    def verify(self, ids_json: bytes, fingerprint: str, signature: object) -> bool:
        """``signature`` is ours for these ids (constant time)."""
        if not isinstance(signature, str):
            return False
        return hmac.compare_digest(self.sign(ids_json, fingerprint), signature)


def signer_from(env: Mapping[str, str]) -> IdsSigner | None:
    """The signer of ``$LBD_INTERNAL_KEY``, or None when the variable is unset or empty."""
    key = env.get(INTERNAL_KEY_ENV, "").strip()
    return IdsSigner(key) if key else None


def derive_key(shared_secret: str) -> str:
    """An internal key every node holding ``shared_secret`` (the cluster token) derives alike."""
    raw = shared_secret.encode("utf-8", "surrogateescape")
    return hmac.new(raw, _DERIVE_LABEL, hashlib.sha256).hexdigest()
