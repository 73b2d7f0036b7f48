"""Engine throughput: lbd's server vs transformers `generate` on the same model, threads and requests, at the
same in-flight caps, side by side in one run.

Rows (the same seeded requests; by default prompts of 64-512 tokens and 32-256 output tokens; greedy,
ignore_eos):
  cap 1       one request at a time on both sides (the first --sequential-requests of them)
  cap 16      lbd with at most 16 requests in flight (a new one starts when one ends: continuous batching)
              vs transformers in static batches of 16, left-padded, each batch running until its longest
              output ends (transformers' own batching)
  cap 64      the same at 64 (one static batch of 64 on the transformers side)
  server      lbd only: every request sent at once, as a server receives them (its scheduler caps the batch
              at --max-num-seqs 64)
Only each request's own tokens count as output on both sides. Also prints lbd's fraction of the CPU's compute
limit (useful model FLOP/s over the torch fp32 matmul rate measured here with the same threads) and the
server's start-up time (first start with an empty conversion cache, then a warm start). No peer figure is
written in this script: every ratio is measured in the same run.

    .venv/bin/python benchmarks/engine_throughput.py      # the full run (default model, 64 requests)
    .venv/bin/python benchmarks/engine_throughput.py --num-requests 16 --sequential-requests 4 --caps 16
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support.procs import EngineServer, exit_on_sigterm  # noqa: E402


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
    p.add_argument("--sequential-requests", type=int, default=8,
                   help="requests of the cap-1 row, one at a time")
    p.add_argument("--caps", default="16,64",
                   help="in-flight caps compared with transformers' static batches")
    p.add_argument("--prompt-len", default="64,512", help="prompt length range in tokens: MIN,MAX")
    p.add_argument("--output-len", default="32,256", help="output length range in tokens: MIN,MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip", default="", help="comma list of parts to skip: cap1,caps,server,hf,startup")
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    caps = [int(c) for c in args.caps.split(",") if c]

    from lbd.engine.loader import resolve_model

    workdir = Path(tempfile.mkdtemp(prefix="lbd-bench-"))
    warm_cache = os.environ.get("LBD_CACHE_DIR", str(Path.home() / ".cache" / "lbd"))
    startup: dict[str, float] = {}
    print(f"{os.cpu_count()} cpus, load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    if "startup" not in skip:
        server, startup["first start (empty cache, conversion included)"] = start_server(
            args.model, args.threads, str(workdir / "cache"), workdir / "cold.log")
        server.close()
    server, startup["later start (cache warm)"] = start_server(args.model, args.threads, warm_cache,
                                                               workdir / "server.log")
    model_path = Path(resolve_model(args.model))
    import json

    cfg = json.loads((model_path / "config.json").read_text())
    name = _served_name(server.base_url)
    plen = tuple(int(x) for x in args.prompt_len.split(","))
    olen = tuple(int(x) for x in args.output_len.split(","))
    reqs = make_requests(args.num_requests, cfg["vocab_size"], args.seed, plen, olen)  # type: ignore[arg-type]
    seq_reqs = reqs[: args.sequential_requests]
    results: dict[str, tuple[float, int]] = {}
    try:
        if "cap1" not in skip:
            results["lbd 1"] = asyncio.run(run_lbd(server.base_url, name, seq_reqs, 1))
        if "caps" not in skip:
            for cap in caps:
                results[f"lbd {cap}"] = asyncio.run(run_lbd(server.base_url, name, reqs, cap))
        if "server" not in skip:
            results["lbd server"] = asyncio.run(run_lbd(server.base_url, name, reqs, len(reqs)))
    finally:
        server.close()
    if "hf" not in skip:
        if "cap1" not in skip:
            results["hf 1"] = run_hf(model_path, seq_reqs, 1, args.threads)
        if "caps" not in skip:
            for cap in caps:
                results[f"hf {cap}"] = run_hf(model_path, reqs, cap, args.threads)
    rate = matmul_rate(args.threads)
    report(results, startup, rate, cfg, reqs, seq_reqs, caps, args.threads)
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


def _served_name(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models").json()["data"][0]["id"]


def report(results: dict[str, tuple[float, int]], startup: dict[str, float], rate: float, cfg: dict,
           reqs: list[Req], seq_reqs: list[Req], caps: list[int], threads: int) -> None:
    print(f"\nthreads={threads}  torch fp32 matmul rate (2048^2): {rate / 1e9:.1f} GFLOP/s")
    for what, secs in startup.items():
        print(f"start-up, {what}: {secs:.1f} s")
    print("\n| row | requests | lbd tok/s | transformers tok/s | lbd / transformers | lbd % of compute |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = [("1", "cap 1: one at a time (transformers: batch 1)", seq_reqs)]
    rows += [(str(c), f"cap {c} (transformers: static batches of {c}, padded)", reqs) for c in caps]
    rows.append(("server", f"server mode: all {len(reqs)} at once (lbd only)", reqs))
    for key, title, work in rows:
        ours, theirs = results.get(f"lbd {key}"), results.get(f"hf {key}")
        if ours is None:
            continue
        ours_tps = ours[1] / ours[0]
        frac = useful_flops(cfg, work) / ours[0] / rate
        hf = f"{theirs[1] / theirs[0]:.1f}" if theirs else "-"
        ratio = f"{ours_tps / (theirs[1] / theirs[0]):.2f}x" if theirs else "-"
        print(f"| {title} | {len(work)} | {ours_tps:.1f} | {hf} | {ratio} | {100 * frac:.1f}% |")


if __name__ == "__main__":
    sys.exit(main())
