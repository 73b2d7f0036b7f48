"""The continuation of a broken stream: what can be resumed, the request that resumes it, and its chunks
rewritten as the original's."""

from __future__ import annotations

import orjson

from lbd.router.continuation import (
    as_chat_choice,
    continuation,
    fix_usage,
    impossible,
    kind_of,
    shift_offsets,
    with_token_ids,
)


def test_kinds() -> None:
    assert kind_of("/v1/completions") == "cmpl"
    assert kind_of("/v1/chat/completions?x=1") == "chat"
    assert kind_of("/v1/responses") is None


def test_what_cannot_be_resumed_says_why() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert "tools" in impossible("chat", {"messages": [], "tools": tools})
    assert impossible("chat", {"messages": [], "tools": tools, "tool_choice": "none"}) is None
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
    assert "image_url" in impossible("chat", {"messages": [image]})
    assert "n > 1" in impossible("cmpl", {"prompt": "a", "n": 2})
    assert "batch" in impossible("cmpl", {"prompt": ["a", "b"]})
    assert impossible("cmpl", {"prompt": [1, 2, 3]}) is None


def test_token_ids_are_asked_for_last() -> None:
    assert orjson.loads(with_token_ids(b'{"a": 1}\n')) == {"a": 1, "return_token_ids": True}
    assert orjson.loads(with_token_ids(b"{}")) == {"return_token_ids": True}
    assert orjson.loads(with_token_ids(b'{"return_token_ids": false}')) == {"return_token_ids": True}


def test_a_completion_continues_with_the_sent_tokens_and_what_is_left() -> None:
    data = {"model": "m", "prompt": "hi", "max_tokens": 10, "min_tokens": 5, "temperature": 0.7, "seed": 3,
            "stop": ["x"], "echo": True, "stream": True}
    body = continuation("cmpl", data, [1, 2], [7, 8, 9])
    assert body["prompt"] == [1, 2, 7, 8, 9]
    assert (body["max_tokens"], body["min_tokens"], body["echo"]) == (7, 2, False)
    assert (body["temperature"], body["seed"], body["stop"], body["stream"]) == (0.7, 3, ["x"], True)
    assert body["return_token_ids"] is True
    assert data["prompt"] == "hi"  # the original is left as it was


def test_a_chat_continues_as_a_token_completion() -> None:
    data = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 4,
            "logprobs": True, "top_logprobs": 2, "top_k": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    body = continuation("chat", data, [5], [6])
    assert "messages" not in body and "max_completion_tokens" not in body and "top_logprobs" not in body
    assert (body["prompt"], body["max_tokens"], body["logprobs"], body["top_k"]) == ([5, 6], 3, 2, 1)
    assert body["stream_options"] == {"include_usage": True}


def test_chunks_of_the_continuation_read_as_the_original() -> None:
    usage = {"prompt_tokens": 30, "completion_tokens": 5, "total_tokens": 35}
    fix_usage(usage, 10, 20)
    assert usage == {"prompt_tokens": 10, "completion_tokens": 25, "total_tokens": 35}
    lp = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}], "text_offset": [0]}
    shift_offsets(lp, 12)
    assert lp["text_offset"] == [12]
    choice = as_chat_choice({"index": 0, "text": "a", "logprobs": lp, "finish_reason": "length",
                             "stop_reason": None})
    assert choice["delta"] == {"content": "a"} and choice["finish_reason"] == "length"
    assert choice["logprobs"]["content"][0]["token"] == "a"
    assert choice["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -0.5
