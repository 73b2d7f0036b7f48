"""Property tests (hypothesis) of the router's request parsing: any body and any pin header give request
facts or a BadRequest (a 400), never another exception, and the pin follows the engine's own rule."""

from __future__ import annotations

import orjson
from hypothesis import given
from hypothesis import strategies as st

from lbd.common.rank_header import RankHeaderError, parse_rank
from lbd.router.facts import BadRequest, parse_facts
from lbd.router.messages import Headers
from support.hostile import PROPERTY, bodies

header_values = st.binary(max_size=16) | st.from_regex(rb"[ \t]*[0-9]{1,4}[ \t]*", fullmatch=True)


@PROPERTY
@given(st.binary(max_size=400) | bodies().map(orjson.dumps) | bodies(required="messages").map(orjson.dumps),
       st.lists(header_values, max_size=2), st.binary(max_size=8) | st.none())
def test_any_body_and_pin_give_facts_or_a_400(body: bytes, pins: list[bytes], session: bytes | None) -> None:
    raw = [(b"X-data-parallel-rank", v) for v in pins] + ([(b"X-Session-ID", session)] if session else [])
    headers = Headers(raw)
    try:
        facts = parse_facts(body, headers, "X-Session-ID")
    except BadRequest as e:
        assert e.message
        return
    assert facts.prompt_tokens >= 0 and len(facts.prefix_hashes) <= 256
    assert facts.model is None or isinstance(facts.model, str)
    try:  # the pin the router acts on is the one the engine would accept
        engine_pin = parse_rank([v.decode("latin-1") for v in pins])
    except RankHeaderError:
        raise AssertionError(f"router accepted a pin the engine refuses: {pins!r}") from None
    assert facts.pinned_rank == engine_pin
