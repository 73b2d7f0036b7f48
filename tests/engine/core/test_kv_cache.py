"""Block manager: allocation, reference counts, hash-chained prefix hits (in tokens) and LRU eviction."""

from __future__ import annotations

import pytest

from lbd.engine.core.kv_cache import KVCacheManager
from lbd.engine.core.request import Request
from lbd.wire.core_messages import SamplingParams

BS = 4


def req(rid: str, tokens: list[int], **sampling: object) -> Request:
    return Request(rid, list(tokens), SamplingParams(**sampling), eos_token_id=None, arrival_time=0.0)


def admit(kv: KVCacheManager, r: Request, num_new: int | None = None) -> int:
    """Look up the prefix, take the blocks and mark every token computed (as a finished prefill would)."""
    blocks, cached = kv.get_computed_prefix(r)
    n = r.num_tokens - cached if num_new is None else num_new
    assert kv.allocate_for(r, n, blocks)
    r.num_computed_tokens = cached + n
    if r.num_cached_tokens < 0:
        r.num_cached_tokens = cached
    kv.cache_blocks(r)
    return cached


def assert_all_free(kv: KVCacheManager) -> None:
    assert kv.ref_cnt == [0] * kv.num_blocks
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.usage == 0.0
    assert sorted(kv.free_plain + list(kv.evictable)) == list(range(kv.num_blocks))


def test_allocate_grow_and_free() -> None:
    kv = KVCacheManager(8, BS)
    r = req("a", range(10))
    assert kv.allocate_for(r, 6)  # chunk 1 of the prompt: 2 blocks
    assert len(r.block_ids) == 2
    r.num_computed_tokens = 6
    assert kv.allocate_for(r, 4)  # rest of the prompt: 10 tokens -> 3 blocks
    assert len(r.block_ids) == 3 and len(set(r.block_ids)) == 3
    r.num_computed_tokens = 10
    assert kv.usage == pytest.approx(3 / 8)
    assert kv.allocate_for(r, 2)  # tokens 10, 11 still fit in block 3
    assert len(r.block_ids) == 3
    kv.free(r)
    assert r.block_ids == []
    assert_all_free(kv)


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(4, BS)
    a = req("a", range(12))
    admit(kv, a)
    b = req("b", range(100, 108))
    before = (list(kv.ref_cnt), list(kv.free_plain), kv.num_free_blocks)
    assert not kv.allocate_for(b, 8)  # needs 2 blocks, 1 free
    assert b.block_ids == [] and (list(kv.ref_cnt), list(kv.free_plain), kv.num_free_blocks) == before
    assert kv.allocate_for(b, 4)
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)


def test_prefix_hits_counted_in_tokens() -> None:
    kv = KVCacheManager(16, BS)
    a = req("a", range(10))  # 2 full blocks + 2 tokens
    assert admit(kv, a) == 0
    assert (kv.prefix_queries, kv.prefix_hits) == (10, 0)
    b = req("b", [*range(8), 50, 51, 52])  # shares 8 tokens = 2 blocks
    blocks, cached = kv.get_computed_prefix(b)
    assert cached == 8 and blocks == a.block_ids[:2]
    assert admit(kv, b) == 8
    assert (kv.prefix_queries, kv.prefix_hits) == (21, 8)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] != a.block_ids[2]
    assert [kv.ref_cnt[x] for x in a.block_ids] == [2, 2, 1]
    kv.free(a)
    assert [kv.ref_cnt[x] for x in b.block_ids] == [1, 1, 1]
    kv.free(b)
    assert_all_free(kv)


def test_never_the_whole_prompt() -> None:
    kv = KVCacheManager(16, BS)
    admit(kv, req("a", range(8)))
    b = req("b", range(8))  # identical, block-aligned: the last block must be recomputed to get logits
    assert kv.get_computed_prefix(b)[1] == 4
    c = req("c", range(9))
    assert kv.get_computed_prefix(c)[1] == 8


def test_hash_is_chained_over_the_prefix() -> None:
    kv = KVCacheManager(16, BS)
    admit(kv, req("a", [1, 2, 3, 4, 5, 6, 7, 8, 0]))
    # Same second block's tokens after a different first block: no hit at all.
    assert kv.get_computed_prefix(req("b", [9, 9, 9, 9, 5, 6, 7, 8, 0]))[1] == 0
    # A different first block breaks the chain even if later blocks match.
    assert kv.get_computed_prefix(req("c", [1, 2, 3, 4, 5, 6, 7, 9, 0]))[1] == 4


def test_freed_cached_blocks_are_reused_lru_and_only_when_needed() -> None:
    kv = KVCacheManager(6, BS)
    a, b = req("a", range(9)), req("b", range(100, 109))  # 2 full blocks + 1 token each
    admit(kv, a)
    admit(kv, b)
    a_full, b_full = a.block_ids[:2], b.block_ids[:2]
    kv.free(a)  # a first: its blocks are the least recently used
    kv.free(b)
    assert kv.num_free_blocks == 6 and len(kv.evictable) == 4 and len(kv.free_plain) == 2
    c = req("c", range(200, 204))
    admit(kv, c, 4)  # one block: taken from the never-cached pool, nothing evicted
    assert c.block_ids[0] not in a_full + b_full
    assert set(kv.cached.values()) == {*a_full, *b_full, c.block_ids[0]}
    d = req("d", range(300, 308))
    admit(kv, d, 8)  # two blocks: one plain, then the LRU cached one = a's *tail* full block
    assert a_full[1] in d.block_ids and a_full[0] not in d.block_ids
    assert kv.get_computed_prefix(req("a2", range(9)))[1] == 4  # a's first block still hits
    assert kv.get_computed_prefix(req("b2", range(100, 109)))[1] == 8  # b untouched
    e = req("e", range(400, 404))
    admit(kv, e, 4)  # next victim: a's head block
    assert e.block_ids == [a_full[0]]
    assert kv.get_computed_prefix(req("a3", range(9)))[1] == 0
    for r in (c, d, e):
        kv.free(r)
    assert_all_free(kv)


def test_hit_on_a_free_cached_block_revives_it() -> None:
    kv = KVCacheManager(3, BS)
    a = req("a", range(9))
    admit(kv, a)  # 3 blocks: all of the pool
    kv.free(a)
    b = req("b", range(9))
    blocks, cached = kv.get_computed_prefix(b)
    assert cached == 8
    # b needs its 2 cached blocks back plus 1 new; the new one must not evict its own prefix.
    assert kv.allocate_for(b, 1, blocks)
    assert b.block_ids[:2] == blocks and len(set(b.block_ids)) == 3
    assert kv.usage == 1.0
    kv.free(b)
    assert_all_free(kv)


def test_capacity_counts_revived_blocks() -> None:
    kv = KVCacheManager(3, BS)
    a = req("a", range(9))
    admit(kv, a)
    kv.free(a)
    x = req("x", range(50, 54))
    admit(kv, x, 4)  # takes the plain block: the 2 cached ones are the only free blocks left
    b = req("b", [*range(8), 7, 7, 7, 7, 7])  # 2 cached blocks + 5 new tokens = 2 new blocks
    blocks, _ = kv.get_computed_prefix(b)
    assert len(blocks) == 2
    assert not kv.allocate_for(b, 5, blocks)
    assert b.block_ids == [] and kv.ref_cnt[blocks[0]] == 0 and len(kv.evictable) == 2


def test_duplicate_blocks_from_concurrent_prefills() -> None:
    kv = KVCacheManager(8, BS)
    a, b = req("a", range(9)), req("b", range(9))
    for r in (a, b):  # both admitted before either is computed: no sharing possible
        assert kv.allocate_for(r, 9, kv.get_computed_prefix(r)[0])
    for r in (a, b):
        r.num_computed_tokens = 9
        kv.cache_blocks(r)
    assert len(kv.cached) == 2 and set(kv.cached.values()) == set(a.block_ids[:2])
    kv.free(a)
    kv.free(b)
    assert_all_free(kv)
    assert len(kv.evictable) == 2  # b's duplicates went back to the plain pool


def test_generated_tokens_fill_and_register_blocks() -> None:
    kv = KVCacheManager(8, BS)
    a = req("a", range(6))
    admit(kv, a)
    assert len(kv.cached) == 1
    for t in (90, 91, 92):  # decode: the sampled token's K/V is written by the next step
        a.append_token(t)
        assert kv.allocate_for(a, 1)
        a.num_computed_tokens += 1
        kv.cache_blocks(a)
    assert a.num_computed_tokens == 9 and len(kv.cached) == 2
    follow_up = req("f", [*range(6), 90, 91, 92, 5])  # e.g. the next chat turn
    assert kv.get_computed_prefix(follow_up)[1] == 8


def test_prefix_caching_off() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = req("a", range(9))
    admit(kv, a)
    assert kv.get_computed_prefix(req("b", range(9))) == ([], 0)
    assert kv.cached == {} and (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    kv.free(a)
    assert_all_free(kv)
    assert not kv.evictable


def test_prompt_logprobs_skip_the_cache() -> None:
    kv = KVCacheManager(8, BS)
    admit(kv, req("a", range(9)))
    assert kv.get_computed_prefix(req("b", range(9), prompt_logprobs=1))[1] == 0


# ---- block keys, collisions, events ---------------------------------------------------------------------
def _first_blocks_collide(parent, tokens, extra):
    """Every first block gets one key; later blocks are keyed by their own tokens, whatever came before."""
    return ("first",) if parent is None else ("block", tuple(tokens))


def test_key_collision_never_shares_another_prompts_blocks() -> None:
    kv = KVCacheManager(16, BS)
    kv.hasher = _first_blocks_collide
    A, A2, B = [1, 2, 3, 4], [9, 8, 7, 6], [5, 6, 7, 8]
    a = req("a", [*A, *B, 0])
    admit(kv, a)
    # Same first-block key, other tokens: the token check refuses it.
    assert kv.get_computed_prefix(req("x", [*A2, *B, 0]))[1] == 0
    b = req("b", [*A2, 0])
    assert admit(kv, b) == 0  # A2 takes the first-block key over; a's B keeps its key
    assert kv.cached[("first",)] == b.block_ids[0] and ("block", tuple(B)) in kv.cached
    # A2 then B: B's tokens match the cached block, but that block was computed after A, not A2.
    e = req("e", [*A2, *B, 0])
    blocks, cached = kv.get_computed_prefix(e)
    assert cached == 4 and blocks == b.block_ids[:1]
    assert admit(kv, e) == 4
    # a's content again: its first block lost the key, so nothing of a is served from the cache.
    assert kv.get_computed_prefix(req("a2", [*A, *B, 0]))[1] == 0
    for r in (a, b, e):
        kv.free(r)
    assert_all_free(kv)


def test_sha256_keys_are_vllms() -> None:
    import hashlib
    import pickle

    kv = KVCacheManager(16, BS)
    a = req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    admit(kv, a)
    proto = pickle.HIGHEST_PROTOCOL
    root = hashlib.sha256(pickle.dumps("vllm-none-hash", protocol=proto)).digest()
    h1 = hashlib.sha256(pickle.dumps((root, (1, 2, 3, 4), None), protocol=proto)).digest()
    h2 = hashlib.sha256(pickle.dumps((h1, (5, 6, 7, 8), None), protocol=proto)).digest()
    assert a.block_hashes[:2] == [h1, h2]
    builtin = KVCacheManager(16, BS, hash_algo="builtin")
    admit(builtin, b := req("b", [1, 2, 3, 4, 5]))
    assert isinstance(b.block_hashes[0], int)


class _Log:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, keys, parent, token_ids) -> None:
        self.events.append(("stored", list(keys), parent, list(token_ids)))

    def removed(self, key) -> None:
        self.events.append(("removed", key))

    def cleared(self) -> None:
        self.events.append(("cleared",))


def test_listener_hears_every_registration_eviction_and_reset() -> None:
    log = _Log()
    kv = KVCacheManager(8, BS, listener=log)
    a = req("a", range(9))  # 2 full blocks + 1 token
    admit(kv, a)
    assert log.events == [("stored", a.block_hashes[:2], None, list(range(8)))]
    b = req("b", [*range(8), 40, 41, 42, 43, 44])  # hits both, then fills a third block
    admit(kv, b)
    assert log.events[-1] == ("stored", [b.block_hashes[2]], b.block_hashes[1], [40, 41, 42, 43])
    dup = req("dup", range(9))  # identical content computed again: its copies stay unregistered, silently
    assert kv.allocate_for(dup, 9)
    dup.num_computed_tokens = 9
    kv.cache_blocks(dup)
    assert log.events[-1][0] == "stored" and len(kv.cached) == 3
    for r in (a, b, dup):
        kv.free(r)
    keys = set(kv.cached)
    log.events.clear()
    big = req("big", range(100, 132))
    assert kv.allocate_for(big, 32)  # all 8 blocks: the 3 cached ones are evicted, oldest first
    assert [e[0] for e in log.events] == ["removed"] * 3
    assert {e[1] for e in log.events} == keys and not kv.cached
    kv.free(big)
    assert kv.reset_prefix_cache() and log.events[-1] == ("cleared",) and not kv.cached
    held = req("h", range(5))
    admit(kv, held)
    assert not kv.reset_prefix_cache()  # a request holds blocks: nothing changes
    kv.free(held)
