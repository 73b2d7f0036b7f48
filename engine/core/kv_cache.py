"""Paged KV-cache block manager with hash-chained prefix caching.

The cache is a fixed pool of ``num_blocks`` blocks of ``block_size`` token slots. A request owns a list of
block ids in position order (``Request.block_ids``). With prefix caching, every *full* block that has been
computed is registered under a hash chained over the whole prefix (hash of the parent block's hash and the
block's token ids), so a later request whose tokens start the same way reuses those blocks instead of
recomputing them. Blocks are reference counted; a freed block that still holds a registered hash is kept,
in LRU order, and only evicted (its hash forgotten) when no never-cached free block is left.

Invariant: ``block_hash[b] == h`` iff ``cached[h] == b``; a block with ``ref_cnt 0`` is either in
``free_plain`` (no hash) or in ``evictable`` (hashed).
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.request import Request

_ROOT_HASH = 0x6C6264  # parent "hash" of a request's first block


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id
        # A stack popped from the end: low block ids go out first, which keeps small pools easy to read.
        self.free_plain: list[int] = list(range(num_blocks - 1, -1, -1))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # hashed blocks with ref 0, oldest first
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
        self._hash_upto(req, max_blocks)
        blocks: list[int] = []
        cached = self.cached
        for h in req.block_hashes[:max_blocks]:
            b = cached.get(h)
            if b is None:
                break
            blocks.append(b)
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
            del self.cached[self.block_hash[b]]
            self.block_hash[b] = None
        self.ref_cnt[b] = 1
        return b

    # ---- registration and release ---------------------------------------------------------------------
    def cache_blocks(self, req: Request) -> None:
        """Register ``req``'s newly filled (full and computed) blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = req.num_computed_tokens // self.block_size
        start = req.num_registered_blocks
        if num_full <= start:
            return
        self._hash_upto(req, num_full)
        hashes, block_ids = req.block_hashes, req.block_ids
        for i in range(start, num_full):
            b = block_ids[i]
            h = hashes[i]
            # A block already registered (a prefix hit) keeps its hash; a duplicate of a block another
            # request registered first stays unregistered and simply returns to the plain pool when freed.
            if self.block_hash[b] is None and h not in self.cached:
                self.cached[h] = b
                self.block_hash[b] = h
        req.num_registered_blocks = num_full

    def free(self, req: Request) -> None:
        """Drop ``req``'s hold on all its blocks (finish, abort or preemption)."""
        # Tail blocks first: they are the least likely to be shared, so they are evicted first.
        for b in reversed(req.block_ids):
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                if self.block_hash[b] is None:
                    self.free_plain.append(b)
                else:
                    self.evictable[b] = None
        req.block_ids = []
        req.num_registered_blocks = 0

    def _hash_upto(self, req: Request, num_blocks: int) -> None:
        """Extend ``req.block_hashes`` to its first ``num_blocks`` full blocks (hashes never change)."""
        hashes = req.block_hashes
        if len(hashes) >= num_blocks:
            return
        bs, toks = self.block_size, req.all_token_ids
        parent = hashes[-1] if hashes else _ROOT_HASH
        for i in range(len(hashes), num_blocks):
            # Tuples of ints hash the same in every process (PYTHONHASHSEED only salts str/bytes).
            parent = hash((parent, *toks[i * bs:(i + 1) * bs]))
            hashes.append(parent)
