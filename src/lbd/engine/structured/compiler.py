"""Grammars compiled off the step loop and cached by schema; each constrained request's state.

The core's loop never compiles: ``GrammarCompiler.state`` returns at once with a ``GrammarState`` whose
compilation runs on one background thread (the libraries compile in native code, with their own threads
where they have them). The scheduler holds the request until its state is ``ready``, then ``start`` gives it
a matcher. Compiled grammars are cached by the request's ``StructuredOutputs`` (least recently used out
past ``CACHE_SIZE``), failures too, so a repeated bad schema costs nothing either. The library, the
tokenizer and the tokenizer's vocabulary tables are loaded on that thread at the first constrained request:
a server that never sees one never pays for them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, Generic, Protocol, TypeVar

from lbd.engine.config.structured import StructuredOutputsConfig
from lbd.engine.structured.backends import Backend, GrammarError, Matcher
from lbd.wire.core_messages import StructuredOutputs

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (a JSON schema's is tens of KB to a few MB)
SLOW_COMPILE_S = 1.0  # compiles slower than this are logged


def load_backend(config: StructuredOutputsConfig, tokenizer: Any, vocab_size: int,
                 eos_token_id: int | None) -> Backend:
    """The configured library over ``tokenizer`` (a Hugging Face fast tokenizer) and the model's
    ``vocab_size`` (the logits' width, which may exceed the tokenizer's); imported only now."""
    if config.library == "guidance":
        from lbd.engine.structured.guidance_backend import GuidanceBackend

        return GuidanceBackend(tokenizer, vocab_size, eos_token_id, config)
    from lbd.engine.structured.xgrammar_backend import XGrammarBackend

    return XGrammarBackend(tokenizer, vocab_size, eos_token_id, config)


class GrammarCompiler:
    def __init__(self, config: StructuredOutputsConfig, tokenizer_path: str, vocab_size: int,
                 eos_token_id: int | None, cache_size: int = CACHE_SIZE) -> None:
        self.config = config
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutputs, Future[Any]] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lbd-grammar")
        self._backend: Backend | None = None
        self._lock = threading.Lock()
        self.compiles = 0  # grammars compiled (cache misses), for tests and logs

    def state(self, spec: StructuredOutputs, prior: Sequence[int] = ()) -> GrammarState:
        """A request's grammar: from the cache, else compiling now on the background thread; ``prior``: output
        it already has (a stream resumed here, ``GrammarState.start``)."""
        fut = self._cache.get(spec)
        if fut is None:
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(spec)
        return GrammarState(spec, fut, self, prior)

    def matcher(self, compiled: Any) -> Matcher:
        assert self._backend is not None  # a compiled grammar exists only once the backend does
        return self._backend.matcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputs) -> Any:
        backend = self._load()
        t0 = time.perf_counter()
        compiled = backend.compile(spec.kind, spec.spec, spec.strict, spec.disable_any_whitespace)
        self.compiles += 1
        took = time.perf_counter() - t0
        if took > SLOW_COMPILE_S:
            logger.info("%s compiled a %s grammar of %d characters in %.1f s", backend.name, spec.kind,
                        len(spec.spec), took)
        return compiled

    def _load(self) -> Backend:
        with self._lock:
            if self._backend is None:
                t0 = time.perf_counter()
                try:
                    from transformers import PreTrainedTokenizerFast

                    tokenizer = PreTrainedTokenizerFast.from_pretrained(self.tokenizer_path)
                except (OSError, ValueError) as e:
                    raise RuntimeError(f"structured outputs need the model's tokenizer, which did not load "
                                       f"from {self.tokenizer_path}: {e}") from None
                self._backend = load_backend(self.config, tokenizer, self.vocab_size, self.eos_token_id)
                logger.info("structured outputs: %s loaded in %.1f s", self._backend.name,
                            time.perf_counter() - t0)
            return self._backend


class PriorRejected(GrammarError):
    """A resumed stream's output so far (``prior``) is not a prefix its grammar allows."""


class GrammarState:
    """One request's grammar: compiling, then (``start``) its matcher, which the scheduler advances over
    every token the request samples; kept across a preemption (the tokens it matched stay the output).

    ``prior``: the output tokens the request had before it came here (lbd's router resuming a stream on
    another rank sends them as the prompt's last tokens, ``lbd_resumed_output_tokens``): the matcher starts
    past them, where the broken stream's grammar was."""

    __slots__ = ("spec", "future", "matcher", "compiler", "prior")

    def __init__(self, spec: StructuredOutputs, future: Future[Any], compiler: GrammarCompiler,
                 prior: Sequence[int] = ()) -> None:
        self.spec = spec
        self.future = future
        self.compiler = compiler
        self.prior = prior
        self.matcher: Matcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed): ``start`` will not wait."""
        return self.matcher is not None or self.future.done()

    @property
    def ended(self) -> bool:
        """The grammar took its end-of-sequence token: the request stops."""
        return self.matcher is not None and self.matcher.is_terminated()

    def advance(self, token_id: int, request_id: str) -> None:
        """Over a sampled token (the mask allowed only tokens it takes; a refusal is logged, not raised)."""
        if self.matcher is not None and not self.matcher.accept(token_id):
            logger.error("request %s sampled token %d, which its grammar does not allow", request_id,
                         token_id)

    def start(self) -> None:
        """Make the matcher (the grammar must be ``ready``); raises GrammarError for a bad grammar, another
        exception when the backend could not load; PriorRejected when the grammar refuses ``prior``."""
        if self.matcher is None:
            matcher = self.compiler.matcher(self.future.result())
            for i, token_id in enumerate(self.prior):
                if not matcher.accept(token_id):
                    raise PriorRejected(
                        f"lbd_resumed_output_tokens: the prompt's last {len(self.prior)} tokens are not "
                        f"output this {self.spec.kind} grammar allows (token {token_id}, number {i + 1} of "
                        "them, is refused)")
            self.matcher = matcher


def failure(e: BaseException) -> tuple[str, int]:
    """(message, HTTP status) of a state's failed ``start``: 400 naming the problem for a bad grammar."""
    if isinstance(e, GrammarError):
        return f"invalid structured output: {e}", 400
    return f"structured outputs failed: {e}", 500


class Constrained(Protocol):
    """What ``GrammarWait`` holds: a request with a grammar (``lbd.engine.core.request.Request``)."""

    grammar: GrammarState | None


T = TypeVar("T", bound=Constrained)


class GrammarWait(Generic[T]):
    """Requests whose grammar is still compiling, in arrival order: the scheduler's queue before its queue."""

    def __init__(self) -> None:
        self.items: list[T] = []

    def __len__(self) -> int:
        return len(self.items)

    def add(self, item: T) -> None:
        self.items.append(item)

    def remove(self, item: T) -> bool:
        if item in self.items:
            self.items.remove(item)
            return True
        return False

    def take_ready(self) -> tuple[list[T], list[tuple[T, str, int]]]:
        """The items whose grammar is compiled, started (in arrival order), and the failed ones with
        (message, HTTP status)."""
        ready: list[T] = []
        failed: list[tuple[T, str, int]] = []
        keep: list[T] = []
        for item in self.items:
            g = item.grammar
            if g is None or not g.ready:
                keep.append(item)
                continue
            try:
                g.start()
                ready.append(item)
            except Exception as e:  # noqa: BLE001 (a bad grammar or a backend that did not load: the client's answer)
                failed.append((item, *failure(e)))
        self.items = keep
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block up to ``timeout_s`` until one grammar is compiled (the core's loop has nothing else)."""
        futures = [item.grammar.future for item in self.items if item.grammar is not None]
        if futures:
            wait(futures, timeout_s, return_when=FIRST_COMPLETED)
