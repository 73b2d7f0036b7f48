"""Send the router's token ids of a prompt with the request to ranks that take them
(lbd.engine.server.forwarded).

The exact view tokenizes every request (per message, cached: a new turn costs its own tokens only); a rank
would render and tokenize the whole prompt again before its prefill. A rank of lbd's engine advertises in
``/tokenizer_info`` that it takes the ids, under which field, and the fingerprint of the tokenizer and chat
template they must come from. The router learns its tokenizer from that same answer, so it sends the ids to
a rank only when the rank's fingerprint is the one its tokenizer was built from (any other rank, or a vLLM
one, gets the body unchanged), and the rank checks the fingerprint again (and verifies the first few prompts
and a sample after them against its own tokenization). The ids go signed with the internal key
(lbd.common.internal_key) for this request's body, with the router's clock and a nonce (a blob seen on the
wire is good for nothing else, once, for a minute), and only to ranks that said the key is theirs: the
router proves it holds the key when it reads ``/tokenizer_info`` (``key_proof``, see ``info_path``) and
the rank answers ``"key": "match"`` or not, publishing nothing of the key. A rank takes no unsigned ids, and
the router strips a client's own copy of the field from every body (``strip_client_copy``), so no client
can make a rank run, or distrust, ids of its choosing.

Only generation requests (``PATHS``: /tokenize and the rest tokenize for themselves), and only prompts the
router renders exactly as Hugging Face's ``apply_chat_template`` does go: chat requests
without tools, template kwargs or ``continue_final_message`` (the router renders those too, for routing, where
a small difference costs a cache hit, not a different prompt), and completions with one text prompt. The body
is spliced into before its closing brace; it is parsed once here for the digest the signature binds (the
rank parses it anyway, and skips a tokenization for it).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from lbd.common.internal_key import IdsSigner, body_digest
from lbd.router.continuation import append_field

FIELD = "lbd_prompt_token_ids"  # the engine's name for it (lbd.engine.server.forwarded.FIELD)
_FIELD = FIELD.encode()
PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})  # where the engine reads it
MEMO_MIN_TOKENS = 64  # pieces this long keep their JSON text (benchmarks/RESULTS.md, "Id memo")
MEMO_BYTES = 16 << 20


@dataclass(slots=True)
class ExactPrompt:
    """A request's prompt as the router tokenized it: token-id pieces, and its tokenizer's fingerprint."""

    pieces: Sequence[Sequence[int]]
    fingerprint: str


def info_path(signer: IdsSigner | None) -> str:
    """The path to read a rank's /tokenizer_info with: with a proof of the key when the router holds one."""
    return "/tokenizer_info" if signer is None else f"/tokenizer_info?key_proof={signer.prove()}"


def advertised(info: Any, keyed: bool = False) -> str | None:
    """The fingerprint a rank's /tokenizer_info says forwarded ids must carry (None: it takes none); when
    ``keyed`` (the router signs), only when the rank said the router's proof of the key verified."""
    entry = info.get("prompt_token_ids") if isinstance(info, dict) else None
    if not isinstance(entry, dict) or entry.get("field") != FIELD:
        return None
    if keyed and entry.get("key") != "match":
        return None
    fp = entry.get("fingerprint")
    return fp if isinstance(fp, str) and fp.isascii() and fp.isalnum() else None


def forwardable(data: dict[str, Any]) -> bool:
    """The request's prompt is one the router renders exactly as the engine does (see above)."""
    if "messages" in data:
        return not (data.get("tools") or data.get("chat_template_kwargs")
                    or data.get("continue_final_message"))
    return isinstance(data.get("prompt"), str)


class _JsonMemo:
    """The JSON text of long cached pieces, by piece object: the tokenizer's piece cache hands every request
    the same id array for a text it has seen (a system prompt, a history's earlier turns), so each long piece
    is written out once. LRU, bounded by bytes; an entry keeps its piece alive, so ids cannot be reused."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._memo: OrderedDict[int, tuple[Sequence[int], bytes]] = OrderedDict()

    def text(self, piece: Sequence[int]) -> bytes:
        """``1,2,3`` for a piece (no brackets; empty for an empty piece)."""
        if len(piece) < MEMO_MIN_TOKENS:
            return orjson.dumps(list(piece))[1:-1]
        key = id(piece)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is piece:
            self._memo.move_to_end(key)
            return hit[1]
        text = orjson.dumps(list(piece))[1:-1]
        self._memo[key] = (piece, text)
        self.bytes += len(text)
        while self.bytes > self.max_bytes and self._memo:
            self.bytes -= len(self._memo.popitem(last=False)[1][1])
        return text


_memo = _JsonMemo(MEMO_BYTES)


def with_ids(body: bytes, prompt: ExactPrompt, signer: IdsSigner) -> bytes | None:
    """``body`` with the field added (signed for this body), or None when it is not one JSON object."""
    end = body.rstrip()
    if not end.endswith(b"}"):
        return None
    try:
        data = orjson.loads(end)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict) or FIELD in data:
        return None
    ids = b"[%s]" % b",".join(t for t in map(_memo.text, prompt.pieces) if t)
    fp = prompt.fingerprint
    sig = signer.sign(ids, fp, body_digest(data))
    return append_field(end, b'"%s":{"ids":%s,"tokenizer":"%s","sig":"%s"}' % (_FIELD, ids, fp.encode(),
                                                                                sig.encode()))


def strip_client_copy(data: dict[str, Any]) -> bytes:
    """The body of a request whose client sent the field itself, without it (only the router's own ids may
    reach a rank); called only when ``FIELD in data``, so other bodies are passed on byte for byte."""
    del data[FIELD]
    return orjson.dumps(data)
