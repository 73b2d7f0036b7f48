"""The P/D trust model (ARCHITECTURE.md, "P/D trust model"; lbd.engine.kv_transfer.trust): a consumer pulls
only for params a producer it shares the key with signed, only from a listener that proves it holds the key,
and resolves no name a request gives; a producer caps its leases by count and bytes; a NIXL notification
ends a lease only with its lend's secret. Units first, then real engine ranks of the tiny Llama."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from lbd.engine.kv_transfer.agent import UNPROVEN, BlockPuller, BlockServer, Leases, PullJob, PullResult
from lbd.engine.kv_transfer.nixl import notification, parse_notification
from lbd.engine.kv_transfer.trust import local_key, sign, signed, transfer_key
from lbd.wire import kv_transfer as KT
from lbd.wire.kv_transfer import KVTransferParams, params_from_obj, params_to_obj
from support.pd import COMMON, body, kv_config, metric, moved, prefill, prompt_ids, start, text_of
from support.procs import EngineServer

LAYOUT = "test/1"


def params(**kw) -> KVTransferParams:
    base = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [1, 2],
            "remote_host": "127.0.0.1", "remote_port": 5555, "remote_request_id": "r"}
    return KVTransferParams(**{**base, **kw})


def test_signed_params_verify_and_any_change_breaks_them() -> None:
    key, other = b"k" * 32, b"o" * 32
    p = sign(key, params())
    assert signed(key, p) and not signed(other, p) and not signed(None, p)
    for change in ({"remote_port": 5556}, {"remote_host": "127.0.0.2"}, {"remote_block_ids": [1, 3]},
                   {"remote_engine_id": "f"}, {"remote_request_id": "s"}):
        forged = msgspec.structs.replace(p, **change)
        assert not signed(key, forged), change
    assert not signed(key, params())  # unsigned
    again = params_from_obj(params_to_obj(p))  # through the HTTP JSON, as a proxy passes it on
    assert signed(key, again)


def test_the_local_key_is_private_and_shared(tmp_path: Path) -> None:
    env = {"XDG_RUNTIME_DIR": str(tmp_path)}
    first = local_key(env)
    assert first is not None and local_key(env) == first
    folder = tmp_path / "lbd"
    assert os.stat(folder).st_mode & 0o777 == 0o700
    assert os.stat(folder / "kv-transfer.key").st_mode & 0o777 == 0o600
    token = {"LBD_CLUSTER_TOKEN": "t" * 40}
    assert transfer_key({**env, **token}) not in (None, first)  # the token's wins, on every node alike
    elsewhere = {**token, "XDG_RUNTIME_DIR": str(tmp_path / "elsewhere")}
    assert transfer_key(elsewhere) == transfer_key({**env, **token})
    os.chmod(folder, 0o755)  # readable by others: no key at all, so no pulls
    assert local_key(env) is None


@pytest.mark.parametrize("host, ok", [
    ("127.0.0.1", True), ("::1", True), ("[::1]", True), ("10.0.0.7", True), ("localhost", True),
    ("example.com", False), ("lbd-test.invalid", False), ("127.0.0.1.nip.io", False)])
def test_remote_host_is_an_address_never_a_name(host: str, ok: bool) -> None:
    raw = params_to_obj(params(remote_host=host))
    if ok:
        assert params_from_obj(raw).remote_host == host
    else:
        with pytest.raises(ValueError, match="remote_host must be an IP address"):
            params_from_obj(raw)


def test_leases_are_capped_by_count_and_blocks() -> None:
    leases = Leases(max_count=2, max_blocks=5)
    assert leases.add("a", [1, 2], 1e9, []) is None
    assert leases.add("a", [3], 1e9, []) == "taken"  # a reused request id never replaces a lease
    assert leases.add("b", [3, 4, 5, 6], 1e9, []) == "bytes"
    assert leases.add("b", [3, 4], 1e9, []) is None
    assert leases.add("c", [7], 1e9, []) == "count"
    assert (len(leases), leases.blocks) == (2, 4)
    assert leases.take("a") is not None and leases.blocks == 2
    assert leases.expired(2e9) == [[3, 4]] and leases.blocks == 0


def test_a_nixl_notification_ends_a_lease_only_with_its_lends_secret() -> None:
    leases = Leases()
    leases.add("t", [1, 2], 1e9, [])
    assert leases.take("t", "") is None  # not lent: no notification ends it
    lease = leases.lend("t", 2, 1e9)
    assert lease is not None and len(lease.notif) == 32
    assert leases.take("t", "0" * 32) is None and leases.take("t", "") is None
    forged = parse_notification(b"t")  # a bare transfer id, as any NIXL peer could send it
    assert forged == ("t", "") and leases.take(*forged) is None
    real = parse_notification(notification("t", lease.notif))  # what the reader sends (NixlSink.read)
    assert leases.take(*real) is lease and len(leases) == 0


def pull(ctx: zmq.Context, key: bytes | None, job: PullJob) -> PullResult:
    """One pull by a consumer's puller thread holding ``key``."""
    puller = BlockPuller(ctx, None, LAYOUT, 4, timeout_s=2.0, max_bytes=1 << 20, key=key)
    puller.start()
    try:
        puller.jobs.put(job)
        return puller.results.get(timeout=10)
    finally:
        puller.stop()
        puller.join(timeout=5)


def test_a_listener_without_the_key_is_never_read_from() -> None:
    """A consumer's pull reaches a listener that answers like a producer (say, one that took a dead
    producer's port): with no proof of the key, its bytes are dropped; a real block server with the key
    proves it and is read."""
    ctx = zmq.Context()
    key = b"k" * 32
    fake = ctx.socket(zmq.ROUTER)
    port = fake.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        ident, payload = fake.recv_multipart()
        pull = KT.decode_pull(payload)
        header = KT.KVBlocksHeader(pull.transfer_id, True, layout=LAYOUT, block_bytes=4, num_blocks=2)
        fake.send_multipart([ident, KT.encode(header), b"EVILEVIL"])

    job = PullJob("req", "127.0.0.1", port, "e", "t", [0, 1], 0, [1] * 8)
    t = threading.Thread(target=answer)
    t.start()
    result = pull(ctx, key, job)
    t.join()
    assert result.data is None and result.error.startswith(UNPROVEN), result.error
    fake.close(linger=0)

    leases = Leases()
    leases.add("t", [0, 1], time.monotonic() + 30, [1] * 8)
    server = BlockServer(ctx, "127.0.0.1", 0, None, "e", leases, lambda ids: memoryview(b"GOODGOOD"), LAYOUT,
                         4, lambda n: None, key=key)
    server.start()
    try:
        real = PullJob("req", "127.0.0.1", server.port, "e", "t", [0, 1], 0, [1] * 8)
        assert pull(ctx, b"x" * 32, real).error.startswith(UNPROVEN)  # a server of another key
        leases.add("t", [0, 1], time.monotonic() + 30, [1] * 8)
        assert pull(ctx, key, real).data == b"GOODGOOD"
    finally:
        server.stop()
        server.join(timeout=2)
        ctx.term()


# ---- real ranks -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A producer with a small cache (128 blocks of 16 tokens) and a consumer, default caps."""
    logs = tmp_path_factory.mktemp("pd-trust")
    producer = start(tiny_llama, "kv_producer", logs / "p.log", "--kv-cache-memory-bytes", "1MiB")
    try:
        consumer = start(tiny_llama, "kv_consumer", logs / "d.log")
        try:
            yield producer, consumer
        finally:
            consumer.close()
    finally:
        producer.close()


def test_forged_params_make_no_connection(pair) -> None:
    """Params no producer signed, naming a listener: the consumer never contacts it and recomputes."""
    producer, consumer = pair
    ctx = zmq.Context()
    listener = ctx.socket(zmq.ROUTER)
    port = listener.bind_to_random_port("tcp://127.0.0.1")
    try:
        base = prompt_ids(70, 4711)
        colocated = text_of(producer, "/v1/completions", body(base))
        untrusted0 = metric(consumer, "lbd:kv_transfer_untrusted_total")
        forged = params_to_obj(params(remote_block_ids=[0, 1, 2, 3], remote_port=port))
        assert text_of(consumer, "/v1/completions", body(base, kv_transfer_params=forged)) == colocated
        assert metric(consumer, "lbd:kv_transfer_untrusted_total") == untrusted0 + 1
        assert not listener.poll(500), "the consumer sent a pull to a listener no producer named"
    finally:
        listener.close(linger=0)
        ctx.term()


def test_a_name_in_params_is_refused_at_once(pair) -> None:
    """The core never resolves a request's host: a name gets a 400 from the front end, without waiting."""
    _, consumer = pair
    raw = params_to_obj(params(remote_host="lbd-test.invalid"))
    t0 = time.monotonic()
    data = body(prompt_ids(40, 1), kv_transfer_params=raw)
    r = httpx.post(consumer.base_url + "/v1/completions", json=data, timeout=30)
    assert r.status_code == 400 and "remote_host" in r.text, r.text
    assert time.monotonic() - t0 < 5


def test_a_producer_of_another_key_is_not_pulled_from(pair, tiny_llama: Path, tmp_path: Path) -> None:
    """A producer of another user (another local key) signs its params with its key: this consumer cannot
    verify them, pulls nothing and recomputes. (The stranger is a sim rank: it signs as any producer does and
    starts without torch; its params are refused as untrusted before anything else is looked at.)"""
    producer, consumer = pair
    stranger = EngineServer(tiny_llama, *COMMON, "--kv-transfer-config", kv_config("kv_producer"),
                            "--device", "sim", "--kv-cache-memory-bytes", "1GiB",
                            env={"XDG_RUNTIME_DIR": str(tmp_path)}, log=tmp_path / "s.log")
    try:
        base = prompt_ids(70, 808)
        colocated = text_of(producer, "/v1/completions", body(base))
        foreign = prefill(stranger, body(base))
        pulled0, _ = moved(consumer)
        untrusted0 = metric(consumer, "lbd:kv_transfer_untrusted_total")
        assert text_of(consumer, "/v1/completions", body(base, kv_transfer_params=foreign)) == colocated
        assert moved(consumer)[0] == pulled0
        assert metric(consumer, "lbd:kv_transfer_untrusted_total") == untrusted0 + 1
        mine = prefill(producer, body(prompt_ids(70, 809)))  # and this producer's params are pulled
        assert text_of(consumer, "/v1/completions", body(prompt_ids(70, 809), kv_transfer_params=mine))
        assert moved(consumer)[0] == pulled0 + 4
    finally:
        stranger.close()


def test_the_decode_runs_on_the_moved_bytes(pair) -> None:
    """What the sim pair cannot show (its tokens are a hash of the prompt, its blocks carry no bytes): on
    real ranks the decode's first 4 blocks are neither computed nor cached there before the pull; they come
    as 4 blocks' bytes, enter as cache hits, only the 6-token tail is computed, and the greedy text, which
    attends over those bytes, is the colocated one."""
    producer, consumer = pair
    base = prompt_ids(70, 2024)
    colocated = text_of(producer, "/v1/completions", body(base))

    def counts() -> tuple[float, ...]:
        return (metric(consumer, "vllm:prompt_tokens_by_source_total", source="local_compute"),
                metric(consumer, "vllm:prompt_tokens_by_source_total", source="local_cache_hit"),
                metric(consumer, "lbd:kv_transfer_bytes_total", direction="pulled"), *moved(consumer))

    params = prefill(producer, body(base))
    before = counts()
    assert text_of(consumer, "/v1/completions", body(base, kv_transfer_params=params)) == colocated
    after = counts()
    per_token = metric(consumer, "lbd:kv_transfer_bytes_per_token")
    computed, hits, nbytes, pulled, local = (a - b for a, b in zip(after, before, strict=True))
    assert (pulled, local) == (4, 0)
    assert nbytes == 4 * 16 * per_token > 0
    assert (hits, computed) == (64, 6)


FLOOD = 60  # 180 blocks against a 128-block cache: enough to pass both the lease cap and the cache


def test_a_flood_of_remote_decode_prefills_leaves_the_cache_usable(pair) -> None:
    """60 prefills with do_remote_decode straight at the producer (3 blocks each, 180 blocks in all against
    a 128-block cache): leases stop at the cap (half the cache), the rest are refused and counted, and a
    normal request of 300 prompt tokens still runs at once."""
    producer, _ = pair
    refused0 = metric(producer, "lbd:kv_transfer_lease_refusals_total")

    def one(i: int) -> int:
        first = {**body(prompt_ids(50, 10_000 + i)), "max_tokens": 1,
                 "kv_transfer_params": {"do_remote_decode": True}}
        r = httpx.post(producer.base_url + "/v1/completions", json=first, timeout=30)
        return r.status_code

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(one, range(FLOOD)))
    flood_s = time.monotonic() - t0
    held = metric(producer, "lbd:kv_transfer_pending_leases")
    held_blocks = metric(producer, "lbd:kv_transfer_lease_blocks")
    refused = metric(producer, "lbd:kv_transfer_lease_refusals_total") - refused0
    usage = metric(producer, "vllm:kv_cache_usage_perc")
    t1 = time.monotonic()
    r = httpx.post(producer.base_url + "/v1/completions", json=body(prompt_ids(300, 5), max_tokens=20),
                   timeout=30)
    normal_s = time.monotonic() - t1
    print(f"\nflood: {FLOOD} requests in {flood_s:.1f} s, codes {sorted(set(codes))}; leases held {held:g} "
          f"({held_blocks:g} blocks), refusals {refused:g}, KV usage {usage:.2f}; then a 300-token request "
          f"in {normal_s:.2f} s: {r.status_code}")
    assert codes == [200] * FLOOD
    assert r.status_code == 200, r.text
    assert held_blocks <= 64 and held + refused == FLOOD
    assert refused > 0 and usage <= 0.6
