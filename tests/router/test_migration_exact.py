"""A stream resumed on another rank is exactly the unbroken one (lbd.router.migration), for what the other
migration tests leave out by setting ``max_tokens`` and ``ignore_eos``: a chat with no ``max_tokens`` (it runs
to the context, --max-model-len 512), a completion with none (16 tokens in all), a chat that ends on a stop
token, a greedy stream with a frequency penalty, logprobs with ``top_logprobs`` 0, a stream cut after its last
token, and structured outputs (a ``json_schema`` chat, a vLLM ``guided_regex`` completion): the new rank
advances the grammar over the output already sent, so the answer goes on where the grammar was; and streamed
tool calls (``tool_choice`` "required", a named function, "auto" read by the ``hermes`` parser): the chat goes
on as a chat on the new rank, whose parser (and forced grammar) picks up where the first one stopped.

Two real engine ranks of an 8-layer tiny Llama behind one `lbd route`, each behind an ``SseCut`` link. The
serving rank's link is cut (a TCP reset) right after an exact event: for the mid-answer cases the one that
brings the client's ``BREAK_AT``-th chunk with text, found in the unbroken run (the router excludes the failed
rank, so the stream goes on on the other rank, as after a kill; SIGKILLs of a rank and of its core mid-answer,
cmpl and chat, are test_migration.py's: a kill here cost a rank restart per test). Each answer is compared
with the unbroken run's: its text, one finish reason, one ``[DONE]``, no error event, its usage; each test
counts its own moves. The ranks
write compact JSON (--structured-outputs-config.disable_any_whitespace: random weights would otherwise spend
their tokens on whitespace).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from support import settled
from support.procs import free_port, spawn, stop, wait_http
from support.sse_cut import Cut, SseCut
from support.tiny import make_tiny_llama

MODEL = "tiny"
CONTEXT = 512
BREAK_AT = 40
PROMPT = "def add(a, b): return a + b # numbers 0123456789 and symbols"
MESSAGES = [{"role": "user", "content": "Count the numbers 0123456789 and add them."}]
# bounded, as real schemas are: random weights end it well past BREAK_AT tokens
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "temps", "sunny"],
          "properties": {"city": {"type": "string", "maxLength": 12},
                         "temps": {"type": "array", "minItems": 16, "maxItems": 16,
                                   "items": {"type": "integer", "minimum": -40, "maximum": 50}},
                         "sunny": {"type": "boolean"}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
CUT_IN_CALL = 20  # chunks with a delta: well inside the call's arguments (the tool tests)
ARGS = {"type": "object", "additionalProperties": False, "required": ["city", "temps"],
        "properties": {"city": {"type": "string", "maxLength": 12}, "temps": SCHEMA["properties"]["temps"]}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": ARGS}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
# random weights write no calls of their own: under "auto" a regex (vLLM lets it stand beside "auto") makes
# the model write content, then hermes markup that the rank's parser turns into a call
HERMES = (r'Hi[a-z ]{0,4}<tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}", '
          r'"temps": \[(-?[1-9]?[0-9], ){15}-?[1-9]?[0-9]\]\}\}</tool_call>')
TOOL_CHOICES: dict[str, dict[str, Any]] = {
    "required": {"tool_choice": "required", "parallel_tool_calls": False},  # one call: it ends
    "named": {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    "auto": {"tool_choice": "auto", "structured_outputs": {"regex": HERMES}},
}
FAST = ("--health-check-interval-s", "0.3", "--health-check-timeout-s", "1", "--health-failure-threshold",
        "1", "--scrape-interval-ms", "200", "--kv-events", "off", "--debug-headers")


class Rank:
    """One `python -m lbd.engine` behind an SseCut."""

    def __init__(self, model: Path, log: Path, number: int) -> None:
        self.model, self.log, self.number = model, log, number
        self.port = free_port()
        self.link = SseCut(self.port)
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()

    def start(self) -> None:
        self.ready.clear()
        argv = [sys.executable, "-m", "lbd.engine", "--host", "127.0.0.1", "--port", str(self.port),
                "--model", str(self.model), "--served-model-name", MODEL, "--kv-cache-memory-bytes", "64MiB",
                "--max-model-len", str(CONTEXT), "--data-parallel-rank", str(self.number),
                "--data-parallel-size", "2", "--structured-outputs-config.disable_any_whitespace", "true",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
        self.proc = spawn(argv, log=self.log)
        wait_http(f"http://127.0.0.1:{self.port}/health", timeout=180, proc=self.proc)
        self.ready.set()

    def close(self) -> None:
        self.link.close()
        if self.proc is not None:
            stop(self.proc)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Rank]]:
    # 8 layers, 512 wide: a cut after 40 tokens meets a rank still generating
    model = make_tiny_llama(tmp_path_factory.mktemp("model"), layers=8, hidden=512, heads=8, kv_heads=2,
                            intermediate=2048, max_pos=1024)
    logs = tmp_path_factory.mktemp("ranks")
    rs = [Rank(model, logs / f"rank{i}.log", i) for i in range(2)]
    threads = [threading.Thread(target=r.start) for r in rs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert all(r.ready.is_set() for r in rs), "a rank did not start"
        yield rs
    finally:
        for r in rs:
            r.close()


@pytest.fixture(scope="module")
def router(ranks: list[Rank], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    proc = spawn([sys.executable, "-m", "lbd", "route", "--host", "127.0.0.1", "--port", str(port),
                  "--upstreams", ",".join(r.link.url for r in ranks), *FAST],
                 log=tmp_path_factory.mktemp("router") / "router.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=60, proc=proc)
        yield url
    finally:
        stop(proc)


@pytest.fixture(autouse=True)
def all_ranks_serving(ranks: list[Rank], router: str) -> Iterator[None]:
    """Both ranks up and known to the router (ready again after a cut), links disarmed after."""
    deadline = time.monotonic() + 30
    while True:
        eps = httpx.get(router + "/router/status", timeout=5).json()["endpoints"]
        if len(eps) == 2 and all(e["state"] == "ready" for e in eps):
            break
        assert time.monotonic() < deadline, f"endpoints not all serving: {eps}"
        time.sleep(0.1)
    yield
    for r in ranks:
        r.link.disarm()


@pytest.fixture(scope="module")
def tool_runs(router: str, ranks: list[Rank]) -> Any:
    """The unbroken greedy tool chat for a tool choice, streamed once per module (two tests compare with
    "auto"'s)."""
    runs: dict[str, dict[str, Any]] = {}

    def run(choice: str) -> dict[str, Any]:
        if choice not in runs:
            runs[choice] = streamed(router, "chat", ranks, max_tokens=300, tools=TOOLS,
                                    **TOOL_CHOICES[choice])
        return runs[choice]

    return run


def moves(router: str) -> dict[str, int]:
    """Moves by outcome, over every reason."""
    got: dict[str, int] = {}
    for by in httpx.get(router + "/router/status", timeout=5).json()["migrations"]["moves"].values():
        for outcome, n in by.items():
            got[outcome] = got.get(outcome, 0) + n
    return got


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def streamed(router: str, kind: str, ranks: list[Rank], mark_at: int = BREAK_AT,
             **extra: Any) -> dict[str, Any]:
    """One streamed request (greedy, usage asked). A chat's tool-call deltas are gathered into ``calls`` as
    OpenAI's SDK does, and any that is not OpenAI's shape (a first delta without id, type and name; a later
    one with them) is noted in ``shapes``; ``event_at``: the event (counted as ``Cut`` counts them) of each
    chunk with text or tool-call deltas; ``at_mark``: the calls' arguments the client had at chunk
    ``mark_at``."""
    req: dict[str, Any] = {"model": MODEL, "temperature": 0, "stream": True,
                           "stream_options": {"include_usage": True}, **extra}
    if kind == "chat":
        req["messages"] = MESSAGES
    else:
        req["prompt"] = PROMPT
    got: dict[str, Any] = {"text": "", "done": 0, "errors": [], "usage": None, "finishes": [], "ids": set(),
                           "chunks": 0, "logprobs": [], "token_ids": [], "after_done": 0, "calls": [],
                           "shapes": [], "at_mark": None, "events": 0, "first_call": None, "event_at": []}
    url = router + ("/v1/chat/completions" if kind == "chat" else "/v1/completions")
    with httpx.stream("POST", url, json=req, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if got["done"]:
                got["after_done"] += 1
            if line == "data: [DONE]":
                got["done"] += 1
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                got["errors"].append(ev["error"]["message"])
                continue
            got["ids"].add(ev["id"])
            got["events"] += 1
            if ev.get("usage"):
                got["usage"] = ev["usage"]
            for c in ev["choices"]:
                text = c["text"] if kind == "cmpl" else c["delta"].get("content") or ""
                got["text"] += text
                got["token_ids"] += c.get("token_ids") or []
                if c.get("finish_reason") is not None:
                    got["finishes"].append(c["finish_reason"])
                lp = c.get("logprobs")
                if lp and kind == "chat":
                    got["logprobs"] += [(e["token"], e["logprob"], [t["token"] for t in e["top_logprobs"]])
                                        for e in lp["content"]]
                deltas = c["delta"].get("tool_calls") or [] if kind == "chat" else []
                for d in deltas:
                    gather_call(got, d)
                if deltas and got["first_call"] is None:
                    got["first_call"] = got["events"]
                if text or deltas:
                    got["chunks"] += 1
                    got["event_at"].append(got["events"])
                    if got["chunks"] == mark_at:
                        got["at_mark"] = [call["arguments"] for call in got["calls"]]
    return got


def cut_mid_answer(ranks: list[Rank], want: dict[str, Any], at: int = BREAK_AT) -> None:
    """Arm a cut of the next stream right after the event that brings its ``at``-th chunk with text or
    tool-call deltas (where the greedy ``want`` had it): the client has ``at`` chunks, the rank goes on."""
    assert len(want["event_at"]) > at, f"the unbroken answer has {len(want['event_at'])} chunks"
    cut = Cut(after=want["event_at"][at - 1])
    for r in ranks:
        r.link.arm(cut)


def gather_call(got: dict[str, Any], d: dict[str, Any]) -> None:
    calls, fn = got["calls"], d.get("function") or {}
    if d["index"] == len(calls):  # its first delta: id, type, name (and the arguments so far)
        if not (d.get("id") and d.get("type") == "function" and fn.get("name")):
            got["shapes"].append(f"a first delta without id, type or name: {d}")
        calls.append({"id": d.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments") or ""})
    elif d["index"] < len(calls):
        if "id" in d or "type" in d or "name" in fn:
            got["shapes"].append(f"id, type or name again: {d}")
        calls[d["index"]]["arguments"] += fn.get("arguments") or ""
    else:
        got["shapes"].append(f"a call out of order: {d}")


def assert_exact(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert not got["errors"], got["errors"]
    assert got["text"] == want["text"]
    assert got["finishes"] == want["finishes"] and len(got["finishes"]) == 1
    assert got["done"] == 1 and got["after_done"] == 0 and len(got["ids"]) == 1
    assert got["usage"] == want["usage"]


@pytest.mark.parametrize("end", ["eos", "context"])
def test_a_chat_with_no_max_tokens_ends_where_the_unbroken_one_does(router: str, ranks: list[Rank],
                                                                    end: str) -> None:
    """No max_tokens: the greedy answer to MESSAGES ends on EOS (351 tokens in); with ignore_eos it runs to
    the context (--max-model-len) and ends by length."""
    extra = {"ignore_eos": True} if end == "context" else {}
    want = streamed(router, "chat", ranks, **extra)
    if end == "context":
        assert want["finishes"] == ["length"] and want["usage"]["total_tokens"] == CONTEXT
    else:
        assert want["finishes"] == ["stop"] and want["usage"]["completion_tokens"] > BREAK_AT + 16
    cut_mid_answer(ranks, want)
    before = moves(router)
    got = streamed(router, "chat", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    print(f"chat, no max_tokens, ends by {end}: {got['usage']['completion_tokens']} tokens after a move, "
          f"{want['usage']['completion_tokens']} unbroken")
    assert_exact(got, want)


def test_a_chat_that_ends_on_its_stop_token_after_a_move_ends_there(router: str, ranks: list[Rank]) -> None:
    """A chat with no max_tokens that ends on a token (as on EOS): the token is one the unbroken answer has
    first well after the break."""
    ids = streamed(router, "chat", ranks, max_tokens=200, return_token_ids=True)["token_ids"]
    stop_id = next(t for i, t in enumerate(ids) if i >= BREAK_AT + 60 and t not in ids[:i])
    want = streamed(router, "chat", ranks, stop_token_ids=[stop_id])
    assert want["finishes"] == ["stop"] and want["usage"]["completion_tokens"] == ids.index(stop_id) + 1
    cut_mid_answer(ranks, want)
    before = moves(router)
    got = streamed(router, "chat", ranks, stop_token_ids=[stop_id])
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    assert_exact(got, want)


def test_a_greedy_stream_with_a_frequency_penalty_is_exact_after_a_move(router: str,
                                                                         ranks: list[Rank]) -> None:
    extra = {"max_tokens": 300, "frequency_penalty": 1.0}
    want = streamed(router, "cmpl", ranks, **extra)
    cut_mid_answer(ranks, want)
    before = moves(router)
    got = streamed(router, "cmpl", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    print(f"frequency_penalty 1.0: {len(got['text'])} characters resumed, {len(want['text'])} unbroken, "
          f"{want['usage']['completion_tokens']} tokens, {want['finishes']}")
    assert_exact(got, want)


def test_a_completion_with_no_max_tokens_gets_16_in_all(router: str, ranks: list[Rank]) -> None:
    want = streamed(router, "cmpl", ranks)
    assert want["usage"]["completion_tokens"] == 16 or want["finishes"] == ["stop"]
    cut = Cut(after=6)
    for r in ranks:
        r.link.arm(cut)  # 6 tokens in
    before = moves(router)
    got = streamed(router, "cmpl", ranks)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    assert_exact(got, want)


def test_chat_logprobs_with_top_logprobs_0_continue_with_no_alternatives(router: str,
                                                                          ranks: list[Rank]) -> None:
    extra = {"max_tokens": 40, "logprobs": True, "top_logprobs": 0}
    want = streamed(router, "chat", ranks, **extra)
    assert all(e[2] == [] for e in want["logprobs"]) and len(want["logprobs"]) == 40
    cut = Cut(after=15)
    for r in ranks:
        r.link.arm(cut)
    before = moves(router)
    got = streamed(router, "chat", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    assert_exact(got, want)
    assert [(t, alt) for t, _, alt in got["logprobs"]] == [(t, alt) for t, _, alt in want["logprobs"]]
    lps = [lp for _, lp, _ in want["logprobs"]]
    assert [lp for _, lp, _ in got["logprobs"]] == pytest.approx(lps, abs=1e-3)


@pytest.mark.parametrize("kind", ["cmpl", "chat"])
def test_a_stream_cut_after_its_finish_reason_is_finished_not_resumed(router: str, ranks: list[Rank],
                                                                      kind: str) -> None:
    extra = {"max_tokens": 20}
    want = streamed(router, kind, ranks, **extra)
    cut = Cut(finish=True)
    for r in ranks:
        r.link.arm(cut)  # the finish chunk arrives; the usage chunk and [DONE] never do
    before = moves(router)
    got = streamed(router, kind, ranks, **extra)
    assert sum(r.link.cuts for r in ranks) >= 1
    assert settled(lambda: delta(before, moves(router)), {"finished": 1}) == {"finished": 1}
    assert_exact(got, want)


def test_an_echoed_completion_is_resumed_with_its_prompt_once(router: str, ranks: list[Rank]) -> None:
    extra = {"max_tokens": 30, "echo": True}
    want = streamed(router, "cmpl", ranks, **extra)
    assert want["text"].startswith(PROMPT) and want["usage"]["completion_tokens"] == 30
    cut = Cut(after=10)
    for r in ranks:
        r.link.arm(cut)
    before = moves(router)
    got = streamed(router, "cmpl", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    assert_exact(got, want)


def test_a_json_schema_chat_cut_mid_answer_completes_on_another_rank(router: str, ranks: list[Rank]) -> None:
    """Issue 45, acceptance 2: the continuation carries ``response_format`` and the new rank starts the
    grammar past the output sent (started again, it would want a "{" there): valid JSON, the unbroken text."""
    extra = {"max_tokens": 300, "response_format": FORMAT}
    want = streamed(router, "chat", ranks, **extra)
    assert want["finishes"] == ["stop"] and want["chunks"] > BREAK_AT + 10, want
    jsonschema.validate(json.loads(want["text"], strict=False), SCHEMA)
    cut_mid_answer(ranks, want)
    before = moves(router)
    got = streamed(router, "chat", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    print(f"json_schema chat: {want['usage']['completion_tokens']} tokens, cut after {BREAK_AT}")
    assert_exact(got, want)
    jsonschema.validate(json.loads(got["text"], strict=False), SCHEMA)


def test_a_vllm_guided_field_is_resumed_with_its_grammar(router: str, ranks: list[Rank]) -> None:
    extra = {"max_tokens": 40, "guided_regex": "a[0-9]{60}"}  # started again, the grammar would want an "a"
    want = streamed(router, "cmpl", ranks, **extra)
    assert want["text"][0] == "a" and want["text"][1:].isdigit() and want["finishes"] == ["length"]
    cut = Cut(after=10)
    for r in ranks:
        r.link.arm(cut)
    before = moves(router)
    got = streamed(router, "cmpl", ranks, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    assert_exact(got, want)


@pytest.mark.parametrize("choice", list(TOOL_CHOICES))
def test_a_tool_call_stream_cut_mid_call_completes_on_another_rank(router: str, ranks: list[Rank],
                                                                   tool_runs: Any, choice: str) -> None:
    """The rank's stream is cut inside the call's arguments; the chat goes on as a chat on the other rank
    (``lbd_resumed_output_token_ids``), whose parser reads the text sent first: the client's call is the
    unbroken greedy run's, announced once, its arguments going on where they stopped, one finish reason
    (``tool_calls``; ``stop`` for a named function, as OpenAI says)."""
    extra = {"max_tokens": 300, "tools": TOOLS, **TOOL_CHOICES[choice]}
    want = tool_runs(choice)
    assert want["finishes"] == ["stop" if choice == "named" else "tool_calls"], want
    assert want["chunks"] > CUT_IN_CALL + 10 and not want["shapes"], want
    assert [c["name"] for c in want["calls"]] == ["get_weather"], want["calls"]
    args = json.loads(want["calls"][0]["arguments"])
    if choice != "auto":  # (the regex, not the tool's schema, wrote "auto"'s call)
        jsonschema.validate(args, ARGS)
    cut_mid_answer(ranks, want, CUT_IN_CALL)
    before = moves(router)
    got = streamed(router, "chat", ranks, mark_at=CUT_IN_CALL, **extra)
    assert settled(lambda: delta(before, moves(router)), {"resumed": 1}) == {"resumed": 1}
    cut = got["at_mark"]
    assert cut and 0 < len(cut[0]) < len(want["calls"][0]["arguments"]), cut  # cut inside the arguments
    print(f"{choice}: {want['usage']['completion_tokens']} tokens, cut with {len(cut[0])} characters of "
          f"arguments sent")
    assert_exact(got, want)  # the content ("auto": "Hi..."), one finish reason, one [DONE], the usage
    assert not got["shapes"], got["shapes"]
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (c["name"], c["arguments"]) for c in want["calls"]]


def test_an_auto_tool_stream_cut_at_the_edge_of_its_call_is_exact(router: str, ranks: list[Rank],
                                                                  tool_runs: Any) -> None:
    """Cuts a kill cannot time: right before the event that announces the call (the rank's parser holds the
    ``<tool_call>`` tag and the call's head, whose tokens the router does not have yet: the new rank
    generates them again) and right after it (the call announced, its arguments begun)."""
    extra = {"max_tokens": 300, "tools": TOOLS, **TOOL_CHOICES["auto"]}
    want = tool_runs("auto")
    assert want["first_call"] is not None and want["first_call"] > 2, want
    for after in (want["first_call"] - 1, want["first_call"]):
        cut = Cut(after=after)
        for r in ranks:
            r.link.arm(cut)
        before = moves(router)
        got = streamed(router, "chat", ranks, **extra)
        assert settled(lambda b=before: delta(b, moves(router)), {"resumed": 1}) == {"resumed": 1}, after
        assert_exact(got, want)
        assert not got["shapes"], got["shapes"]
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
            (c["name"], c["arguments"]) for c in want["calls"]], after
