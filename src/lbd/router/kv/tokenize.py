"""Tokenize requests in the router as the engine does: its tokenizer.json (the `tokenizers` library, never
transformers) and its chat template (jinja2, in the sandbox and with the helpers Hugging Face templates use).

Multi-turn chat resends the whole history each turn, and tokenizing it again would cost milliseconds. But a
tokenizer splits its input at added tokens (``<|im_start|>``...) before anything else, so the rendered prompt
is tokenized piece by piece: each text piece between added tokens is looked up in an LRU cache, and only new
pieces (the new turn) are encoded. This is exact when no added token strips its neighbours and pieces are
normalized alone; it is checked when the tokenizer is loaded (else whole prompts are encoded).
Cached ids are kept as ``array("i")``: 4 bytes a token instead of a list's 8-byte pointer to a 32-byte int
(36 MiB instead of 300 MiB for 4,000 cached 2,000-token prompts).
Large new pieces are encoded off the event loop with ``encode_batch``: ``Tokenizer.encode`` holds the GIL for
the whole call (a thread running it stalls the loop just the same), ``encode_batch`` releases it.

The head of a text (up to a space: a pre-tokenizer boundary for byte-level BPE and SentencePiece alike)
tokenizes to a prefix of the whole text's ids, which is also checked at load (``by_heads``): the router reads
a new prompt's first blocks from its head (``lbd.router.kv.cold``) without waiting for the rest.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer

from lbd.router.kv.forward import advertised

CACHE_PIECES = 16_384
CACHE_CHARS = 32 << 20
_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_HEAD_PROBE = (
    "Alice's 12345 cats, at 3.14159 o'clock -- and Bob's (naïve) dogs! Ask: why?  Twice spaced; "
    "tabs\there, CamelCaseWords and snake_case_words, e-mail@example.com 1,000,000 times."
)
_PROBE = [
    {"role": "system", "content": "You are kind."},
    {"role": "user", "content": "Hi there, friend!"},
    {"role": "assistant", "content": " Hello!  How can I help?"},
    {"role": "user", "content": "x\n\n y"},
]


class NotTokenizable(ValueError):
    """The request cannot be tokenized here (no template, a template error, content we do not render)."""


@dataclass(slots=True)
class Plan:
    """A prompt as pieces: token ids (added tokens, special prefix/suffix) or text still to look up."""

    pieces: list[str | Sequence[int]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    @property
    def missing_chars(self) -> int:
        return sum(len(s) for s in self.missing)


def _compile(template: str) -> Any:
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # HF's {% generation %} marks assistant text; rendering ignores it
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type", "text") != "text":
                raise NotTokenizable("non-text content parts")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise NotTokenizable("message content is not text")


class RouterTokenizer:
    def __init__(self, tokenizer_json: str, info: dict[str, Any]) -> None:
        self.rust = Tokenizer.from_str(tokenizer_json)
        self.fingerprint = advertised(info)  # ranks advertising it take our ids (lbd.router.kv.forward)
        template = info.get("chat_template")
        self.template_source = template if isinstance(template, str) and template else None
        self.template = _compile(template) if self.template_source else None
        specials = info.get("special_tokens_map") or {}
        self.template_vars = {
            k: v for k, v in {**info, **specials}.items() if k.endswith("_token") and isinstance(v, str)
        }
        self._cache: OrderedDict[str, Sequence[int]] = OrderedDict()
        self._cache_chars = 0
        added = self.rust.get_added_tokens_decoder()
        self._added = {t.content: i for i, t in added.items() if t.content}
        self._added_piece = {c: [i] for c, i in self._added.items()}  # one list per token: pieces are shared
        self._split = (
            re.compile("(" + "|".join(re.escape(c) for c in sorted(self._added, key=len, reverse=True)) + ")")
            if self._added
            else None
        )
        self.prefix, self.suffix = self._special_ends()
        self.by_pieces = self._pieces_are_exact(added.values())
        self.by_heads = self.by_pieces and self._heads_are_exact()

    # ---- set-up checks --------------------------------------------------------------------------------
    def _special_ends(self) -> tuple[list[int], list[int]]:
        """Ids a plain prompt gets around it with add_special_tokens (BOS, EOS), from the post-processor."""
        plain = self.rust.encode("Hello", add_special_tokens=False).ids
        full = self.rust.encode("Hello", add_special_tokens=True).ids
        for i in range(len(full) - len(plain) + 1):
            if full[i : i + len(plain)] == plain:
                return full[:i], full[i + len(plain) :]
        return [], []

    def _pieces_are_exact(self, added: Any) -> bool:
        if any(t.lstrip or t.rstrip or t.single_word for t in added):
            return False
        if self.rust.normalizer is not None and any(t.normalized for t in added):
            return False
        probe = self.render(_PROBE, True) if self.template is not None else "Hi there<|probe|> friend"
        whole = self.rust.encode(probe, add_special_tokens=False).ids
        self.by_pieces = True
        plan = self.plan_text(probe, False)
        self.fill(plan, self.encode_missing(plan))
        return self.assemble(plan) == whole

    def _heads_are_exact(self) -> bool:
        whole = self.rust.encode(_HEAD_PROBE, add_special_tokens=False).ids
        for end in range(8, len(_HEAD_PROBE), 7):
            head = self.head(_HEAD_PROBE, end)
            if head and whole[: len(ids := self.rust.encode(head, add_special_tokens=False).ids)] != ids:
                return False
        return True

    @staticmethod
    def head(text: str, max_chars: int) -> str | None:
        """``text`` up to its last single space within ``max_chars`` that follows and precedes a non-space
        (a split every pre-tokenizer we load makes), or None when there is none."""
        cut = text.rfind(" ", 1, max_chars)
        while cut > 0 and (text[cut - 1].isspace() or cut + 1 >= len(text) or text[cut + 1].isspace()):
            cut = text.rfind(" ", 1, cut)
        return text[:cut] if cut > 0 else None

    # ---- rendering ------------------------------------------------------------------------------------
    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Any = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        if self.template is None:
            raise NotTokenizable("the model has no chat template")
        chat = []
        for m in messages:
            if not isinstance(m, dict):
                raise NotTokenizable("a message is not an object")
            chat.append({**m, "content": _text(m.get("content"))})
        if continue_final_message and chat:
            chat[-1]["content"] += _TAG
        try:
            text = self.template.render(
                messages=chat,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                **{**self.template_vars, **(kwargs or {})},
            )
        except Exception as e:  # template errors, raise_exception(), odd message shapes
            raise NotTokenizable(f"chat template: {e}") from None
        if continue_final_message:
            at = text.rfind(_TAG.strip())
            if at < 0:
                raise NotTokenizable("continue_final_message: the template dropped the final message")
            text = text[:at] if text[at : at + len(_TAG)] == _TAG else text[:at].rstrip()
        return text

    # ---- tokenizing ------------------------------------------------------------------------------------
    def plan_request(self, data: dict[str, Any]) -> Plan | None:
        """The prompt of a chat or completions body, or None when the body has none we can tokenize."""
        messages = data.get("messages")
        if isinstance(messages, list):
            if not messages:
                return None
            kwargs = data.get("chat_template_kwargs")
            text = self.render(
                messages,
                bool(data.get("add_generation_prompt", True)),
                bool(data.get("continue_final_message", False)),
                data.get("tools"),
                kwargs if isinstance(kwargs, dict) else None,
            )
            return self.plan_text(text, False)
        prompt = data.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: the first prompt keys it
        if isinstance(prompt, str) and prompt:
            return self.plan_text(prompt, bool(data.get("add_special_tokens", True)))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return Plan(pieces=[prompt])
        return None

    def plan_text(self, text: str, add_special_tokens: bool) -> Plan:
        plan = Plan()
        if add_special_tokens and self.prefix:
            plan.pieces.append(self.prefix)
        parts = self._split.split(text) if self._split is not None and self.by_pieces else [text]
        cache, added = self._cache, self._added
        for i, part in enumerate(parts):  # odd parts are the added tokens the split found
            if not part:
                continue
            if i % 2 and part in added:
                plan.pieces.append(self._added_piece[part])
                continue
            hit = cache.get(part)
            if hit is None:
                plan.missing.append(part)
                plan.pieces.append(part)
            else:
                cache.move_to_end(part)
                plan.pieces.append(hit)
        if add_special_tokens and self.suffix:
            plan.pieces.append(self.suffix)
        return plan

    def encode_missing(self, plan: Plan, off_loop: bool = False) -> list[Sequence[int]]:
        """Token ids of the plan's new pieces (thread-safe: touches no shared state). ``off_loop``: in a
        thread, so through ``encode_batch``, which lets go of the GIL while it works."""
        if not plan.missing:
            return []
        if len(plan.missing) == 1 and not off_loop:
            return [array("i", self.rust.encode(plan.missing[0], add_special_tokens=False).ids)]
        return [array("i", e.ids) for e in self.rust.encode_batch(plan.missing, add_special_tokens=False)]

    def fill(self, plan: Plan, encoded: Sequence[Sequence[int]]) -> None:
        """Cache the new pieces' ids (on the event loop's thread)."""
        cache = self._cache
        for text, ids in zip(plan.missing, encoded, strict=True):
            if text not in cache:
                cache[text] = ids
                self._cache_chars += len(text)
        while cache and (len(cache) > CACHE_PIECES or self._cache_chars > CACHE_CHARS):
            old, _ = cache.popitem(last=False)
            self._cache_chars -= len(old)
        found = {t: cache.get(t, ids) for t, ids in zip(plan.missing, encoded, strict=True)}
        plan.pieces = [found[p] if isinstance(p, str) else p for p in plan.pieces]
        plan.missing = []

    @staticmethod
    def assemble(plan: Plan) -> list[int]:
        ids: list[int] = []
        for p in plan.pieces:
            ids += p  # type: ignore[arg-type]
        return ids


def load_local(path: str) -> RouterTokenizer:
    """``lbd route --tokenizer``: a tokenizer.json, or a folder with it, its tokenizer_config.json and
    chat_template.jinja (either may hold the chat template)."""
    from pathlib import Path

    p = Path(path)
    folder = p if p.is_dir() else p.parent
    tokenizer_json = (p / "tokenizer.json" if p.is_dir() else p).read_text()
    info: dict[str, Any] = {}
    config = folder / "tokenizer_config.json"
    if config.is_file():
        raw = json.loads(config.read_text())
        for key, value in raw.items():
            if isinstance(value, dict) and "content" in value:
                value = value["content"]  # an AddedToken's serialized form
            info[key] = value
    template = folder / "chat_template.jinja"
    if template.is_file():
        info["chat_template"] = template.read_text()
    return RouterTokenizer(tokenizer_json, info)
