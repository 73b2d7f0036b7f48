"""Adapter placement (issue 44): adapter loads and TTFT per router over 8 sim ranks with 4 LoRA slots each.

One `lbd supervise --device sim --enable-lora --max-loras 4 --lora-modules lora0=... lora31=...` fleet (real
front ends, schedulers, prefix caches and adapter slots; ``lbd.engine.core.sim_lora`` charges a slot miss
its load time, ``SimProfile.lora_load_s``, to the step that admits the request), then for each round and each
target in turn (interleaved): the router starts over the 8 ranks, an open-loop Poisson stream of requests
runs through it (the same seeded stream for every target), the router stops. The stream: ``--adapter-share``
of the requests name an adapter drawn with Zipf popularity (exponent ``--zipf``) over 32 adapters, the rest
the base model; each adapter (and the base) has a few system prompts its requests share (tenants), plus a
question of their own. Every rank's prefix cache is emptied before each run; the first ``--warmup``
requests are left out of every number (slots reach that router's steady state).

Printed per run: adapter loads (slot misses, counted from the ranks' ``sim lora: load`` log lines), TTFT
p50/p99 of adapter and of base-model requests, their p99 ratio, the prefix-cache hit rate (the ranks'
counters) and the load average. Targets: `lbd route` (predicted_ttft with the adapter scorer, with and
without `--lora-max-replicas 2`), `lbd route --policy round_robin`, `lbd route --policy least_load`, `lbd
route` on the same stream with every request on the base model (the prefix hit rate without adapters), and
the peers when installed (`bash scripts/setup-peers.sh routers`): sglang-router cache_aware and
vllm-router round_robin.

    .venv/bin/python benchmarks/lora_routing.py [--rounds 2] [--requests 700] [--rate 30]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
from lbd.engine.config.model_files import converted_path, default_gguf  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from policy_tail import cache_counters, rank_urls, reset_caches  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
ADAPTERS = 32
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def start_fleet(ranks: int, slots: int, model: Path, log: Path) -> tuple[object, list[str]]:
    base, sup = free_port_run(ranks), free_port()
    modules = [f"lora{i}=/sim/adapters/lora{i}" for i in range(ADAPTERS)]
    argv = [PY, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
            "--data-parallel-size", str(ranks), "--data-parallel-size-local", str(ranks), "--device", "sim",
            "--host", "127.0.0.1", "--port", str(base), "--data-parallel-supervisor-port", str(sup),
            "--model", str(model), "--max-model-len", "2048", "--log-level", "info", "--disable-log-requests",
            "--enable-lora", "--max-loras", str(slots), "--lora-modules", *modules]
    proc = spawn(argv, env={"VLLM_SERVER_DEV_MODE": "1"}, log=log)
    wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=600, proc=proc)
    return proc, rank_urls(base, ranks)


def workload(args: argparse.Namespace, base_model: str) -> list[tuple[float, str, str]]:
    """(send time s, model, prompt) per request: Poisson arrivals, Zipf adapters, shared system prompts."""
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(ADAPTERS)]
    names = [f"lora{i}" for i in range(ADAPTERS)]
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        model = rng.choices(names, weights)[0] if rng.random() < args.adapter_share else base_model
        tenant = rng.randrange(3)
        system = " ".join(random.Random(f"{model}/{tenant}").choice(WORDS) for _ in range(300))
        question = " ".join(rng.choice(WORDS) for _ in range(30))
        out.append((t, model, f"{system}\n\nRequest {i}: {question}"))
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> float | None:
    body = {"model": model, "prompt": prompt, "max_tokens": 16, "stream": True}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return None
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data:"):
                    ttft = time.perf_counter() - t0
            return ttft
    except httpx.HTTPError:
        return None


async def drive(url: str, stream: list[tuple[float, str, str]], warmup: int, log: Path) -> tuple[list, int]:
    """Send the stream on its schedule; (per request (model, ttft or None), the log offset at warmup)."""
    offset = [0]
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=512)) as client:
        start = time.perf_counter()

        async def at(i: int, when: float, model: str, prompt: str) -> tuple[str, float | None]:
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            if i == warmup:
                offset[0] = log.stat().st_size
            return model, await one(client, url, model, prompt)

        got = await asyncio.gather(*(at(i, w, m, p) for i, (w, m, p) in enumerate(stream)))
    return list(got), offset[0]


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def router_argv(target: str, port: int, ranks: list[str]) -> tuple[list[str], str]:
    if target == "sglang-router cache_aware":
        return peer_argv("sglang-router", port, ranks, "cache_aware")
    if target == "vllm-router round_robin":
        return peer_argv("vllm-router", port, ranks, "round_robin")
    return lbd_route_argv(port, ",".join(ranks), *target.removesuffix(" (base only)").split()[2:])


def run(args: argparse.Namespace, target: str, ranks: list[str], stream: list, base_model: str, log: Path,
        tmp: Path, rnd: int) -> dict:
    reset_caches(ranks)
    if target.endswith("(base only)"):
        stream = [(t, base_model, p) for t, _, p in stream]
    port = free_port()
    argv, ready = router_argv(target, port, ranks)
    router = spawn(argv, log=tmp / f"{target.replace(' ', '_')}-{rnd}.log")
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=120, proc=router)
        time.sleep(2.0)  # the router's first view of every rank
        q0, h0 = cache_counters(ranks)
        got, offset = asyncio.run(drive(f"http://127.0.0.1:{port}", stream, args.warmup, log))
        q1, h1 = cache_counters(ranks)
    finally:
        stop(router)
    time.sleep(0.5)
    with log.open("rb") as f:
        f.seek(offset)
        loads = f.read().count(b"sim lora: load ")
    measured = got[args.warmup:]
    ada = [t * 1e3 for m, t in measured if t is not None and m != base_model]
    base = [t * 1e3 for m, t in measured if t is not None and m == base_model]
    return {"target": target, "round": rnd, "loads": loads, "failed": sum(t is None for _, t in got),
            "ada_p50": pct(ada, 50), "ada_p99": pct(ada, 99), "base_p50": pct(base, 50),
            "base_p99": pct(base, 99), "hit": (h1 - h0) / (q1 - q0) if q1 > q0 else math.nan,
            "load1": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--slots", type=int, default=4, help="--max-loras of every rank")
    p.add_argument("--requests", type=int, default=700)
    p.add_argument("--warmup", type=int, default=150)
    p.add_argument("--rate", type=float, default=30.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--adapter-share", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--targets", default="", help="comma-separated subset of the targets (default: all)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="lbd-lora-routing-"))
    model = converted_path(default_gguf())
    targets = ["lbd route", "lbd route --lora-max-replicas 2", "lbd route --policy round_robin",
               "lbd route --policy least_load", "lbd route (base only)"]
    targets += ["sglang-router cache_aware"] if peer_installed("sglang-router") else []
    targets += ["vllm-router round_robin"] if peer_installed("vllm-router") else []
    if args.targets:
        targets = [t for t in targets if t in args.targets.split(",")]
    log = tmp / "supervise.log"
    fleet, ranks = start_fleet(args.ranks, args.slots, model, log)
    rows = []
    print("| round | target | adapter loads | failed | adapter TTFT p50 / p99 ms | base TTFT p50 / p99 ms "
          "| p99 adapter / base | prefix hit rate | load avg |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        base_model = httpx.get(ranks[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        stream = workload(args, base_model)
        for rnd in range(args.rounds):
            for target in targets:
                r = run(args, target, ranks, stream, base_model, log, tmp, rnd)
                rows.append(r)
                ratio = r["ada_p99"] / r["base_p99"] if r["base_p99"] > 0 else math.nan
                print(f"| {rnd} | {target} | {r['loads']} | {r['failed']} | {r['ada_p50']:.1f} / "
                      f"{r['ada_p99']:.1f} | {r['base_p50']:.1f} / {r['base_p99']:.1f} | {ratio:.2f} | "
                      f"{r['hit']:.1%} | {r['load1']:.1f} |", flush=True)
    finally:
        stop(fleet, timeout=30)
    print(f"\nlogs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
