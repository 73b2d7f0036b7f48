"""The tracking of one resumable stream (no processes): token ids counted and stripped, a retryable error
event, and a continuation's chunks rewritten as the original stream's."""

from __future__ import annotations

import json
from typing import Any

from lbd.router.resumable import Move


def ev(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_a_stream_is_tracked_and_its_token_ids_stripped() -> None:
    m = Move("cmpl", {"prompt": "p", "max_tokens": 5}, False, None)
    first = ev({"id": "c1", "created": 7, "model": "m", "choices": [
        {"index": 0, "text": "ab", "prompt_token_ids": [1, 2], "token_ids": [10, 11]}]})
    out = m.feed(first[:20]) + m.feed(first[20:])  # an event split across reads waits for its rest
    want = {"id": "c1", "created": 7, "model": "m", "choices": [{"index": 0, "text": "ab"}]}
    assert json.loads(out[6:]) == want
    plain = ev({"id": "c1", "choices": [{"index": 0, "text": "c"}]})
    assert m.feed(plain) == plain and not m.ids_ok  # passed on as it was; but text came without ids
    assert (m.prompt_ids, m.out_ids, m.chars) == ([1, 2], [10, 11], 3)
    assert m.feed(b"data: [DONE]\n\n") == b"" and m.done


def test_a_retryable_error_event_breaks_the_stream_and_others_pass() -> None:
    m = Move("cmpl", {}, False, None)
    bad = ev({"error": {"message": "bad", "code": 400}})
    assert m.feed(bad) == bad and m.broken is None
    assert m.feed(ev({"error": {"message": "engine core died", "code": 503}})) == b""
    assert m.broken == "error_event"


def test_a_chat_continuation_reads_as_the_original_stream() -> None:
    data = {"messages": [], "max_tokens": 10, "stream": True}
    m = Move("chat", data, False, None)
    m.feed(ev({"id": "chat1", "created": 5, "model": "m", "object": "chat.completion.chunk",
               "prompt_token_ids": [1, 2, 3], "choices": [{"index": 0, "delta": {"content": "hi"},
                                                            "token_ids": [9, 8]}]}))
    m.broken = "reset"
    m.resume_on()
    assert json.loads(m.body) == {"stream": True, "prompt": [1, 2, 3, 9, 8], "echo": False,
                                  "return_token_ids": True, "max_tokens": 8}
    out = m.feed(ev({"id": "cmpl-x", "created": 6, "model": "m", "object": "text_completion", "choices": [
        {"index": 0, "text": "!", "token_ids": [7], "finish_reason": "length", "stop_reason": None}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}}))
    chunk = json.loads(out[6:])
    assert (chunk["id"], chunk["created"], chunk["object"]) == ("chat1", 5, "chat.completion.chunk")
    assert chunk["choices"][0]["delta"] == {"content": "!"} and "token_ids" not in chunk["choices"][0]
    assert chunk["usage"] == {"prompt_tokens": 3, "completion_tokens": 10, "total_tokens": 13}
    assert m.out_ids == [9, 8, 7]


def test_the_prompt_ids_of_a_compact_first_event_are_cut_out_and_read_only_for_a_move() -> None:
    """The engines write compact JSON; the first event's prompt ids (most of its bytes) are cut out as bytes
    and parsed only when the stream moves."""
    m = Move("chat", {"messages": [], "max_tokens": 10, "stream": True}, False, None)
    head = {"id": "chat1", "created": 5, "model": "m", "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "token_ids": []}]}
    first = (b"data: " + json.dumps({**head, "prompt_token_ids": list(range(1, 300))},
                                    separators=(",", ":")).encode() + b"\n\n")
    token = ev({**head, "choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [9]}]})
    out = m.feed(first + token)
    assert b"prompt_token_ids" not in out and b"token_ids" not in out
    role = json.loads(out.split(b"\n\n")[0][6:])["choices"][0]["delta"]
    assert role == {"role": "assistant", "content": ""}
    assert m._prompt_raw is not None and m._prompt_ids is None  # not parsed yet
    m.broken = "reset"
    m.resume_on()
    assert json.loads(m.body)["prompt"] == [*range(1, 300), 9]
