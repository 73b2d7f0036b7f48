"""Parsing and validation of OpenAI chat/completion request bodies into what the front end submits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from lbd.engine.server.errors import APIError, bad_request
from lbd.engine.server.fields import Fields, is_int_list
from lbd.engine.server.structured_params import structured_from
from lbd.engine.server.tool_choice import ForcedTools, forced_tools
from lbd.wire.core_messages import SamplingParams, StructuredOutputs
from lbd.wire.kv_transfer import KVTransferParams, params_from_obj

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
PRIORITY_HEADER = "X-Vllm-Priority"  # vLLM's: overrides the body's ``priority`` when it reads as an integer
MAX_STOP_STRINGS = 64


@dataclass(slots=True)
class Limits:
    """Server-side bounds a request is checked against."""

    max_model_len: int
    max_logprobs: int
    vocab_size: int
    max_prompt_chars: int = 1 << 62  # max_model_len x the tokenizer's most characters per token


@dataclass(slots=True)
class CommonParams:
    """Fields shared by chat and completions."""

    model: str | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    n: int
    max_tokens: int | None
    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    logprobs: int | None  # top-k per token (0 = just the chosen token's), None = no logprobs
    sampling: SamplingParams
    kv_transfer_params: KVTransferParams | None = None  # prefill/decode disaggregation (vLLM's field)
    return_token_ids: bool = False  # vLLM's field: prompt_token_ids and each choice's token_ids in the answer
    priority: int = 0  # vLLM's field, lower first; only --scheduling-policy priority orders by it


@dataclass(slots=True)
class ChatRequest:
    common: CommonParams
    messages: list[dict[str, Any]]
    add_generation_prompt: bool
    continue_final_message: bool
    tools: list[Any] | None
    template_kwargs: dict[str, Any]
    forced_tools: ForcedTools | None = None  # tool_choice "required" or named: the output is tool calls


@dataclass(slots=True)
class CompletionRequest:
    common: CommonParams
    prompts: list[str | list[int]]  # text, or token ids
    echo: bool
    add_special_tokens: bool


def sampling_from(f: Fields) -> SamplingParams:
    """The sampling fields shared by chat, completions and responses (vLLM's extras included)."""
    top_k = f.int("top_k", 0, lo=-1, hi=(1 << 31) - 1)
    return SamplingParams(
        temperature=f.float("temperature", 1.0, lo=0.0),
        top_p=f.float("top_p", 1.0, lo=1e-9, hi=1.0),
        top_k=0 if top_k in (-1, None) else top_k,
        min_p=f.float("min_p", 0.0, lo=0.0, hi=1.0),
        seed=f.int("seed", None, lo=-(1 << 63), hi=(1 << 63) - 1),
        min_tokens=f.int("min_tokens", 0, lo=0),
        stop_token_ids=f.int_list("stop_token_ids", lo=0),
        ignore_eos=f.bool("ignore_eos", False),
        presence_penalty=f.float("presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=f.float("frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=f.float("repetition_penalty", 1.0, lo=1e-6),
        # lbd's router resuming a stream: the prompt's last n tokens are this answer's output (penalties)
        prior_output_tokens=f.int("lbd_resumed_output_tokens", 0, lo=0, hi=(1 << 31) - 1),
    )


def _unsupported(f: Fields) -> None:
    """Refuse what we would otherwise silently ignore and answer wrongly."""
    if f.has("suffix"):
        raise bad_request("'suffix' is not supported", "suffix")
    if f.raw("logit_bias"):
        raise bad_request("'logit_bias' is not supported", "logit_bias")
    best_of = f.int("best_of", None, lo=1)
    if best_of is not None and best_of != f.int("n", 1):
        raise bad_request("'best_of' is not supported (use n)", "best_of")


def _common(f: Fields, limits: Limits, logprobs: int | None, max_tokens: int | None) -> CommonParams:
    _unsupported(f)
    stream = f.bool("stream", False)
    opts = f.obj("stream_options")
    if opts is not None and not stream:
        raise bad_request("stream_options can only be set when stream is true", "stream_options")
    if logprobs is not None and logprobs > limits.max_logprobs:
        raise bad_request(f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
                          f"{limits.max_logprobs}", "top_logprobs" if f.has("top_logprobs") else "logprobs")
    sampling = sampling_from(f)
    bad_ids = [t for t in sampling.stop_token_ids if t >= limits.vocab_size]
    if bad_ids:
        raise bad_request(f"stop_token_ids {bad_ids} are outside the vocabulary (size {limits.vocab_size})",
                          "stop_token_ids")
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise bad_request(f"'min_tokens' ({sampling.min_tokens}) must be at most max_tokens ({max_tokens})",
                          "min_tokens")
    sampling.logprobs = logprobs
    sampling.n = f.int("n", 1, lo=1, hi=128)
    sampling.structured = structured_from(f)  # response_format, structured_outputs, guided_*
    return CommonParams(
        model=f.str("model"), stream=stream,
        include_usage=bool(opts and opts.bool("include_usage", False)),
        continuous_usage=bool(opts and opts.bool("continuous_usage_stats", False)),
        n=sampling.n, max_tokens=max_tokens, stop=f.str_list("stop", MAX_STOP_STRINGS),
        include_stop=f.bool("include_stop_str_in_output", False),
        skip_special_tokens=f.bool("skip_special_tokens", True), logprobs=logprobs, sampling=sampling,
        kv_transfer_params=kv_transfer_params(f.raw("kv_transfer_params"), sampling.n),
        return_token_ids=f.bool("return_token_ids", False), priority=f.int("priority", 0))


def header_priority(headers: Mapping[str, str], priority: int) -> int:
    """vLLM's rule: an ``X-Vllm-Priority`` header that reads as a signed 64-bit integer overrides the body's
    ``priority``; any other value is ignored (vLLM ignores one ``int()`` cannot read)."""
    raw = headers.get(PRIORITY_HEADER)
    if raw is None:
        return priority
    try:
        value = int(raw)
    except ValueError:
        return priority
    return value if -(1 << 63) <= value < (1 << 63) else priority


def kv_transfer_params(raw: Any, n: int) -> KVTransferParams | None:
    """vLLM's ``kv_transfer_params``, checked: 400 naming the field for a wrong type, a decode request without
    where its blocks are, or more than one choice."""
    if raw is None:
        return None
    try:
        params = params_from_obj(raw)
    except ValueError as e:
        raise bad_request(str(e), "kv_transfer_params") from None
    if params.do_remote_decode and params.do_remote_prefill:
        raise bad_request("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
                          "kv_transfer_params")
    if params.do_remote_prefill:
        missing = [k for k in ("remote_engine_id", "remote_host", "remote_port", "remote_request_id",
                               "remote_block_ids") if getattr(params, k) is None]
        if missing:
            raise bad_request(f"kv_transfer_params with do_remote_prefill needs {missing}: pass the "
                              "kv_transfer_params of the prefill's response", "kv_transfer_params")
        if not 0 < params.remote_port < 65536:
            raise bad_request("kv_transfer_params.remote_port must be a port number", "kv_transfer_params")
    if (params.do_remote_decode or params.do_remote_prefill) and n != 1:
        raise bad_request("kv_transfer_params needs n=1", "n")
    return params


def parse_message(m: Any, i: int) -> dict[str, Any]:
    mf = Fields(m, f"messages[{i}]")
    role = mf.required("role")
    if role not in _ROLES:
        raise bad_request(f"'messages[{i}].role' must be one of {', '.join(_ROLES)}, got {role!r}",
                          f"messages[{i}].role")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        out["content"] = "".join(_text_part(part, i, j) for j, part in enumerate(content))
    elif content is None:
        if role != "assistant":
            raise bad_request(f"'messages[{i}].content' is a required field", f"messages[{i}].content")
        out["content"] = ""
    elif not isinstance(content, str):
        raise bad_request(f"'messages[{i}].content' must be a string or a list of content parts",
                          f"messages[{i}].content")
    return out


def _text_part(part: Any, i: int, j: int) -> str:
    pf = Fields(part, f"messages[{i}].content[{j}]")
    kind = pf.str("type", "text")
    if kind != "text":
        raise bad_request(f"content part type {kind!r} is not supported (text only)", pf.param("type"))
    pf.required("text")
    return pf.str("text")


def parse_chat(body: Any, limits: Limits) -> ChatRequest:
    f = Fields(body)
    messages = f.required("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list", "messages")
    want_logprobs = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, lo=0)
    if top and not want_logprobs:
        raise bad_request("when using 'top_logprobs', 'logprobs' must be set to true", "top_logprobs")
    max_tokens = f.int("max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = f.int("max_tokens", None, lo=1)
    common = _common(f, limits, (top or 0) if want_logprobs else None, max_tokens)
    kwargs = f.raw("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad_request("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    tools = f.raw("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list", "tools")
    parsed = [parse_message(m, i) for i, m in enumerate(messages)]
    chars = sum(len(m["content"]) for m in parsed) + (len(orjson.dumps(tools)) if tools else 0)
    check_prompt_chars(chars, limits, "messages")
    forced = forced_tools(f, tools)
    if forced is not None:
        if common.sampling.structured is not None:
            raise bad_request("tool_choice 'required' or a named function cannot be combined with "
                              "response_format or structured outputs", "tool_choice")
        common.sampling.structured = StructuredOutputs("json", orjson.dumps(forced.schema).decode())
    return ChatRequest(common=common, messages=parsed,
                       add_generation_prompt=f.bool("add_generation_prompt", True),
                       continue_final_message=f.bool("continue_final_message", False),
                       tools=tools, template_kwargs=dict(kwargs or {}), forced_tools=forced)


def parse_completion(body: Any, limits: Limits) -> CompletionRequest:
    f = Fields(body)
    prompts = _prompts(f.required("prompt"), limits)
    logprobs = f.int("logprobs", None, lo=0)
    echo = f.bool("echo", False)
    if echo and logprobs is not None:
        raise bad_request("'echo' together with 'logprobs' is not supported (no prompt logprobs)", "echo")
    common = _common(f, limits, logprobs, f.int("max_tokens", 16, lo=1))
    return CompletionRequest(common=common, prompts=prompts, echo=echo,
                             add_special_tokens=f.bool("add_special_tokens", True))


def _prompts(value: Any, limits: Limits) -> list[str | list[int]]:
    if isinstance(value, str):
        prompts: list[str | list[int]] = [value]
    elif is_int_list(value) and value:
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) or is_int_list(p) for p in value):
        prompts = list(value)
    else:
        raise bad_request("'prompt' must be a string, a list of strings, a list of token ids, or a list of "
                          "token-id lists", "prompt")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            check_prompt_chars(len(p), limits, "prompt")
        else:
            if not p:
                raise bad_request(f"prompt[{i}] is an empty token list", "prompt")
            if len(p) >= limits.max_model_len:
                raise _context_error(len(p), limits, "prompt")
            bad = [t for t in p if not 0 <= t < limits.vocab_size]
            if bad:
                raise bad_request(f"prompt[{i}] holds token ids outside the vocabulary (size "
                                  f"{limits.vocab_size}): {bad[:8]}", "prompt")
    return prompts


def _context_error(n: int, limits: Limits, what: str) -> APIError:
    return APIError(f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
                    f"request has {n} input tokens. Please reduce the length of the input {what}.", 400, what)


def check_prompt_chars(chars: int, limits: Limits, what: str) -> None:
    """Refuse, before tokenizing, a text too long to fit the context whatever its tokens: tokenizing it
    would cost seconds of CPU for a certain 400."""
    if chars > limits.max_prompt_chars:
        raise APIError(f"This model's maximum context length is {limits.max_model_len} tokens. However, your "
                       f"{what} has {chars} characters, more than {limits.max_model_len} tokens can hold. "
                       f"Please reduce the length of the {what}.", 400, what)


def plan_tokens(ids: list[int], max_tokens: int | None, limits: Limits, what: str) -> int:
    """The request's max_tokens after checking prompt + completion against the context length."""
    n = len(ids)
    if n == 0:
        raise bad_request(f"the {what} is empty: at least one token is needed", what)
    if n >= limits.max_model_len:
        raise _context_error(n, limits, what)
    if max_tokens is None:
        return limits.max_model_len - n
    if n + max_tokens > limits.max_model_len:
        message = (f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
                   f"requested {n + max_tokens} tokens ({n} in the {what}, {max_tokens} in the completion). "
                   f"Please reduce the length of the {what} or completion.")
        raise APIError(message, 400, "max_tokens")
    return max_tokens
