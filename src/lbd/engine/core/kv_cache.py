"""Paged KV-cache block manager with hash-chained prefix caching.

The cache is a fixed pool of ``num_blocks`` blocks of ``block_size`` token slots. A request owns a list of
block ids in position order (``Request.block_ids``). With prefix caching, every *full* block that has been
computed is registered under a key chained over the whole prefix (``lbd.engine.core.block_hash``: the parent
block's key, the block's token ids, extra keys), so a later request whose tokens start the same way reuses
those blocks instead of recomputing them. Blocks are reference counted; a freed block that still holds a
registered key is kept, in LRU order, and only evicted (its key forgotten) when no never-cached free block is
left.

Collisions are harmless by construction, whatever the hash: a registered block remembers its token ids and
the *content serial* of the block before it (every computed full block gets one; a block proven identical to
a registered one shares its serial). A lookup takes a cached block only if its tokens equal the request's and
its parent serial is that of the block just taken, so by induction every block taken holds exactly the
request's prefix. A key that matches other content is a miss (and the newer content takes the key over).

Invariant: ``block_hash[b] == h`` iff ``cached[h] == b``; a block with ``ref_cnt 0`` is either in
``free_plain`` (no key) or in ``evictable`` (keyed). Every registration, eviction and reset is told to the
optional ``listener`` (the KV-event publisher's recorder), in order.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from lbd.engine.core.block_hash import BlockKey, make_hasher
from lbd.engine.core.request import Request

_ROOT_SERIAL = 0  # the "parent" of a request's first block


class CacheListener(Protocol):
    def stored(self, keys: list[BlockKey], parent: BlockKey | None, token_ids: Sequence[int],
               lora: tuple[int, str | None] | None = None) -> None: ...  # lora: (id, name) of an adapter's
    def removed(self, key: BlockKey) -> None: ...
    def cleared(self) -> None: ...


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_algo: str = "sha256", listener: CacheListener | None = None) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_algo = hash_algo
        self.hasher = make_hasher(hash_algo)
        self.listener = listener
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[BlockKey | None] = [None] * num_blocks
        self.cached: dict[BlockKey, int] = {}  # block key -> block id
        # what a registered block holds, checked on every hit: its tokens and its parent's content serial
        self._tokens: list[list[int] | None] = [None] * num_blocks
        self._parent: list[int] = [_ROOT_SERIAL] * num_blocks
        self._serial: list[int] = [_ROOT_SERIAL] * num_blocks  # content serial of each computed full block
        self._next_serial = _ROOT_SERIAL + 1
        # A stack popped from the end: low block ids go out first, which keeps small pools easy to read.
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # keyed blocks with ref 0, oldest first
        self.prefix_queries = 0  # tokens looked up in the prefix cache (vLLM semantics)
        self.prefix_hits = 0  # tokens found there

    # ---- capacity -------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free, as in vLLM)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix lookup and allocation -------------------------------------------------------------------
    def get_computed_prefix(self, req: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of ``req``'s tokens, and how many tokens they cover.

        Never the whole sequence: the last token is always left to compute, so there are logits to sample.
        Pure lookup; nothing is taken until ``allocate_for`` succeeds with these blocks.
        """
        if not self.enable_prefix_caching or req.sampling.prompt_logprobs is not None:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        self.hash_upto(req, max_blocks)
        blocks: list[int] = []
        cached, tokens, parents, serials = self.cached, self._tokens, self._parent, self._serial
        bs, toks, prev = self.block_size, req.all_token_ids, _ROOT_SERIAL
        for i, h in enumerate(req.block_hashes[:max_blocks]):
            b = cached.get(h)
            if b is None or parents[b] != prev or tokens[b] != toks[i * bs:(i + 1) * bs]:
                break  # a miss, or a key collision: never another prompt's KV
            blocks.append(b)
            prev = serials[b]
        return blocks, len(blocks) * self.block_size

    def allocate_for(self, req: Request, num_new_tokens: int,
                     computed_blocks: list[int] | None = None) -> bool:
        """Give ``req`` the blocks to hold ``num_new_tokens`` more tokens; False (and no change) if short.

        For a request being admitted pass ``computed_blocks`` from ``get_computed_prefix``: they become its
        first blocks and the new tokens start after them. Otherwise new tokens start at
        ``req.num_computed_tokens``.
        """
        if computed_blocks is not None:
            assert not req.block_ids, "computed blocks are only taken by a request that holds none"
            start = len(computed_blocks) * self.block_size
            held = len(computed_blocks)
            revived = sum(1 for b in computed_blocks if self.ref_cnt[b] == 0)
        else:
            start, held, revived = req.num_computed_tokens, len(req.block_ids), 0
        num_new_blocks = self.blocks_for(start + num_new_tokens) - held
        if max(num_new_blocks, 0) + revived > self.num_free_blocks:
            return False
        if computed_blocks is not None:
            self._take_computed(req, computed_blocks)
        for _ in range(num_new_blocks):
            req.block_ids.append(self._take_free())
        return True

    def _take_computed(self, req: Request, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_cnt[b] == 0:
                del self.evictable[b]
            self.ref_cnt[b] += 1
        req.block_ids.extend(blocks)
        req.num_registered_blocks = len(blocks)
        if self.enable_prefix_caching and req.num_cached_tokens < 0:
            # Count a request once, at its first admission; recomputes after preemption are not queries.
            self.prefix_queries += req.num_tokens
            self.prefix_hits += len(blocks) * self.block_size

    def _take_free(self) -> int:
        if self.free_plain:
            b = self.free_plain.pop()
        else:
            b, _ = self.evictable.popitem(last=False)  # least recently freed cached block
            self._unregister(b)
        self.ref_cnt[b] = 1
        self._serial[b] = _ROOT_SERIAL
        return b

    def _unregister(self, b: int) -> None:
        h = self.block_hash[b]
        assert h is not None
        del self.cached[h]
        self.block_hash[b] = None
        self._tokens[b] = None
        if self.listener is not None:
            self.listener.removed(h)

    # ---- registration and release ---------------------------------------------------------------------
    def cache_blocks(self, req: Request) -> None:
        """Register ``req``'s newly filled (full and computed) blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        start = req.num_registered_blocks
        if num_full <= start:
            return
        self.hash_upto(req, num_full)
        hashes, block_ids, toks, bs = req.block_hashes, req.block_ids, req.all_token_ids, self.block_size
        prev = self._serial[block_ids[start - 1]] if start else _ROOT_SERIAL
        run_start = -1  # first block of the current run of newly registered blocks (one event per run)
        for i in range(start, num_full):
            b = block_ids[i]
            if self.block_hash[b] is None:  # a prefix hit keeps its key: only new blocks are offered
                if self._register(b, hashes[i], toks[i * bs:(i + 1) * bs], prev):
                    run_start = i if run_start < 0 else run_start
                else:
                    self._emit_run(req, run_start, i)
                    run_start = -1
            prev = self._serial[b]
        self._emit_run(req, run_start, num_full)
        req.num_registered_blocks = num_full

    def _register(self, b: int, h: BlockKey, tokens: list[int], parent: int) -> bool:
        """Key block ``b``; False when an identical block already holds the key (``b`` shares its serial
        and simply returns to the plain pool when freed)."""
        x = self.cached.get(h)
        if x is not None:
            if self._parent[x] == parent and self._tokens[x] == tokens:
                self._serial[b] = self._serial[x]
                return False
            self._drop_key(x)  # other content under the same key (a collision or a stale chain): newest wins
        self.cached[h] = b
        self.block_hash[b] = h
        self._tokens[b] = tokens
        self._parent[b] = parent
        self._serial[b] = self._next_serial
        self._next_serial += 1
        return True

    def _drop_key(self, x: int) -> None:
        self._unregister(x)
        if self.ref_cnt[x] == 0:
            del self.evictable[x]
            self.free_plain.append(x)

    def _emit_run(self, req: Request, first: int, end: int) -> None:
        if self.listener is None or first < 0 or end <= first:
            return
        bs = self.block_size
        parent = req.block_hashes[first - 1] if first else None
        keys, tokens = req.block_hashes[first:end], req.all_token_ids[first * bs:end * bs]
        if req.lora_id:  # KV events name the adapter (vLLM's lora_id / lora_name)
            self.listener.stored(keys, parent, tokens, lora=(req.lora_id, req.lora_name))
        else:
            self.listener.stored(keys, parent, tokens)

    def free(self, req: Request) -> None:
        """Drop ``req``'s hold on all its blocks (finish, abort or preemption)."""
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        self.release(req.block_ids[::-1])
        req.block_ids = []
        req.num_registered_blocks = 0

    def hold(self, block_ids: list[int]) -> None:
        """One more hold on blocks a request still holds (a prefill's blocks kept for a remote decode,
        ``lbd.engine.kv_transfer``); ``release`` drops it."""
        for b in block_ids:
            assert self.ref_cnt[b] > 0, "only blocks in use can be held"
            self.ref_cnt[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one hold on each block, in the order given (the first freed is the first evicted)."""
        for b in block_ids:
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self.free_plain.append(b)
                else:
                    self.evictable[b] = None

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset_prefix_cache); False, changing nothing, while any block is
        held by a request."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for b in self.evictable:
            self.block_hash[b] = None
            self._tokens[b] = None
            self.free_plain.append(b)
        self.evictable.clear()
        self.cached.clear()
        if self.listener is not None:
            self.listener.cleared()
        return True

    def hash_upto(self, req: Request, num_blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``num_blocks`` full blocks (keys never change)."""
        hashes = req.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs, toks, key = self.block_size, req.all_token_ids, self.hasher
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_blocks):
            parent = key(parent, toks[i * bs:(i + 1) * bs], req.hash_extra)
            hashes.append(parent)
