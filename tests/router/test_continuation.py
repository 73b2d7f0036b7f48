"""The continuation of a broken stream: what can be resumed, the request that resumes it, and its chunks
rewritten as the original's."""

from __future__ import annotations

import orjson

from lbd.router.continuation import (
    CHAT,
    COMPLETIONS,
    RESUMED_FIELD,
    RESUMED_IDS_FIELD,
    RankFacts,
    as_chat_choice,
    continuation,
    fix_usage,
    impossible,
    kind_of,
    left,
    needs_lbd,
    penalised,
    rank_facts,
    shift_offsets,
    with_token_ids,
)
from lbd.router.resumable import Move


def test_kinds() -> None:
    assert kind_of("/v1/completions") == "cmpl"
    assert kind_of("/v1/chat/completions?x=1") == "chat"
    assert kind_of("/v1/responses") is None


def test_what_cannot_be_resumed_says_why() -> None:
    assert "functions" in impossible("chat", {"messages": [], "functions": [{"name": "f"}]})
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
    body = continuation("cmpl", data, [1, 2], [7, 8, 9], 7)
    assert body["prompt"] == [1, 2, 7, 8, 9]
    assert (body["max_tokens"], body["min_tokens"], body["echo"]) == (7, 2, False)
    assert (body["temperature"], body["seed"], body["stop"], body["stream"]) == (0.7, 3, ["x"], True)
    assert body["return_token_ids"] is True
    assert data["prompt"] == "hi"  # the original is left as it was


def test_a_chat_continues_as_a_token_completion() -> None:
    data = {"model": "m", "messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 4,
            "logprobs": True, "top_logprobs": 2, "top_k": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    body = continuation("chat", data, [5], [6], 3)
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
                             "stop_reason": None}, 1)
    assert choice["delta"] == {"content": "a"} and choice["finish_reason"] == "length"
    assert choice["logprobs"]["content"][0]["token"] == "a"
    assert choice["logprobs"]["content"][0]["top_logprobs"][0]["logprob"] == -0.5


def test_what_is_left_is_what_the_unbroken_run_had_left() -> None:
    # a chat with no limit runs to the context: its first rank's context less prompt and output
    assert left("chat", {"messages": []}, 30, 40, 512) == 442
    assert left("chat", {"messages": []}, 30, 40, None) is None  # unknown context: not resumable
    assert left("chat", {"messages": [], "max_tokens": 100, "max_completion_tokens": 50}, 30, 40, 512) == 10
    assert left("chat", {"messages": [], "max_tokens": 100, "max_completion_tokens": None}, 3, 40, 512) == 60
    # a completion with no limit gets the engines' default, 16, in all (not 16 more)
    assert left("cmpl", {"prompt": "p"}, 3, 10, 512) == 6
    assert left("cmpl", {"prompt": "p", "max_tokens": 10}, 3, 10, 512) == 0  # done: its finish was cut off
    body = continuation("chat", {"messages": [], "stream": True}, [1, 2], [3], 508)
    assert body["max_tokens"] == 508


def test_penalties_tell_lbd_ranks_which_prompt_tokens_are_output() -> None:
    data = {"prompt": "p", "max_tokens": 10, "frequency_penalty": 1.0, "truncate_prompt_tokens": 5,
            "prompt_logprobs": 1, "lbd_resumed_output_tokens": 99}
    body = continuation("cmpl", data, [1, 2], [7, 8, 9], 7)
    assert body[RESUMED_FIELD] == 3  # the prompt's last 3 tokens are output
    assert "truncate_prompt_tokens" not in body and "prompt_logprobs" not in body
    assert RESUMED_FIELD not in continuation("cmpl", {"prompt": "p"}, [1], [2], 5)
    assert penalised({"presence_penalty": -0.5}) and not penalised({"repetition_penalty": 1.3})


def test_structured_outputs_continue_their_grammar_on_lbd_ranks() -> None:
    """The continuation keeps the constraint and says which prompt tokens were output: lbd's engine advances
    the grammar over them. Only lbd's engine can (``needs_lbd``)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    chat = {"messages": [], "response_format": fmt, "max_tokens": 50}
    assert impossible("chat", chat) is None
    body = continuation("chat", chat, [1, 2], [7, 8], 48)
    assert body["response_format"] == fmt and body[RESUMED_FIELD] == 2 and "messages" not in body
    assert RESUMED_FIELD not in continuation("chat", chat, [1, 2], [], 50)  # nothing sent yet
    cmpl = {"prompt": "p", "structured_outputs": {"regex": "[a-z]+"}, "guided_choice": None}
    body = continuation("cmpl", cmpl, [1], [5, 6, 7], 4)
    assert body["structured_outputs"] == {"regex": "[a-z]+"} and body[RESUMED_FIELD] == 3
    assert "json_schema" in needs_lbd(chat) and "guided_choice" in needs_lbd({"guided_choice": ["a"]})
    assert "penalties" in needs_lbd({"presence_penalty": 1.0, "guided_json": {}})
    assert needs_lbd({"response_format": {"type": "text"}}) is None and needs_lbd(cmpl | {"n": 1}) is not None


def test_a_tool_chat_continues_as_the_same_chat_told_the_output_sent() -> None:
    """Tool calls are parsed from a chat's text by the rank: the continuation is the chat itself with the
    output ids the client has (after any the original was told), its limit what is left; lbd ranks only.
    ``tool_choice: "none"`` is plain text: a token completion, any engine."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"model": "m", "messages": [{"role": "user", "content": "q"}], "tools": tools, "stream": True,
            "tool_choice": "required", "max_completion_tokens": 40, "min_tokens": 5, "prompt_logprobs": 1,
            "logprobs": True, "top_logprobs": 2, RESUMED_FIELD: 3}
    assert impossible("chat", chat) is None and "tools" in needs_lbd(chat)
    body = continuation("chat", chat, [1, 2], [7, 8], 38)
    assert body[RESUMED_IDS_FIELD] == [7, 8] and body["max_tokens"] == 38 and body["min_tokens"] == 3
    assert (body["messages"], body["tools"], body["tool_choice"]) == (chat["messages"], tools, "required")
    assert (body["logprobs"], body["top_logprobs"], body["return_token_ids"]) == (True, 2, True)
    for gone in ("prompt", "max_completion_tokens", "prompt_logprobs", RESUMED_FIELD):
        assert gone not in body, gone
    again = continuation("chat", {**chat, RESUMED_IDS_FIELD: [4]}, [1, 2, 4], [9], 30)
    assert again[RESUMED_IDS_FIELD] == [4, 9]
    auto = {"messages": [], "tools": tools}  # no tool_choice: "auto", where the rank has a parser
    assert continuation("chat", auto, [1], [2], 5)[RESUMED_IDS_FIELD] == [2]
    plain = {"messages": [], "tools": tools, "tool_choice": "none"}
    assert needs_lbd(plain) is None and continuation("chat", plain, [1], [2], 5)["prompt"] == [1, 2]
    assert Move("chat", chat, False, None).path == CHAT
    assert Move("chat", plain, False, None).path == COMPLETIONS


def test_ids_move_only_to_a_rank_with_the_same_tokenizer() -> None:
    cards = [{"id": "m", "owned_by": "lbd", "root": "/m", "max_model_len": 512, "lbd_tokenizer": "abc"}]
    lbd = rank_facts(cards, "m")
    assert lbd == RankFacts("lbd", "/m", 512, "abc") and rank_facts(cards, None) == lbd
    assert rank_facts(cards, "other") == RankFacts()
    upgraded = RankFacts("lbd", "/m2", 512, "def")
    vllm = rank_facts([{"id": "m", "owned_by": "vllm", "root": "/m", "max_model_len": 512}], "m")
    assert lbd.takes_ids_of(lbd, lbd_only=True) and not upgraded.takes_ids_of(lbd, lbd_only=False)
    assert not vllm.takes_ids_of(lbd, lbd_only=False) and not RankFacts().takes_ids_of(lbd, lbd_only=False)
    # no fingerprint on the first rank: only ranks with none either, of the same engine and model
    assert vllm.takes_ids_of(vllm, lbd_only=False) and not lbd.takes_ids_of(vllm, lbd_only=False)
    assert not RankFacts("vllm", "/other", 512).takes_ids_of(vllm, lbd_only=False)
    assert not vllm.takes_ids_of(vllm, lbd_only=True)  # penalties, grammars continue on lbd's engine only
