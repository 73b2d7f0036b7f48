"""The exact index's bounds and bulk updates: an endpoint publishing more blocks than its cap keeps at most
the cap (its least recently stored blocks gone, recent prefixes still found), the cap's sources (flag,
reported KV capacity, the global share), and a removal or clear applied in one pass leaving the same index
as one hash at a time. In-process, through the feed's decode and apply path. ~1 s."""

from __future__ import annotations

import random

import pytest

from lbd.router.config import parse_args
from lbd.router.kv.feed import EventFeed, Source
from lbd.router.kv.index import BlockIndex, EndpointBlocks, chain_keys
from lbd.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch

BS = 4


def stored(hashes: list, parent: object, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, "GPU", None)


class Feeder:
    """An ``EventFeed`` fed encoded batches in sequence, without a socket."""

    def __init__(self, blocks: EndpointBlocks) -> None:
        self.feed = EventFeed("test", Source("tcp://127.0.0.1:1", None), blocks)
        self.feed.stats.state = "live"
        self.seq = 0

    async def send(self, *events: object) -> None:
        await self.feed.on_live(self.seq, encode_batch(KVEventBatch(0.0, list(events))))
        self.seq += 1


async def test_an_endpoint_over_its_cap_keeps_its_most_recent_blocks() -> None:
    index = BlockIndex(max_blocks_per_endpoint=64)
    blocks = index.endpoint()
    other = index.endpoint()
    feeder = Feeder(blocks)
    chains = []
    for c in range(40):  # 40 conversations of 4 blocks each: 160 blocks, 2.5 times the cap
        tokens = [c * 1000 + i for i in range(4 * BS)]
        chains.append(tokens)
        await feeder.send(stored([c * 10 + i for i in range(4)], None, tokens))
        assert len(blocks) <= 64
    assert blocks.cap == 64
    assert blocks.evicted == index.evicted == 160 - len(blocks) > 0
    assert len(blocks) >= 64 - (64 >> 4) - 4  # a slice under the cap at most, not emptied
    assert index.match(chain_keys(chains[0], BS), blocks.bit) == {}  # the oldest are gone
    for tokens in chains[-8:]:  # the most recent prefixes are found whole
        assert index.match(chain_keys(tokens, BS), blocks.bit | other.bit) == {blocks.bit: 4}
    assert len(index.held) == len(blocks)  # evicted keys left the index, not just the endpoint


async def test_a_block_stored_again_counts_as_recent() -> None:
    index = BlockIndex(max_blocks_per_endpoint=16)
    blocks = index.endpoint()
    feeder = Feeder(blocks)
    first = list(range(BS))
    await feeder.send(stored([1], None, first))
    for c in range(1, 16):
        await feeder.send(stored([100 + c], None, [c * 100 + i for i in range(BS)]))
        await feeder.send(stored([1], None, first))  # a second copy, each time: kept as the newest
        await feeder.send(BlockRemoved([1], "GPU"))
    await feeder.send(stored([999], None, [7] * BS))  # over the cap: the least recently stored go
    assert index.match(chain_keys(first, BS), blocks.bit) == {blocks.bit: 1}
    assert index.match(chain_keys([100 + i for i in range(BS)], BS), blocks.bit) == {}


def test_the_cap_comes_from_the_flag_the_capacity_or_the_global_share() -> None:
    index = BlockIndex(max_blocks=1000, default_blocks_per_endpoint=300)
    a = index.endpoint()
    assert a.cap == 300  # capacity unknown: the default
    a.capacity = lambda: 50
    assert a.cap == 100  # twice the reported capacity
    a.capacity = lambda: 4000
    assert a.cap == 1000  # never over the global cap
    more = [index.endpoint() for _ in range(3)]
    assert a.cap == 250 and more[0].cap == 250  # an equal share of it each
    index.release(more.pop())
    assert a.cap == 333
    pinned = BlockIndex(max_blocks=1000, max_blocks_per_endpoint=40)
    b = pinned.endpoint()
    b.capacity = lambda: 4000
    assert b.cap == 40  # the flag, when given, whatever the capacity


def _populate(index: BlockIndex, rng: random.Random) -> tuple[list[EndpointBlocks], list[int]]:
    """Three endpoints over overlapping chains, some blocks stored twice, some keys pending."""
    eps = [index.endpoint() for _ in range(3)]
    hashes = []
    for e, ep in enumerate(eps):
        for c in range(20):
            hs = [e * 10_000 + c * 10 + i for i in range(5)]
            tokens = [(c % 7) * 100 + i for i in range(5 * BS)]  # chains shared between endpoints
            ep.stored(hs, None, tokens, BS)
            if c % 3 == 0:
                ep.stored(hs[:2], None, tokens[: 2 * BS], BS)  # second copies
            hashes += hs
    for ep in eps[:2]:
        index.add_pending(chain_keys([(1 % 7) * 100 + i for i in range(5 * BS)], BS), ep.bit)
    return eps, hashes


def _state(index: BlockIndex, eps: list[EndpointBlocks]) -> tuple:
    return (
        dict(index.held),
        dict(index.union),
        dict(index.pending),
        [(dict(e.by_engine), dict(e.copies)) for e in eps],
    )


async def test_a_bulk_removal_leaves_the_index_a_per_hash_removal_leaves() -> None:
    rng = random.Random(3)
    one, bulk = BlockIndex(), BlockIndex()
    eps_one, hashes = _populate(one, rng)
    eps_bulk, _ = _populate(bulk, rng)
    assert _state(one, eps_one) == _state(bulk, eps_bulk)
    for e in range(3):
        gone = rng.sample(hashes, 150) + [123456789]  # some of another endpoint's, one never seen
        gone += gone[:10]  # some named twice: a second copy goes too, or nothing
        per_hash, at_once = Feeder(eps_one[e]), Feeder(eps_bulk[e])
        for h in gone:
            await per_hash.send(BlockRemoved([h], "GPU"))
        await at_once.send(BlockRemoved(gone, "GPU"))
        assert _state(one, eps_one) == _state(bulk, eps_bulk)
    cleared = Feeder(eps_bulk[1])
    await cleared.send(AllBlocksCleared())
    per_hash = Feeder(eps_one[1])
    for h in list(eps_one[1].by_engine) * 3:  # every copy of each
        await per_hash.send(BlockRemoved([h], "GPU"))
    assert _state(one, eps_one) == _state(bulk, eps_bulk)
    assert not eps_bulk[1].by_engine and not eps_bulk[1].copies


def test_hashes_that_msgpack_gave_as_lists_are_removed_too() -> None:
    index = BlockIndex()
    ep = index.endpoint()
    ep.stored([[1, 2], 3], None, list(range(2 * BS)), BS)
    assert len(ep) == 2
    ep.removed([3, [1, 2]])
    assert len(ep) == 0 and not index.held and not index.union


@pytest.mark.parametrize("flag", ["--kv-index-max-blocks", "--kv-index-max-blocks-per-endpoint"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_a_cap_that_is_not_positive_exits_2_naming_its_flag(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parse_args(["--upstreams", "http://127.0.0.1:1", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    cfg = parse_args(["--upstreams", "http://127.0.0.1:1", flag, "1000"])
    assert 1000 in (cfg.kv_index_max_blocks, cfg.kv_index_max_blocks_per_endpoint)


async def test_held_depth_splits_a_match_into_announced_and_pending_blocks() -> None:
    """A lookup's depth counts pending blocks (sent to compute, no event yet); ``held_depth`` says how many of
    them the endpoint's events announced, so the policy can tell a prefix held from one still in prefill."""
    index = BlockIndex()
    blocks = index.endpoint()
    tokens = list(range(10 * BS))
    keys = chain_keys(tokens, BS)
    await Feeder(blocks).send(stored(list(range(4)), None, tokens[:4 * BS]))  # 4 blocks announced
    index.add_pending(keys[4:], blocks.bit)  # the other 6 sent to compute
    assert index.match(keys, blocks.bit) == {blocks.bit: 10}
    assert index.held_depth(keys, blocks.bit, 10) == 4
    assert index.held_depth(keys, blocks.bit, 3) == 3  # all of a shorter depth announced: one probe
    index.remove_pending(keys[4:], blocks.bit)
    assert index.held_depth(keys, blocks.bit, 10) == 4 and index.match(keys, blocks.bit) == {blocks.bit: 4}
    other = index.endpoint()
    index.add_pending(keys, other.bit)  # nothing announced there: the whole depth is pending
    assert index.held_depth(keys, other.bit, 10) == 0
