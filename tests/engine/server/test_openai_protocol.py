"""Request parsing and validation of the OpenAI endpoints (no server needed)."""

from __future__ import annotations

import pytest

from lbd.engine.server.errors import APIError, error_body
from lbd.engine.server.openai_protocol import Limits, parse_chat, parse_completion, plan_tokens

LIM = Limits(max_model_len=512, max_logprobs=5, vocab_size=384)
MSG = [{"role": "user", "content": "hi"}]


def err(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    return info.value


def test_chat_defaults_and_sampling_fields() -> None:
    req = parse_chat({"messages": MSG}, LIM)
    c = req.common
    assert (c.stream, c.n, c.max_tokens, c.logprobs, c.stop) == (False, 1, None, None, [])
    assert c.sampling.temperature == 1.0 and c.sampling.top_k == 0
    req = parse_chat({"messages": MSG, "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "seed": 7,
                      "stop": "x", "stop_token_ids": [3], "n": 3, "max_completion_tokens": 9, "max_tokens": 2,
                      "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
                      "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "stream": True,
                      "stream_options": {"include_usage": True}}, LIM)
    c = req.common
    s = c.sampling
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.0, 0.5, 0, 0.1, 7)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (0.5, -0.5, 1.2)
    assert s.ignore_eos
    assert (c.stop, s.stop_token_ids, c.n, c.max_tokens, c.logprobs) == (["x"], [3], 3, 9, 2)
    assert c.stream and c.include_usage


def test_chat_content_parts_are_joined() -> None:
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                 {"type": "text", "text": "b"}]}]}, LIM)
    assert req.messages[0]["content"] == "ab"


@pytest.mark.parametrize("body,param", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [MSG[0], {"role": "user", "content": 5}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
    ({"messages": MSG, "temperature": "hot"}, "temperature"),
    ({"messages": MSG, "temperature": -1}, "temperature"),
    ({"messages": MSG, "top_p": 0}, "top_p"),
    ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
    ({"messages": MSG, "max_tokens": True}, "max_tokens"),
    ({"messages": MSG, "max_tokens": 1.5}, "max_tokens"),
    ({"messages": MSG, "n": 0}, "n"),
    ({"messages": MSG, "stop": [1, 2]}, "stop"),
    ({"messages": MSG, "stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"messages": MSG, "stop_token_ids": [10_000]}, "stop_token_ids"),
    ({"messages": MSG, "stream": "yes"}, "stream"),
    ({"messages": MSG, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": MSG, "logprobs": True, "top_logprobs": 6}, "top_logprobs"),
    ({"messages": MSG, "presence_penalty": 3}, "presence_penalty"),
    ({"messages": MSG, "logit_bias": {"1": 5}}, "logit_bias"),
    ({"messages": MSG, "response_format": {"type": "structural_tag"}}, "response_format.type"),
    ({"messages": MSG, "structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"messages": MSG, "guided_choice": [1]}, "guided_choice"),
    ({"messages": MSG, "model": 3}, "model"),
    ({"messages": MSG, "seed": 1 << 64}, "seed"),
    ({"messages": MSG, "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
])
def test_chat_bad_fields_name_the_param(body: dict, param: str) -> None:
    e = err(parse_chat, body, LIM)
    assert e.status == 400 and e.param == param, e.message


def test_body_must_be_an_object() -> None:
    assert err(parse_chat, [1, 2], LIM).status == 400
    assert err(parse_completion, "x", LIM).status == 400


def test_logprobs_over_the_limit_uses_vllm_wording() -> None:
    e = err(parse_completion, {"prompt": "x", "logprobs": 6}, LIM)
    assert e.param == "logprobs"
    assert e.message == "Requested sample logprobs of 6, which is greater than max allowed: 5"


def test_completion_prompt_shapes() -> None:
    assert parse_completion({"prompt": "a"}, LIM).prompts == ["a"]
    assert parse_completion({"prompt": [1, 2]}, LIM).prompts == [[1, 2]]
    assert parse_completion({"prompt": ["a", "b"]}, LIM).prompts == ["a", "b"]
    assert parse_completion({"prompt": [[1], [2, 3]]}, LIM).prompts == [[1], [2, 3]]
    assert parse_completion({"prompt": "a"}, LIM).common.max_tokens == 16  # OpenAI/vLLM default
    for bad in ([], [1, "a"], [[]], 5, {"a": 1}, [True]):
        assert err(parse_completion, {"prompt": bad}, LIM).param == "prompt"
    assert "outside the vocabulary" in err(parse_completion, {"prompt": [1, 384]}, LIM).message
    assert err(parse_completion, {"prompt": "a", "suffix": "b"}, LIM).param == "suffix"
    assert err(parse_completion, {"prompt": "a", "echo": True, "logprobs": 1}, LIM).param == "echo"


def test_context_length_messages() -> None:
    assert plan_tokens([1] * 10, None, LIM, "messages") == 502
    assert plan_tokens([1] * 10, 502, LIM, "prompt") == 502
    e = err(plan_tokens, [1] * 10, 503, LIM, "messages")
    assert e.param == "max_tokens"
    assert e.message.startswith("This model's maximum context length is 512 tokens. However, you requested "
                                "513 tokens (10 in the messages, 503 in the completion).")
    e = err(plan_tokens, [1] * 512, None, LIM, "prompt")
    assert "512 input tokens" in e.message
    assert err(plan_tokens, [], 5, LIM, "prompt").status == 400


def test_error_body_shape() -> None:
    assert error_body("nope", 404, "model") == {"error": {"message": "nope", "type": "NotFoundError",
                                                          "param": "model", "code": 404}}
    assert error_body("big", 413)["error"]["type"] == "RequestEntityTooLargeError"
