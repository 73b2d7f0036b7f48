"""POST /v1/chat/completions.

A stream that lbd's router resumes here after its rank failed (``lbd.router.continuation``) comes as the same
chat request with ``lbd_resumed_output_token_ids``: the output tokens the client already has. The prompt is
the rendered messages followed by them; they count as output (penalties, and the request's grammar starts
past them: tool_choice "required" or named, response_format, structured outputs); the answer's formatter
reads their text first without sending anything (``ChatFormatter``'s ``prior``), so its tool-call parser is
where the broken stream's was: an announced call is not announced again (no second id or name), its
arguments go on where they stopped, and the finish reason is the one the whole answer earns. The stream
starts without the role delta the client had already.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from aiohttp import web

from lbd.engine.server.errors import bad_request
from lbd.engine.server.fields import Fields
from lbd.engine.server.generate import Generation, PromptInput
from lbd.engine.server.logprobs import chat_entries
from lbd.engine.server.openai_protocol import CommonParams, header_priority, parse_chat, plan_tokens
from lbd.engine.server.request_io import checked_state, read_json
from lbd.engine.server.sequence import Delta, Sequence
from lbd.engine.server.state import FrontendState
from lbd.engine.server.streaming import respond
from lbd.engine.server.token_ids import EmittedIds
from lbd.engine.server.tool_choice import ForcedTools, ToolCallStream, auto_parser, tool_calls
from lbd.engine.server.tool_parsers import PARSERS, ToolParser
from lbd.engine.tokenizer import ChatTemplateError, IncrementalDetokenizer
from lbd.wire.core_messages import TokenLogprobs


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state = checked_state(request)
    body = await read_json(request)
    sent = state.forwarded.take(body)
    req = parse_chat(body, state.limits)
    req.common.priority = header_priority(request.headers, req.common.priority)
    model = state.check_model(req.common.model)
    fields = Fields(body)
    auto = auto_parser(fields, req.tools, server_tool_parser(state), absent_is_auto=True)

    def own() -> Awaitable[list[int]]:
        return render_prompt_ids(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                                 req.tools, req.template_kwargs)

    prior = resumed_output(fields, req.common, state.limits.vocab_size)
    ids = await (own() if sent is None else state.forwarded.resolve(sent, own))
    prior_text = None if prior is None else resumed_text(state, ids, prior, req.common)
    ids = ids + (prior or [])
    max_tokens = plan_tokens(ids, req.common.max_tokens, state.limits, "messages")
    gen = Generation(state, "chatcmpl", [PromptInput(ids, max_tokens)], req.common)
    fmt = ChatFormatter(gen, model, req.forced_tools, PARSERS[auto] if auto else None,
                        fields.bool("parallel_tool_calls", True), prior_text)
    return await respond(request, gen, fmt)


RESUMED_IDS = "lbd_resumed_output_token_ids"  # (lbd.router.continuation's RESUMED_IDS_FIELD)


def resumed_output(f: Fields, common: CommonParams, vocab_size: int) -> list[int] | None:
    """The output a resumed stream already sent (``RESUMED_IDS``; None: a new request); they count as output
    (``prior_output_tokens``). Only a stream of one choice resumes, and not with the completions field too."""
    if f.raw(RESUMED_IDS) is None:
        return None
    prior = f.int_list(RESUMED_IDS, lo=0, hi=vocab_size - 1)
    if not common.stream or common.n != 1:
        raise bad_request(f"'{RESUMED_IDS}' resumes a stream of one choice: it needs stream true and n 1",
                          RESUMED_IDS)
    if common.sampling.prior_output_tokens:
        raise bad_request(f"'{RESUMED_IDS}' and 'lbd_resumed_output_tokens' cannot both be set", RESUMED_IDS)
    common.sampling.prior_output_tokens = len(prior)
    return prior


def resumed_text(state: FrontendState, prompt: list[int], prior: list[int], common: CommonParams) -> str:
    """The text of ``prior`` as the broken stream's detokenizer made it (after the same prompt)."""
    detok = IncrementalDetokenizer(state.tokenizer, prompt, None, common.skip_special_tokens)
    for token_id in prior:
        detok.add(token_id)
    return detok.text


def server_tool_parser(state: FrontendState) -> str | None:
    """The parser ``tool_choice: "auto"`` answers are read with (None: ``--enable-auto-tool-choice`` is
    off)."""
    server = state.config.server
    return server.tool_call_parser if server.enable_auto_tool_choice else None


async def render_prompt_ids(state: FrontendState, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                            param: str = "messages") -> list[int]:
    """The chat template applied to ``messages``, tokenized (long prompts in the tokenizer worker); shared
    with the Responses API."""
    try:
        text = state.tokenizer.render_chat(messages, add_generation_prompt, continue_final_message, tools,
                                           template_kwargs or {})
    except ChatTemplateError as e:
        raise bad_request(str(e), param) from e
    return await state.offload.encode(text, False)


class ChatFormatter:
    """Chat's JSON shapes. The text is content, or tool calls: forced (``tool_choice`` "required" or named,
    server.tool_choice) or read by the server's parser under "auto" (server.tool_parsers); with
    ``parallel_tool_calls: false`` only the first call goes out, as vLLM does.

    ``prior``: a resumed stream's text so far (``resumed_output``; None: not resumed), read by the parsers and
    never sent again.
    With ``return_token_ids`` a token whose text gave the client nothing yet (a tool tag, a call's name being
    read) goes out with the next chunk that does (``_held``): the ids a chunk carries are those whose text
    the formatter has read, so a router resuming the stream sends back exactly the tokens the parser had
    seen when the client's last chunk left."""

    def __init__(self, gen: Generation, model: str, forced: ForcedTools | None = None,
                 auto: ToolParser | None = None, parallel: bool = True, prior: str | None = None) -> None:
        self.gen = gen
        self.model = model
        self.forced = forced
        self.auto = auto
        self.parallel = parallel
        self._calls = [ToolCallStream(forced) for _ in gen.seqs] if forced is not None else None
        self._auto = [auto.stream() for _ in gen.seqs] if auto is not None else None
        self._called = [False] * len(gen.seqs)  # "auto": the answer holds calls (finish reason tool_calls)
        self.tok = gen.state.tokenizer
        self.want_logprobs = gen.common.logprobs is not None
        n = len(gen.seqs)
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._logprobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]
        self._ids = EmittedIds(n) if gen.common.return_token_ids else None
        self._out_ids: list[list[int]] = [[] for _ in range(n)]
        self._held: list[list[int]] = [[] for _ in range(n)]
        self.resumed = prior is not None  # (even with no text yet: the client has its role delta)
        for i in range(n if prior else 0):  # what it gives went out from the broken stream's rank
            self._delta_body(i, prior or "", False)

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.gen.id, "object": "chat.completion.chunk", "created": self.gen.created,
                "model": self.model, "choices": [choice]}

    def stream_start(self, seq: Sequence) -> dict[str, Any] | None:
        if self.resumed:  # the client has its role delta (and the router the prompt's ids)
            return None
        chunk = self._chunk({"index": seq.index, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
        if self._ids is not None:  # return_token_ids: the prompt's ids with the first chunk (as vLLM)
            chunk["prompt_token_ids"] = seq.prompt_ids
            chunk["choices"][0]["token_ids"] = []
        return chunk

    def stream_chunk(self, delta: Delta) -> dict[str, Any] | None:
        # return_token_ids: text, ids and logprobs go out together, whole tokens at a time (token_ids)
        out = self._ids.take(delta) if self._ids is not None else None
        text, ids, lps, _ = out if out is not None else (delta.text, delta.token_ids, delta.logprobs, None)
        body = self._delta_body(delta.seq.index, text, delta.finished)
        if not body and not delta.finished and not (self.want_logprobs and ids):
            if out is not None:
                self._held[delta.seq.index] += ids
            return None
        choice: dict[str, Any] = {"index": delta.seq.index, "delta": body, "logprobs": self._lp(ids, lps),
                                  "finish_reason": self._finish_reason(delta.seq)}
        if delta.finished:
            choice["stop_reason"] = delta.seq.stop_reason
        if out is not None:
            held = self._held[delta.seq.index]
            choice["token_ids"] = held + ids if held else ids
            held.clear()
        return self._chunk(choice)

    def _delta_body(self, index: int, text: str, finished: bool) -> dict[str, Any]:
        if self._auto is not None:
            parser = self._auto[index]
            step = parser.feed(text)
            if finished:
                step += parser.finish()
            self._called[index] = parser.called
            body: dict[str, Any] = {"content": step.content} if step.content else {}
            calls = self._first_only(step.calls)
            return {**body, "tool_calls": calls} if calls else body
        if self._calls is None:
            return {"content": text} if text else {}
        calls = self._first_only(self._calls[index].feed(text))
        return {"tool_calls": calls} if calls else {}

    def _first_only(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return calls if self.parallel else [c for c in calls if c["index"] == 0]

    def _finish_reason(self, seq: Sequence) -> str | None:
        """A forced tool call's grammar that ended reads ``tool_calls`` for "required" (``stop`` when named),
        as OpenAI and vLLM say; an "auto" answer with calls reads ``tool_calls`` (vLLM: when it stopped, in a
        stream; whatever ended it, whole)."""
        if self.forced is not None and seq.finish_reason == "stop":
            return self.forced.finish_reason
        if self._called[seq.index] and (seq.finish_reason == "stop" or not self.gen.common.stream):
            return "tool_calls"
        return seq.finish_reason

    def _message(self, index: int) -> dict[str, Any]:
        text = "".join(self._text[index])
        if self.auto is not None:
            found = self.auto.extract(text)
            self._called[index] = bool(found.calls)
            if not found.calls:
                return {"role": "assistant", "content": text}
            calls = found.calls if self.parallel else found.calls[:1]
            return {"role": "assistant", "content": found.content, "tool_calls": calls}
        if self.forced is None:
            return {"role": "assistant", "content": text}
        return {"role": "assistant", "content": "", "tool_calls": tool_calls(self.forced, text)}

    def _lp(self, ids: list[int], lps: list[TokenLogprobs] | None) -> dict[str, Any] | None:
        if not self.want_logprobs or lps is None:
            return None
        return {"content": chat_entries(self.tok, ids, lps)}

    def collect(self, delta: Delta) -> None:
        i = delta.seq.index
        self._text[i].append(delta.text)
        if self._ids is not None:
            self._out_ids[i].extend(self._ids.take(delta).token_ids)
        if self.want_logprobs and delta.logprobs is not None:
            self._logprobs[i].extend(chat_entries(self.tok, delta.token_ids, delta.logprobs))

    def response(self) -> dict[str, Any]:
        messages = [self._message(s.index) for s in self.gen.seqs]  # before the finish reasons: "auto"
        choices = [{"index": s.index, "message": m,
                    "logprobs": {"content": self._logprobs[s.index]} if self.want_logprobs else None,
                    "finish_reason": self._finish_reason(s), "stop_reason": s.stop_reason}
                   for s, m in zip(self.gen.seqs, messages, strict=True)]
        out = {"id": self.gen.id, "object": "chat.completion", "created": self.gen.created,
               "model": self.model, "choices": choices, "usage": self.gen.usage(),
               **self.gen.kv_transfer_field()}
        if self._ids is not None:
            out["prompt_token_ids"] = self.gen.seqs[0].prompt_ids
            for s, c in zip(self.gen.seqs, choices, strict=True):
                c["token_ids"] = self._out_ids[s.index]
        return out

    def usage_chunk(self) -> dict[str, Any]:
        return {"id": self.gen.id, "object": "chat.completion.chunk", "created": self.gen.created,
                "model": self.model, "choices": [], "usage": self.gen.usage()}
