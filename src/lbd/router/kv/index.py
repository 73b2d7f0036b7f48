"""The exact index: which endpoint holds which block chain, keyed by the router's own chained block keys.

The router cannot know an engine's hash seed (vLLM's keys depend on ``PYTHONHASHSEED`` and the algorithm), so
it keys blocks by its own chain over token ids: ``key(block) = hash((key(parent), *token_ids))`` (Python's
tuple hash: cheap, the same in every worker; a collision could only misroute a request, never serve wrong
KV, since the engine verifies its own blocks). Each endpoint maps the engine's block hashes to these keys
(BlockRemoved names engine hashes), with a count (vLLM may store the same block twice). One dict maps every
key to a bitmask of the endpoints holding it, so a request's chain is walked once for all endpoints.

Memory is bounded per endpoint (its cap: its least recently stored blocks go first) and per worker; a removal
or a clear names many blocks and is applied in one pass (``BlockIndex.release_keys``). A chain's head is
stored before its tail, so an endpoint over its cap loses its oldest chains from the head: their tails stay
unreachable until they go too (the cap sits above the engine's capacity, where the engine's own removals
keep the index under it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from itertools import islice
from typing import Any

ROOT_KEY = 0x6C6264_6B76  # the parent key of a chain's first block
DEFAULT_MAX_BLOCKS = 8 << 20  # endpoint-blocks over every endpoint, per worker (--kv-index-max-blocks)
DEFAULT_BLOCKS_PER_ENDPOINT = 256 << 10  # an endpoint whose KV capacity is not known
RECHECK_CAP = 64  # EndpointBlocks.trim calls between two look-ups of the cap


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
    for the lookup (the same mask object as ``held``'s where nothing is pending: wide fleets' masks are big).
    Pending entries are counted per (key, endpoint) and dropped after the first byte.

    Memory is bounded by caps on the blocks held per endpoint (``EndpointBlocks.cap``): ``max_blocks`` over
    every endpoint (each gets an equal share), and per endpoint ``max_blocks_per_endpoint`` when given, else
    twice the endpoint's reported KV capacity, else ``default_blocks_per_endpoint``."""

    def __init__(
        self,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        max_blocks_per_endpoint: int | None = None,
        default_blocks_per_endpoint: int = DEFAULT_BLOCKS_PER_ENDPOINT,
    ) -> None:
        self.held: dict[int, int] = {}  # own key -> bitmask of endpoints
        self.pending: dict[int, int] = {}
        self.union: dict[int, int] = {}
        self.max_blocks = max_blocks
        self.max_blocks_per_endpoint = max_blocks_per_endpoint
        self.default_blocks_per_endpoint = default_blocks_per_endpoint
        self.endpoints: set[EndpointBlocks] = set()
        self.evicted = 0  # blocks let go of over the caps, every endpoint's
        self._pending_count: dict[tuple[int, int], int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0

    @property
    def width(self) -> int:
        """Bits a mask may use: the endpoints' bits ever handed out."""
        return self._next_bit

    def endpoint(self) -> EndpointBlocks:
        bit = self._free_bits.pop() if self._free_bits else self._next_bit
        if bit == self._next_bit:
            self._next_bit += 1
        blocks = EndpointBlocks(self, 1 << bit)
        self.endpoints.add(blocks)
        return blocks

    def release(self, blocks: EndpointBlocks) -> None:
        blocks.clear()
        self.purge_pending(blocks.bit)
        self.endpoints.discard(blocks)
        self._free_bits.append(blocks.bit.bit_length() - 1)

    # ---- updates -------------------------------------------------------------------------------------------
    def release_keys(self, keys: Iterable[int], bit: int) -> None:
        """``bit`` no longer holds ``keys``: one pass, no call per key (a removal names many blocks)."""
        held, pending, union = self.held, self.pending, self.union
        keep = ~bit
        if not pending:
            for k in keys:
                left = held.get(k, 0) & keep
                if left:
                    held[k] = union[k] = left
                else:
                    held.pop(k, None)
                    union.pop(k, None)
            return
        for k in keys:
            left = held.get(k, 0) & keep
            if left:
                held[k] = left
            else:
                held.pop(k, None)
            both = left | pending.get(k, 0)
            if both:
                union[k] = both
            else:
                union.pop(k, None)

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
    def held_depth(self, keys: Sequence[int], bit: int, depth: int) -> int:
        """How many of the first ``depth`` blocks of ``keys`` endpoint ``bit``'s events announced (the rest of
        a ``match`` depth is pending there): one probe when all are, else a binary search (an endpoint holds
        a chain's blocks from its start)."""
        held = self.held
        if depth <= 0 or held.get(keys[depth - 1], 0) & bit:
            return depth
        lo, hi = 0, depth - 1  # the first block not announced lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if held.get(keys[mid], 0) & bit:
                lo = mid + 1
            else:
                hi = mid
        return lo

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
    """One endpoint's blocks: engine hash -> own key, in the order they were (last) stored, and the extra
    copies of a block stored more than once (vLLM may store a block twice). Over its ``cap`` (``trim``) it
    lets go of its least recently stored blocks, a slice at a time so that the scan for them stays cheap."""

    __slots__ = ("index", "bit", "by_engine", "copies", "orphans", "evicted", "capacity", "limit", "_recheck")

    def __init__(self, index: BlockIndex, bit: int, capacity: Callable[[], int] = lambda: 0) -> None:
        self.index = index
        self.bit = bit
        self.by_engine: dict[Any, int] = {}
        self.copies: dict[Any, int] = {}  # engine hash -> copies beyond the first
        self.orphans = 0  # stored blocks whose parent this view never saw (it joined late or lost events)
        self.evicted = 0  # blocks let go of over the cap (the engine may still hold them)
        self.capacity = capacity  # the engine's KV capacity in blocks (0: not known)
        self.limit = 0  # the cap as last looked up (trim)
        self._recheck = 0

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
        by_engine = self.by_engine
        if parent is None:
            key = ROOT_KEY
        else:
            key = by_engine.get(_hashable(parent))
            if key is None:
                self.orphans += len(hashes)
                return
        index, bit = self.index, self.bit
        held, pending, union = index.held, index.pending, index.union
        for i, h in enumerate(hashes):
            tokens = token_ids[i * block_size : (i + 1) * block_size]
            if len(tokens) < block_size:
                return  # a partial block (never sent by vLLM or lbd for full-block caching)
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            key = hash((key, *tokens)) if extra is None else hash((key, *tokens, _hashable(extra)))
            h = _hashable(h)
            if h in by_engine:  # another copy: counted, and now the most recently stored
                self.copies[h] = self.copies.get(h, 0) + 1
                key = by_engine.pop(h)
                by_engine[h] = key
                continue
            by_engine[h] = key
            mask = held[key] = held.get(key, 0) | bit
            union[key] = mask if not pending or key not in pending else mask | pending[key]

    def removed(self, hashes: Sequence[Any]) -> None:
        """One pass over the hashes, the index updated once for all the blocks gone."""
        by_engine, copies = self.by_engine, self.copies
        gone: list[int] = []
        try:
            for h in hashes:
                key = by_engine.get(h)
                if key is None:
                    continue
                if copies and h in copies:
                    n = copies.pop(h) - 1
                    if n:
                        copies[h] = n
                    continue
                del by_engine[h]
                gone.append(key)
        except TypeError:  # a list where a tuple was meant (msgpack): made hashable, from the first one on
            first = next((i for i, h in enumerate(hashes) if isinstance(h, list)), None)
            if first is None:
                raise
            self.removed([_hashable(h) for h in hashes[first:]])
        self.index.release_keys(gone, self.bit)

    @property
    def cap(self) -> int:
        """The most blocks this endpoint's index may hold."""
        index = self.index
        own = index.max_blocks_per_endpoint
        if own is None:
            capacity = self.capacity()
            own = 2 * capacity if capacity > 0 else index.default_blocks_per_endpoint
        return max(1, min(own, index.max_blocks // max(1, len(index.endpoints))))

    def trim(self) -> int:
        """Let go of the least recently stored blocks over the cap (and a slice more, so that this runs
        once per slice of stores, not once per store); how many went. The cap is looked up again every
        ``RECHECK_CAP`` calls (it moves when endpoints come and go or the capacity becomes known) and
        whenever the blocks pass the last one seen."""
        self._recheck -= 1
        if self._recheck <= 0:
            self._recheck, self.limit = RECHECK_CAP, self.cap
        if len(self.by_engine) <= self.limit:
            return 0
        cap = self.limit = self.cap
        over = len(self.by_engine) - cap
        if over <= 0:
            return 0
        n = min(len(self.by_engine), over + (cap >> 4))
        victims = list(islice(self.by_engine, n))
        by_engine, copies = self.by_engine, self.copies
        gone = [by_engine.pop(h) for h in victims]
        if copies:
            for h in victims:
                copies.pop(h, None)
        self.index.release_keys(gone, self.bit)
        self.evicted += n
        self.index.evicted += n
        return n

    def clear(self) -> None:
        self.index.release_keys(self.by_engine.values(), self.bit)
        self.by_engine.clear()
        self.copies.clear()
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
