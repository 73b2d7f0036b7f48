"""The OpenAI Responses API: ``POST /v1/responses`` (stream and not), ``GET`` and ``DELETE
/v1/responses/{id}``. Text, structured text (``text.format``) or function calls (``tools``: the items and
their events are ``responses_items``'); what is refused is listed in ``responses_protocol``.

The prompt is the chat template over ``instructions`` (as a system message, never carried to the next turn,
as in OpenAI's API), the stored conversation of ``previous_response_id`` and the new input items. A streamed
answer uses the official event types: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta``...,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, then
``response.completed``, each as ``event: <type>`` plus ``data: <json>`` with a ``sequence_number``, and no
``[DONE]`` line. A response cut by ``max_output_tokens`` has status ``incomplete`` (and
``incomplete_details.reason``) but still ends with ``response.completed``, as vLLM's does: OpenAI sends
``response.incomplete`` there, which the openai SDK's ``responses.stream()`` helper and clients written for
vLLM do not take as the end.

Response ids carry the DP rank (``resp_r<rank>-<hex>``): ``lbd route`` pins a ``previous_response_id`` (and a
GET/DELETE of an id) to the rank whose store holds it.
"""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from lbd.engine.server.chat import render_prompt_ids, server_tool_parser
from lbd.engine.server.errors import APIError
from lbd.engine.server.fields import Fields
from lbd.engine.server.generate import Generation, PromptInput
from lbd.engine.server.openai_protocol import check_prompt_chars, header_priority, plan_tokens
from lbd.engine.server.request_io import check_rank, checked_state, read_json, state_of
from lbd.engine.server.responses_items import OutputItems, text_part
from lbd.engine.server.responses_protocol import ResponsesRequest, parse_responses
from lbd.engine.server.sequence import Delta, Sequence
from lbd.engine.server.streaming import EventFraming, json_response, respond
from lbd.engine.server.tool_choice import auto_parser
from lbd.engine.server.tool_parsers import PARSERS, ToolParser


async def create_response(request: web.Request) -> web.StreamResponse:
    state = checked_state(request)
    req = parse_responses(await read_json(request))
    req.common.priority = header_priority(request.headers, req.common.priority)
    model = state.check_model(req.common.model)
    auto = auto_parser(Fields({"tool_choice": req.tool_choice}), req.tools, server_tool_parser(state))
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        record = state.responses.get(req.previous_response_id)
        if record is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        history = record["messages"]
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages = system + history + req.input_messages
    check_prompt_chars(sum(len(str(m["content"])) for m in messages), state.limits, "input")
    ids = await render_prompt_ids(state, messages, tools=req.tools, param="input")
    max_tokens = plan_tokens(ids, req.common.max_tokens, state.limits, "input")
    gen = Generation(state, f"resp_r{state.config.rank}", [PromptInput(ids, max_tokens)], req.common)
    return await respond(request, gen, ResponsesFormatter(gen, model, req, history,
                                                          PARSERS[auto] if auto else None))


async def get_response(request: web.Request) -> web.Response:
    state = state_of(request)
    check_rank(request, state)
    response_id = request.match_info["response_id"]
    record = state.responses.get(response_id)
    if record is None:
        raise _not_found(response_id, "response_id")
    return json_response(record["response"])


async def delete_response(request: web.Request) -> web.Response:
    state = state_of(request)
    check_rank(request, state)
    response_id = request.match_info["response_id"]
    if not state.responses.delete(response_id):
        raise _not_found(response_id, "response_id")
    return json_response({"id": response_id, "object": "response", "deleted": True})


def _not_found(response_id: str, param: str) -> APIError:
    return APIError(f"Response with id '{response_id}' not found.", 404, param, "NotFoundError")


class ResponsesFormatter(EventFraming):
    """One response object, or its stream of events; stores the finished response when asked to."""

    done = b""

    def __init__(self, gen: Generation, model: str, req: ResponsesRequest, history: list[dict[str, Any]],
                 auto: ToolParser | None = None) -> None:
        self.gen = gen
        self.model = model
        self.req = req
        self.history = history
        self.msg_id = "msg_" + gen.id.rpartition("-")[2]
        self._text: list[str] = []
        self._seq = 0
        self._store = req.store and gen.state.responses.enabled
        # the text may hold tool calls: items opened as they come (responses_items); else one message
        parallel = bool(req.echo.get("parallel_tool_calls", True))
        self.items = (OutputItems(self.msg_id, req.forced, auto, parallel)
                      if req.forced is not None or auto is not None else None)
        self._streamed = False

    # ---- framing --------------------------------------------------------------------------------------
    def encode(self, event: dict[str, Any]) -> bytes:
        event["sequence_number"] = self._seq
        self._seq += 1
        return b"event: %s\ndata: %s\n\n" % (event["type"].encode(), orjson.dumps(event))

    def lead_in(self) -> list[dict[str, Any]]:
        started = self._response("in_progress", [], None)
        if self.items is not None:
            return [{"type": "response.created", "response": started},
                    {"type": "response.in_progress", "response": started}]
        item = {"id": self.msg_id, "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        return [{"type": "response.created", "response": started},
                {"type": "response.in_progress", "response": started},
                {"type": "response.output_item.added", "output_index": 0, "item": item},
                {"type": "response.content_part.added", "item_id": self.msg_id, "output_index": 0,
                 "content_index": 0, "part": text_part("")}]

    def closing(self) -> list[dict[str, Any]]:
        final = self._final()
        if self.items is not None:
            return [*self.items.closing(final["status"] == "incomplete"),
                    {"type": "response.completed", "response": final}]
        item, text = final["output"][0], "".join(self._text)
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": text_part(text)},
                {"type": "response.output_item.done", "output_index": 0, "item": item},
                {"type": "response.completed", "response": final}]

    def error_event(self, message: str, status: int) -> dict[str, Any]:
        code = "server_error" if status >= 500 else "invalid_request_error"
        return {"type": "error", "code": code, "message": message, "param": None}

    # ---- Formatter ------------------------------------------------------------------------------------
    def stream_start(self, seq: Sequence) -> dict[str, Any] | None:
        return None

    def stream_chunk(self, delta: Delta) -> dict[str, Any] | list[dict[str, Any]] | None:
        self.collect(delta)
        if self.items is not None:
            self._streamed = True
            return self.items.feed(delta.text, delta.finished) or None
        if not delta.text:
            return None
        return {"type": "response.output_text.delta", "item_id": self.msg_id, "output_index": 0,
                "content_index": 0, "delta": delta.text, "logprobs": []}

    def collect(self, delta: Delta) -> None:
        if delta.text:
            self._text.append(delta.text)

    def response(self) -> dict[str, Any]:
        return self._final()

    def usage_chunk(self) -> dict[str, Any]:
        raise AssertionError("the Responses API has no usage chunk")  # include_usage is never set

    # ---- the response object --------------------------------------------------------------------------
    def _final(self) -> dict[str, Any]:
        seq = self.gen.seqs[0]
        cut = seq.finish_reason == "length"
        text = "".join(self._text)
        if self.items is None:
            output = [{"id": self.msg_id, "type": "message", "status": "incomplete" if cut else "completed",
                       "role": "assistant", "content": [text_part(text)]}]
            turn: dict[str, Any] = {"role": "assistant", "content": text}
        else:
            if not self._streamed:
                self.items.read(text)
                self._streamed = True  # read once
            output, turn = self.items.items(cut), self.items.history()
        p, c = self.gen.prompt_tokens, self.gen.completion_tokens
        usage = {"input_tokens": p, "input_tokens_details": {"cached_tokens": seq.num_cached},
                 "output_tokens": c, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": p + c}
        final = self._response("incomplete" if cut else "completed", output, usage)
        if cut:
            final["incomplete_details"] = {"reason": "max_output_tokens"}
        else:
            final["completed_at"] = int(time.time())
        if self._store:
            messages = [*self.history, *self.req.input_messages, turn]
            self.gen.state.responses.put(self.gen.id, {"response": final, "messages": messages})
        return final

    def _response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict:
        req = self.req
        return {"id": self.gen.id, "object": "response", "created_at": self.gen.created, "status": status,
                "background": False, "error": None, "incomplete_details": None, "completed_at": None,
                "instructions": req.instructions, "model": self.model, "output": output,
                "previous_response_id": req.previous_response_id, "reasoning": None, "store": self._store,
                "text": {"format": {"type": "text"}}, "tools": [], "truncation": "disabled", "usage": usage,
                **req.echo}

