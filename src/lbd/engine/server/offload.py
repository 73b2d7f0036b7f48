"""Tokenizer work that can take long runs in a worker process, never on the event loop that answers /health.

HF ``tokenizers`` holds the GIL while it encodes, so a long prompt on a thread would still stall the loop;
a process does not. Short texts (the usual prompt) are encoded inline: a round trip to the worker costs more
than they do. Prompts that can
never fit the context are refused before any of this (``openai_protocol.check_prompt_chars``).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from lbd.engine.server.errors import APIError
from lbd.engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
INLINE_CHARS = 16_384  # longer texts are encoded in the worker, so inline encoding stays short
INLINE_TOKENS = 16_384  # longer id lists are decoded in the worker
WORKER_PROCESS_NAME = "lbd-tokenize"

_worker_tokenizer = None


def _init_worker(tokenizer_json: str, parent_pid: int) -> None:
    from tokenizers import Tokenizer as RustTokenizer

    from lbd.engine.procutil import set_pdeathsig, set_process_name

    set_pdeathsig(signal.SIGKILL, parent_pid)
    set_process_name(WORKER_PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the pool ends
    global _worker_tokenizer
    _worker_tokenizer = RustTokenizer.from_str(tokenizer_json)


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    return _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def _decode(ids: list[int], skip_special_tokens: bool) -> str:
    return _worker_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def _ready() -> bool:
    return _worker_tokenizer is not None


class Offload:
    """One worker process per front end, holding a copy of the front end's tokenizer."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._json = tokenizer.rust.to_str()
        self._pool = self._new_pool()

    def _new_pool(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"),
                                   initializer=_init_worker, initargs=(self._json, os.getpid()))

    async def warm(self) -> None:
        """Start the worker now (it loads the tokenizer in a second), not on the first long prompt."""
        await asyncio.wrap_future(self._pool.submit(_ready))

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        except BrokenProcessPool:
            logger.error("tokenizer worker died; starting a new one")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = self._new_pool()
            raise APIError("the tokenizer worker died while handling this request; try again", 503) from None

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens)
        return await self._run(_encode, text, add_special_tokens)

    async def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if len(ids) <= INLINE_TOKENS:
            return self.tokenizer.decode(ids, skip_special_tokens)
        return await self._run(_decode, ids, skip_special_tokens)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
