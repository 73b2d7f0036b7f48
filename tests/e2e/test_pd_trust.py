"""A trusted proxy in front of the ranks still drives vLLM's P/D contract: vllm-router's
``--vllm-pd-disaggregation`` (installed by scripts/setup-peers.sh into .venv-peers; skipped without it) over
an lbd prefill rank and an lbd decode rank answers the colocated greedy text, and the decode rank really
pulled the blocks: the producer's signed ``kv_transfer_params`` (``lbd_sig``) survive the proxy."""

from __future__ import annotations

import json
import socket
import uuid
from pathlib import Path

import httpx
import pytest

from support.pd import body, moved, producer_and_consumer, text_of
from support.procs import spawn, stop, wait_http

PEER = Path(__file__).resolve().parents[2] / ".venv-peers" / "bin" / "vllm-router"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(not PEER.exists(), reason="no vllm-router (bash scripts/setup-peers.sh routers)")
def test_vllm_router_pd_mode_drives_lbd_ranks(tiny_llama: Path, tmp_path: Path) -> None:
    with producer_and_consumer(tiny_llama, tmp_path) as (producer, consumer):
        port = _port()
        proc = spawn([str(PEER), "--host", "127.0.0.1", "--port", str(port), "--vllm-pd-disaggregation",
                      "--prefill", producer.base_url, "--decode", consumer.base_url,
                      "--policy", "round_robin", "--log-level", "warning", "--prometheus-port", str(_port())],
                     log=tmp_path / "peer.log")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_http(url + "/health", timeout=60, proc=proc)
            prompt = f"{uuid.uuid4()} " + "a long shared document about numbers 0123456789 " * 8
            data = {**body([]), "prompt": prompt, "max_tokens": 12}
            colocated = text_of(producer, "/v1/completions", data)
            pulled0, _ = moved(consumer)
            for stream in (False, True):
                r_data = {**data, "stream": stream}
                if stream:
                    r_data["prompt"] = prompt + " again"
                    colocated = text_of(producer, "/v1/completions", {**data, "prompt": r_data["prompt"]})
                got = _through(url, r_data)
                assert got == colocated, (stream, got, colocated)
            assert moved(consumer)[0] > pulled0, "the decode rank pulled no blocks through vllm-router"
        finally:
            stop(proc)


def _through(url: str, data: dict) -> str:
    """The text of ``data`` sent to the proxy at ``url``."""
    if not data.get("stream"):
        r = httpx.post(url + "/v1/completions", json=data, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    out = []
    with httpx.stream("POST", url + "/v1/completions", json=data, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.extend(c.get("text") or "" for c in json.loads(line[6:])["choices"])
    return "".join(out)
