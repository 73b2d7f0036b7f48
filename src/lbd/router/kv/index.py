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


class ChainMemo:
    """Block keys of tokenized prompts, computed once per shared piece sequence.

    A prompt arrives as pieces (``tokenize.Plan``: token-id arrays the tokenizer caches, the same object
    for the same text), so a trie over piece identities holds, per node, the keys of the blocks completed
    within that piece and the partial block left over. A new chat turn walks the trie through the cached
    history and hashes only its own new blocks. Nodes pin their pieces (no id reuse while in the trie); the
    trie is dropped whole when it outgrows ``max_nodes`` or pins ``max_tokens`` (a flood of new long prompts:
    the tokenizer's cache lets go of their ids, the trie must too).
    """

    __slots__ = ("block_size", "max_nodes", "max_tokens", "_root", "_nodes", "_tokens")

    def __init__(self, block_size: int, max_nodes: int = 50_000, max_tokens: int = 8 << 20) -> None:
        self.block_size = block_size
        self.max_nodes, self.max_tokens = max_nodes, max_tokens
        self._root = _Node(None, [], [], ROOT_KEY)
        self._nodes = self._tokens = 0

    def keys(self, pieces: Sequence[Sequence[int]]) -> list[int]:
        """Keys of every full block of the concatenated pieces."""
        bs = self.block_size
        node, keys, i = self._root, [], 0
        for p in pieces:
            child = node.children.get(id(p))
            if child is None or child.piece is not p:
                break
            keys += child.inc
            node, i = child, i + 1
        if i == len(pieces):
            return keys
        if self._nodes > self.max_nodes or self._tokens > self.max_tokens:
            self._root, self._nodes, self._tokens = _Node(None, [], [], ROOT_KEY), 0, 0
            return self.keys(pieces)
        tail, parent = node.tail, node.last
        for p in pieces[i:]:
            buf = tail + list(p) if tail else p
            full = len(buf) // bs * bs
            inc = []
            for start in range(0, full, bs):
                parent = hash((parent, *buf[start:start + bs]))
                inc.append(parent)
            tail = list(buf[full:])
            child = _Node(p, inc, tail, parent)
            node.children[id(p)] = child
            self._nodes += 1
            self._tokens += len(p)
            node = child
            keys += inc
        return keys


class _Node:
    __slots__ = ("piece", "inc", "tail", "last", "children")

    def __init__(self, piece: Sequence[int] | None, inc: list[int], tail: list[int], last: int) -> None:
        self.piece, self.inc, self.tail, self.last = piece, inc, tail, last
        self.children: dict[int, _Node] = {}


class BlockIndex:
    """All endpoints' blocks, for one router worker: ``held`` from the events, ``pending`` for blocks this
    worker sent an endpoint to compute that its events have not announced yet (a request sharing a prefix
    with one still in prefill goes where the prefix is being computed: it will hit there), ``union`` of both
    for the lookup. Pending entries are counted per (key, endpoint) and dropped after the first byte."""

    def __init__(self) -> None:
        self.held: dict[int, int] = {}  # own key -> bitmask of endpoints
        self.pending: dict[int, int] = {}
        self.union: dict[int, int] = {}
        self._pending_count: dict[tuple[int, int], int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    def endpoint(self) -> EndpointBlocks:
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        return EndpointBlocks(self, 1 << bit)

    def release(self, blocks: EndpointBlocks) -> None:
        blocks.clear()
        self.purge_pending(blocks.bit)
        self._free_bits.append(blocks.bit.bit_length() - 1)

    # ---- updates -------------------------------------------------------------------------------------------
    def hold(self, key: int, bit: int) -> None:
        self.held[key] = self.held.get(key, 0) | bit
        self.union[key] = self.union.get(key, 0) | bit

    def release_key(self, key: int, bit: int) -> None:
        _drop(self.held, key, bit)
        self._recompute(key)

    def _recompute(self, key: int) -> None:
        both = self.held.get(key, 0) | self.pending.get(key, 0)
        if both:
            self.union[key] = both
        else:
            self.union.pop(key, None)

    def add_pending(self, keys: Sequence[int], bit: int) -> None:
        count, pending, union = self._pending_count, self.pending, self.union
        for k in keys:
            n = count.get((k, bit), 0)
            if not n:
                pending[k] = pending.get(k, 0) | bit
                union[k] = union.get(k, 0) | bit
            count[(k, bit)] = n + 1

    def remove_pending(self, keys: Sequence[int], bit: int) -> None:
        count = self._pending_count
        for k in keys:
            n = count.pop((k, bit), 0) - 1
            if n > 0:
                count[(k, bit)] = n
            elif n == 0:
                _drop(self.pending, k, bit)
                self._recompute(k)

    def purge_pending(self, bit: int) -> None:
        for k, b in [kb for kb in self._pending_count if kb[1] == bit]:
            del self._pending_count[(k, b)]
            _drop(self.pending, k, b)
            self._recompute(k)

    # ---- lookup --------------------------------------------------------------------------------------------
    def match(self, keys: Sequence[int], bits: int) -> dict[int, int]:
        """How many leading blocks of ``keys`` each endpoint in ``bits`` holds or is computing:
        {bit: blocks} (only bits with at least one block)."""
        union = self.union
        alive = bits
        depth: dict[int, int] = {}
        for i, k in enumerate(keys):
            held = union.get(k, 0) & alive
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
        index, bit, by_engine = self.index, self.bit, self.by_engine
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
                index.hold(key, bit)
            else:
                entry[1] += 1

    def removed(self, hashes: Sequence[Any]) -> None:
        index, by_engine = self.index, self.by_engine
        for h in hashes:
            h = _hashable(h)
            entry = by_engine.get(h)
            if entry is None:
                continue
            entry[1] -= 1
            if entry[1] <= 0:
                del by_engine[h]
                index.release_key(entry[0], self.bit)

    def clear(self) -> None:
        index, bit = self.index, self.bit
        for key, _ in self.by_engine.values():
            index.release_key(key, bit)
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
