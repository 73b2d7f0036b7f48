"""Prefix-cache block keys: a hash chained over (parent key, the block's token ids, extra keys).

``sha256`` (the default, as in vLLM) is vLLM's ``--prefix-caching-hash-algo sha256`` byte for byte: the
SHA-256 of ``pickle.dumps((parent, tuple(token_ids), extra_keys), HIGHEST_PROTOCOL)``, with the first
block's parent derived from a seed (``$PYTHONHASHSEED`` when set, else vLLM's fixed ``"vllm-none-hash"``). So
an engine of ours and a vLLM engine key the same prompt the same way, and a consumer that recomputes vLLM's
keys from token ids (llm-d's precise scorer) matches our events. Collisions are out of reach (2^128 work).

``builtin`` is Python's tuple hash: cheaper than SHA-256 (benchmarks/RESULTS.md, "Block hash"), but 64 bits
and not keyed, so colliding prompts can be built on purpose. It is fine for a single trusted tenant; never use
it where tenants share a cache. Even then no request reads another prompt's blocks: the cache verifies token
ids and the parent block on every hit (``lbd.engine.core.kv_cache``), so a collision costs a recompute, never
wrong KV.

KV events carry these keys in vLLM's external form (``lbd.engine.kv_events.recorder.external_key_fn``).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

HASH_ALGOS = ("sha256", "builtin")
DEFAULT_SEED = "vllm-none-hash"  # vLLM's seed of the first block's parent for cryptographic hashes
_BUILTIN_ROOT = 0x6C6264

BlockKey = bytes | int
# (parent key or None for the first block, the block's token ids, extra keys or None) -> key
Hasher = Callable[[BlockKey | None, Sequence[int], tuple[Any, ...] | None], BlockKey]


def _seed() -> str:
    return os.environ.get("PYTHONHASHSEED") or DEFAULT_SEED


def make_hasher(algo: str) -> Hasher:
    if algo == "sha256":
        sha, dumps, proto = hashlib.sha256, pickle.dumps, pickle.HIGHEST_PROTOCOL
        root = sha(dumps(_seed(), protocol=proto)).digest()

        def sha256_key(parent: BlockKey | None, tokens: Sequence[int],
                       extra: tuple[Any, ...] | None) -> bytes:
            return sha(dumps((parent or root, tuple(tokens), extra), protocol=proto)).digest()

        return sha256_key
    if algo == "builtin":

        def builtin_key(parent: BlockKey | None, tokens: Sequence[int], extra: tuple[Any, ...] | None) -> int:
            # Tuples of ints hash the same in every process (PYTHONHASHSEED salts only str and bytes).
            if extra is None:
                return hash((parent if parent is not None else _BUILTIN_ROOT, *tokens))
            return hash((parent if parent is not None else _BUILTIN_ROOT, *tokens, extra))

        return builtin_key
    raise ValueError(f"unknown prefix-caching hash algorithm {algo!r}; use one of {', '.join(HASH_ALGOS)}")
