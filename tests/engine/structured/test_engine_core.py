"""Structured outputs in the engine core (scheduler, runner, sampler; in process), on each backend: random
weights under a grammar still give text of that grammar, through chunked prefill, prefix hits and recompute
preemption (the matcher keeps its state); a request cut by max_tokens inside its grammar ends with
``length``; a bad grammar is refused with its problem, once compiled and then from the cache, and nothing
else is affected; a schema compiles once however many requests use it."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.structured import StructuredOutputsConfig
from lbd.engine.core.engine_core import EngineCore, RequestRejected
from lbd.engine.structured import mask as token_mask
from lbd.engine.structured.compiler import load_backend
from lbd.engine.tokenizer import _byte_decoder
from lbd.wire.core_messages import EngineCoreOutput, EngineCoreRequest, SamplingParams, StructuredOutputs

BLOCK_BYTES = 8192  # tiny Llama: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B x 16 tokens
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "kind": {"enum": ["cat", "dog"]},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                  "maxItems": 3}},
          "required": ["name", "kind", "age", "tags"]}
GRAMMAR = 'root ::= "ab" ("x" | "yz")+ "!"'  # GBNF: xgrammar's EBNF, and llguidance reads it too
REGEX = r"[a-f]{20,30}-[0-9]{3}"


def json_spec(schema: dict) -> StructuredOutputs:
    return StructuredOutputs("json", json.dumps(schema), disable_any_whitespace=True)


def constrained(rid: str, prompt: list[int], spec: StructuredOutputs, seed: int, **sampling: object
                ) -> EngineCoreRequest:
    sampling.setdefault("max_tokens", 200)
    params = SamplingParams(temperature=1.0, seed=seed, structured=spec, **sampling)
    return EngineCoreRequest(rid, prompt, params, None, time.time())


Outcome = tuple[dict[str, list[int]], dict[str, EngineCoreOutput], list[tuple[str, str, int]]]


def drive(core: EngineCore, reqs: list[EngineCoreRequest]) -> Outcome:
    """Run ``reqs`` to the end: (tokens, last output, rejected) by request id."""
    for r in reqs:
        core.add_request(r)
    tokens: dict[str, list[int]] = {}
    last: dict[str, EngineCoreOutput] = {}
    rejected: list[tuple[str, str, int]] = []
    deadline = time.monotonic() + 120
    while core.has_work():
        for o in core.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                last[o.request_id] = o
        rejected += core.take_rejected()
        assert time.monotonic() < deadline
    return tokens, last, rejected


@pytest.fixture(scope="module")
def tokenizer(tiny_llama: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(str(tiny_llama))


def tight_core(model: Path, backend: str) -> EngineCore:
    """12 blocks of 16 tokens for 8 requests of ~100 tokens: preemption; 48-token steps: chunked prefill."""
    return EngineCore.from_args(EngineArgs(device="cpu", max_model_len=192, max_num_batched_tokens=48,
                                           kv_cache_memory_bytes=12 * BLOCK_BYTES, max_num_seqs=8,
                                           structured_outputs_backend=backend), str(model))


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_random_weights_write_the_grammar_through_preemption(tiny_llama: Path, tokenizer,
                                                             backend: str) -> None:
    core = tight_core(tiny_llama, backend)
    shared = [(7 * i) % 300 + 3 for i in range(40)]  # a shared prefix: prefix-cache hits
    specs = {"json": json_spec(SCHEMA), "regex": StructuredOutputs("regex", REGEX),
             "choice": StructuredOutputs("choice", json.dumps(["alpha", "beta gamma"])),
             "grammar": StructuredOutputs("grammar", GRAMMAR)}
    reqs = [constrained(f"{kind}{i}", shared + [i + 3, 5, 9], spec, seed=10 * i + j)
            for i in range(2) for j, (kind, spec) in enumerate(specs.items())]
    tokens, last, rejected = drive(core, reqs)
    assert rejected == []
    assert core.scheduler.counters.num_preemptions > 0, "the workload must preempt"
    assert core.scheduler.kv.prefix_hits > 0
    for rid, ids in tokens.items():
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert last[rid].finish_reason == "stop", (rid, text)
        kind = rid.rstrip("0123456789")
        if kind == "json":  # strict=False: xgrammar lets raw control characters into strings (as in vLLM)
            jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        elif kind == "choice":
            assert text in ("alpha", "beta gamma")
        else:
            pattern = REGEX if kind == "regex" else r"ab(x|yz)+!"
            assert re.fullmatch(pattern, text, re.ASCII), (rid, text)
    assert sum(last[r].timings[2] for r in tokens) > 0, "a constrained request must have been preempted"
    core.close()


def test_length_inside_the_grammar_bad_grammars_and_the_cache(tiny_llama: Path, tokenizer) -> None:
    core = EngineCore.from_args(EngineArgs(device="cpu", max_model_len=192,
                                           kv_cache_memory_bytes=64 * BLOCK_BYTES), str(tiny_llama))
    bad = StructuredOutputs("json", '{"type": "objekt"}')
    reqs = [constrained("cut", [5, 6, 7], json_spec(SCHEMA), seed=1, max_tokens=4),
            constrained("bad", [5, 6, 7], bad, seed=2),
            constrained("same1", [8, 9], StructuredOutputs("regex", REGEX), seed=3),
            constrained("same2", [8, 9, 10], StructuredOutputs("regex", REGEX), seed=4),
            EngineCoreRequest("plain", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6,
                                                                 ignore_eos=True), None, time.time())]
    tokens, last, rejected = drive(core, reqs)
    assert last["cut"].finish_reason == "length" and len(tokens["cut"]) == 4
    assert [(rid, status) for rid, _, status in rejected] == [("bad", 400)]
    assert "objekt" in rejected[0][1]
    assert "bad" not in tokens  # no output: the front end answers the error
    assert last["plain"].finish_reason == "length" and len(tokens["plain"]) == 6
    for rid in ("same1", "same2"):
        assert re.fullmatch(REGEX, tokenizer.decode(tokens[rid], skip_special_tokens=True), re.ASCII)
    assert core.grammars.compiles == 2  # SCHEMA and REGEX; the bad one failed
    with pytest.raises(RequestRejected, match="objekt") as e:  # a known bad grammar: refused at once
        core.add_request(constrained("bad-again", [5], bad, seed=5))
    assert e.value.status == 400
    assert not core.has_work()
    core.close()


def utf8(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> bool:
    """The tokens' bytes are whole UTF-8 text (a grammar of text admits nothing else)."""
    return "\ufffd" not in tokenizer.decode(ids, skip_special_tokens=True)


def test_a_grammar_that_admits_any_text_changes_nothing(tiny_llama: Path, tokenizer) -> None:
    """Greedy text under a regex any text matches equals greedy text without it: the mask masks nothing it
    should not (the end-of-sequence token included). Random weights also write stray UTF-8 bytes, which no
    grammar of text admits: only the prompts whose plain answer is text are compared."""
    core = EngineCore.from_args(EngineArgs(device="cpu", max_model_len=192,
                                           kv_cache_memory_bytes=64 * BLOCK_BYTES), str(tiny_llama))
    prompts = {f"p{i}": [3 + (37 * i) % 300, 3 + (11 * i) % 300] for i in range(32)}

    def run(spec: StructuredOutputs | None, ids: dict[str, list[int]]) -> dict[str, list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=8, structured=spec)
        reqs = [EngineCoreRequest(rid, p, params, None, time.time()) for rid, p in ids.items()]
        return drive(core, reqs)[0]

    plain = run(None, prompts)
    text = {rid: prompts[rid] for rid, ids in plain.items() if utf8(tokenizer, ids)}
    assert len(text) >= 2, "too few prompts whose greedy answer is text"
    assert run(StructuredOutputs("regex", r"[\s\S]*"), text) == {rid: plain[rid] for rid in text}
    # a JSON schema that admits any string, its opening quote already output (a resumed answer's prior
    # token): greedy text inside the string is the plain greedy text where that text may stand in a string
    (quote,) = tokenizer.encode('"')
    quoted = {rid: p + [quote] for rid, p in prompts.items()}
    plain = run(None, quoted)
    bare = {rid: quoted[rid] for rid, ids in plain.items() if len(ids) == 8 and utf8(tokenizer, ids)
            and not re.search(r'["\\\x00-\x1f]', tokenizer.decode(ids))}
    assert len(bare) >= 2, "too few prompts whose greedy answer may stand in a JSON string"
    params = SamplingParams(temperature=0.0, max_tokens=8, prior_output_tokens=1,
                            structured=StructuredOutputs("json", '{"type": "string"}'))
    got = drive(core, [EngineCoreRequest(rid, p, params, None, time.time()) for rid, p in bare.items()])[0]
    assert got == {rid: plain[rid] for rid in bare}
    # a batch of greedy rows whose argmax the grammar mostly refuses (the sampler's masked argmax)
    reqs = [EngineCoreRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_tokens=200,
                                                         structured=json_spec(SCHEMA)), None, time.time())
            for i, p in enumerate(list(prompts.values())[:4])]
    tokens, last, _ = drive(core, reqs)
    assert sorted(tokens) == ["g0", "g1", "g2", "g3"]
    for rid, ids in tokens.items():
        assert last[rid].finish_reason == "stop", rid
        jsonschema.validate(json.loads(tokenizer.decode(ids, skip_special_tokens=True), strict=False), SCHEMA)
    core.close()


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_json_object_takes_any_object_and_strict_schemas_only_theirs(tiny_llama: Path, tokenizer,
                                                                     backend: str) -> None:
    """``json_object`` is any object (not only ``{}``); a strict schema refuses a property it does not name,
    a non-strict one (``json_schema.strict: false``) takes it."""
    core = tight_core(tiny_llama, backend)
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})

    def takes(spec: StructuredOutputs, text: str) -> bool:
        state = core.grammars.state(spec)
        state.future.result(timeout=60)
        state.start()
        return all(state.matcher.accept(t) for t in tokenizer.encode(text))

    assert takes(StructuredOutputs("json_object"), '{"zebra": [1, {"b": null}], "c": "d"}')
    assert takes(StructuredOutputs("json", schema), '{"a": 1}')
    assert not takes(StructuredOutputs("json", schema), '{"a": 1, "b": 2}')
    assert takes(StructuredOutputs("json", schema, strict=False), '{"a": 1, "b": 2}')
    core.close()


BROKEN = {"surrogate ED A0 80": b"\xed\xa0\x80", "surrogate ED BF BF": b"\xed\xbf\xbf",
          "overlong C0 80": b"\xc0\x80", "overlong E0 80 80": b"\xe0\x80\x80",
          "past U+10FFFF": b"\xf4\x90\x80\x80", "stray continuation": b"\x80", "F5": b"\xf5"}
WHOLE = {"U+D7FF": b"\xed\x9f\xbf", "U+4E00": b"\xe4\xb8\x80", "U+10FFFF": b"\xf4\x8f\xbf\xbf"}


@pytest.mark.parametrize("backend", ["xgrammar", "guidance"])
def test_a_json_string_takes_whole_utf8_characters_only(tokenizer, backend: str) -> None:
    """Written byte by byte (the tiny tokenizer has a token for every byte), a JSON string takes only UTF-8:
    the matcher refuses the first byte that breaks it and the mask it fills leaves that byte's token out.
    xgrammar alone took the encoded surrogates (U+D800-U+DFFF): random weights put them into strings, which
    the client decoded as U+FFFD characters, past the schema's maxLength (now: the guard, structured.utf8)."""
    vocab = len(tokenizer)
    lib = load_backend(StructuredOutputsConfig(backend=backend), tokenizer, vocab, tokenizer.eos_token_id)
    compiled = lib.compile("json", json.dumps({"type": "string", "maxLength": 4}), True, True)
    byte_token = {b: tokenizer.convert_tokens_to_ids(c) for c, b in _byte_decoder().items()}

    def refused_at(data: bytes) -> int | None:
        """The index of the first byte of '"' + data the matcher refuses (its mask must refuse it too)."""
        m = lib.matcher(compiled)
        for i, b in enumerate(b'"' + data):
            bitmask = torch.full((1, token_mask.words(vocab)), -1, dtype=torch.int32)
            m.fill(bitmask, 0)
            t = byte_token[b]
            masked = not (int(bitmask[0, t >> 5]) >> (t & 31)) & 1
            took = m.accept(t)
            assert took != masked, (data, i)
            if not took:
                return i
        return None

    for name, data in BROKEN.items():
        assert refused_at(data) is not None, name
    assert refused_at(b"\xed\xa0\x80") == 2  # at the byte that makes it a surrogate
    for name, data in WHOLE.items():
        assert refused_at(data + b'"') is None, name
