"""Adapter placement (issue 44): adapter loads and TTFT per router over 8 sim ranks with 4 LoRA slots each.

One `lbd supervise --device sim --enable-lora --max-loras 4 --lora-modules lora0=... lora31=...` fleet (real
front ends, schedulers, prefix caches and adapter slots; ``lbd.engine.core.sim_lora`` keeps a request whose
adapter is not in the CPU cache waiting ``SimProfile.lora_load_s`` for its read, as lbd's engine does, and
charges a copy into a slot to the step that admits it), then for each round and each
target in turn (interleaved): the router starts over the 8 ranks, an open-loop Poisson stream of requests
runs through it (the same seeded stream for every target), the router stops. The stream: ``--adapter-share``
of the requests name an adapter drawn with Zipf popularity (exponent ``--zipf``) over 32 adapters, the rest
the base model; each adapter (and the base) has a few system prompts its requests share (tenants), plus a
question of their own. Every rank's prefix cache is emptied before each run; the first ``--warmup``
requests are left out of every number (slots reach that router's steady state).

Printed per run: adapter loads (reads from disk; in brackets, copies from a rank's CPU cache into a slot;
both from the ranks' ``lbd:lora_reads_total`` and ``lbd:lora_slot_fills_total``), TTFT
p50/p99 of adapter and of base-model requests, their p99 ratio, the prefix-cache hit rate (the ranks'
counters) and the load average. Targets: `lbd route` (predicted_ttft with the adapter scorer, with and
without `--lora-max-replicas 2`), `lbd route --policy round_robin`, `lbd route --policy least_load`, `lbd
route` on the same stream with every request on the base model (the prefix hit rate without adapters), and
the peers when installed (`bash scripts/setup-peers.sh routers`): sglang-router cache_aware and
vllm-router round_robin.

    .venv/bin/python benchmarks/lora_routing.py [--rounds 2] [--requests 2000] [--rate 30]
    .venv/bin/python benchmarks/lora_routing.py --device cpu --ranks 2 --slots 2 --adapters 8 ...
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
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
from lbd.engine.config.model_files import converted_path, default_gguf  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from policy_tail import cache_counters, metric_sums, rank_urls, reset_caches  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def adapter_modules(args: argparse.Namespace, model: Path, tmp: Path) -> list[str]:
    """``name=path`` of every adapter: names only on sim ranks; on CPU ranks random rank-16 PEFT adapters of
    every attention and MLP projection of the model (as benchmarks/lora_engine.py serves them)."""
    if args.device == "sim":
        return [f"lora{i}=/sim/adapters/lora{i}" for i in range(args.adapters)]
    from support.lora import ATTENTION, MLP, make_adapter

    return [f"lora{i}=" + str(make_adapter(tmp / f"lora{i}", model, rank=16, alpha=32, seed=i, scale=0.02,
                                           targets=ATTENTION + MLP)) for i in range(args.adapters)]


def start_fleet(args: argparse.Namespace, model: Path, modules: list[str],
                log: Path) -> tuple[object, list[str]]:
    ranks = args.ranks
    base, sup = free_port_run(ranks), free_port()
    argv = [PY, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
            "--data-parallel-size", str(ranks), "--data-parallel-size-local", str(ranks),
            "--device", args.device, "--host", "127.0.0.1", "--port", str(base),
            "--data-parallel-supervisor-port", str(sup), "--model", str(model), "--max-model-len", "2048",
            "--log-level", "info", "--disable-log-requests", "--enable-lora", "--max-loras", str(args.slots),
            "--max-lora-rank", "16", "--lora-modules", *modules]
    proc = spawn(argv, env={"VLLM_SERVER_DEV_MODE": "1"}, log=log)
    wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=600, proc=proc)
    return proc, rank_urls(base, ranks)


def workload(args: argparse.Namespace, base_model: str) -> list[tuple[float, str, str]]:
    """(send time s, model, prompt) per request: Poisson arrivals, Zipf adapters, shared system prompts."""
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.zipf for i in range(args.adapters)]
    names = [f"lora{i}" for i in range(args.adapters)]
    t, out = 0.0, []
    for i in range(args.requests):
        t += rng.expovariate(args.rate)
        model = rng.choices(names, weights)[0] if rng.random() < args.adapter_share else base_model
        tenant = rng.randrange(3)
        own = random.Random(f"{model}/{tenant}")  # the same system prompt for every request of the tenant
        system = " ".join(own.choice(WORDS) for _ in range(args.system_words))
        question = " ".join(rng.choice(WORDS) for _ in range(args.question_words))
        out.append((t, model, f"{system}\n\nRequest {i}: {question}"))
    return out


def lora_counts(ranks: list[str]) -> tuple[float, float]:
    """(adapters read from disk, adapters copied into a slot) summed over the ranks' /metrics."""
    reads, fills = metric_sums(ranks, "lbd:lora_reads_total", "lbd:lora_slot_fills_total")
    return reads, fills


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str,
              max_tokens: int) -> tuple[float | None, str, str]:
    """(TTFT s or None on failure, the router's x-lbd-route-reason and x-lbd-endpoint, "" from a peer)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            reason, endpoint = r.headers.get("x-lbd-route-reason", ""), r.headers.get("x-lbd-endpoint", "")
            if r.status_code != 200:
                return None, reason, endpoint
            ttft = None
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data:"):
                    ttft = time.perf_counter() - t0
            return ttft, reason, endpoint
    except httpx.HTTPError:
        return None, "", ""


async def drive(url: str, stream: list[tuple[float, str, str]], warmup: int, ranks: list[str],
                max_tokens: int) -> tuple[list, tuple[float, float]]:
    """Send the stream on its schedule; (per request (model, ttft or None, route reason, endpoint), the ranks'
    adapter reads and slot fills when the first measured request is sent)."""
    at_warmup = [(0.0, 0.0)]
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=512)) as client:
        start = time.perf_counter()

        async def at(i: int, when: float, model: str, prompt: str) -> tuple[str, float | None, str, str]:
            await asyncio.sleep(max(0.0, start + when - time.perf_counter()))
            if i == warmup:
                at_warmup[0] = await asyncio.to_thread(lora_counts, ranks)
            return (model, *await one(client, url, model, prompt, max_tokens))

        got = await asyncio.gather(*(at(i, w, m, p) for i, (w, m, p) in enumerate(stream)))
    return list(got), at_warmup[0]


def ranks_per(pairs: Iterable[tuple[object, str]]) -> float:
    """Distinct (key, endpoint) pairs per distinct key: how many ranks each key was sent to on average."""
    placed = set(pairs)
    return len(placed) / len({k for k, _ in placed}) if placed else math.nan


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
    return lbd_route_argv(port, ",".join(ranks), *target.removesuffix(" (base only)").split()[2:],
                          "--debug-headers")


def run(args: argparse.Namespace, target: str, ranks: list[str], stream: list, base_model: str, tmp: Path,
        rnd: int) -> dict:
    reset_caches(ranks)
    if target.endswith("(base only)"):
        stream = [(t, base_model, p) for t, _, p in stream]
    port = free_port()
    argv, ready = router_argv(target, port, ranks)
    router = spawn(argv, log=tmp / f"{target.replace(' ', '_').replace('/', '_')}-{rnd}.log")
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=120, proc=router)
        time.sleep(2.0)  # the router's first view of every rank
        q0, h0 = cache_counters(ranks)
        got, (reads0, fills0) = asyncio.run(drive(f"http://127.0.0.1:{port}", stream, args.warmup, ranks,
                                                  args.max_tokens))
        q1, h1 = cache_counters(ranks)
        reads1, fills1 = lora_counts(ranks)
    finally:
        stop(router)
    loads, copies = reads1 - reads0, (fills1 - fills0) - (reads1 - reads0)
    measured = got[args.warmup:]
    ada = [t * 1e3 for m, t, _, _ in measured if t is not None and m != base_model]
    base = [t * 1e3 for m, t, _, _ in measured if t is not None and m == base_model]
    reasons = Counter(r.split(" ")[0].split(":")[0] for m, _, r, _ in measured if r and m != base_model)
    spread = ranks_per((m, e) for m, _, _, e in measured if e and m != base_model)  # ranks an adapter went to
    prompt_ranks = ranks_per(((m, p.partition("\n")[0]), e)  # ranks each shared system prompt went to
                             for (_, _, p), (m, _, _, e) in zip(stream, got, strict=True) if e)
    return {"target": target, "round": rnd, "loads": int(loads), "copies": int(copies),
            "failed": sum(t is None for _, t, _, _ in got),
            "reasons": dict(reasons.most_common()), "spread": spread, "prompt_ranks": prompt_ranks,
            "ada_p50": pct(ada, 50), "ada_p99": pct(ada, 99), "base_p50": pct(base, 50),
            "base_p99": pct(base, 99), "hit": (h1 - h0) / (q1 - q0) if q1 > q0 else math.nan,
            "load1": os.getloadavg()[0],
            "tail": slowest(measured, stream[args.warmup:], base_model, args.tail)}


def slowest(measured: list, sent: list, base_model: str, n: int) -> list[str]:
    """The ``n`` slowest adapter requests: send time, adapter, TTFT, endpoint and route reason."""
    rows = [(t, when, m, e, r) for (m, t, r, e), (when, _, _) in zip(measured, sent, strict=True)
            if t is not None and m != base_model]
    return [f"{when:7.2f}s {m:7} {t * 1e3:6.0f} ms {e} {r}" for t, when, m, e, r in sorted(rows)[-n:]] \
        if n > 0 else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--device", choices=["sim", "cpu"], default="sim",
                   help="cpu: real ranks of the default model serving real adapters (use fewer ranks, "
                        "adapters and requests, and a lower rate)")
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--slots", type=int, default=4, help="--max-loras of every rank")
    p.add_argument("--adapters", type=int, default=32)
    p.add_argument("--system-words", type=int, default=300, help="words of each shared system prompt")
    p.add_argument("--question-words", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--rate", type=float, default=30.0, help="requests per second (Poisson)")
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--adapter-share", type=float, default=0.8)
    p.add_argument("--seed", type=int, default=44)
    p.add_argument("--tail", type=int, default=0, help="print the N slowest adapter requests of each run")
    p.add_argument("--targets", default="", help="comma-separated targets (default: all of them), or any "
                   "'lbd route <flags>' (e.g. --routing-config FILE)")
    args = p.parse_args(argv)
    exit_on_sigterm()
    tmp = Path(tempfile.mkdtemp(prefix="lbd-lora-routing-"))
    model = converted_path(default_gguf())
    targets = ["lbd route", "lbd route --lora-max-replicas 2", "lbd route --policy round_robin",
               "lbd route --policy least_load", "lbd route (base only)"]
    targets += ["sglang-router cache_aware"] if peer_installed("sglang-router") else []
    targets += ["vllm-router round_robin"] if peer_installed("vllm-router") else []
    if args.targets:
        wanted = args.targets.split(",")
        unknown = [t for t in wanted if t not in targets and not t.startswith("lbd route ")]
        if unknown:
            p.error(f"--targets: unknown {unknown}; known: {targets}, or any 'lbd route <flags>'")
        targets = wanted
    log = tmp / "supervise.log"
    fleet, ranks = start_fleet(args, model, adapter_modules(args, model, tmp), log)
    rows = []
    print("| round | target | adapter loads (copies) | failed | adapter TTFT p50 / p99 ms "
          "| base TTFT p50 / p99 ms | p99 adapter / base | prefix hit rate | load avg |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    try:
        base_model = httpx.get(ranks[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        stream = workload(args, base_model)
        for rnd in range(args.rounds):
            for target in targets:
                r = run(args, target, ranks, stream, base_model, tmp, rnd)
                rows.append(r)
                ratio = r["ada_p99"] / r["base_p99"] if r["base_p99"] > 0 else math.nan
                print(f"| {rnd} | {target} | {r['loads']} ({r['copies']}) | {r['failed']} | "
                      f"{r['ada_p50']:.1f} / {r['ada_p99']:.1f} | {r['base_p50']:.1f} / "
                      f"{r['base_p99']:.1f} | {ratio:.2f} | "
                      f"{r['hit']:.1%} | {r['load1']:.1f} |", flush=True)
                if not math.isnan(r["prompt_ranks"]):
                    print(f"  adapter requests: route reasons {r['reasons']}; ranks per adapter "
                          f"{r['spread']:.2f}; ranks per system prompt (whole run) {r['prompt_ranks']:.2f}",
                          file=sys.stderr, flush=True)
                for line in r["tail"]:
                    print("   ", line, file=sys.stderr, flush=True)
    finally:
        stop(fleet, timeout=30)
    print(f"\nlogs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
