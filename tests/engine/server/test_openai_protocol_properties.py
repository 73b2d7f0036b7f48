"""Property tests (hypothesis) of the engine's OpenAI request parsing: whatever JSON arrives, the parser
either refuses it with a 4xx naming the problem or produces a request the core can carry (every number fits
msgpack and the core's ranges, every token id is in the vocabulary). Nothing else, never a 500."""

from __future__ import annotations

import re

from hypothesis import given
from hypothesis import strategies as st

from lbd.common.rank_header import RankHeaderError, parse_rank
from lbd.engine.server.errors import APIError
from lbd.engine.server.openai_protocol import Limits, parse_chat, parse_completion
from lbd.wire.core_messages import EngineCoreRequest, encode
from support.hostile import PROPERTY, bodies

LIMITS = Limits(max_model_len=512, max_logprobs=5, vocab_size=384, max_prompt_chars=512 * 8)
INT64 = (-(2**63), 2**63 - 1)


def _parsed(parse, body: object):
    """The parsed request, or None after checking the refusal is a 4xx with a message."""
    try:
        return parse(body, LIMITS)
    except APIError as e:
        assert 400 <= e.status < 500 and e.message
        return None


def _checked(params) -> None:
    sp = params.sampling
    assert 1 <= params.n <= 128 and sp.n == params.n
    assert sp.temperature >= 0 and 0 < sp.top_p <= 1 and 0 <= sp.min_p <= 1
    assert 0 <= sp.top_k < 2**31 and sp.min_tokens >= 0
    assert sp.seed is None or INT64[0] <= sp.seed <= INT64[1]
    assert all(0 <= t < LIMITS.vocab_size for t in sp.stop_token_ids)
    assert params.logprobs is None or 0 <= params.logprobs <= LIMITS.max_logprobs
    assert params.max_tokens is None or params.max_tokens >= 1


@PROPERTY
@given(bodies())
def test_completion_parsing_refuses_with_4xx_or_yields_a_core_request(body: object) -> None:
    req = _parsed(parse_completion, body)
    if req is None:
        return
    _checked(req.common)
    assert req.prompts
    for p in req.prompts:
        if isinstance(p, list):
            assert p and all(0 <= t < LIMITS.vocab_size for t in p) and len(p) < LIMITS.max_model_len
            encode(EngineCoreRequest("r", p, req.common.sampling, 2, 0.0))  # msgpack can carry it
        else:
            assert isinstance(p, str) and len(p) <= LIMITS.max_prompt_chars


@PROPERTY
@given(bodies(required="messages"))
def test_chat_parsing_refuses_with_4xx_or_yields_a_core_request(body: object) -> None:
    req = _parsed(parse_chat, body)
    if req is None:
        return
    _checked(req.common)
    assert req.messages and all(isinstance(m["content"], str) for m in req.messages)
    assert sum(len(m["content"]) for m in req.messages) <= LIMITS.max_prompt_chars
    encode(EngineCoreRequest("r", [1, 2], req.common.sampling, 2, 0.0))


_CANONICAL = re.compile(r"(0|[1-9][0-9]{0,8})")


@PROPERTY
@given(st.lists(st.text(max_size=12) | st.from_regex(r"[ \t]*[0-9]{1,3}[ \t]*", fullmatch=True), min_size=1,
                max_size=2))
def test_rank_header_accepts_exactly_plain_integers(values: list[str]) -> None:
    try:
        rank = parse_rank(values)
    except RankHeaderError:
        assert len(values) > 1 or not _CANONICAL.fullmatch(values[0].strip(" \t"))
        return
    assert len(values) == 1 and _CANONICAL.fullmatch(values[0].strip(" \t"))
    assert rank == int(values[0])
