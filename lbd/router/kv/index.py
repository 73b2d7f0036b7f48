"""The exact index: which endpoint holds which block chain, keyed by the router's own chained block keys.

The router cannot know an engine's hash seed (vLLM's keys depend on ``PYTHONHASHSEED`` and the algorithm), so
it keys blocks by its own chain over token ids: ``key(block) = hash((key(parent), *token_ids))`` (Python's
tuple hash: cheap, the same in every worker; a collision could only misroute a request, never serve wrong
KV, since the engine verifies its own blocks). Each endpoint maps the engine's block hashes to these keys
(BlockRemoved names engine hashes), with a count (vLLM may store the same block twice). One dict maps every
key to a bitmask of the endpoints holding it, so a request's chain is walked once for all endpoints.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ROOT_KEY = 0x6C6264_6B76  # the parent key of a chain's first block


def chain_keys(token_ids: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """Keys of the full blocks of ``token_ids`` (at most ``limit``)."""
    n = len(token_ids) // block_size
    if limit is not None and n > limit:
        n = limit
    keys: list[int] = []
    parent = ROOT_KEY
    for start in range(0, n * block_size, block_size):
        parent = hash((parent, *token_ids[start : start + block_size]))
        keys.append(parent)
    return keys


class BlockIndex:
    """All endpoints' blocks, for one router worker."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}  # own key -> bitmask of endpoints
        self._free_bits: list[int] = []
        self._next_bit = 0

    def endpoint(self) -> EndpointBlocks:
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        return EndpointBlocks(self, 1 << bit)

    def release(self, blocks: EndpointBlocks) -> None:
        blocks.clear()
        self._free_bits.append(blocks.bit.bit_length() - 1)

    def match(self, keys: Sequence[int], bits: int, pending: dict[int, int] | None = None) -> dict[int, int]:
        """How many leading blocks of ``keys`` each endpoint in ``bits`` holds (or, with ``pending``, is
        computing): {bit: blocks} (only bits with at least one block)."""
        holders = self.holders
        alive = bits
        depth: dict[int, int] = {}
        for i, k in enumerate(keys):
            held = (holders.get(k, 0) | pending.get(k, 0) if pending else holders.get(k, 0)) & alive
            if held != alive:
                lost = alive & ~held
                if i:
                    while lost:
                        low = lost & -lost
                        depth[low] = i
                        lost ^= low
                alive = held
                if not alive:
                    return depth
        n = len(keys)
        while alive and n:
            low = alive & -alive
            depth[low] = n
            alive ^= low
        return depth


class PendingBlocks:
    """Blocks the router sent endpoints to compute and their events have not yet announced: a request that
    shares a prefix with one still in prefill goes where that prefix is being computed, as it will hit
    there. Entries are counted per (key, endpoint) and dropped after the request's first byte."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}
        self._count: dict[tuple[int, int], int] = {}

    def add(self, keys: Sequence[int], bit: int) -> None:
        holders, count = self.holders, self._count
        for k in keys:
            n = count.get((k, bit), 0)
            if not n:
                holders[k] = holders.get(k, 0) | bit
            count[(k, bit)] = n + 1

    def remove(self, keys: Sequence[int], bit: int) -> None:
        holders, count = self.holders, self._count
        for k in keys:
            n = count.pop((k, bit), 0) - 1
            if n > 0:
                count[(k, bit)] = n
            elif n == 0:
                _drop(holders, k, bit)

    def purge(self, bit: int) -> None:
        for k, b in [kb for kb in self._count if kb[1] == bit]:
            del self._count[(k, b)]
            _drop(self.holders, k, b)


class EndpointBlocks:
    """One endpoint's blocks: engine hash -> [own key, copies]."""

    __slots__ = ("index", "bit", "by_engine", "orphans")

    def __init__(self, index: BlockIndex, bit: int) -> None:
        self.index = index
        self.bit = bit
        self.by_engine: dict[Any, list] = {}
        self.orphans = 0  # stored blocks whose parent this view never saw (it joined late or lost events)

    def __len__(self) -> int:
        return len(self.by_engine)

    def stored(
        self,
        hashes: Sequence[Any],
        parent: Any,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[Any] | None = None,
    ) -> None:
        if parent is None:
            key = ROOT_KEY
        else:
            entry = self.by_engine.get(_hashable(parent))
            if entry is None:
                self.orphans += len(hashes)
                return
            key = entry[0]
        holders, bit, by_engine = self.index.holders, self.bit, self.by_engine
        for i, h in enumerate(hashes):
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            if len(tokens) < block_size:
                return  # a partial block (never sent by vLLM or lbd for full-block caching)
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            key = hash((key, *tokens)) if extra is None else hash((key, *tokens, _hashable(extra)))
            h = _hashable(h)
            entry = by_engine.get(h)
            if entry is None:
                by_engine[h] = [key, 1]
                holders[key] = holders.get(key, 0) | bit
            else:
                entry[1] += 1

    def removed(self, hashes: Sequence[Any]) -> None:
        holders, by_engine = self.index.holders, self.by_engine
        for h in hashes:
            h = _hashable(h)
            entry = by_engine.get(h)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del by_engine[h]
                _drop(holders, entry[0], self.bit)

    def clear(self) -> None:
        holders, bit = self.index.holders, self.bit
        for key, _ in self.by_engine.values():
            _drop(holders, key, bit)
        self.by_engine.clear()
        self.orphans = 0


def _drop(holders: dict[int, int], key: int, bit: int) -> None:
    left = holders.get(key, 0) & ~bit
    if left:
        holders[key] = left
    else:
        holders.pop(key, None)


def _hashable(value: Any) -> Any:
    """msgpack gives lists for tuples; keys and extra keys must hash."""
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value
