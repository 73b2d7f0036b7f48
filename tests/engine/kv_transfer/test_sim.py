"""Prefill/decode disaggregation on ``--device sim`` ranks: a real producer and consumer (`lbd serve`, sim
device) driven with vLLM's two-stage requests.

What this proves: the protocol and its accounting on sim ranks: leases, pulls, the producer's token check,
registration in the consumer's prefix cache, KV events, and that only the blocks the consumer lacks are
charged, in modelled time that grows with them (order only: never absolute times). What it cannot prove:
that the transfer is right. A sim rank's tokens are a hash of the prompt ids and its block IO moves no bytes,
so its P/D text equals the colocated text whatever crosses the wire; the text check here only says the
decode finished. The bytes are proven on real ranks of the tiny Llama (test_trust.py,
``test_the_decode_runs_on_the_moved_bytes``: the decode's first blocks arrive only by the pull, count as
cache hits, only the tail is computed, and the greedy text is the colocated one; test_connector.py)."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import httpx
import pytest

from lbd.engine.kv_transfer.sim import SimBlockIO
from lbd.engine.sim_profiles import PROFILES, get_profile
from support import metric_value
from support.kv_events import subscribed, wait_for_stored_run
from support.procs import EngineServer

BLOCK = 16
H100 = PROFILES["h100-llama3-8b"]


def test_modelled_time_grows_with_blocks_and_follows_the_layout() -> None:
    io = SimBlockIO(H100, BLOCK)
    assert io.block_bytes == 2 * 32 * 8 * 128 * 2 * BLOCK  # K and V x layers x KV heads x head_dim x bf16
    times = [io.transfer_seconds(n) for n in (0, 1, 4, 12, 128)]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[0] > 0  # a pull of nothing still pays the link's latency
    slower_link = SimBlockIO(PROFILES["a100-llama3-8b"], BLOCK)
    assert slower_link.transfer_seconds(128) > io.transfer_seconds(128)
    dilated = SimBlockIO(get_profile("h100-llama3-8b*10"), BLOCK)
    assert dilated.transfer_seconds(12) > io.transfer_seconds(12)
    assert io.layout != SimBlockIO(PROFILES["cpu-smollm2-135m"], BLOCK).layout  # never paired


def metric(server: EngineServer, name: str, **labels: str) -> float:
    return metric_value(httpx.get(server.base_url + "/metrics", timeout=10).text, name, **labels)


@pytest.fixture(scope="module")
def pair(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory):
    """A sim producer and consumer whose link is slow enough that a pull's modelled time shows."""
    folder = tmp_path_factory.mktemp("pd-sim")
    fields = {
        **dataclasses.asdict(H100),
        "name": "slow-link",
        "kv_link_bandwidth": 60e6,
        "kv_link_latency_s": 0.01,
    }
    (folder / "slow-link.json").write_text(json.dumps(fields))
    common = (
        "--device",
        "sim",
        "--sim-profile",
        str(folder / "slow-link.json"),
        "--max-model-len",
        "512",
        "--served-model-name",
        "tiny",
    )

    def start(role: str, name: str, *extra: str) -> EngineServer:
        cfg = json.dumps({"kv_connector": "LbdConnector", "kv_role": role})
        return EngineServer(tiny_llama, *common, "--kv-transfer-config", cfg, *extra, log=folder / name)

    events = json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{folder}/events.sock"}
    )
    producer = start("kv_producer", "p.log")
    try:
        consumer = start("kv_consumer", "d.log", "--kv-events-config", events)
    except Exception:
        producer.close()
        raise
    yield producer, consumer, f"ipc://{folder}/events.sock"
    consumer.close()
    producer.close()


def complete(server: EngineServer, prompt: list[int], **kw) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}
    r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def two_stage(producer: EngineServer, consumer: EngineServer, prompt: list[int]) -> tuple[str, dict]:
    """vLLM's proxy's two requests: the prefill (do_remote_decode, one token), then the decode."""
    first = complete(
        producer,
        prompt,
        max_tokens=1,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    return complete(consumer, prompt, kv_transfer_params=params)["choices"][0]["text"], params


def moved(consumer: EngineServer) -> tuple[float, float, float, float]:
    """Blocks pulled, blocks found locally, bytes pulled, seconds spent pulling (the histogram's sum)."""
    return (
        metric(consumer, "lbd:kv_transfer_blocks_total", direction="pulled"),
        metric(consumer, "lbd:kv_transfer_blocks_total", direction="local"),
        metric(consumer, "lbd:kv_transfer_bytes_total", direction="pulled"),
        metric(consumer, "lbd:kv_transfer_pull_seconds_sum"),
    )


def test_sim_pair_moves_only_missing_blocks_in_modelled_time(pair) -> None:
    producer, consumer, _ = pair
    rng = random.Random(7)
    base = [rng.randrange(10, 300) for _ in range(200)]  # 199 // 16 = 12 blocks to move
    colocated = complete(producer, base)["choices"][0]["text"]
    before = moved(consumer)
    text, params = two_stage(producer, consumer, base)
    assert text == colocated
    first = moved(consumer)
    assert len(params["remote_block_ids"]) == 12
    assert (first[0] - before[0], first[1] - before[1]) == (12, 0)
    assert first[2] - before[2] == 12 * BLOCK * H100.kv_bytes_per_token
    assert metric(consumer, "lbd:kv_transfer_bytes_per_token") == H100.kv_bytes_per_token

    same_head = base[:128] + [rng.randrange(10, 300) for _ in range(72)]  # 8 blocks already on the consumer
    colocated = complete(producer, same_head)["choices"][0]["text"]
    text, _ = two_stage(producer, consumer, same_head)
    assert text == colocated
    second = moved(consumer)
    assert (second[0] - first[0], second[1] - first[1]) == (4, 8)
    assert second[2] - first[2] < first[2] - before[2]
    assert second[3] - first[3] < first[3] - before[3]  # fewer blocks, less modelled link time
    assert metric(producer, "lbd:kv_transfer_blocks_total", direction="served") >= 16


def test_sim_pulled_blocks_are_published_as_kv_events(pair) -> None:
    producer, consumer, endpoint = pair
    with subscribed(endpoint) as sub:
        base = [random.Random(99).randrange(10, 300) for _ in range(70)]  # 4 full blocks
        two_stage(producer, consumer, base)
        runs = wait_for_stored_run(sub, base[: 4 * BLOCK])
        assert base[: 4 * BLOCK] in runs
