"""Engine throughput: lbd's server vs transformers `generate` on the same model, threads and requests.

Runs, side by side in one process tree:
  (a) one request at a time, on both sides;
  (b) the 64 requests as a server gets them (all at once: lbd batches them continuously) vs transformers in
      static batches of 16 (left-padded; each batch runs until its longest output ends);
  (c) lbd only: 32 concurrent requests, ~125-token prompts, 128 output tokens, greedy, ignore_eos.
The issue asks for "our ratio to each" of transformers' (a) and (b); lbd's (b) run is compared with both.
``--lbd-concurrency 16`` caps lbd at 16 in flight for a like-for-like batch size.
and the start-up time of the server (first start with an empty conversion cache, then a warm start).
Prints output tok/s, lbd's ratio to transformers, and lbd's fraction of the CPU's compute limit (useful model
FLOP/s over the torch matmul rate measured here with the same threads).

    .venv/bin/python benchmarks/engine_throughput.py            # the full run (default model, 64 requests)
    .venv/bin/python benchmarks/engine_throughput.py --num-requests 16 --sequential-requests 4   # quicker
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import EngineServer, exit_on_sigterm  # noqa: E402


@dataclass(slots=True)
class Req:
    prompt: list[int]
    max_tokens: int


def make_requests(n: int, vocab: int, seed: int, plen: tuple[int, int], olen: tuple[int, int]) -> list[Req]:
    rng = random.Random(seed)
    lo, hi = 100, min(vocab, 40000)  # ordinary tokens, away from the specials at the start of the vocab
    return [Req([rng.randrange(lo, hi) for _ in range(rng.randint(*plen))], rng.randint(*olen))
            for _ in range(n)]


def matmul_rate(threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(4):
            a @ b
        best = max(best, 4 * 2 * 2048**3 / (time.perf_counter() - t))
    return best


def useful_flops(cfg: dict, reqs: list[Req]) -> float:
    """Model FLOPs the requests need: 2 x matmul params per token, causal attention, lm_head per output."""
    d, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hd = cfg.get("head_dim") or d // heads
    per_layer = d * (heads * hd + 2 * kv * hd) + heads * hd * d + 3 * d * inter
    total = 0.0
    for r in reqs:
        tokens = len(r.prompt) + r.max_tokens
        total += 2 * per_layer * layers * tokens
        # attention: QK^T and PV, each 2*heads*hd per (query, key) pair, causal
        total += 4 * heads * hd * layers * tokens * tokens / 2
        total += 2 * d * cfg["vocab_size"] * r.max_tokens
    return total


async def _one(session: aiohttp.ClientSession, url: str, model: str, r: Req) -> int:
    body = {"model": model, "prompt": r.prompt, "max_tokens": r.max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"request failed: {resp.status} {data}")
        return data["usage"]["completion_tokens"]


async def run_lbd(url: str, model: str, reqs: list[Req], concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=None)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def bounded(r: Req) -> int:
            async with sem:
                return await _one(session, url, model, r)

        t = time.perf_counter()
        counts = await asyncio.gather(*(bounded(r) for r in reqs))
        return time.perf_counter() - t, sum(counts)


def run_hf(model_path: Path, reqs: list[Req], batch: int, threads: int) -> tuple[float, int]:
    """transformers generate, static batches (left-padded); only each request's own tokens count as output."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    pad = 0
    useful, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        group = reqs[i:i + batch]
        width = max(len(r.prompt) for r in group)
        ids = torch.tensor([[pad] * (width - len(r.prompt)) + r.prompt for r in group])
        mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in group])
        new = max(r.max_tokens for r in group)
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=pad)
        useful += sum(r.max_tokens for r in group)
    return time.perf_counter() - t0, useful


def start_server(model: str | None, threads: int, cache_dir: str, log: Path) -> tuple[EngineServer, float]:
    env = {"LBD_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": str(threads)}
    t = time.perf_counter()
    server = EngineServer(model, "--max-num-seqs", "64", env=env, log=log, ready_timeout=600)
    return server, time.perf_counter() - t


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the bundled SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--sequential-requests", type=int, default=None,
                   help="requests used for (a), one at a time (default: all)")
    p.add_argument("--lbd-concurrency", type=int, default=None,
                   help="requests lbd gets at once in (b) (default: all of them, as a server would)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of parts to skip: a,b,c,hf,startup")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))

    from engine.loader import resolve_model

    workdir = Path(tempfile.mkdtemp(prefix="lbd-bench-"))
    cold_cache = str(workdir / "cache")
    warm_cache = os.environ.get("LBD_CACHE_DIR", str(Path.home() / ".cache" / "lbd"))
    startup: dict[str, float] = {}
    if "startup" not in skip:
        server, startup["first start (empty cache, conversion included)"] = start_server(
            args.model, args.threads, cold_cache, workdir / "cold.log")
        server.close()
    server, startup["later start (cache warm)"] = start_server(args.model, args.threads, warm_cache,
                                                               workdir / "server.log")
    model_path = Path(resolve_model(args.model))
    import json

    cfg = json.loads((model_path / "config.json").read_text())
    name = server.base_url and _served_name(server.base_url)
    reqs = make_requests(args.num_requests, cfg["vocab_size"], args.seed, (64, 512), (32, 256))
    seq_reqs = reqs[: args.sequential_requests or len(reqs)]
    conc = make_requests(32, cfg["vocab_size"], args.seed + 1, (120, 130), (128, 128))
    results: dict[str, tuple[float, int]] = {}
    try:
        if "a" not in skip:
            results["lbd a"] = asyncio.run(run_lbd(server.base_url, name, seq_reqs, 1))
        if "b" not in skip:
            cap = args.lbd_concurrency or len(reqs)
            results["lbd b"] = asyncio.run(run_lbd(server.base_url, name, reqs, cap))
        if "c" not in skip:
            results["lbd c"] = asyncio.run(run_lbd(server.base_url, name, conc, 32))
    finally:
        server.close()
    if "hf" not in skip:
        if "a" not in skip:
            results["hf a"] = run_hf(model_path, seq_reqs, 1, args.threads)
        if "b" not in skip:
            results["hf b"] = run_hf(model_path, reqs, 16, args.threads)
    rate = matmul_rate(args.threads)
    report(results, startup, rate, cfg, {"a": seq_reqs, "b": reqs, "c": conc}, args.threads)
    return 0


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def report(results: dict[str, tuple[float, int]], startup: dict[str, float], rate: float, cfg: dict,
           workloads: dict[str, list[Req]], threads: int) -> None:
    print(f"\nthreads={threads}  torch fp32 matmul rate (2048^2): {rate / 1e9:.1f} GFLOP/s")
    for what, secs in startup.items():
        print(f"start-up, {what}: {secs:.1f} s")
    print(f"\n{'part':<58}{'lbd tok/s':>11}{'hf tok/s':>10}{'ratio':>8}{'lbd % of compute':>18}")
    everything = len(workloads["b"])
    titles = {"a": "(a) one request at a time",
              "b": f"(b) {everything} requests (lbd: all at once; hf: static batches of 16)",
              "c": "(c) 32 concurrent, 125 in / 128 out"}
    for part, title in titles.items():
        ours, theirs = results.get(f"lbd {part}"), results.get(f"hf {part}")
        if ours is None:
            continue
        ours_tps = ours[1] / ours[0]
        frac = useful_flops(cfg, workloads[part]) / ours[0] / rate
        hf_tps = theirs[1] / theirs[0] if theirs else float("nan")
        print(f"{title:<58}{ours_tps:>11.1f}{hf_tps:>10.1f}{ours_tps / hf_tps:>7.2f}x{100 * frac:>17.1f}%")
    if "lbd b" in results and "hf a" in results:
        b_tps = results["lbd b"][1] / results["lbd b"][0]
        a_tps = results["hf a"][1] / results["hf a"][0]
        title = "(b) lbd, all at once, vs hf one request at a time"
        print(f"{title:<58}{b_tps:>11.1f}{a_tps:>10.1f}{b_tps / a_tps:>7.2f}x")
    if "lbd c" in results:
        tps = results["lbd c"][1] / results["lbd c"][0]
        # no fixed peer figure (another day's or machine's number is no comparison): vLLM runs side by side
        # in benchmarks/engine_vs_vllm.py
        print(f"\n(c) lbd, 32 concurrent: {tps:.1f} tok/s (against vLLM, side by side: "
              "benchmarks/engine_vs_vllm.py)")


if __name__ == "__main__":
    sys.exit(main())
