"""The internal key: what lets a rank tell its own router's requests from a client's.

A router that tokenized a prompt sends the ids with the request (``lbd_prompt_token_ids``, see
lbd.engine.server.forwarded), and a rank that runs them skips its own tokenization. Ids are trusted data:
wrong ones among a front end's verified prompts turn forwarding off for every tenant. So a rank takes them
only signed with its internal key, and a signature is good for one request, once, for a minute:

- **Bound to the request.** The HMAC-SHA256 covers the ids' JSON text, the tokenizer fingerprint and the
  sha256 of the rest of the body (``body_digest``: the parsed body without the field, written with sorted
  keys, so the router, which splices the field into the bytes, and the rank, which parses them, agree). A
  signature copied beside another prompt, model or sampling setting does not verify.
- **Fresh.** The signed data carries the router's clock (milliseconds) and a random nonce; a rank takes it
  for ``VALID_S`` after that, ``SKEW_S`` of clock difference allowed either way.
- **Once.** Each front end remembers the nonces it accepted until they expire (``ReplayGuard``): the exact
  same blob sent again is refused. (Another front end or rank holding the key would run it, but only with
  the very body it was signed for: the request its router already sent, with its correct ids.)

The wire shape is unchanged: ``"sig": "<ms>.<nonce>.<hex mac>"``.

**Nothing to check a guess against offline.** No function of the key is published: ``/tokenizer_info``
used to advertise an HMAC of a fixed label (a ``key_id``), which let anyone test guesses of a weak key at
their own speed. Now a router proves it holds the key when it asks (``GET /tokenizer_info?key_proof=...``,
``prove``/``check_proof``: an HMAC over its clock and a nonce) and the rank answers only whether that proof
verified (``"key": "match"``). Anyone can ask, one guess per request: an online oracle, and the keys ``lbd
serve`` uses have 256 bits (random, derived from a cluster token, or given: it refuses either below that
strength, lbd.common.cluster.check_token_strength). Only a holder of the key can make a proof or a
signature, and only the router-to-rank hop carries them.

The key comes from ``$LBD_INTERNAL_KEY`` (never a flag: command lines show in ``ps``). ``lbd serve`` makes
one per deployment (derived from ``$LBD_CLUSTER_TOKEN`` when nodes share one, else random per node) and
hands it to its supervisor (the ranks) and its router; ``lbd supervise`` passes its own to its ranks. A rank
without a key refuses the field with a 400: there is no router whose ids it could tell from a client's.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import orjson

INTERNAL_KEY_ENV = "LBD_INTERNAL_KEY"
VALID_S = 60.0  # a signature is good this long after the router made it
SKEW_S = 5.0  # clock difference allowed between router and rank, either way
REPLAY_CAPACITY = 200_000  # nonces a front end remembers; past it, the oldest go and older stamps are refused
_DERIVE_LABEL = b"lbd internal key"
_IDS_LABEL = b"lbd forwarded ids v2"
_PROOF_LABEL = b"lbd internal key proof v1"


def body_digest(body: Mapping[str, Any]) -> str:
    """sha256 of a parsed request body (without the ids field) written with sorted keys: what a signature
    binds the ids to."""
    return hashlib.sha256(orjson.dumps(body, option=orjson.OPT_SORT_KEYS)).hexdigest()


def _stamp(value: str) -> int | None:
    return int(value) if value.isascii() and value.isdigit() and len(value) <= 15 else None


class ReplayGuard:
    """The nonces one front end accepted, until they expire; a nonce seen again is a replay."""

    def __init__(self, capacity: int = REPLAY_CAPACITY) -> None:
        self.capacity = capacity
        self.floor_ms = 0  # stamps at or below it are refused (the guard forgot their nonces)
        self._seen: OrderedDict[str, int] = OrderedDict()  # nonce -> its stamp, in arrival order

    def first_use(self, nonce: str, stamp_ms: int, now_ms: int) -> bool:
        """Record ``nonce``; False when it was seen before (or is older than what the guard remembers)."""
        horizon = now_ms - int((VALID_S + SKEW_S) * 1000)
        seen = self._seen
        while seen and (next(iter(seen.values())) < horizon or len(seen) >= self.capacity):
            _, old = seen.popitem(last=False)
            if old >= horizon:  # forgotten before it expired: anything as old is refused from now on
                self.floor_ms = max(self.floor_ms, old)
        if stamp_ms <= self.floor_ms or nonce in seen:
            return False
        seen[nonce] = stamp_ms
        return True

    def __len__(self) -> int:
        return len(self._seen)


class IdsSigner:
    """Signs (router) and checks (rank) forwarded prompt ids, and proves possession of the key."""

    __slots__ = ("_key", "replay")

    def __init__(self, key: str) -> None:
        self._key = key.encode("utf-8", "surrogateescape")
        self.replay = ReplayGuard()

    def _mac(self, *parts: bytes) -> str:
        return hmac.new(self._key, b"\n".join(parts), hashlib.sha256).hexdigest()

    def sign(self, ids_json: bytes, fingerprint: str, digest: str, now: float | None = None,
             nonce: str | None = None) -> str:
        """The signature of ids written as ``[1,2,3]`` (orjson's text, no spaces) with ``fingerprint``, for
        the body whose ``body_digest`` is ``digest``: ``<ms>.<nonce>.<mac>``."""
        ms = str(int((time.time() if now is None else now) * 1000))
        nonce = secrets.token_hex(12) if nonce is None else nonce
        mac = self._mac(_IDS_LABEL, ms.encode(), nonce.encode(), fingerprint.encode("ascii", "replace"),
                        digest.encode(), ids_json)
        return f"{ms}.{nonce}.{mac}"

    def verify(self, ids_json: bytes, fingerprint: str, digest: str, signature: object,
               now: float | None = None) -> str | None:
        """None when ``signature`` is ours for these ids and this body, fresh and not seen before (its nonce
        is then remembered); else why not (``"signature"``, ``"expired"``, ``"replayed"``)."""
        if not isinstance(signature, str) or signature.count(".") != 2 or len(signature) > 200:
            return "signature"
        ms, nonce, mac = signature.split(".")
        stamp = _stamp(ms)
        if stamp is None or not nonce.isalnum() or not nonce.isascii():
            return "signature"
        want = self._mac(_IDS_LABEL, ms.encode(), nonce.encode(), fingerprint.encode("ascii", "replace"),
                         digest.encode(), ids_json)
        if not hmac.compare_digest(want, mac):
            return "signature"
        now_ms = int((time.time() if now is None else now) * 1000)
        if not now_ms - (VALID_S + SKEW_S) * 1000 <= stamp <= now_ms + SKEW_S * 1000:
            return "expired"
        return None if self.replay.first_use(nonce, stamp, now_ms) else "replayed"

    def prove(self, now: float | None = None) -> str:
        """A proof of holding the key (``<ms>.<nonce>.<mac>``), for ``GET /tokenizer_info?key_proof=``."""
        ms = str(int((time.time() if now is None else now) * 1000))
        nonce = secrets.token_hex(12)
        return f"{ms}.{nonce}.{self._mac(_PROOF_LABEL, ms.encode(), nonce.encode())}"

    def check_proof(self, proof: object, now: float | None = None) -> bool:
        """``proof`` was made with this key, within ``VALID_S`` (one online guess per call, nothing more)."""
        if not isinstance(proof, str) or proof.count(".") != 2 or len(proof) > 200:
            return False
        ms, nonce, mac = proof.split(".")
        stamp = _stamp(ms)
        now_ms = int((time.time() if now is None else now) * 1000)
        if stamp is None or not now_ms - (VALID_S + SKEW_S) * 1000 <= stamp <= now_ms + SKEW_S * 1000:
            return False
        return hmac.compare_digest(self._mac(_PROOF_LABEL, ms.encode(), nonce.encode()), mac)


def signer_from(env: Mapping[str, str]) -> IdsSigner | None:
    """The signer of ``$LBD_INTERNAL_KEY``, or None when the variable is unset or empty."""
    key = env.get(INTERNAL_KEY_ENV, "").strip()
    return IdsSigner(key) if key else None


def derive_key(shared_secret: str) -> str:
    """An internal key every node holding ``shared_secret`` (the cluster token) derives alike."""
    raw = shared_secret.encode("utf-8", "surrogateescape")
    return hmac.new(raw, _DERIVE_LABEL, hashlib.sha256).hexdigest()
