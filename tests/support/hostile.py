"""Hypothesis strategies for hostile OpenAI request bodies, shared by the engine's and the router's property
tests: any JSON orjson can hand over (ints up to 64 bits, floats of any size, deep nesting) under the field
names the parsers look at, so the examples reach past the first type check."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# Sized for two busy cores: each property test stays within a few seconds.
PROPERTY = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    database=None)

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "stop_token_ids", "logprobs", "top_logprobs", "echo", "stream",
          "stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
          "ignore_eos", "best_of", "suffix", "logit_bias", "response_format", "tools", "chat_template_kwargs",
          "add_generation_prompt", "continue_final_message", "include_stop_str_in_output",
          "skip_special_tokens", "add_special_tokens", "user"]
NUMERIC = ["max_tokens", "max_completion_tokens", "n", "temperature", "top_p", "top_k", "min_p", "seed",
           "logprobs", "top_logprobs", "min_tokens", "stop_token_ids", "presence_penalty",
           "repetition_penalty"]
ROLES = ["system", "developer", "user", "assistant", "tool", "function", "root", ""]

scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
           | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16))
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
extreme_ints = st.sampled_from([2**63 - 1, 2**63, 2**64 - 1, -(2**63), 2**31, 2**31 - 1, -1, 0])
ints = st.integers(-2, 40) | st.integers(-2, 40) | extreme_ints | st.floats(-1e20, 1e20) | json_values
floats = st.floats(-3, 3) | st.floats(-3, 3) | st.floats(allow_nan=False, allow_infinity=False) | ints
bools = st.booleans() | st.booleans() | json_values
token_lists = st.lists(st.integers(0, 383) | st.integers(0, 383) | extreme_ints, min_size=0, max_size=12)
texts = st.text(max_size=60) | st.text(alphabet="ab <|>\n", max_size=60)
content = (texts | texts | st.none() | st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "text", "image_url"]), "text": texts | json_values}), max_size=3)
    | json_values)
message = st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": content})
messages = st.lists(message, min_size=1, max_size=4) | st.lists(message, min_size=1, max_size=4) | json_values
prompts = texts | texts | token_lists | st.lists(texts | token_lists, max_size=3) | json_values
stops = texts | st.lists(texts, max_size=70) | json_values

_BY_FIELD = {"prompt": prompts, "messages": messages, "stop_token_ids": token_lists | json_values,
             "stop": stops, "model": st.text(max_size=10) | json_values, "user": texts | json_values,
             "stream_options": st.fixed_dictionaries({"include_usage": bools}) | json_values,
             "response_format": st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])})
             | json_values, "tools": st.lists(json_values, max_size=2) | json_values,
             "chat_template_kwargs": st.dictionaries(st.text(max_size=5), json_values, max_size=2)
             | json_values}
for _name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
    _BY_FIELD[_name] = floats
for _name in ("echo", "stream", "ignore_eos", "add_generation_prompt", "continue_final_message",
              "include_stop_str_in_output", "skip_special_tokens", "add_special_tokens"):
    _BY_FIELD[_name] = bools


@st.composite
def bodies(draw: st.DrawFn, required: str = "prompt") -> object:
    """A request body: mostly an object holding ``required`` and some other fields, each drawn from values
    of about the right kind with hostile ones mixed in; now and then anything at all."""
    if draw(st.integers(0, 19)) == 0:
        return draw(json_values)
    keys = draw(st.lists(st.sampled_from(NUMERIC) | st.sampled_from(FIELDS), max_size=5, unique=True))
    out = {key: draw(_BY_FIELD.get(key, ints)) for key in keys}
    if draw(st.integers(0, 9)) < 8:  # mostly a usable prompt, so the other fields get looked at
        out[required] = draw(_PLAUSIBLE[required])
    return out


_PLAUSIBLE = {
    "prompt": texts | st.lists(st.integers(0, 383), min_size=1, max_size=12),
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                                "content": texts}), min_size=1, max_size=3),
}
