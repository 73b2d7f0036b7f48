"""Prompt token ids a router sends along with a request, so this rank skips its chat template and tokenizer.

`lbd route` tokenizes every request to find each rank's cached prefix (lbd.router.kv), and caches the ids
per message, so a multi-turn chat costs it the new turn only. Without them the rank renders and tokenizes
the whole history again on every turn, a cost on the time to first token that grows with the chat. With the
router's ids in the body it uses them as they are:

    "lbd_prompt_token_ids": {"ids": [1, 9690, ...], "tokenizer": "<fingerprint>"}

The fingerprint is the sha256 of this rank's ``/tokenizer_info`` answer (tokenizer.json's sha256, the chat
template, the special tokens: what rendering and tokenizing depend on), which advertises it as
``prompt_token_ids.fingerprint``. Ids made with another fingerprint (a router that learned another model or
template) are ignored and the rank tokenizes as usual. The ids are checked like a token prompt of
/v1/completions (integers in the vocabulary, the context length). Trust is verified: the first
``VERIFY_FIRST`` forwarded prompts are also rendered and tokenized here and compared before use, then one in
``VERIFY_EVERY`` after its request has started; a mismatch turns forwarding off in this front end (an error
in the log, ``lbd:forwarded_prompts_total{outcome="mismatch"}``) and that request, when checked before use,
runs on the rank's own ids.

Only the router may send the field: a client's ids, wrong on purpose, would turn forwarding off for every
tenant. The router signs the ids with the rank's internal key (lbd.common.internal_key: ``"sig"``, an
HMAC over the ids, the fingerprint and the digest of the rest of the body, with the router's clock and a
nonce) and strips any copy a client put in its own body; the rank refuses the field with a 400 when the
signature is missing, wrong, made for another body, older than a minute or already used here, and when it
holds no internal key at all (``$LBD_INTERNAL_KEY`` unset: no router's ids can be told from a client's). A
refused field changes nothing else: no counter of the verification, forwarding stays on (refusals are
counted by reason, in ``ForwardedPrompts.refused`` and as ``lbd:forwarded_prompts_total`` outcomes
``refused_signature``, ``refused_expired``, ``refused_replayed``, ``refused_no_key``). ``/tokenizer_info``
publishes nothing of the key: a router that proves it holds the key (``?key_proof=``) learns whether the
rank's key is the same (``"key": "match"``), so a router holding another key sends no ids rather than refused
ones.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from prometheus_client import Counter

from lbd.common.internal_key import INTERNAL_KEY_ENV, SKEW_S, IdsSigner, body_digest
from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import is_int_list

FIELD = "lbd_prompt_token_ids"
Counts = collections.Counter[str]
VERIFY_FIRST = 4
VERIFY_EVERY = 128

log = logging.getLogger("lbd.engine")


def fingerprint(tokenizer_info: dict[str, Any]) -> str:
    """sha256 of the /tokenizer_info answer (sorted keys): routers send it with ids made from that answer."""
    return hashlib.sha256(orjson.dumps(tokenizer_info, option=orjson.OPT_SORT_KEYS)).hexdigest()


class ForwardedPrompts:
    """One front end's use of forwarded ids: the fingerprint it accepts, verification, counters."""

    def __init__(self, tokenizer_fingerprint: str, vocab_size: int, counters: dict[str, Counter],
                 signer: IdsSigner | None = None) -> None:
        self.fingerprint = tokenizer_fingerprint
        self.signer = signer  # the internal key: ids without its signature are refused
        self.vocab_size = vocab_size
        self.enabled = True
        self.accepted = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self.refused: Counts = collections.Counter()  # 400s by reason: signature, expired, replayed, no_key
        self._count = counters  # FrontendMetrics.forwarded_prompts, by outcome

    def take(self, body: Any) -> list[int] | None:
        """Remove the field from a request body; the ids to use (checked), or None to tokenize here."""
        if not isinstance(body, dict):
            return None
        sent = body.pop(FIELD, None)
        if sent is None:
            return None
        if not isinstance(sent, dict) or not isinstance(sent.get("ids"), list):
            raise bad_request(f"'{FIELD}' must be an object with 'ids' (a list of token ids) and 'tokenizer' "
                              "(the fingerprint from GET /tokenizer_info)", FIELD)
        self._check_signature(sent, body)
        if sent.get("tokenizer") != self.fingerprint:
            self._count["other_tokenizer"].inc()
            return None
        if not self.enabled:
            self._count["disabled"].inc()
            return None
        ids = sent["ids"]
        vocab = self.vocab_size
        if not ids or not is_int_list(ids) or not 0 <= min(ids) <= max(ids) < vocab:
            raise bad_request(f"'{FIELD}.ids' must be a non-empty list of token ids below the vocabulary "
                              f"size ({vocab})", FIELD)
        return ids

    def key_answer(self, proof: str | None) -> str | None:
        """What /tokenizer_info says of the key to a caller that sent ``proof``: None (this rank has none),
        ``"unproven"`` (no proof sent), ``"match"`` or ``"mismatch"``. Nothing to check a guess against
        offline."""
        if self.signer is None:
            return None
        if not proof:
            return "unproven"
        return "match" if self.signer.check_proof(proof) else "mismatch"

    def _check_signature(self, sent: dict[str, Any], body: dict[str, Any]) -> None:
        """A 400 unless the field is signed with this rank's internal key (only its router holds it) for this
        body, recently, and not seen before."""
        if self.signer is None:
            self._refuse("no_key")
            raise bad_request(f"'{FIELD}' is taken only from a router holding this rank's internal key, and "
                              f"this rank has none (${INTERNAL_KEY_ENV}): drop the field", FIELD)
        ids, fp = sent["ids"], sent.get("tokenizer")
        try:
            text = orjson.dumps(ids) if is_int_list(ids) else None
            digest = body_digest(body)
        except (orjson.JSONEncodeError, TypeError):  # an integer beyond 64 bits
            text = None
        why = "signature"
        if text is not None and isinstance(fp, str):
            why = self.signer.verify(text, fp, digest, sent.get("sig")) or ""
        if why:
            self._refuse(why)
            if why == "expired" and self.refused[why] == 1:  # a router's clock far from ours refuses them all
                log.warning("forwarded prompt ids refused: signed more than a minute ago or in the future "
                            "(router and rank clocks more than %.0f s apart?)", SKEW_S)
            raise bad_request(f"'{FIELD}' is taken only from a router holding this rank's internal key, "
                              f"signed for this request, once, within a minute ({why}): drop it", FIELD)

    def _refuse(self, why: str) -> None:
        """Count a refused field, in memory and as an outcome ``refused_<why>`` of the metric."""
        self.refused[why] += 1
        counter = self._count.get(f"refused_{why}")
        if counter is not None:
            counter.inc()

    async def resolve(self, ids: list[int], own: Callable[[], Awaitable[list[int]]]) -> list[int]:
        """The ids to run: ``ids``, checked against ``own()`` (the rank's tokenization) first for the first
        few, and now and then after the request has gone on."""
        self.accepted += 1
        n = self.accepted
        if n <= VERIFY_FIRST:
            mine = await own()
            if not self._agrees(ids, mine):
                return mine
        elif n % VERIFY_EVERY == 0:
            task = asyncio.ensure_future(self._check_later(ids, own))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._count["used"].inc()
        return ids

    async def _check_later(self, ids: list[int], own: Callable[[], Awaitable[list[int]]]) -> None:
        try:
            mine = await own()
        except Exception:  # the request itself will have failed or succeeded on its own; nothing to compare
            return
        self._agrees(ids, mine)

    def _agrees(self, ids: list[int], mine: list[int]) -> bool:
        if ids == mine:
            return True
        at = next((i for i, (a, b) in enumerate(zip(ids, mine, strict=False)) if a != b),
                  min(len(ids), len(mine)))
        log.error("forwarded prompt token ids differ from this rank's own tokenization (%d vs %d tokens, "
                  "first difference at %d): forwarding is off in this front end until it restarts",
                  len(ids), len(mine), at)
        self.enabled = False
        self._count["mismatch"].inc()
        return False
