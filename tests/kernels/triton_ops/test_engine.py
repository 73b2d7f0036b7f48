"""The engine with LBD_KERNELS=triton (Triton interpreter on CPU) generates the same greedy tokens as with
LBD_KERNELS=torch, over concurrent requests of different lengths (mixed prefill + decode batches)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from support import EngineServer

PROMPTS = ["The capital of France is", "Once upon a time there was a tiny model that learned to count: one",
           "def add(a, b):", "Hello"]


def _generate(model: Path, mode: str, log: Path) -> list[list[str]]:
    env = {"LBD_KERNELS": mode, "TRITON_INTERPRET": "1"}
    try:
        server = EngineServer(model, "--kv-cache-memory-bytes", "8MiB", "--block-size", "4", env=env, log=log)
    except Exception as e:
        tail = log.read_text(errors="replace")[-3000:]
        raise AssertionError(f"{mode} engine failed to start: {e}\n{tail}") from e
    try:
        with httpx.Client(base_url=server.base_url, timeout=240) as client:

            def one(prompt: str) -> list[str]:
                body = {"model": str(model), "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
                        "logprobs": 1, "ignore_eos": True}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["logprobs"]["tokens"]

            with ThreadPoolExecutor(len(PROMPTS)) as pool:
                return list(pool.map(one, PROMPTS))
    finally:
        server.close()


def test_triton_engine_matches_torch_engine(tiny_llama: Path, tmp_path: Path) -> None:
    want = _generate(tiny_llama, "torch", tmp_path / "torch.log")
    got = _generate(tiny_llama, "triton", tmp_path / "triton.log")
    assert all(len(t) == 6 for t in want)
    assert got == want
    assert "Triton kernels in use" in (tmp_path / "triton.log").read_text(errors="replace")
    assert "Triton kernels in use" not in (tmp_path / "torch.log").read_text(errors="replace")
