"""Record vLLM's own KV-event messages for tests/router/kv/test_vllm_interop.py (run with vLLM installed).

vLLM's ZmqEventPublisher (its sha256 block hashes from its own ``hash_block_tokens``) publishes a scripted
sequence of batches on ipc endpoints; a SUB socket records the live frames and a DEALER the replay answer from
sequence 0 (with vLLM's end marker). Everything is written verbatim, as bytes, to vllm_kv_events.msgpack:

    VENV/bin/python tests/router/kv/data/make_vllm_kv_events.py tests/router/kv/data/vllm_kv_events.msgpack
"""

from __future__ import annotations

import sys
import tempfile
import time

import msgspec
import zmq
from vllm import __version__
from vllm.distributed.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

BS = 16


def chain(tokens: list[int], parent: bytes | None = None) -> list[bytes]:
    out = []
    for i in range(0, len(tokens) - len(tokens) % BS, BS):
        parent = hash_block_tokens(sha256, parent, tokens[i : i + BS])
        out.append(parent)
    return out


def stored(tokens: list[int], parent: bytes | None = None) -> tuple[BlockStored, list[bytes]]:
    hashes = chain(tokens, parent)
    ev = BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens[: len(hashes) * BS],
                     block_size=BS, lora_id=None, medium="GPU", lora_name=None, group_idx=0)
    return ev, hashes


def main(out: str) -> None:
    init_none_hash(sha256)
    assert kv_cache_utils.NONE_HASH
    tmp = tempfile.mkdtemp()
    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=f"ipc://{tmp}/pub",
                            replay_endpoint=f"ipc://{tmp}/replay", topic="kv")
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"ipc://{tmp}/pub")
    time.sleep(0.5)
    system = list(range(1000, 1048))  # 3 blocks
    a, a_hashes = stored(system)
    b, _ = stored(list(range(2000, 2016)), a_hashes[1])  # a branch off the second block
    c, _ = stored(list(range(3000, 3032)))
    script = [
        [a],
        [b],
        [BlockRemoved(block_hashes=[a_hashes[2]], medium="GPU")],
        [AllBlocksCleared(), c],
    ]
    for events in script:
        pub.publish(KVEventBatch(ts=time.time(), events=events))
    live = []
    while sub.poll(1000) and len(live) < len(script):
        live.append(sub.recv_multipart())
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"ipc://{tmp}/replay")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    replay = []
    while dealer.poll(2000):
        frames = dealer.recv_multipart()
        replay.append(frames)
        if frames[-2] == ZmqEventPublisher.END_SEQ:
            break
    pub.shutdown()
    assert len(live) == len(script), live
    with open(out, "wb") as f:
        record = {"vllm": __version__, "block_size": BS, "live": live, "replay": replay}
        f.write(msgspec.msgpack.encode(record))
    print(f"vLLM {__version__}: {len(live)} live messages, {len(replay)} replay frames -> {out}")


if __name__ == "__main__":
    main(sys.argv[1])
