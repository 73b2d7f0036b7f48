"""The prefix-cache hit rate no router can beat, computed from the requests a run sent.

The oracle is one unbounded cache that holds every KV block any rank computed so far (prompt blocks, and the
blocks of prompt + answer that generation fills), looked up in arrival order. Like an engine it never serves
the last prompt token from cache (one token is always computed). Prompts are tokenized the way the engine
does: chat messages through the chat template without special tokens added, plain prompts with them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lbd.bench.client import RequestRecord


@dataclass(slots=True)
class OracleResult:
    hit_rate: float  # hits / queries, in tokens (vLLM's prefix-cache counters)
    queries: int
    hits: int
    length_matches: int  # requests whose local prompt length equals the server's usage count
    requests: int


def block_hashes(ids: list[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``ids``: block i's hash covers every token before it."""
    hashes, h = [], 0
    for i in range(len(ids) // block_size):
        h = hash((h, tuple(ids[i * block_size : (i + 1) * block_size])))
        hashes.append(h)
    return hashes


def prompt_ids(tok: Any, prompt: str | list[dict[str, str]]) -> list[int]:
    if isinstance(prompt, str):
        return tok.encode(prompt, add_special_tokens=True)
    text = tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def oracle_hit_rate(records: list[RequestRecord], tok: Any, block_size: int) -> OracleResult:
    seen: set[int] = set()
    hits = queries = matches = 0
    done = sorted((r for r in records if r.ok and r.prompt is not None), key=lambda r: r.start)
    for rec in done:
        ids = prompt_ids(tok, rec.prompt)
        matches += len(ids) == rec.prompt_tokens
        hashes = block_hashes(ids, block_size)
        limit = (len(ids) - 1) // block_size
        n = 0
        while n < limit and hashes[n] in seen:
            n += 1
        hits += n * block_size
        queries += len(ids)
        seen.update(hashes)
        seen.update(block_hashes(ids + tok.encode(rec.text, add_special_tokens=False), block_size))
    return OracleResult(hits / queries if queries else 0.0, queries, hits, matches, len(done))
