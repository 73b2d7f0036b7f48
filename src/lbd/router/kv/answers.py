"""Tokenize a streamed chat answer when its stream ends: the conversation's next turn sends it back.

A multi-turn chat resends its whole history every turn. The piece cache (``kv.tokenize``) holds every earlier
piece, but the answer the last turn got is new text to the router, and tokenizing it inline is most of what a
warm turn costs the router before dispatch (benchmarks/RESULTS.md, "Answers ahead"). The router has the
answer's token ids as the stream ends (the tracking pump asks every rank for them: ``lbd.router.resumable``),
so it decodes them, renders the conversation as its next turn will render it (the answer as an assistant
message, then a user message), and tokenizes the pieces that hold the answer in a thread, off the event loop;
the next turn finds them in the cache and tokenizes only its new question.

Only for conversations (an assistant message already in the history, or a session key): a one-shot answer is
never sent back, and its tokenization would be spent for nothing. At most ``MAX_RUNNING`` run at a time and
answers over ``MAX_CHARS`` are left to the next turn: this is work ahead of need, never a queue. A guess
that misses (the client sends back other text: a stop string cut, an edited answer, a template that renders
the last answer unlike an earlier one) costs that tokenization and nothing else: the next turn tokenizes
its own text as before, and the cache drops the unused piece in its LRU order. So does a next turn that
reaches another router worker (``--workers``: the kernel spreads connections), whose cache is its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from lbd.router.kv.tokenize import NotTokenizable, Plan, RouterTokenizer

MAX_RUNNING = 2  # answers being tokenized at once (past it, the next turn tokenizes its answer itself)
MAX_CHARS = 32_768  # longer answers are left to the next turn
_NEXT_QUESTION = "?"  # the next turn's question is not known: a stand-in, never cached


def conversational(data: dict[str, Any], session: str | None) -> bool:
    """Whether this chat's answer will likely be sent back: a session key, or an earlier answer in it."""
    if session:
        return True
    messages = data.get("messages")
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" for m in messages
    )


def answer_plan(tok: RouterTokenizer, data: dict[str, Any], answer: str) -> Plan | None:
    """The pieces of the next turn's prompt that hold ``answer`` and are not cached yet, as a plan of their
    own (None: nothing to tokenize, or the request is not one we render the same way twice)."""
    messages = data.get("messages")
    if not (tok.by_pieces and answer and isinstance(messages, list)) or data.get("continue_final_message"):
        return None
    kwargs = data.get("chat_template_kwargs")
    nxt = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": _NEXT_QUESTION}]
    try:
        text = tok.render(nxt, True, False, data.get("tools"), kwargs if isinstance(kwargs, dict) else None)
    except NotTokenizable:
        return None
    full = tok.plan_text(text, False)
    mine = [t for t in full.missing if answer in t]
    return Plan(pieces=list(mine), missing=mine) if mine else None


class AnswersAhead:
    """One router worker's answer tokenizations in flight."""

    def __init__(self) -> None:
        self.running = 0
        self.started = 0  # answers tokenized ahead (for tests and /router/status)

    def warm(self, tok: RouterTokenizer, data: dict[str, Any], ids: Sequence[int]) -> bool:
        """Tokenize the answer ``ids`` decode to, for the next turn, in a thread; False when it is not."""
        if self.running >= MAX_RUNNING or not 0 < len(ids) <= MAX_CHARS:  # (not decoded: it is on the loop)
            return False
        answer = tok.rust.decode(list(ids), skip_special_tokens=True)
        if len(answer) > MAX_CHARS:
            return False
        plan = answer_plan(tok, data, answer)
        if plan is None:
            return False
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(None, tok.encode_missing, plan, True)
        self.running += 1
        self.started += 1

        def done(j: asyncio.Future[list[Sequence[int]]]) -> None:
            self.running -= 1
            if not j.cancelled() and j.exception() is None:
                tok.fill(plan, j.result())

        job.add_done_callback(done)
        return True
