"""`lbd serve --data-parallel-size 2 --prefill-ranks 0 --decode-ranks 1`: a one-command P/D node. The
supervisor gives the ranks their KV roles and its router runs long prompts in two stages."""

from __future__ import annotations

import random
import time
import uuid
from pathlib import Path

import httpx

from support import free_port_run
from support.deploy_harness import ServeNode


def test_one_command_pd_node(tiny_llama: Path, tmp_path: Path) -> None:
    base = free_port_run(4)  # router, 2 ranks, health port
    args = ["--model", str(tiny_llama), "--kv-cache-memory-bytes", "32MiB", "--max-model-len", "512",
            "--served-model-name", "tiny", "--data-parallel-size", "2",
            "--prefill-ranks", "0", "--decode-ranks", "1", "--host", "127.0.0.1", "--port", str(base),
            "--rank-port", str(base + 1), "--data-parallel-supervisor-port", str(base + 3),
            "--dp-supervisor-probe-interval-s", "0.5"]
    node = ServeNode(args, tmp_path / "serve.log", port=base, health_port=base + 3)
    try:
        node.wait_ready(timeout=240)
        roles = {r["rank"]: r["role"] for r in httpx.get(node.health + "/status", timeout=5).json()["ranks"]}
        assert roles == {0: "prefill", 1: "decode"}
        rng = random.Random(uuid.uuid4().int)
        prompt = [rng.randrange(10, 300) for _ in range(300)]  # over lbd route's --pd-min-prompt-tokens 256
        data = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        alone = httpx.post(f"http://127.0.0.1:{base + 1}/v1/completions", json=data, timeout=60).json()
        deadline = time.monotonic() + 20  # the router reads the supervisor's /status every 0.5 s
        while True:  # until it has seen both ranks ready, it runs requests colocated
            r = httpx.post(node.api + "/v1/completions", json=data, timeout=60)
            assert r.status_code == 200, r.text
            if r.headers["x-lbd-disagg"].startswith("pd ") or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert r.headers["x-lbd-disagg"] == f"pd http://127.0.0.1:{base + 1}"
        assert r.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    finally:
        node.close()
