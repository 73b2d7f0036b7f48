"""The ``tool_choice: "auto"`` parsers (hermes, llama3_json) on real model-style strings: read whole, and
streamed token by token as the engine's detokenizer hands the text out (a real BPE tokenizer), and in
pieces of every size. A stream must announce each call once (index, id, type, name), then send argument
text only, leak no tool markup into content, and agree with the whole-text reading. The flags: an unknown
parser is exit 2 naming the flag and the choices, and they reach ranks as other engine flags do. The
Responses API's items and events over a parsed stream."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lbd.engine.config.args import TOOL_CALL_PARSERS, make_parser, parse_engine_args
from lbd.engine.server.errors import APIError
from lbd.engine.server.fields import Fields
from lbd.engine.server.responses_items import OutputItems
from lbd.engine.server.tool_choice import AUTO_NEEDS_FLAGS, auto_parser
from lbd.engine.server.tool_parsers import PARSERS
from lbd.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from lbd.supervisor.flags import engine_flags

W = {"city": "Paris, \"FR\" {x}", "days": 3}
T = {"zone": "UTC"}
HERMES = [  # (text, content, calls)
    (f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {json.dumps(W)}}}\n</tool_call>\n'
     f'<tool_call>{{"arguments": {json.dumps(T)}, "name": "get_time"}}</tool_call>',
     "Let me check.\n", [("get_weather", W), ("get_time", T)]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>', None,
     [("get_time", {"zone": "CET"})]),
    ("No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 and <tool is not a tag.", []),
]
LLAMA = [
    (f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', None, [("get_weather", W)]),
    (f'<|python_tag|>{{"name": "get_time", "arguments": {json.dumps(T)}}}; '
     f'{{"name": "get_weather", "parameters": {json.dumps(W)}}}', None,
     [("get_time", T), ("get_weather", W)]),
    ("It is sunny {mostly}.", "It is sunny {mostly}.", []),
    ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call: content
]


def _calls(found: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in found]


@pytest.mark.parametrize("name, text, content, calls", [("hermes", *c) for c in HERMES]
                         + [("llama3_json", *c) for c in LLAMA])
def test_whole_answers(name: str, text: str, content: str | None, calls: list) -> None:
    found = PARSERS[name].extract(text)
    assert found.content == content and _calls(found.calls) == calls
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") for c in found.calls)


def _stream(name: str, pieces: list[str]) -> tuple[str, list[tuple[str, Any]], bool]:
    """Feed ``pieces`` as a stream; check the deltas' shape; return (content, calls, called)."""
    parser = PARSERS[name].stream()
    content, names, args = "", [], []
    for i, piece in enumerate(pieces):
        step = parser.feed(piece)
        if i == len(pieces) - 1:
            step += parser.finish()
        assert "<tool_call" not in step.content and "python_tag" not in step.content
        content += step.content
        for d in step.calls:
            if d["index"] == len(names):  # a call's first delta: everything OpenAI sends first
                assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                names.append(d["function"]["name"])
                args.append(d["function"]["arguments"])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                assert d["index"] == len(names) - 1  # calls come in order
                args[d["index"]] += d["function"]["arguments"]
    return content, [(n, json.loads(a)) for n, a in zip(names, args, strict=True)], parser.called


def _tokens(tok: Tokenizer, text: str) -> list[str]:
    """``text`` as the server streams it: one detokenized piece per generated token."""
    detok = IncrementalDetokenizer(tok, tok.encode("Answer:", False))
    pieces = []
    for token_id in tok.encode(text, False):
        detok.add(token_id)
        pieces.append(detok.take())
    pieces[-1] += detok.take(final=True)
    assert "".join(pieces) == text
    return pieces


@pytest.fixture(scope="module")
def tok(tiny_llama: Path) -> Tokenizer:
    return Tokenizer(tiny_llama)


@pytest.mark.parametrize("name, text, content, calls", [("hermes", *c) for c in HERMES]
                         + [("llama3_json", *c) for c in LLAMA])
def test_streamed_token_by_token_and_in_every_piece_size(tok: Tokenizer, name: str, text: str,
                                                         content: str | None, calls: list) -> None:
    splits = [_tokens(tok, text)]
    splits += [[text[i:i + n] for i in range(0, len(text), n)] for n in (1, 2, 3, 7, 500)]
    for pieces in splits:
        got_content, got_calls, called = _stream(name, pieces)
        assert got_calls == calls and called == bool(calls)
        assert got_content == (content or "")


@pytest.mark.parametrize("name, text, content, calls", [("hermes", *c) for c in HERMES]
                         + [("llama3_json", *c) for c in LLAMA])
def test_a_stream_resumed_at_any_token_goes_on_as_the_unbroken_one(tok: Tokenizer, name: str, text: str,
                                                                   content: str | None, calls: list) -> None:
    """What a chat resumed on another rank relies on (server.chat's ``prior``): the client has the steps of
    the text up to a token; a new parser fed that text at once, its steps dropped, then the rest token by
    token, sends what completes the unbroken stream, no call announced twice (checked by ``_stream``'s
    shapes: the steps are replayed into one parser's accounting)."""
    pieces = _tokens(tok, text)
    for j in range(len(pieces) + 1):
        first = PARSERS[name].stream()
        steps = [first.feed(piece) for piece in pieces[:j]]
        again = PARSERS[name].stream()
        again.feed("".join(pieces[:j]))
        steps += [again.feed(piece) for piece in pieces[j:]] + [again.finish()]
        assert again.called == bool(calls), j
        assert _replayed(steps) == ((content or ""), calls), j


def _replayed(steps: list[Any]) -> tuple[str, list[tuple[str, Any]]]:
    """The client's content and calls from parser steps, with OpenAI's shapes checked (as ``_stream``)."""
    content, names, args = "", [], []
    for step in steps:
        content += step.content
        for d in step.calls:
            if d["index"] == len(names):
                assert d["type"] == "function" and d["id"].startswith("chatcmpl-tool-")
                names.append(d["function"]["name"])
                args.append(d["function"]["arguments"])
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                args[d["index"]] += d["function"]["arguments"]
    return content, [(n, json.loads(a)) for n, a in zip(names, args, strict=True)]


def test_hermes_holds_back_a_tag_in_the_making_and_releases_it_at_the_end() -> None:
    parser = PARSERS["hermes"].stream()
    assert parser.feed("Sure <tool").content == "Sure "
    assert parser.feed("_ca").content == ""
    assert parser.finish().content == "<tool_ca"


def test_a_stream_cut_inside_a_call_sends_the_call_so_far() -> None:
    parser = PARSERS["hermes"].stream()
    step = parser.feed('<tool_call>{"name": "get_time", "arguments": {"zone": "U')
    step += parser.finish()
    assert step.content == ""
    assert step.calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "U'}


def test_auto_parser_rules() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert auto_parser(Fields({"tool_choice": "auto"}), tools, "hermes") == "hermes"
    assert auto_parser(Fields({}), tools, "hermes") == "hermes"  # tools without tool_choice: auto
    assert auto_parser(Fields({"tool_choice": "none"}), tools, "hermes") is None
    assert auto_parser(Fields({"tool_choice": "required"}), tools, "hermes") is None  # forced, not parsed
    assert auto_parser(Fields({}), tools, None) is None  # the Responses API: the tools in the prompt, text
    assert auto_parser(Fields({"tool_choice": "none"}), tools, None, absent_is_auto=True) is None
    with pytest.raises(APIError) as absent:  # chat: vLLM reads tools without tool_choice as "auto"
        auto_parser(Fields({}), tools, None, absent_is_auto=True)
    assert absent.value.status == 400 and absent.value.message == AUTO_NEEDS_FLAGS
    with pytest.raises(APIError) as e:
        auto_parser(Fields({"tool_choice": "auto"}), tools, None)
    assert e.value.status == 400 and e.value.message == AUTO_NEEDS_FLAGS


def test_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert set(PARSERS) == set(TOOL_CALL_PARSERS)
    for argv, words in ((["--tool-call-parser", "nope"], ["--tool-call-parser", "hermes", "llama3_json"]),
                        (["--enable-auto-tool-choice"], ["--enable-auto-tool-choice", "--tool-call-parser"])):
        with pytest.raises(SystemExit) as e:
            parse_engine_args(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err
    args = parse_engine_args(["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert args.enable_auto_tool_choice and args.tool_call_parser == "llama3_json"
    parser = make_parser()  # lbd supervise / lbd serve rebuild a rank's engine flags this way
    ns = parser.parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
    dests = {a.dest for a in parser._actions} - {"help"}
    assert engine_flags(parser, ns, dests) == ["--enable-auto-tool-choice", "--tool-call-parser=hermes"]


def test_responses_items_stream_a_message_then_each_call(tok: Tokenizer) -> None:
    """The Responses API's events for an "auto" answer: the message item closes before the first call's
    opens, each call closes before the next, and the whole-text reading gives the same items."""
    text, content, calls = HERMES[0]
    items = OutputItems("msg_1", None, PARSERS["hermes"], True)
    pieces = _tokens(tok, text)
    events = [e for i, p in enumerate(pieces) for e in items.feed(p, i == len(pieces) - 1)]
    events += items.closing(False)
    kinds = [e["type"].removeprefix("response.") for e in events if not e["type"].endswith(".delta")]
    call_events = ["output_item.added", "function_call_arguments.done", "output_item.done"]
    assert kinds == ["output_item.added", "content_part.added", "output_text.done", "content_part.done",
                     "output_item.done", *call_events, *call_events]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]
    streamed = items.items(cut=False)
    whole = OutputItems("msg_1", None, PARSERS["hermes"], True)
    whole.read(text)
    for got in (streamed, whole.items(cut=False)):
        assert got[0]["content"][0]["text"] == content
        assert [(c["name"], json.loads(c["arguments"])) for c in got[1:]] == calls
