"""The tracking of one resumable stream (no processes): token ids counted and stripped, a retryable error
event, and a continuation's chunks rewritten as the original stream's."""

from __future__ import annotations

import json
from typing import Any

import orjson

from lbd.router.resumable import MAX_EVENT_BYTES, Move


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
    m.resume_on(8)
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
    m.resume_on(9)
    assert json.loads(m.body)["prompt"] == [*range(1, 300), 9]


# ---- the engines' compact bytes (orjson, as lbd's engine and vLLM write them): the fast path -------------

def compact(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


HEAD = {"id": "cmpl-1", "object": "text_completion", "created": 5, "model": "m"}


def token(text: str, ids: list[int], finish: str | None = None) -> bytes:
    return compact({**HEAD, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
                                         "stop_reason": None, "token_ids": ids}]})


def usage(prompt: int, done: int) -> bytes:
    return compact({**HEAD, "choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": done,
                                                     "total_tokens": prompt + done}})


def first_compact() -> bytes:
    choice = {"index": 0, "text": "a", "logprobs": None, "finish_reason": None, "stop_reason": None,
              "prompt_token_ids": [1, 2, 3], "token_ids": [7]}
    return compact({**HEAD, "choices": [choice]})


def test_compact_events_have_their_ids_cut_out_as_bytes() -> None:
    """The ``_IDS`` fast path: ids counted and cut from the bytes, the rest of the event left as it was."""
    m = Move("cmpl", {"prompt": "p", "max_tokens": 5, "stream": True}, False, None)
    out = m.feed(first_compact() + token("b", [8]) + token("cd", [9, 10]))
    events = out.split(b"\n\n")[:-1]
    assert len(events) == 3 and b"token_ids" not in out
    assert events[1] == b"data: " + orjson.dumps({**HEAD, "choices": [
        {"index": 0, "text": "b", "logprobs": None, "finish_reason": None, "stop_reason": None}]})
    assert (m.prompt_ids, m.out_ids, m.ids_ok, m.finished) == ([1, 2, 3], [7, 8, 9, 10], True, False)


def test_a_compact_finish_reason_is_seen_and_a_cut_after_it_is_not_resumed() -> None:
    data = {"prompt": "p", "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}}
    m = Move("cmpl", data, False, None)
    m.feed(first_compact() + token("b", [8]))
    assert not m.finished
    m.feed(token("", [2], finish="stop"))
    assert m.finished and not m.usage_sent
    # cut before the usage chunk: what the client still lacks is its usage, counted from the ids
    assert orjson.loads(m.tail()[6:]) == {**HEAD, "object": "text_completion", "choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}
    m.feed(usage(3, 3))
    assert m.usage_sent and m.tail() == b""


def test_text_with_finish_reason_in_it_is_not_a_finish() -> None:
    m = Move("cmpl", {"prompt": "p", "stream": True}, False, None)
    m.feed(first_compact() + token('"finish_reason":"stop"', [8]))
    assert not m.finished and m.out_ids == [7, 8]


def test_an_event_split_anywhere_is_whole_once_its_end_arrives() -> None:
    m = Move("cmpl", {"prompt": "p", "stream": True}, False, None)
    stream = first_compact() + token("b", [8]) + token("c", [9], finish="length")
    out = b"".join(m.feed(stream[i:i + 7]) for i in range(0, len(stream), 7))
    assert out.count(b"\n\n") == 3 and m.out_ids == [7, 8, 9] and m.finished
    m2 = Move("cmpl", {"prompt": "p", "stream": True}, False, None)
    one = first_compact()
    assert m2.feed(one[:-1]) == b"" and m2.feed(b"\n") != b""  # the blank line split between two reads


def test_an_event_without_end_is_capped_not_copied() -> None:
    m = Move("cmpl", {"prompt": "p", "stream": True}, False, None)
    m.feed(first_compact())
    piece = b"x" * (1 << 20)
    m.feed(b"data: {")
    for _ in range((MAX_EVENT_BYTES >> 20) - 1):
        assert m.feed(piece) == b"" and m.broken is None
    assert len(m._rest) > 1  # kept as pieces, not one buffer copied again per read
    m.feed(piece + b"x")
    assert m.broken == "oversized" and m._rest == []


def test_an_echoed_prompt_is_not_output_without_ids() -> None:
    """lbd's engine sends an echoed prompt first, on its own, without ids: it is the prompt, not output."""
    m = Move("cmpl", {"prompt": "hello", "echo": True, "stream": True}, False, None)
    echo = compact({**HEAD, "choices": [{"index": 0, "text": "hello", "logprobs": None, "finish_reason": None,
                                         "stop_reason": None}]})
    out = m.feed(echo + first_compact())
    assert b"hello" in out and m.ids_ok and m.out_ids == [7] and m.prompt_ids == [1, 2, 3]
    m.broken = "reset"
    m.resume_on(4)
    body = orjson.loads(m.body)
    assert body["prompt"] == [1, 2, 3, 7] and body["echo"] is False and body["max_tokens"] == 4


def test_a_chat_continuation_with_top_logprobs_0_has_no_alternatives() -> None:
    data = {"messages": [], "stream": True, "logprobs": True, "top_logprobs": 0}
    m = Move("chat", data, False, None)
    m.feed(compact({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "prompt_token_ids": [1], "choices": [{"index": 0, "delta": {"content": "a"},
                                                          "logprobs": None, "finish_reason": None,
                                                          "token_ids": [5]}]}))
    m.broken = "reset"
    m.resume_on(3)
    assert orjson.loads(m.body)["logprobs"] == 0
    lp = {"tokens": ["b"], "token_logprobs": [-0.1], "top_logprobs": [{"b": -0.1}], "text_offset": [1]}
    out = m.feed(compact({**HEAD, "choices": [{"index": 0, "text": "b", "logprobs": lp, "finish_reason": None,
                                               "stop_reason": None, "token_ids": [6]}]}))
    entry = orjson.loads(out[6:])["choices"][0]["logprobs"]["content"][0]
    assert entry["token"] == "b" and entry["top_logprobs"] == []  # as the unbroken chat's top_logprobs: 0
