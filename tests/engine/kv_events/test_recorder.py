"""KV-cache events, read as a vLLM consumer reads them.

The structs below are declared here with the shape of ``vllm.distributed.kv_events`` (vLLM 0.32: field names,
types, order, defaults, ``array_like`` batch, ``tag=True`` events), not imported from the engine, and decode
the engine's messages with msgspec's strict typed decoder. A scripted run of the real tiny-Llama engine core
(prefix hits, decode-filled blocks, eviction, a reset, a restart on the same endpoints) is checked message by
message: framing, sequence numbers, replay with its end marker, and the blocks the events describe against
the cache manager's own table. ~3 s.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from lbd.engine.config.args import EngineArgs
from lbd.engine.config.kv_events import offset_endpoint_port, parse_kv_events_config
from lbd.engine.core.engine_core import EngineCore
from lbd.engine.kv_events.recorder import external_key_fn
from lbd.wire.core_messages import EngineCoreRequest, SamplingParams

BLOCK_BYTES = 2048  # tiny Llama at --block-size 4: 2 layers x (K, V) x 2 KV heads x 16 dims x 4 B x 4 tokens
BS = 4


# ---- vLLM's declarations (shape copied by hand) ----------------------------------------------------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=VKVEventBatch)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


# ---- helpers --------------------------------------------------------------------------------------------
def make_core(model: Path, tmp: Path, rank: int = 0) -> EngineCore:
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp}/kv-pub",
           "replay_endpoint": f"ipc://{tmp}/kv-replay", "buffer_steps": 1000, "topic": "kv"}
    args = EngineArgs(device="cpu", block_size=BS, max_model_len=64, kv_cache_memory_bytes=24 * BLOCK_BYTES,
                      data_parallel_rank=rank, data_parallel_size=rank + 1, kv_events_config=json.dumps(cfg))
    return EngineCore.from_args(args, str(model))


def run(core: EngineCore, rid: str, prompt: list[int], max_tokens: int = 6) -> None:
    core.add_request(EngineCoreRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                   ignore_eos=True), None, time.time()))
    while core.has_work():
        core.step()


def receive(sub: zmq.Socket, until_quiet_s: float = 0.5) -> list[tuple[int, VKVEventBatch]]:
    out = []
    while sub.poll(int(until_quiet_s * 1000)):
        frames = sub.recv_multipart()
        assert len(frames) == 3, "framing: [topic, seq, payload]"
        topic, seq, payload = frames
        assert topic == b"kv" and len(seq) == 8
        out.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
    return out


def replay(ctx: zmq.Context, address: str, start: int) -> list[tuple[int, VKVEventBatch]]:
    req = ctx.socket(zmq.DEALER)
    req.setsockopt(zmq.LINGER, 0)
    req.connect(address)
    req.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert req.poll(5000), "replay: no answer"
            frames = req.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4, "replay framing: ['', topic, seq, payload]"
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b"", "vLLM's end marker"
                return out
            assert frames[1] == b"kv"
            out.append((int.from_bytes(frames[2], "big"), DECODER.decode(frames[3])))
    finally:
        req.close()


def apply(batches: list[tuple[int, VKVEventBatch]], table: dict[Any, list[int]]) -> tuple[int, int]:
    """Fold batches into {hash: token ids}, checking each event against what came before."""
    stored = removed = 0
    for _, batch in batches:
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            if isinstance(ev, VBlockStored):
                assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
                assert ev.parent_block_hash is None or ev.parent_block_hash in table, "the parent is cached"
                assert len(ev.token_ids) == BS * len(ev.block_hashes)
                for i, h in enumerate(ev.block_hashes):
                    assert h not in table
                    table[h] = ev.token_ids[i * BS:(i + 1) * BS]
                stored += len(ev.block_hashes)
            elif isinstance(ev, VBlockRemoved):
                for h in ev.block_hashes:
                    assert table.pop(h, None) is not None, "only stored blocks are removed"
                removed += len(ev.block_hashes)
            else:
                table.clear()
    return stored, removed


def cache_table(core: EngineCore) -> dict[Any, list[int]]:
    kv, ext = core.scheduler.kv, external_key_fn()
    return {ext(h): kv._tokens[b] for h, b in kv.cached.items()}


# ---- the test -------------------------------------------------------------------------------------------
def test_events_decode_as_vllm_and_match_the_cache(tiny_llama: Path, tmp_path: Path) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    core = make_core(tiny_llama, tmp_path)
    try:
        sub.connect(f"ipc://{tmp_path}/kv-pub")
        time.sleep(0.3)  # the subscription reaches the publisher
        shared = list(range(10, 22))  # 3 full blocks
        run(core, "a", [*shared, 50, 51, 52, 53, 54])  # 4 full prompt blocks, decode fills 2 more
        run(core, "b", [*shared, 60, 61, 62, 63, 64])  # hits the 3 shared blocks
        for i in range(6):  # distinct prompts: 24 blocks hold only a few of them, the rest is evicted
            run(core, f"c{i}", [100 + 20 * i + j for j in range(17)], max_tokens=3)
        live = receive(sub)
        seqs = [s for s, _ in live]
        assert seqs == list(range(len(seqs))) and len(seqs) >= 8, "one batch per step that changed the cache"
        table: dict[Any, list[int]] = {}
        stored, removed = apply(live, table)
        assert removed > 0, "the script must evict"
        assert table == cache_table(core), "events say exactly what the cache holds"
        # parent links: the second request's own blocks hang off the shared chain
        b_first = next(ev for _, bt in live for ev in bt.events
                       if isinstance(ev, VBlockStored) and ev.token_ids[:4] == [60, 61, 62, 63])
        assert b_first.parent_block_hash == external_key_fn()(
            core.scheduler.kv.hasher(core.scheduler.kv.hasher(core.scheduler.kv.hasher(
                None, shared[:4], None), shared[4:8], None), shared[8:12], None))
        # replay: every retained batch from the start sequence on, byte-identical content, then the marker
        assert [s for s, _ in replay(ctx, f"ipc://{tmp_path}/kv-replay", 0)] == seqs
        assert replay(ctx, f"ipc://{tmp_path}/kv-replay", 3) == live[3:]
        assert replay(ctx, f"ipc://{tmp_path}/kv-replay", 10_000) == []
        # a reset is AllBlocksCleared
        assert core.reset_prefix_cache()
        (seq, cleared), = receive(sub)
        assert seq == seqs[-1] + 1 and [type(e) for e in cleared.events] == [VAllBlocksCleared]
        apply([(seq, cleared)], table)
        assert table == {} == cache_table(core)
    finally:
        core.close()
    # A restart on the same endpoints: a new publisher, numbered from 0 again. (A fresh SUB socket: libzmq
    # 4.3.5 does not reconnect a SUB to a publisher re-bound in the same process; across processes, as with
    # a real restart, it does, and the router's own tests cover that.)
    sub.close(linger=0)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    core = make_core(tiny_llama, tmp_path)
    try:
        sub.connect(f"ipc://{tmp_path}/kv-pub")
        time.sleep(0.3)
        run(core, "d", [*shared, 70, 71, 72, 73, 74])
        again = receive(sub)
        assert again and again[0][0] == 0 and [s for s, _ in again] == list(range(len(again)))
        fresh: dict[Any, list[int]] = {}
        apply(again, fresh)
        assert fresh == cache_table(core)
        assert [s for s, _ in replay(ctx, f"ipc://{tmp_path}/kv-replay", 0)] == [s for s, _ in again]
    finally:
        core.close()
        sub.close(linger=0)
        ctx.term()


def test_core_info_advertises_the_resolved_endpoints(tiny_llama: Path, tmp_path: Path) -> None:
    cfg = {"enable_kv_cache_events": True, "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}
    args = EngineArgs(device="cpu", max_model_len=64, kv_cache_memory_bytes=8 * BLOCK_BYTES * 4,
                      host="127.0.0.1", kv_events_config=json.dumps(cfg))
    core = EngineCore.from_args(args, str(tiny_llama))
    try:
        adv = core.core_info().extra["kv_events"]
        assert adv["publisher"] == "zmq" and adv["buffer_steps"] == 10_000 and adv["hwm"] == 100_000
        for key in ("endpoint", "replay_endpoint"):
            host, _, port = adv[key].removeprefix("tcp://").rpartition(":")
            assert host == "127.0.0.1" and int(port) > 0
    finally:
        core.close()


def test_config_and_per_rank_endpoints() -> None:
    assert offset_endpoint_port("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint_port("tcp://*:0", 3) == "tcp://*:0"
    assert offset_endpoint_port("inproc://cache", 2) == "inproc://cache_dp2"
    assert offset_endpoint_port("ipc:///tmp/x", 0) == "ipc:///tmp/x"
    with pytest.raises(ValueError, match="cannot be offset"):
        offset_endpoint_port("ipc:///tmp/x", 1)
    cfg = parse_kv_events_config('{"enable_kv_cache_events": true}')
    assert cfg.publisher == "zmq" and cfg.endpoint == "tcp://*:5557" and cfg.active
    assert parse_kv_events_config("{}").publisher == "null"
    for bad, match in (("[1]", "JSON object"), ('{"endpoint": 5}', "wrong type"),
                       ('{"nope": 1}', "unknown key"), ('{"publisher": "kafka"}', "publisher"),
                       ("{", "not valid JSON")):
        with pytest.raises(ValueError, match=match):
            parse_kv_events_config(bad)


def test_forced_key_collisions_never_change_a_token(tiny_llama: Path) -> None:
    """Every first block shares one key and later blocks are keyed by their own tokens only (parents
    ignored): the real model must still answer every prompt exactly as without a prefix cache."""
    def colliding(parent: Any, tokens: Any, extra: Any) -> Any:
        return ("first",) if parent is None else ("block", tuple(tokens))

    a, b, tail = [11, 12, 13, 14], [31, 32, 33, 34], [5, 6, 7, 8]
    # a's chain; a again (hits); b takes the first-block key; b + tail (tail's cached block hangs off a:
    # refused); b + tail again (hits b's own chain); a again (its first block lost the key)
    prompts = [[*a, *tail, 9], [*a, *tail, 9], [*b, 0], [*b, *tail, 9], [*b, *tail, 2], [*a, *tail, 3]]

    def answers(**kw: Any) -> list[list[int]]:
        core = EngineCore.from_args(EngineArgs(device="cpu", block_size=BS, max_model_len=64,
                                               kv_cache_memory_bytes=64 * BLOCK_BYTES, **kw), str(tiny_llama))
        if kw.get("enable_prefix_caching", True):
            core.scheduler.kv.hasher = colliding
        out = []
        for i, p in enumerate(prompts):
            sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            core.add_request(EngineCoreRequest(f"r{i}", p, sampling, None, time.time()))
            toks: list[int] = []
            while core.has_work():
                for o in core.step():
                    toks += o.new_token_ids
            out.append(toks)
        if kw.get("enable_prefix_caching", True):
            assert core.scheduler.kv.prefix_hits > 0, "the collisions must not turn every hit off"
        return out

    assert answers() == answers(enable_prefix_caching=False)
