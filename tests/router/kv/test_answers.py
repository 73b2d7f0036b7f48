"""Tokenizing a streamed chat answer ahead of the conversation's next turn (lbd.router.kv.answers): the next
turn then finds the answer in the piece cache and its ids are exactly the whole prompt's; one-shot chats,
answers the client does not send back, long answers and a full thread pool are left alone. The default
model's real tokenizer and chat template; no server. ~1 s."""

from __future__ import annotations

import asyncio

from lbd.router.kv import answers
from lbd.router.kv.answers import AnswersAhead, answer_plan, conversational
from lbd.router.kv.tokenize import RouterTokenizer
from support import default_router_tokenizer as default_tokenizer

SYSTEM = "You answer questions about rivers. " * 20


def next_turn(answer: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How long?"},
                         {"role": "assistant", "content": answer}, {"role": "user", "content": "And wide?"}]}


def first_turn() -> dict:
    return {"messages": next_turn("")["messages"][:2]}


def whole(tok: RouterTokenizer, data: dict) -> list[int]:
    return tok.rust.encode(tok.render(data["messages"]), add_special_tokens=False).ids


async def warm_and_wait(ahead: AnswersAhead, tok: RouterTokenizer, data: dict, ids: list[int]) -> bool:
    started = ahead.warm(tok, data, ids)
    while ahead.running:
        await asyncio.sleep(0.005)
    return started


def test_a_warmed_answer_leaves_the_next_turn_only_its_question() -> None:
    tok = default_tokenizer()
    first = first_turn()
    plan = tok.plan_request(first)
    tok.fill(plan, tok.encode_missing(plan))  # the first turn, as the router tokenized it to route it
    answer = " The Nile is about 6,650 km long, give or take, depending on where one measures from."
    ids = tok.rust.encode(answer, add_special_tokens=False).ids  # what the rank streamed
    assert asyncio.run(warm_and_wait(AnswersAhead(), tok, first, ids))
    nxt = next_turn(tok.rust.decode(ids, skip_special_tokens=True))
    plan = tok.plan_request(nxt)
    assert plan is not None and plan.missing and all("wide" in t for t in plan.missing), plan.missing
    assert plan.missing_chars < 40  # the question's piece only
    tok.fill(plan, tok.encode_missing(plan))
    assert tok.assemble(plan) == whole(tok, nxt)


def test_an_answer_sent_back_otherwise_is_a_miss_and_nothing_else() -> None:
    tok = default_tokenizer()
    first = first_turn()
    ids = tok.rust.encode(" Rivers run to the sea, mostly.", add_special_tokens=False).ids
    assert asyncio.run(warm_and_wait(AnswersAhead(), tok, first, ids))
    edited = next_turn("Rivers run to the sea.")  # the client trimmed it
    plan = tok.plan_request(edited)
    assert any("Rivers run to the sea." in t for t in plan.missing)
    tok.fill(plan, tok.encode_missing(plan))
    assert tok.assemble(plan) == whole(tok, edited)


def test_what_is_not_warmed() -> None:
    tok = default_tokenizer()
    one_shot = first_turn()
    assert not conversational(one_shot, None)  # no session key, no earlier answer: never sent back
    assert conversational(one_shot, "s-1") and conversational(next_turn("Yes."), None)
    assert answer_plan(tok, one_shot, "") is None
    assert answer_plan(tok, {**one_shot, "continue_final_message": True}, "x") is None
    ahead = AnswersAhead()
    long = tok.rust.encode("word " * (answers.MAX_CHARS // 4), add_special_tokens=False).ids
    assert not asyncio.run(warm_and_wait(ahead, tok, one_shot, long))
    assert not asyncio.run(warm_and_wait(ahead, tok, one_shot, []))
    assert not asyncio.run(warm_and_wait(ahead, tok, one_shot, [0] * (answers.MAX_CHARS + 1)))

    async def flood() -> list[bool]:
        got = [ahead.warm(tok, one_shot, tok.rust.encode(f" Answer {i}.", add_special_tokens=False).ids)
               for i in range(answers.MAX_RUNNING + 2)]
        while ahead.running:
            await asyncio.sleep(0.005)
        return got

    got = asyncio.run(flood())
    assert got == [True] * answers.MAX_RUNNING + [False, False]  # work ahead of need, never a queue
    assert ahead.started == answers.MAX_RUNNING
