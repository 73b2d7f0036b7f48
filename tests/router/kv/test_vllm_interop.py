"""`lbd route` reads vLLM's own KV events: the router's feed follows messages that vLLM 0.32's
ZmqEventPublisher produced (sha256 block hashes from vLLM's ``hash_block_tokens``, its framing, its replay
answer and end marker), recorded verbatim by data/make_vllm_kv_events.py. A stand-in publisher (named as
such: it only re-sends those recorded bytes) serves them on ipc sockets; the feed must build exactly the
blocks the script stored, branch, evict and clear. ~1 s.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from lbd.router.kv.feed import EventFeed, Source
from lbd.router.kv.index import BlockIndex, chain_keys
from lbd.wire.kv_events import BlockStored, decode_batch, encode_batch

DATA = msgspec.msgpack.decode((Path(__file__).parent / "data" / "vllm_kv_events.msgpack").read_bytes())
BS = DATA["block_size"]
SYSTEM = list(range(1000, 1048))  # the recorded script (see make_vllm_kv_events.py)
BRANCH = SYSTEM[:32] + list(range(2000, 2016))
FRESH = list(range(3000, 3032))


class RecordedPublisher:
    """Stand-in for a vLLM engine's publisher: re-sends vLLM's recorded live frames and answers replay
    requests with vLLM's recorded replay frames (those at or after the asked start, up to what has been
    published so far), then vLLM's recorded end marker."""

    def __init__(self, tmp: Path) -> None:
        self.ctx = zmq.asyncio.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"ipc://{tmp}/vllm-pub")
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.bind(f"ipc://{tmp}/vllm-replay")
        self.source = Source(f"ipc://{tmp}/vllm-pub", f"ipc://{tmp}/vllm-replay", "kv")
        self.published = 0
        self.replays = 0
        self._task = asyncio.ensure_future(self._serve())

    async def publish_next(self) -> None:
        await self.pub.send_multipart(DATA["live"][self.published])
        self.published += 1

    async def _serve(self) -> None:
        *retained, end = DATA["replay"]
        while True:
            client, empty, start = await self.router.recv_multipart()
            self.replays += 1
            first = int.from_bytes(start, "big")
            for frames in retained:
                seq = int.from_bytes(frames[2], "big")
                if first <= seq < self.published:
                    await self.router.send_multipart([client, *frames])
            await self.router.send_multipart([client, *end])

    def close(self) -> None:
        self._task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def settle(pred, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout
        await asyncio.sleep(0.02)


def test_recorded_payloads_decode_completely() -> None:
    assert DATA["vllm"].startswith("0.")
    kinds = []
    for topic, seq, payload in DATA["live"]:
        batch, unknown = decode_batch(payload)
        assert topic == b"kv" and len(seq) == 8 and batch.ts > 0 and batch.data_parallel_rank == 0
        assert unknown == 0
        assert encode_batch(batch) == payload  # our structs encode vLLM's batch to vLLM's bytes
        kinds += [type(e).__name__ for e in batch.events]
        for e in batch.events:
            if isinstance(e, BlockStored):
                assert all(isinstance(h, bytes) and len(h) == 32 for h in e.block_hashes)  # vLLM's sha256
                assert e.block_size == BS and len(e.token_ids) == BS * len(e.block_hashes)
    assert kinds == ["BlockStored", "BlockStored", "BlockRemoved", "AllBlocksCleared", "BlockStored"]
    # the replay answer: vLLM's 4-frame form ['', topic, seq, payload], the live payloads byte for byte
    assert [f[3] for f in DATA["replay"][:-1]] == [f[2] for f in DATA["live"]]
    assert DATA["replay"][-1][2] == (-1).to_bytes(8, "big", signed=True)


async def test_feed_follows_vllms_events(tmp_path: Path) -> None:
    pub = RecordedPublisher(tmp_path)
    index = BlockIndex()
    blocks = index.endpoint()
    await pub.publish_next()  # before anyone listens: only the replay has batches 0 and 1
    await pub.publish_next()
    feed = EventFeed("vllm", pub.source, blocks)
    feed.start()

    def held(tokens: list[int]) -> int:
        return index.match(chain_keys(tokens, BS), blocks.bit).get(blocks.bit, 0)

    try:
        await settle(lambda: feed.stats.state == "live" and feed.stats.last_seq == 1)
        assert pub.replays >= 1 and not feed.stats.partial and feed.stats.block_size == BS
        assert len(blocks) == 4 and held(SYSTEM) == 3 and held(BRANCH) == 3  # the branch hangs off block 2
        await asyncio.sleep(0.2)  # the subscription reaches the publisher (else the gap is replayed)
        await pub.publish_next()  # BlockRemoved of the system prompt's last block
        await settle(lambda: feed.stats.last_seq == 2)
        assert len(blocks) == 3 and held(SYSTEM) == 2 and held(BRANCH) == 3
        await pub.publish_next()  # AllBlocksCleared, then a fresh chain
        await settle(lambda: feed.stats.last_seq == 3)
        assert len(blocks) == 2 and held(FRESH) == 2 and held(SYSTEM) == 0 and held(BRANCH) == 0
        assert feed.stats.events == {"stored": 3, "removed": 1, "cleared": 1} and not feed.stats.error
    finally:
        await feed.close()
        pub.close()
