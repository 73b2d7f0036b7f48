"""The router's exact view, piece by piece: the block index, payload decoding (vLLM's current map-tagged
events and the older array form) and one endpoint's feed against the engine's real ZMQ publisher (initial
replay, a gap repaired by replay, a gap beyond the replay buffer, a publisher that starts over, a
disconnection), and the prompt ids the view adds to a request for endpoints of its tokenizer. ~3 s."""

from __future__ import annotations

import asyncio
import time
from array import array
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from lbd.common.internal_key import IdsSigner, body_digest
from lbd.engine.config.kv_events import KVEventsConfig
from lbd.engine.kv_events.publisher import ZmqEventPublisher
from lbd.router.kv.feed import EventFeed, Source
from lbd.router.kv.forward import (
    FIELD,
    ExactPrompt,
    _JsonMemo,
    advertised,
    forwardable,
    info_path,
    strip_client_copy,
    with_ids,
)
from lbd.router.kv.index import BlockIndex, EndpointBlocks, chain_keys
from lbd.router.kv.view import EndpointView, ExactView, subscribe_address
from lbd.wire.kv_events import (
    AllBlocksCleared,
    BadPayload,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)

BS = 4


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def test_index_walks_one_chain_for_every_endpoint() -> None:
    index = BlockIndex()
    a, b, c = index.endpoint(), index.endpoint(), index.endpoint()
    toks = list(range(12))
    a.stored([1, 2, 3], None, toks, BS)  # engine hashes are the engine's business: any values
    b.stored([7], None, toks[:4], BS)
    b.stored([8], 7, toks[4:8], BS)
    c.stored([9], None, [99, 98, 97, 96], BS)
    keys = chain_keys([*toks, 50], BS)
    assert len(keys) == 3
    assert index.match(keys, a.bit | b.bit | c.bit) == {a.bit: 3, b.bit: 2}
    b.stored([8], 7, toks[4:8], BS)  # a second copy (vLLM may store a block twice)
    b.removed([8])
    assert index.match(keys, b.bit) == {b.bit: 2}
    b.removed([8])
    assert index.match(keys, b.bit) == {b.bit: 1}
    a.removed([1])  # the head gone: nothing of a's chain matches any more
    assert index.match(keys, a.bit | b.bit) == {b.bit: 1}
    c.stored([10], 12345, [1, 2, 3, 4], BS)  # its parent was never seen (joined late): an orphan
    assert c.orphans == 1 and len(c) == 1
    b.clear()
    assert index.match(keys, a.bit | b.bit | c.bit) == {}
    index.release(a)
    assert index.endpoint().bit == a.bit  # bits are reused


def test_decode_current_and_older_payloads() -> None:
    batch = KVEventBatch(
        ts=1.5,
        events=[stored([1], None, [1, 2, 3, 4]), BlockRemoved([1], "GPU"), AllBlocksCleared()],
        data_parallel_rank=2,
    )
    got, unknown = decode_batch(encode_batch(batch))
    assert got == batch and unknown == 0

    class Old(msgspec.Struct, array_like=True, tag=True):  # vLLM <= 0.10: events were arrays too
        pass

    class OldStored(Old, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    old = msgspec.msgpack.encode([2.0, [OldStored([5], 4, [9, 9, 9, 9], BS, None), ["Mystery", 1]]])
    got, unknown = decode_batch(old)
    assert got.events == [BlockStored([5], 4, [9, 9, 9, 9], BS, None, None, None)] and unknown == 1
    assert got.data_parallel_rank is None and got.ts == 2.0


def test_subscribe_addresses() -> None:
    assert subscribe_address("tcp://*:5557", "http://10.0.0.5:8000") == "tcp://10.0.0.5:5557"
    assert subscribe_address("tcp://0.0.0.0:5", "http://[::1]:8000") == "tcp://[::1]:5"
    assert subscribe_address("tcp://10.1.1.1:7", "http://h:1") == "tcp://10.1.1.1:7"
    assert subscribe_address("ipc:///tmp/x", "http://h:1") == "ipc:///tmp/x"
    assert subscribe_address("inproc://x", "http://h:1") is None
    # the engine's default endpoint is on its --host, loopback when unset: only a router beside it can read it
    assert subscribe_address("tcp://127.0.0.1:5557", "http://127.0.0.1:8001") == "tcp://127.0.0.1:5557"
    assert subscribe_address("tcp://127.0.0.1:5557", "http://10.0.0.5:8000") is None
    assert subscribe_address("tcp://[::1]:5557", "http://10.0.0.5:8000") is None


class Publisher:
    """The engine's publisher on ipc endpoints in ``tmp``, with batches numbered as they are sent."""

    def __init__(self, tmp: Path, buffer_steps: int = 100) -> None:
        self.cfg = KVEventsConfig(True, "zmq", f"ipc://{tmp}/pub", f"ipc://{tmp}/replay", buffer_steps)
        self.pub = ZmqEventPublisher(self.cfg, 0)

    def send(self, *events: Any) -> None:
        self.pub.publish(list(events))

    def close(self) -> None:
        self.pub.shutdown()


async def settle(pred, timeout: float = 5.0) -> None:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout
        await asyncio.sleep(0.02)


async def test_feed_replays_repairs_and_resyncs(tmp_path: Path) -> None:
    index = BlockIndex()
    blocks = index.endpoint()
    pub = Publisher(tmp_path)
    pub.send(stored([1], None, [1, 2, 3, 4]))  # before anyone listens: only the replay has it
    time.sleep(0.1)
    feed = EventFeed("e", Source(pub.cfg.endpoint, pub.cfg.replay_endpoint), blocks)
    feed.start()
    try:
        await settle(lambda: feed.stats.state == "live" and len(blocks) == 1)
        assert feed.stats.last_seq == 0 and not feed.stats.partial
        pub.send(stored([2], 1, [5, 6, 7, 8]))
        await settle(lambda: len(blocks) == 2)
        assert index.match(chain_keys(list(range(1, 9)), BS), blocks.bit) == {blocks.bit: 2}
        pub.send(stored([3], 2, [9, 9, 9, 9]), BlockRemoved([1], "GPU"))  # seq 2
        await settle(lambda: feed.stats.last_seq == 2)
        assert len(blocks) == 2
        await feed.on_live(4, b"")  # 3 went missing and was never sent: it cannot be replayed
        assert feed.stats.gaps == 1 and feed.stats.partial and feed.stats.lost == 1 and len(blocks) == 0
        # A sequence number that goes back: a new publisher (here on other addresses, so that the live
        # socket stays up), rebuilt from a fresh state out of its replay buffer.
        other = tmp_path / "new"
        other.mkdir()
        pub2 = Publisher(other)
        pub2.send(stored([7], None, [1, 2, 3, 4]), AllBlocksCleared(), stored([8], None, [4, 3, 2, 1]))
        time.sleep(0.1)
        feed.source = Source(pub2.cfg.endpoint, pub2.cfg.replay_endpoint)
        await feed.on_live(0, b"")
        pub2.close()
        assert feed.stats.state == "live" and feed.stats.resyncs == 2 and not feed.stats.partial
        assert feed.stats.last_seq == 0 and len(blocks) == 1
        assert index.match(chain_keys([4, 3, 2, 1, 0], BS), blocks.bit) == {blocks.bit: 1}
    finally:
        await feed.close()
        pub.close()


async def test_feed_marks_partial_when_the_replay_buffer_lost_the_start(tmp_path: Path) -> None:
    pub = Publisher(tmp_path, buffer_steps=2)
    for i in range(4):
        pub.send(stored([i + 1], i or None, [i] * BS))
    time.sleep(0.1)
    index = BlockIndex()
    feed = EventFeed("e", Source(pub.cfg.endpoint, pub.cfg.replay_endpoint), index.endpoint())
    feed.start()
    try:
        await settle(lambda: feed.stats.state == "live")
        assert feed.stats.partial and feed.stats.last_seq == 3 and feed.stats.lost == 1
    finally:
        await feed.close()
        pub.close()


@pytest.mark.parametrize("form", ["dict", "list"])
def test_decode_rejects_non_batches(form: str) -> None:
    with pytest.raises(BadPayload):
        decode_batch(msgspec.msgpack.encode({"nope": 1} if form == "dict" else [1]))
    with pytest.raises(BadPayload):
        decode_batch(b"\xc1")


def test_chain_memo_matches_a_fresh_chain_however_the_prompt_is_split() -> None:
    from lbd.router.kv.index import ChainMemo

    memo = ChainMemo(BS, max_nodes=20)
    system = list(range(100, 137))  # 9 blocks + 1 token
    turns = [[7, 8, 9], list(range(200, 211)), [1]]
    for k in range(1, len(turns) + 1):
        for tail in ([42], [43, 44, 45, 46, 47]):  # shared history, then a new piece each time
            pieces = [system, *turns[:k], tail]
            assert memo.keys(pieces) == chain_keys([t for p in pieces for t in p], BS)
    for i in range(30):  # past max_nodes the trie starts over; answers stay right
        pieces = [system, [i, i + 1]]
        assert memo.keys(pieces) == chain_keys([t for p in pieces for t in p], BS)


def test_shared_pending_checkpoints_cross_workers() -> None:
    import os

    from lbd.router.kv.shared_pending import SharedPending, checkpoints

    assert checkpoints(0, 20) == [7, 15, 19] and checkpoints(16, 17) == [16] and checkpoints(5, 5) == []
    table = SharedPending(capacity=64, ttl_s=60)
    pid = os.fork()
    if pid == 0:  # another worker writes...
        table.add([11, 12, 0], 3)
        table.add([11], 3)
        table.add([11], 5)
        os._exit(0)
    os.waitpid(pid, 0)
    assert sorted(table.slots(11)) == [3, 5] and table.slots(12) == [3] and table.slots(0) == [3]
    table.remove([11], 3)
    assert sorted(table.slots(11)) == [3, 5]  # added twice for slot 3: one removal leaves one
    table.remove([11, 12], 3)
    assert table.slots(11) == [5] and table.slots(12) == []
    for k in range(100, 190):  # more keys than entries: the table never grows; the rest are dropped
        table.add([k], 1)
    assert table.slots(11) == [5]
    expired = SharedPending(capacity=8, ttl_s=0.0)
    expired.add([1], 1)
    time.sleep(0.002)
    assert expired.slots(1) == []


def test_prompt_ids_are_spliced_in_signed_for_endpoints_of_their_tokenizer_and_key_only() -> None:
    prompt = ExactPrompt([[1, 2], array("i", [3, 4])], "ab12")
    signer, other = IdsSigner("internal"), IdsSigner("another")
    bodies = (b'{"model": "m", "messages": []}', b'{"messages": [], "n": 7}  \n', b"{}")
    for body in bodies:
        out = with_ids(body, prompt, signer)
        assert out is not None
        data = orjson.loads(out)  # still one JSON object
        sent = data.pop(FIELD)
        assert data == orjson.loads(body) and sent["ids"] == [1, 2, 3, 4] and sent["tokenizer"] == "ab12"
        # signed for this body (as the rank parses it, without the field), once
        assert signer.verify(b"[1,2,3,4]", "ab12", body_digest(data), sent["sig"]) is None
        assert signer.verify(b"[1,2,3,4]", "ab12", body_digest(data), sent["sig"]) == "replayed"
        assert other.verify(b"[1,2,3,4]", "ab12", body_digest(data), sent["sig"]) == "signature"
        assert signer.verify(b"[1,2,3,4]", "ab12", body_digest({**data, "x": 1}), sent["sig"]) == "signature"
    for bad in (b"[1, 2]", b'{"a": 1', b'"}', b'{"lbd_prompt_token_ids": 1}'):
        assert with_ids(bad, prompt, signer) is None
    client = {"messages": [], FIELD: {"ids": [9], "tokenizer": "ab12"}}
    assert orjson.loads(strip_client_copy(client)) == {"messages": []}
    # long pieces keep their JSON text (by piece object, LRU by bytes): the same ids however often it is used
    memo = _JsonMemo(max_bytes=600)
    long_a, long_b = array("i", range(100, 200)), array("i", range(300, 400))
    for piece in (long_a, long_b, long_a, [7, 8], long_b, array("i")):
        assert orjson.loads(b"[" + memo.text(piece) + b"]") == list(piece)
    assert memo.bytes <= 600 and len(memo._memo) == 1  # 400 bytes a piece: the older one went
    long_prompt = ExactPrompt([[1], long_a, [], long_b], "ab12")
    for _ in range(2):
        assert orjson.loads(with_ids(b"{}", long_prompt, signer))[FIELD]["ids"] == [1, *long_a, *long_b]

    info = {"prompt_token_ids": {"field": FIELD, "fingerprint": "ab12", "key": "match"}}
    assert advertised(info) == "ab12" and advertised(info, keyed=True) == "ab12"
    for key in ("mismatch", "unproven", None):  # another key, or none: no ids (it would refuse them)
        assert advertised({"prompt_token_ids": {**info["prompt_token_ids"], "key": key}}, keyed=True) is None
    assert info_path(None) == "/tokenizer_info" and signer.check_proof(info_path(signer).split("=", 1)[1])
    for bad in ({}, {"prompt_token_ids": {"field": "other", "fingerprint": "ab12"}},
                {"prompt_token_ids": {"field": FIELD, "fingerprint": 'x"}'}}, []):
        assert advertised(bad) is None
    assert forwardable({"messages": []}) and forwardable({"prompt": "hi"})
    for body in ({"messages": [], "tools": [{}]}, {"messages": [], "chat_template_kwargs": {"a": 1}},
                 {"messages": [], "continue_final_message": True}, {"prompt": ["a", "b"]}, {"prompt": [1]}):
        assert not forwardable(body), body

    CHAT = "/v1/chat/completions"  # noqa: N806
    assert ExactView("auto", None, 1.0, 1.0).signer is None  # type: ignore[arg-type]  # no key: no ids
    view = ExactView("auto", None, 1.0, 1.0, signer=signer)  # type: ignore[arg-type]
    for url, fp in (("http://a:1", "ab12"), ("http://b:1", "cd34"), ("http://c:1", None)):
        view.views[url] = EndpointView(url, frozenset, EndpointBlocks(view.index, 0), takes_ids=fp)
    body = b'{"prompt": "hi"}'
    assert orjson.loads(view.body_for("http://a:1", CHAT, prompt, body))[FIELD]["tokenizer"] == "ab12"
    assert view.body_for("http://b:1", CHAT, prompt, body) is body  # another tokenizer or template there
    assert view.body_for("http://c:1", CHAT, prompt, body) is body  # takes no ids (a vLLM rank)
    assert view.body_for("http://a:1", CHAT, None, body) is body  # the router has no exact prompt
    assert view.body_for("http://a:1", "/tokenize", prompt, body) is body  # it tokenizes for itself
    assert [v.forwarded for v in view.views.values()] == [1, 0, 0]
