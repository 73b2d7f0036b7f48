"""NixlConnector end to end on this machine's CPUs: real `lbd serve` ranks whose KV caches (DRAM) are READ
through NIXL's UCX backend (the ``nixl-cu13`` wheel, no GPU needed), driven with vLLM's two-stage requests.

Greedy output through the P/D path equals the colocated path's, streamed and not, with only the missing
blocks moved; the producer's lease ends on the READ's notification (not at its deadline); the connectors
interoperate both ways (a NIXL consumer gets bytes from an LbdConnector producer, an LbdConnector consumer
gets bytes from a NIXL producer); a killed producer leaves the decode to recompute; a sim rank gets exit 2
naming the flag."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.pd import (
    BLOCK,
    assert_killed_producer_means_recompute,
    body,
    kv_config,
    metric,
    moved,
    prefill,
    producer_and_consumer,
    prompt_ids,
    start,
    text_of,
)

pytest.importorskip("nixl_cu13", reason="NixlConnector's tests need lbd[nixl] (bash scripts/setup.sh)")

LEASE_S = 30.0  # long: a lease that ends before this ended on the READ's notification


@pytest.fixture(scope="module")
def nixl_pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    logs = tmp_path_factory.mktemp("pd-nixl")
    with producer_and_consumer(tiny_llama, logs, "NixlConnector", lease_s=LEASE_S) as pair:
        yield pair


def pending(producer) -> float:
    return metric(producer, "lbd:kv_transfer_pending_leases")


@pytest.mark.parametrize("stream", [False, True])
def test_nixl_pd_equals_colocated_and_reads_only_missing_blocks(nixl_pair, stream: bool) -> None:
    producer, consumer = nixl_pair
    base = prompt_ids(70, 11 + stream)  # 4 full blocks
    colocated = text_of(producer, "/v1/completions", body(base))
    pulled0, local0 = moved(consumer)
    reads0 = metric(consumer, "lbd:kv_transfer_nixl_reads_total")
    params = prefill(producer, body(base, stream=stream))
    decoded = text_of(consumer, "/v1/completions", body(base, stream=stream, kv_transfer_params=params))
    assert decoded == colocated
    pulled1, local1 = moved(consumer)
    assert (pulled1 - pulled0, local1 - local0) == (4, 0)

    longer = base + prompt_ids(40, 111 + stream)  # 6 blocks, the first 4 already on the consumer
    colocated = text_of(producer, "/v1/completions", body(longer))
    params = prefill(producer, body(longer, stream=stream))
    assert text_of(consumer, "/v1/completions", body(longer, stream=stream, kv_transfer_params=params)) \
        == colocated
    pulled2, local2 = moved(consumer)
    assert (pulled2 - pulled1, local2 - local1) == (2, 4)
    assert metric(consumer, "lbd:kv_transfer_nixl_reads_total") == reads0 + 2  # not bytes over ZMQ


def test_lease_ends_on_the_reads_notification(nixl_pair) -> None:
    producer, consumer = nixl_pair
    prompt = prompt_ids(5 * BLOCK + 3, 23)
    params = prefill(producer, body(prompt))
    assert pending(producer) >= 1
    text_of(consumer, "/v1/completions", body(prompt, kv_transfer_params=params))
    deadline = time.monotonic() + 10  # far below LEASE_S: only the notification can end it this soon
    while pending(producer) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pending(producer) == 0
    assert metric(producer, "lbd:kv_transfer_blocks_total", direction="served") >= 5


def test_connectors_interoperate_both_ways(nixl_pair, tiny_llama: Path, tmp_path: Path) -> None:
    """A NIXL consumer gets bytes from an LbdConnector producer; an LbdConnector consumer gets bytes from a
    NIXL producer: same tokens, blocks moved, no failed pull. One LbdConnector rank (kv_both) is both ends."""
    nixl_producer, nixl_consumer = nixl_pair
    lbd_rank = start(tiny_llama, "kv_both", tmp_path / "lb.log")
    try:
        pairs = ((lbd_rank, nixl_consumer, 31), (nixl_producer, lbd_rank, 32))
        for producer, consumer, seed in pairs:
            prompt = prompt_ids(3 * BLOCK + 5, seed)
            colocated = text_of(producer, "/v1/completions", body(prompt))
            failed0, (pulled0, _) = metric(consumer, "lbd:kv_transfer_failed_pulls_total"), moved(consumer)
            reads0 = metric(consumer, "lbd:kv_transfer_nixl_reads_total")
            params = prefill(producer, body(prompt))
            assert text_of(consumer, "/v1/completions", body(prompt, kv_transfer_params=params)) == colocated
            assert moved(consumer)[0] - pulled0 == 3
            assert metric(consumer, "lbd:kv_transfer_failed_pulls_total") == failed0
            assert metric(consumer, "lbd:kv_transfer_nixl_reads_total") == reads0  # bytes: one end lacks NIXL
    finally:
        lbd_rank.close()


def test_killed_nixl_producer_decode_recomputes(nixl_pair) -> None:
    """The last test of the pair (file order): its own NIXL producer prefills and is SIGKILLed, so no extra
    engine starts."""
    producer, consumer = nixl_pair
    assert_killed_producer_means_recompute(producer, consumer, doomed=producer)


def test_nixl_on_a_sim_rank_exits_2_naming_the_flag(tiny_llama: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "lbd.engine", "--model", str(tiny_llama), "--device", "sim",
                        "--kv-transfer-config", kv_config("kv_producer", "NixlConnector")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "--kv-transfer-config" in r.stderr and "model the transfer with LbdConnector" in r.stderr
