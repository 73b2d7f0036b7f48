"""LoRA in lbd's engine against vLLM's CPU build (issue 44, acceptance 2): the same 4 rank-16 adapters
(random, all seven projections, PEFT folders written once) served by both, mixed evenly, at concurrency 1
and 32, and each engine's base-model rate, so the cost of LoRA is stated next to the comparison.

Servers (each started once and kept warm; `benchmarks/engine_specs.py` starts them as
`benchmarks/engine_vs_vllm.py` does, same model folder, CPUs, threads and KV cache):
  - lbd: `python -m lbd.engine` (what `lbd serve` runs for one rank), no LoRA;
  - lbd-lora: the same with `--enable-lora --max-loras 4 --max-lora-rank 16 --lora-modules a0=.. a3=..`;
  - vllm and vllm-lora: `vllm.entrypoints.openai.api_server` with the same flags.
Cases: "base" (the server without LoRA), "lora on, base" (the LoRA server, base model only: what enabling
costs by itself), "4 adapters" (the LoRA server, request i names adapter a{i mod 4}). Each run sends
N = max(4, c) completions of random-token prompts, ignore_eos, greedy, streamed, with c in flight. Rounds
interleave every case (the order flipped every round), one engine under load at a time. Printed: a greedy
check (per adapter, lbd's and vLLM's texts for the same prompts must agree), every run with the load
average, the median tok/s per case, and lbd / vLLM ratios per round pair.

    .venv/bin/python benchmarks/lora_engine.py [--rounds 3] [--prompt-len 64] [--output-len 64]
    .venv/bin/python benchmarks/lora_engine.py --engines lbd        # lbd only (no .venv-vllm)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from benchmarks.engine_specs import VLLM_PYTHON, EngineSpec, RunningEngine, vllm_available  # noqa: E402
from benchmarks.engine_vs_vllm import cpu_list  # noqa: E402

from lbd.bench.client import RequestRecord, send  # noqa: E402
from support.lora import ATTENTION, MLP, make_adapter  # noqa: E402

NAMES = ("a0", "a1", "a2", "a3")
CASES = ("base", "lora on, base", "4 adapters")
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


@dataclass(slots=True)
class Run:
    engine: str
    case: str
    c: int
    round: int
    tok_s: float
    errors: int
    load: float


def lora_flags(modules: list[str]) -> list[str]:
    return ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16", "--lora-modules", *modules]


async def _load(url: str, models: list[str], prompts: list[list[int]], output_len: int,
                c: int) -> tuple[float, list[RequestRecord]]:
    """Request i names models[i]; c in flight; (wall seconds, records)."""
    sem = asyncio.Semaphore(c)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                     connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(i: int) -> RequestRecord:
            async with sem:
                body = {"model": models[i], "prompt": prompts[i], "max_tokens": output_len,
                        "temperature": 0.0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                return await send(http, url + "/v1/completions", body, {"Content-Type": "application/json"},
                                  RequestRecord(str(i), 0, 0.0), False, 1800.0)

        t0 = time.perf_counter()
        records = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        return time.perf_counter() - t0, records


def measure(eng: RunningEngine, case: str, c: int, rnd: int, prompt_len: int, output_len: int) -> Run:
    n = max(4, c)
    rng = random.Random(rnd * 1009 + c)  # the same prompts for every case and engine of a round
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt_len)] for _ in range(n)]
    models = [NAMES[i % 4] if case == "4 adapters" else eng.model for i in range(n)]
    wall, records = asyncio.run(_load(eng.url, models, prompts, output_len, c))
    bad = [r for r in records if not r.ok]
    if bad:
        print(f"  {eng.spec.name} {case}: {len(bad)} errors, e.g. {bad[0].error}: {bad[0].error_message}")
    tokens = sum(r.output_tokens for r in records if r.ok)
    return Run(eng.spec.name.removesuffix("-lora"), case, c, rnd, tokens / wall, len(bad), os.getloadavg()[0])


def greedy(eng: RunningEngine, model: str) -> list[str]:
    out = []
    for prompt in GREEDY_PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
        r = httpx.post(eng.url + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def greedy_check(servers: dict[str, RunningEngine]) -> None:
    if "lbd-lora" not in servers or "vllm-lora" not in servers:
        return
    for name in NAMES:
        a, b = greedy(servers["lbd-lora"], name), greedy(servers["vllm-lora"], name)
        same = sum(x == y for x, y in zip(a, b, strict=True))
        forks = [f"{x!r} vs {y!r}" for x, y in zip(a, b, strict=True) if x != y]
        print(f"greedy {name}: lbd and vLLM agree on {same} of {len(a)} texts (24 tokens)"
              + "".join(f"; {f}" for f in forks), flush=True)


def report(runs: list[Run], engines: list[str]) -> None:
    def of(e: str, case: str, c: int) -> list[Run]:
        return [r for r in runs if r.engine == e and r.case == case and r.c == c]

    print("\n| engine | case | c=1 tok/s (median, min-max) | c=32 tok/s (median, min-max) | load |")
    print("|---|---|---:|---:|---:|")
    for e in engines:
        for case in CASES:
            cells = []
            for c in (1, 32):
                xs = [r.tok_s for r in of(e, case, c)]
                cells.append(f"{statistics.median(xs):.1f} ({min(xs):.1f}-{max(xs):.1f})" if xs else "-")
            loads = [r.load for r in runs if r.engine == e and r.case == case]
            print(f"| {e} | {case} | {cells[0]} | {cells[1]} | {statistics.median(loads):.1f} |")
    print("\n| ratio (per round pair: median, min-max) | c=1 | c=32 |\n|---|---:|---:|")
    pairs = [(f"lbd / vLLM, {case}", ("lbd", case), ("vllm", case)) for case in CASES]
    pairs += [(f"{e}: 4 adapters / base", (e, "4 adapters"), (e, "base")) for e in engines]
    for label, (ea, ca), (eb, cb) in pairs:
        cells = []
        for c in (1, 32):
            q = [x.tok_s / y.tok_s for x in of(ea, ca, c) for y in of(eb, cb, c)
                 if x.round == y.round and y.tok_s]
            cells.append(f"{statistics.median(q):.2f} ({min(q):.2f}-{max(q):.2f})" if q else "-")
        if any(cell != "-" for cell in cells):
            print(f"| {label} | {cells[0]} | {cells[1]} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--engines", default="lbd,vllm", help="lbd, vllm or both")
    p.add_argument("--kv-gib", type=float, default=1.0, help="KV-cache GiB for each server")
    p.add_argument("--vllm-python", type=Path, default=VLLM_PYTHON)
    args = p.parse_args()
    from lbd.engine.loader import resolve_model
    from support import exit_on_sigterm

    exit_on_sigterm()  # a SIGTERM (timeout, Ctrl-C's kin) still stops the servers

    engines = [e for e in args.engines.split(",") if e]
    why = vllm_available(args.vllm_python)
    if "vllm" in engines and why:
        print(f"vLLM skipped: {why}")
        engines.remove("vllm")
    model = Path(resolve_model(None))
    tmp = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    paths = [make_adapter(tmp / n, model, rank=16, alpha=32, seed=i, scale=0.02, targets=ATTENTION + MLP)
             for i, n in enumerate(NAMES)]
    modules = [f"{n}={path}" for n, path in zip(NAMES, paths, strict=True)]
    cpus, threads = cpu_list()
    common = dict(model=model, cpus=cpus, threads=threads, kv_gib=args.kv_gib, max_model_len=2048,
                  device="cpu", python=args.vllm_python, ready_timeout=900.0)
    print(f"{time.strftime('%Y-%m-%d %H:%M')} {model.name} cpus {cpus} engines {engines} adapters in {tmp}",
          flush=True)
    servers: dict[str, RunningEngine] = {}
    runs: list[Run] = []
    try:
        for e in engines:
            for name, extra in ((e, []), (f"{e}-lora", lora_flags(modules))):
                spec = EngineSpec(name, e, extra=extra)
                servers[name] = RunningEngine(spec, log=tmp / f"{name}.log", **common)
                print(f"started {name} in {servers[name].startup_s:.1f} s (load {os.getloadavg()[0]:.1f})",
                      flush=True)
        greedy_check(servers)
        for eng in servers.values():  # warm-up, not measured
            measure(eng, "4 adapters" if eng.spec.name.endswith("-lora") else "base", 4, -1, 16, 8)
        order = [(e, case) for e in engines for case in CASES]
        for rnd in range(args.rounds):
            for c in (1, 32):
                for e, case in (order if rnd % 2 == 0 else order[::-1]):
                    eng = servers[e if case == "base" else f"{e}-lora"]
                    run = measure(eng, case, c, rnd, args.prompt_len, args.output_len)
                    runs.append(run)
                    print(f"round {rnd} c={c:2d} {e:5s} {case:14s} {run.tok_s:8.1f} tok/s  "
                          f"load {run.load:.1f}", flush=True)
    finally:
        for eng in servers.values():
            eng.close()
    report(runs, engines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
