"""POST /v1/completions (legacy completions: text or token prompts, batches of prompts, echo)."""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from lbd.engine.server.generate import Generation, PromptInput
from lbd.engine.server.logprobs import CompletionLogprobs
from lbd.engine.server.openai_protocol import (
    CompletionRequest,
    header_priority,
    parse_completion,
    plan_tokens,
)
from lbd.engine.server.request_io import checked_state, read_json
from lbd.engine.server.sequence import Delta, Sequence
from lbd.engine.server.streaming import respond
from lbd.engine.server.token_ids import EmittedIds


async def completions(request: web.Request) -> web.StreamResponse:
    state = checked_state(request)
    body = await read_json(request)
    sent = state.forwarded.take(body)
    req = parse_completion(body, state.limits)
    req.common.priority = header_priority(request.headers, req.common.priority)
    model = state.check_model(req.common.model)
    tok = state.tokenizer
    inputs: list[PromptInput] = []
    texts: list[str] = []
    limits = state.limits
    if sent is not None and not (len(req.prompts) == 1 and isinstance(req.prompts[0], str)):
        sent = None  # ids stand for one text prompt: a batch or a token prompt is used as sent
    for prompt in req.prompts:
        if isinstance(prompt, list):
            ids = prompt
        else:
            own = partial(state.offload.encode, prompt, req.add_special_tokens)
            ids = await (own() if sent is None else state.forwarded.resolve(sent, own))
        inputs.append(PromptInput(ids, plan_tokens(ids, req.common.max_tokens, limits, "prompt")))
        texts.append(prompt if isinstance(prompt, str) else tok.decode(prompt) if req.echo else "")
    gen = Generation(state, "cmpl", inputs, req.common)
    return await respond(request, gen, CompletionFormatter(gen, model, req, texts))


class CompletionFormatter:
    def __init__(self, gen: Generation, model: str, req: CompletionRequest, prompt_texts: list[str]) -> None:
        self.gen = gen
        self.model = model
        self.tok = gen.state.tokenizer
        self.echo = req.echo
        self.prompt_texts = prompt_texts
        self.want_logprobs = req.common.logprobs is not None
        n = len(gen.seqs)
        self._text: list[list[str]] = [[] for _ in range(n)]
        self._logprobs = [CompletionLogprobs() for _ in range(n)]
        self._ids = EmittedIds(n) if req.common.return_token_ids else None
        self._out_ids: list[list[int]] = [[] for _ in range(n)]
        self._prompt_sent: set[int] = set()

    def _prefix(self, seq: Sequence) -> str:
        return self.prompt_texts[seq.prompt_index] if self.echo else ""

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.gen.id, "object": "text_completion", "created": self.gen.created,
                "model": self.model, "choices": choices}

    def stream_start(self, seq: Sequence) -> dict[str, Any] | None:
        if not self.echo:
            return None
        return self._chunk([{"index": seq.index, "text": self._prefix(seq), "logprobs": None,
                             "finish_reason": None, "stop_reason": None}])

    def stream_chunk(self, delta: Delta) -> dict[str, Any] | None:
        # return_token_ids: text, ids and logprobs go out together, whole tokens at a time (token_ids)
        out = self._ids.take(delta) if self._ids is not None else None
        text, ids, lps, offsets = out if out is not None else (delta.text, delta.token_ids, delta.logprobs,
                                                                 delta.offsets)
        if not text and not delta.finished and not (self.want_logprobs and ids):
            return None
        lp = None
        if self.want_logprobs and lps is not None:
            acc = CompletionLogprobs()
            acc.add(self.tok, ids, lps, offsets, len(self._prefix(delta.seq)))
            lp = acc.as_dict()
        seq = delta.seq
        choice = {"index": seq.index, "text": text, "logprobs": lp,
                  "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason}
        if out is not None:
            self._with_ids(choice, seq, ids)
        return self._chunk([choice])

    def _with_ids(self, choice: dict[str, Any], seq: Sequence, ids: list[int]) -> None:
        """return_token_ids: the choice's ids, and the prompt's with its first chunk."""
        if seq.index not in self._prompt_sent:
            self._prompt_sent.add(seq.index)
            choice["prompt_token_ids"] = seq.prompt_ids
        choice["token_ids"] = ids

    def collect(self, delta: Delta) -> None:
        i = delta.seq.index
        self._text[i].append(delta.text)
        if self._ids is not None:
            self._out_ids[i].extend(self._ids.take(delta).token_ids)
        if self.want_logprobs and delta.logprobs is not None:
            self._logprobs[i].add(self.tok, delta.token_ids, delta.logprobs, delta.offsets,
                                  len(self._prefix(delta.seq)))

    def response(self) -> dict[str, Any]:
        choices = [{"index": s.index, "text": self._prefix(s) + "".join(self._text[s.index]),
                    "logprobs": self._logprobs[s.index].as_dict() if self.want_logprobs else None,
                    "finish_reason": s.finish_reason, "stop_reason": s.stop_reason} for s in self.gen.seqs]
        if self._ids is not None:
            for s, c in zip(self.gen.seqs, choices, strict=True):
                self._with_ids(c, s, self._out_ids[s.index])
        return {**self._chunk(choices), "usage": self.gen.usage(), **self.gen.kv_transfer_field()}

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._chunk([]), "usage": self.gen.usage()}
