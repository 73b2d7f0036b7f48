"""Where a continuation may go (lbd.router.migration ``_unfit``), on the router's real state: only ranks
whose tokenizer is the first rank's (the ``lbd_tokenizer`` fingerprint of their /v1/models card), whose
context holds the answer, and, for a penalised or structured stream, only lbd's engine (a vLLM first rank's is
not resumed, the reason says why). And where the first rank's card was
not known when the stream began, it is read at the move."""

from __future__ import annotations

from lbd.router.config import parse_args
from lbd.router.continuation import RankFacts
from lbd.router.endpoints import Endpoint
from lbd.router.migration import Migrator
from lbd.router.resumable import Move
from lbd.router.shared import SharedCounters
from lbd.router.state import RouterState

URLS = [f"http://127.0.0.1:{port}" for port in (1, 2, 3, 4, 5)]


def card(engine: str, fp: str | None, ctx: int = 512, root: str = "/m") -> list[dict]:
    c = {"id": "m", "owned_by": engine, "root": root, "max_model_len": ctx}
    return [c | {"lbd_tokenizer": fp} if fp else c]


async def test_a_continuation_goes_only_where_the_ids_mean_the_same() -> None:
    cfg = parse_args(["--upstreams", ",".join(URLS), "--kv-events", "off"])
    state = RouterState(cfg, SharedCounters(1, 16))
    for rank, url in enumerate(URLS):
        state.add(url, "static", rank)
    try:
        a, same_short, upgraded, vllm, vllm2 = (state.endpoints[u] for u in URLS)
        a.model_cards, same_short.model_cards = card("lbd", "f1"), card("lbd", "f1", ctx=256)
        upgraded.model_cards, vllm.model_cards = card("lbd", "f2"), card("vllm", None)
        vllm2.model_cards = card("vllm", None)
        mig = Migrator(state)
        move = Move("chat", {"model": "m", "messages": []}, False, None)
        move.origin = RankFacts("lbd", "/m", 512, "f1")
        assert mig._unfit(move, 100) == [upgraded.url, vllm.url, vllm2.url]
        short = [same_short.url, upgraded.url, vllm.url, vllm2.url]
        assert mig._unfit(move, 512) == short  # a context too short for the answer, too
        # a first rank with no fingerprint (vLLM): ranks with none either, same engine and model
        move.origin = RankFacts("vllm", "/m", 512, None)
        assert mig._unfit(move, 100) == [a.url, same_short.url, upgraded.url]
        penalised = Move("cmpl", {"model": "m", "prompt": "p", "frequency_penalty": 1.0}, False, None)
        penalised.origin = RankFacts("lbd", "/m", 512, "f1")
        assert mig._unfit(penalised, 100) == [upgraded.url, vllm.url, vllm2.url]
        schema = Move("chat", {"model": "m", "messages": [], "response_format": {"type": "json_object"}},
                      False, None)
        schema.origin, schema._prompt_ids = RankFacts("lbd", "/m", 512, "f1"), [1, 2]
        assert mig._unfit(schema, 100) == [upgraded.url, vllm.url, vllm2.url]
        assert mig._why_not(schema) == (None, "")
        schema.origin = RankFacts("vllm", "/m", 512, None)  # vLLM cannot advance a grammar over sent tokens
        why, outcome = mig._why_not(schema)
        assert outcome == "impossible" and "response_format json_object" in why and "lbd's engine" in why
        tools = [{"type": "function", "function": {"name": "f"}}]  # goes on as a chat: lbd ranks only
        tool = Move("chat", {"model": "m", "messages": [], "tools": tools}, False, None)
        tool.origin, tool._prompt_ids = RankFacts("lbd", "/m", 512, "f1"), [1, 2]
        assert mig._unfit(tool, 100) == [upgraded.url, vllm.url, vllm2.url]
        assert mig._why_not(tool) == (None, "")
        tool.origin = RankFacts("vllm", "/m", 512, None)
        why, outcome = mig._why_not(tool)
        assert outcome == "impossible" and "tools" in why and "lbd's engine" in why
    finally:
        for url in URLS:
            state.remove(url)


def test_the_first_ranks_card_is_read_at_the_move_when_it_was_not_known() -> None:
    ep = Endpoint(URLS[0], "static", 0)
    move = Move("chat", {"model": "m", "messages": []}, False, None)
    move._origin_ep = ep  # (set by the first relay)
    assert move.origin_facts() is None
    ep.model_cards = card("lbd", "f1")
    assert move.origin_facts() == RankFacts("lbd", "/m", 512, "f1")
    ep.model_cards = card("lbd", "f2")  # a restart with another model does not change what made the ids
    assert move.origin_facts() == RankFacts("lbd", "/m", 512, "f1")
