"""Exact cache-aware routing: `lbd route` following the KV events of `lbd supervise` ranks (--device sim:
the real scheduler, KV-cache manager and publisher, a timed stand-in forward pass, the tiny model's
tokenizer and chat template).

- the router tokenizes chat and completion bodies exactly as the engine's /tokenize does;
- a new long prompt is routed on its head, and requests sharing it follow it to its rank; a flood of them is
  routed on heads without waiting for the tokenizer, and each next request still finds its prompt held;
- multi-turn chat stays on the rank that holds its history, and the decisions say how many blocks it holds,
  with two router workers that each follow the events themselves (and read the ranks' JSON /telemetry);
- each request goes to its rank with the router's token ids (the rank skips its template and tokenizer);
- a conversation's streamed answer is tokenized before the next turn sends it back (kv.answers);
- a tool chat's next turn (the assistant's call, the tool's answer, a new question) finds its first turn held
  (the ranks' template writes the tools and the call in the prompt, as real ones do);
- after a rank restarts its old prefixes are forgotten: with events (the publisher's disconnection clears
  the view at once) and with the approximate fallback (--kv-events off; the new pid clears it).
One node for the module (~5 s to start), a router per test; ~40 s in all.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from lbd.common.internal_key import INTERNAL_KEY_ENV
from lbd.router.kv.tokenize import RouterTokenizer
from support import metric_value
from support.node import SupervisorNode

pytestmark = pytest.mark.slow
MODEL = "tiny"
EVENTS = json.dumps(
    {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": "tcp://*:0",
        "replay_endpoint": "tcp://*:0",
    }
)
FAST = (
    "--scrape-interval-ms",
    "100",
    "--health-check-interval-s",
    "0.5",
    "--health-check-timeout-s",
    "1",
    "--supervisor-poll-interval-s",
    "0.2",
    "--debug-headers",
)
SYSTEM = "You are a careful assistant who answers questions about rivers, lakes and the sea. " * 6
# the tiny model's ChatML (plain chats render the same) with tools in a system turn and calls as hermes markup
TOOL_CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
    "{% for c in message.tool_calls or [] %}{{ '<tool_call>\\n{\"name\": \"' + c['function']['name'] + "
    "'\", \"arguments\": ' + c['function']['arguments'] + '}\\n</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "required": ["city"],
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
TOOL_TURN = [{"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 3}'}]


@pytest.fixture(scope="module", autouse=True)
def internal_key() -> Iterator[None]:
    """The ranks and the routers share an internal key (inherited), so the routers' ids are taken."""
    os.environ[INTERNAL_KEY_ENV] = secrets.token_urlsafe(32)
    try:
        yield
    finally:
        os.environ.pop(INTERNAL_KEY_ENV, None)


@pytest.fixture(scope="module")
def node(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SupervisorNode]:
    log = tmp_path_factory.mktemp("kv-node") / "supervise.log"
    n = SupervisorNode(
        tiny_llama,
        2,
        "--served-model-name",
        MODEL,
        "--device",
        "sim",
        "--sim-profile",
        "h100-llama3-8b",
        "--kv-cache-memory-bytes",
        "8GiB",  # sim: bookkeeping only; room for every prompt the tests send (65k tokens a rank)
        "--max-model-len",
        "8192",
        "--kv-events-config",
        EVENTS,
        "--chat-template",
        TOOL_CHATML,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        interval=0.3,
        timeout=1.0,
        threshold=3,
        log=log,
    )
    try:
        n.wait_ready(timeout=120)
        yield n
    finally:
        n.close()


async def router_for(node: SupervisorNode, start_router, *extra: str):
    r = start_router("--upstreams", f"supervisor://127.0.0.1:{node.sport}", *FAST, *extra)
    await r.wait(timeout=60)
    await until(
        r,
        lambda st: (
            all(e["state"] == "ready" and e["models"] for e in st["endpoints"]) and len(st["endpoints"]) == 2
        ),
        "both ranks ready",
    )
    return r


async def until(r, pred, what: str, timeout: float = 30.0) -> dict:
    t0 = time.monotonic()
    while True:
        st = await r.status()
        if pred(st):
            return st
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}: {st}"
        await asyncio.sleep(0.05)


def exact_everywhere(st: dict) -> bool:
    return all(e["kv_events"]["mode"] == "exact" for e in st["endpoints"])


async def chat(c: httpx.AsyncClient, url: str, messages: list[dict]) -> tuple[str, str, str]:
    resp = await c.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 8}
    )
    assert resp.status_code == 200, resp.text
    return (
        resp.headers["x-lbd-endpoint"],
        resp.headers["x-lbd-route-reason"],
        resp.json()["choices"][0]["message"]["content"],
    )


async def conversation(c: httpx.AsyncClient, url: str, turns: int, tag: str) -> list[tuple[str, str]]:
    msgs = [{"role": "system", "content": f"{tag}. {SYSTEM}"}]
    out = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"Question {t}: how deep is lake number {t * 7}?"})
        endpoint, reason, text = await chat(c, url, msgs)
        msgs.append({"role": "assistant", "content": text})
        out.append((endpoint, reason))
    return out


def test_router_tokenizes_like_the_engine(node: SupervisorNode) -> None:
    url = node.rank_url(0)
    info = httpx.get(url + "/tokenizer_info").json()
    tok = RouterTokenizer(httpx.get(url + "/tokenizer.json").text, info)
    assert node.rank(0)["kv_event_sources"]["0"]["enable_kv_cache_events"] is True  # the supervisor's copy
    bodies = [
        {"messages": [{"role": "user", "content": "hi"}]},
        {
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": "a <|im_end|> b"},
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "  spaced  \n\n out"},
            ]
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}],
                }
            ],
            "add_generation_prompt": False,
        },
        {"messages": [{"role": "user", "content": "Weather?"}, *TOOL_TURN], "tools": TOOLS},
        {"prompt": "The capital of France is"},
        {"prompt": "no specials", "add_special_tokens": False},
    ]
    for body in bodies:
        plan = tok.plan_request(body)
        tok.fill(plan, tok.encode_missing(plan))
        engine = httpx.post(url + "/tokenize", json={"model": MODEL, **body}).json()["tokens"]
        assert tok.assemble(plan) == engine, body


async def test_multi_turn_stays_on_the_rank_that_holds_it(node: SupervisorNode, start_router) -> None:
    r = await router_for(node, start_router, "--workers", "2")
    await until(r, exact_everywhere, "exact views")
    async with httpx.AsyncClient(timeout=60) as c:
        turns = await conversation(c, r.url, 4, "River")
        home = turns[0][0]
        assert all(e == home for e, _ in turns), turns
        assert all(reason.startswith("prefix_hit") for _, reason in turns[1:]), turns
        cached = [int(reason.split(" uncached, ")[1].split(" blocks")[0]) for _, reason in turns[1:]]
        assert cached == sorted(cached) and cached[0] > 0, turns  # the history grows, and is held
        for _ in range(8):  # each worker follows the events itself: every answer says the same
            st = await r.status()
            held = {e["url"]: e["kv_events"]["blocks"] for e in st["endpoints"]}
            assert exact_everywhere(st) and held[home] > 0, st
            # each worker reads the ranks' load from the JSON /telemetry their /metrics advertises
            assert all(e["telemetry"] == "/telemetry" for e in st["endpoints"]), st
            assert all(e["scrape_age_s"] < 1.0 for e in st["endpoints"]), st


async def test_the_router_sends_the_ranks_its_token_ids(node: SupervisorNode, start_router) -> None:
    """Each turn reaches its rank with the router's token ids, which the rank runs instead of rendering and
    tokenizing the history again (lbd.engine.server.forwarded): the same prompt as sent straight to a rank."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")

    def outcome(name: str) -> float:
        return sum(
            metric_value(httpx.get(node.rank_url(k) + "/metrics").text, "lbd:forwarded_prompts_total",
                         outcome=name)
            for k in range(2)
        )

    used = outcome("used")
    msgs = [{"role": "system", "content": f"Delta. {SYSTEM}"}, {"role": "user", "content": "How wide?"}]
    async with httpx.AsyncClient(timeout=60) as c:
        body = {"model": MODEL, "messages": msgs, "max_tokens": 4}
        routed = (await c.post(r.url + "/v1/chat/completions", json=body)).json()
        direct = (await c.post(node.rank_url(0) + "/v1/chat/completions", json=body)).json()
        assert routed["usage"]["prompt_tokens"] == direct["usage"]["prompt_tokens"], (routed, direct)
        await conversation(c, r.url, 3, "Estuary")
        tools = {**body, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}
        assert (await c.post(r.url + "/v1/chat/completions", json=tools)).status_code == 200
    assert outcome("used") - used == 4  # the first request and 3 turns; not the one with tools
    assert outcome("mismatch") == 0 and outcome("other_tokenizer") == 0
    st = await r.status()
    assert sum(e["kv_events"]["forwarded_ids"] for e in st["endpoints"]) == 4, st
    off = await router_for(node, start_router, "--no-forward-prompt-ids")
    await until(off, exact_everywhere, "exact views")
    async with httpx.AsyncClient(timeout=60) as c:
        assert (await c.post(off.url + "/v1/chat/completions", json=body)).status_code == 200
    assert outcome("used") - used == 4
    st = await off.status()
    assert sum(e["kv_events"]["forwarded_ids"] for e in st["endpoints"]) == 0, st


async def test_a_tool_chats_next_turn_finds_its_first_turn_held(node: SupervisorNode, start_router) -> None:
    """Issue 45: the exact view renders a chat with tools as the rank does, so turn 2 (the assistant's call,
    the tool's answer, a new question) is routed to the rank that computed turn 1, with all of turn 1's
    prompt blocks held there (the blocks of its prompt; the rank's own answer is not what turn 2 sends)."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")
    msgs = [{"role": "system", "content": f"Tarn. {SYSTEM}"}, {"role": "user", "content": "Weather in Oslo?"}]
    body = {"model": MODEL, "tools": TOOLS, "tool_choice": "auto", "max_tokens": 8}
    async with httpx.AsyncClient(timeout=60) as c:
        first = await c.post(r.url + "/v1/chat/completions", json={**body, "messages": msgs})
        assert first.status_code == 200, first.text
        prompt = first.json()["usage"]["prompt_tokens"]
        msgs += [*TOOL_TURN, {"role": "user", "content": "And tomorrow?"}]
        second = await c.post(r.url + "/v1/chat/completions", json={**body, "messages": msgs})
        assert second.status_code == 200, second.text
    why = second.headers["x-lbd-route-reason"]
    assert second.headers["x-lbd-endpoint"] == first.headers["x-lbd-endpoint"], why
    assert why.startswith("prefix_hit"), why
    held = int(why.split(" uncached, ")[1].split(" blocks")[0])
    assert held == prompt // 16 and held > 0, (why, prompt)  # every whole block of turn 1's prompt


async def streamed_chat(
    c: httpx.AsyncClient, url: str, messages: list[dict], session: str
) -> tuple[str, int]:
    """(the streamed answer's text, the prompt's tokens from its usage)."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}
    text, prompt_tokens = "", 0
    headers = {"X-Session-ID": session} if session else {}
    async with c.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "token_ids" not in line, line  # the router asked for them; the client did not
                text += "".join(ch["delta"].get("content") or "" for ch in chunk["choices"])
                prompt_tokens = (chunk.get("usage") or {}).get("prompt_tokens", prompt_tokens)
    return text, prompt_tokens


async def test_a_streamed_answer_is_tokenized_before_the_next_turn(
    node: SupervisorNode, start_router
) -> None:
    """A conversation's answer, once streamed, is tokenized by the router before the next turn sends it back
    (lbd.router.kv.answers); that turn's prompt is the one the rank itself would make of it."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")
    msgs = [{"role": "system", "content": f"Fjord. {SYSTEM}"}, {"role": "user", "content": "How deep?"}]
    async with httpx.AsyncClient(timeout=60) as c:
        await streamed_chat(c, r.url, msgs, "")  # no session key
        st = await r.status()
        assert st["kv_index"]["answers_tokenized_ahead"] == 0, st  # a one-shot answer is never sent back
        for turn in range(3):
            answer, _ = await streamed_chat(c, r.url, msgs, "fjord-1")
            assert answer, "the sim rank always answers"
            await until(r, lambda st, n=turn + 1: st["kv_index"]["answers_tokenized_ahead"] == n,
                        "the answer tokenized ahead")
            msgs += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"And {turn}?"}]
        _, via_router = await streamed_chat(c, r.url, msgs, "fjord-1")
        direct = (await c.post(node.rank_url(0) + "/v1/chat/completions",
                               json={"model": MODEL, "messages": msgs, "max_tokens": 1})).json()
    assert via_router == direct["usage"]["prompt_tokens"], (via_router, direct)


async def test_a_new_long_prompt_is_routed_before_it_is_tokenized(node: SupervisorNode, start_router) -> None:
    """A cold 5,000-character system prompt: the router reads its head, sees no rank holds even that, and
    sends it at once (the whole text is tokenized meanwhile); a second request with that prompt, sent
    right behind it, still finds the rank computing it: the prefix pending there, behind that whole prefill,
    so it is computed again on an idle rank, as soon (``prefix_wait``, issue 42), unless the first had
    started by then (a hit); a third, later, finds it cached where they went."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")
    system = " ".join(f"Note {i}. You are a careful assistant who answers about rivers." for i in range(70))
    assert len(system) > 4096  # lookup.OFFLOAD_CHARS: a text this long is tokenized off the event loop

    def msgs(q: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    async with httpx.AsyncClient(timeout=60) as c:
        first = asyncio.ensure_future(chat(c, r.url, msgs("How long is river 3?")))
        await asyncio.sleep(0.002)  # behind the first one, most likely while its text is tokenized
        (home, why, _), (second, why2, _) = await asyncio.gather(first, chat(c, r.url, msgs("And river 4?")))
        third, why3, _ = await chat(c, r.url, msgs("And river 5?"))
    assert "0 blocks cached" in why and why.startswith("lowest_ttft"), why
    if second == home:
        assert why2.startswith("prefix_hit"), why2
    else:
        assert why2.startswith("prefix_wait"), (why2, home, second)
    assert third in (home, second) and why3.startswith("prefix_hit"), why3  # (both hold it then)
    held = [int(w.split(" uncached, ")[1].split(" blocks")[0]) for w in (why2, why3) if "prefix_hit" in w]
    assert min(held) * 16 > 1000, held  # the whole system prompt, not only the head's ~250 tokens
    st = await r.status()
    early = {e["url"]: e["kv_events"]["routed_on_head"] for e in st["endpoints"]}
    assert early[home] == 1 and sum(early.values()) == 1, early  # only the first was new everywhere


async def test_a_new_prompt_that_opens_like_a_cached_one_is_routed_on_its_long_head(
    node: SupervisorNode, start_router
) -> None:
    """Two long system prompts open with the same ~600 characters: the second one's short head is held where
    the first was computed, so the router reads its long head, sees the rest held nowhere, and routes it at
    once all the same, with the shared opening counted as cached there."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")
    opening = " ".join(f"Rule {i}: be brief about rivers." for i in range(20))

    def msgs(k: int) -> list[dict]:
        system = opening + " " + " ".join(f"Tenant {k} note {i}. You answer about lakes." for i in range(90))
        assert len(system) > 4096  # lookup.OFFLOAD_CHARS
        return [{"role": "system", "content": system}, {"role": "user", "content": "How deep?"}]

    async with httpx.AsyncClient(timeout=60) as c:
        home, why, _ = await chat(c, r.url, msgs(1))
        await asyncio.sleep(0.3)  # the rank's events for its blocks
        other, why2, _ = await chat(c, r.url, msgs(2))
    st = await r.status()
    early = sum(e["kv_events"]["routed_on_head"] for e in st["endpoints"])
    assert early == 2, st  # the second one too, although its short head was held
    assert "0 blocks cached" in why, why
    if other == home:  # the opening, not more: the rest of the second prompt is new everywhere
        uncached, held = why2.split(" tok/s, ")[1].split(" blocks")[0].split(" uncached, ")
        assert 4 * 16 <= int(held) * 16 < int(uncached) / 4, why2


async def test_a_flood_of_new_prompts_is_routed_on_heads_and_tokenized_on_second_sight(
    node: SupervisorNode, start_router
) -> None:
    """Twelve new long system prompts at once: past cold.MAX_BACKGROUND (2) running tokenizations the router
    routes them on their heads and leaves their texts untokenized (``head_only``). Nothing is lost: each
    prompt's next request goes to the rank that computed it and sees the whole prompt held there (its rank's
    events announced the blocks; that request tokenized the text itself)."""
    r = await router_for(node, start_router)
    await until(r, exact_everywhere, "exact views")

    def msgs(k: int, q: str) -> list[dict]:
        system = " ".join(f"Flood {k} note {i}. You are a careful assistant about lakes." for i in range(90))
        assert len(system) > 4096  # lookup.OFFLOAD_CHARS
        return [{"role": "system", "content": system}, {"role": "user", "content": q}]

    async with httpx.AsyncClient(timeout=60) as c:
        firsts = await asyncio.gather(*(chat(c, r.url, msgs(k, "How deep?")) for k in range(12)))
        st = await r.status()
        head_only = sum(e["kv_events"]["head_only"] for e in st["endpoints"])
        early = sum(e["kv_events"]["routed_on_head"] for e in st["endpoints"])
        assert early == 12 and 1 <= head_only <= 10, st  # the 2 first ones at least were tokenized
        await asyncio.sleep(0.3)  # the ranks' events for the last blocks
        seconds = [await chat(c, r.url, msgs(k, "And how wide?")) for k in range(12)]
    for (home, why, _), (again, why2, _) in zip(firsts, seconds, strict=True):
        assert "0 blocks cached" in why, why
        assert again == home and why2.startswith("prefix_hit"), (why2, home, again)
        held = int(why2.split(" uncached, ")[1].split(" blocks")[0])
        assert held * 16 > 1000, why2  # the whole system prompt, not only the head's ~250 tokens


@pytest.mark.parametrize("events", ["auto", "off"])
async def test_a_restarted_rank_loses_its_prefixes(node: SupervisorNode, start_router, events: str) -> None:
    r = await router_for(node, start_router, "--kv-events", events)
    if events == "auto":
        await until(r, exact_everywhere, "exact views")
    async with httpx.AsyncClient(timeout=60) as c:
        msgs = [
            {"role": "system", "content": f"Lake {events}. {SYSTEM}"},
            {"role": "user", "content": "hello"},
        ]
        home, _, _ = await chat(c, r.url, msgs)
        again, reason, _ = await chat(c, r.url, msgs)
        assert again == home and reason.startswith("prefix_hit"), reason
        rank = int(home.rsplit(":", 1)[1]) - node.base_port
        old_pid = node.rank(rank)["pid"]
        t_kill = time.monotonic()
        node.signal_rank(rank, signal.SIGKILL)
        if events == "auto":  # the publisher's disconnection clears the view within an event interval
            await until(
                r,
                lambda st: next(e for e in st["endpoints"] if e["url"] == home)["kv_events"]["blocks"] == 0,
                "the dead rank's view cleared",
                timeout=5.0,
            )
            assert time.monotonic() - t_kill < 5.0
        node.wait_for(
            lambda: node.rank(rank)["state"] == "ready" and node.rank(rank)["pid"] != old_pid,
            60,
            "the rank back",
        )
        st = await until(
            r,
            lambda st: next(e for e in st["endpoints"] if e["url"] == home)["state"] == "ready",
            "the router re-admits it",
        )
        if events == "auto":
            assert next(e for e in st["endpoints"] if e["url"] == home)["kv_events"]["blocks"] == 0
        endpoint, reason, _ = await chat(c, r.url, msgs)  # nobody holds it now
        assert cached_of(reason) == 0, (endpoint, reason)
        again, reason, _ = await chat(c, r.url, msgs)  # and now the rank that served it does
        assert again == endpoint and cached_of(reason) > 0, reason


def cached_of(reason: str) -> int:
    """The blocks (or text chunks) the decision counted as cached where it sent the request."""
    return int(reason.rsplit(" uncached, ", 1)[1].split(" ", 1)[0])
