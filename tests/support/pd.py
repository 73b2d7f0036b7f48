"""Prefill/decode disaggregation in tests: engines by KV-transfer role, vLLM's two-stage requests (the
prefill with ``do_remote_decode``, then the decode with the params it returned), and the consumer's counts of
moved blocks."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx

from support import metric_value
from support.procs import EngineServer

BLOCK = 16
COMMON = ("--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512", "--served-model-name", "tiny")


def kv_config(role: str, connector: str = "LbdConnector", **extra: float) -> str:
    cfg: dict = {"kv_connector": connector, "kv_role": role}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return json.dumps(cfg)


def start(model: Path, role: str, log: Path, *args: str, connector: str = "LbdConnector",
          **extra: float) -> EngineServer:
    """An engine of tiny ``model`` with this KV-transfer role."""
    return EngineServer(model, *COMMON, "--kv-transfer-config", kv_config(role, connector, **extra), *args,
                        log=log)


def events_config(folder: Path) -> tuple[str, str]:
    """KV events on an ipc:// socket the engine binds (no port to pick)."""
    return "--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                             "endpoint": f"ipc://{folder}/events.sock"})


def metric(server: EngineServer, name: str, **labels: str) -> float:
    return metric_value(httpx.get(server.base_url + "/metrics", timeout=10).text, name, **labels)


def prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 300) for _ in range(n)]


def body(prompt: list[int], **kw) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **kw}


def post(server: EngineServer, path: str, data: dict) -> dict:
    r = httpx.post(server.base_url + path, json=data, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def text_of(server: EngineServer, path: str, data: dict) -> str:
    """The completion's text, read from the SSE stream when ``data`` asks for one."""
    if not data.get("stream"):
        choice = post(server, path, data)["choices"][0]
        return choice["text"] if "text" in choice else choice["message"]["content"]
    out = []
    with httpx.stream("POST", server.base_url + path, json=data, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    out.append(c.get("text") or c.get("delta", {}).get("content") or "")
    return "".join(out)


def prefill(producer: EngineServer, data: dict, path: str = "/v1/completions") -> dict:
    """vLLM's proxy's first stage: the request, with do_remote_decode and one token, not streamed."""
    first = {**data, "max_tokens": 1, "stream": False,
             "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                    "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                                    "remote_port": None}}
    first.pop("stream_options", None)
    params = post(producer, path, first)["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    return params


def moved(consumer: EngineServer) -> tuple[float, float]:
    return (metric(consumer, "lbd:kv_transfer_blocks_total", direction="pulled"),
            metric(consumer, "lbd:kv_transfer_blocks_total", direction="local"))


def assert_killed_producer_means_recompute(producer: EngineServer, consumer: EngineServer,
                                           doomed: EngineServer) -> None:
    """``doomed`` prefills, is SIGKILLed before the pull, and ``consumer`` still answers what colocated
    ``producer`` answers (it recomputed the prefill), with one failed pull counted."""
    prompt = prompt_ids(60, 77)
    try:
        colocated = text_of(producer, "/v1/completions", body(prompt))
        params = prefill(doomed, body(prompt))
    finally:
        os.killpg(doomed.proc.pid, signal.SIGKILL)
        doomed.close()
    failed0 = metric(consumer, "lbd:kv_transfer_failed_pulls_total")
    assert text_of(consumer, "/v1/completions", body(prompt, kv_transfer_params=params)) == colocated
    assert metric(consumer, "lbd:kv_transfer_failed_pulls_total") == failed0 + 1


@contextlib.contextmanager
def producer_and_consumer(model: Path, logs: Path, connector: str = "LbdConnector", lease_s: float = 60.0,
                          pull_timeout_s: float = 5.0, consumer_args: tuple[str, ...] = ()
                          ) -> Iterator[tuple[EngineServer, EngineServer]]:
    """A kv_producer and a kv_consumer engine of ``model``, both closed on the way out."""
    producer = start(model, "kv_producer", logs / "p.log", connector=connector, lease_s=lease_s)
    try:
        consumer = start(model, "kv_consumer", logs / "d.log", *consumer_args, connector=connector,
                         pull_timeout_s=pull_timeout_s)
        try:
            yield producer, consumer
        finally:
            consumer.close()
    finally:
        producer.close()
