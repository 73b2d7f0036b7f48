"""What a router adds to a cold chat request: a new ~1,500-token system prompt per request, one at a time.

Two `--device sim` ranks under `lbd supervise` (time scale 1, KV events on), then each target in turn over
them: `lbd route` (the exact view: the head of a new prompt is tokenized before it is routed), `lbd route
--kv-events off`, and sglang-router (cache_aware) when installed (`bash scripts/setup-peers.sh routers`).
Each request through the router alternates with another new prompt sent straight to rank 0, on one HTTP
client; added latency is the difference of the two medians of time to first token. Rounds interleave the
targets. Every prompt is new everywhere (seeded texts, a distinct opening per request).

    .venv/bin/python benchmarks/cold_route.py [--rounds 2] [--requests 55] [--prompt-len 1500]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(Path(__file__).resolve().parent)]
from lbd.bench.tokenizer import load_tokenizer  # noqa: E402
from lbd.bench.workloads import TextSource  # noqa: E402
from lbd.engine.config.model_files import converted_path, default_gguf  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
WARMUP = 5  # first requests of each run left out of the medians


def start_fleet(model: str, log: Path) -> tuple[object, list[str]]:
    base, sup = free_port_run(2), free_port()
    proc = spawn([sys.executable, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
                  "--data-parallel-size", "2", "--data-parallel-size-local", "2", "--host", "127.0.0.1",
                  "--port", str(base), "--data-parallel-supervisor-port", str(sup), "--device", "sim",
                  "--model", model, "--log-level", "warning", "--disable-log-requests",
                  "--kv-events-config", KV_EVENTS], log=log)
    wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=300, proc=proc)
    return proc, [f"http://127.0.0.1:{base + i}" for i in range(2)]


def router_argv(target: str, port: int, ranks: list[str]) -> tuple[list[str], str]:
    if target == "sglang-router":
        return peer_argv("sglang-router", port, ranks, "cache_aware")
    return lbd_route_argv(port, ",".join(ranks), *target.split()[2:])  # "lbd route [flags]"


def ttft(client: httpx.Client, url: str, model: str, text: str) -> float:
    body = {"model": model, "max_tokens": 1, "stream": True,
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "What now?"}]}
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.perf_counter() - t0
        raise RuntimeError(f"{url}: {r.status_code}, no stream")


def overhead(client: httpx.Client, router: str) -> tuple[float, float]:
    """(sum of seconds, count) of lbd's arrival-to-dispatch histogram; zeros for a peer (no such metric)."""
    text = client.get(router + "/metrics").text if router else ""
    got = {name: float(value) for line in text.splitlines() if line.startswith("lbd_router_overhead_seconds_")
           for name, value in [line.rsplit(" ", 1)]}
    return (sum(v for k, v in got.items() if k.startswith("lbd_router_overhead_seconds_sum")),
            sum(v for k, v in got.items() if k.startswith("lbd_router_overhead_seconds_count")))


def measure(target: str, ranks: list[str], texts: list[str], tmp: Path) -> tuple[float, float, float | None]:
    """(median TTFT straight to rank 0, median TTFT through the router, lbd's mean arrival-to-dispatch or
    None for a peer), ms."""
    port = free_port()
    argv, ready = router_argv(target, port, ranks)
    router = spawn(argv, log=tmp / f"{target.replace(' ', '_')}.log")
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=120, proc=router)
        time.sleep(2)  # the lbd router's views of the ranks settle
        with httpx.Client() as client:
            model = client.get(ranks[0] + "/v1/models").json()["data"][0]["id"]
            direct, through = [], []
            url = f"http://127.0.0.1:{port}"
            ours = target.startswith("lbd")
            for i, text in enumerate(texts):
                if i == WARMUP:
                    before = overhead(client, url if ours else "")
                through.append(ttft(client, url, model, text))
                direct.append(ttft(client, ranks[0], model, "Direct. " + text))
            after = overhead(client, url if ours else "")
    finally:
        stop(router)
    n = after[1] - before[1]
    dispatch = 1e3 * (after[0] - before[0]) / n if ours and n > 0 else None
    return 1e3 * statistics.median(direct[WARMUP:]), 1e3 * statistics.median(through[WARMUP:]), dispatch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=60, help="per target and round (the first 5 warm up)")
    p.add_argument("--prompt-len", type=int, default=1500, help="system prompt tokens")
    p.add_argument("--lbd-flags", action="append", default=[], metavar="FLAGS",
                   help="another lbd target: `lbd route` with these flags (repeatable), "
                   "e.g. '--migration-limit 0'")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.requests <= WARMUP:
        p.error(f"--rounds must be >= 1 and --requests > {WARMUP}")
    exit_on_sigterm()
    model = str(converted_path(default_gguf()))
    targets = ["lbd route", "lbd route --kv-events off", *(f"lbd route {f}" for f in args.lbd_flags)]
    targets += ["sglang-router"] if peer_installed("sglang-router") else []
    src, rng = TextSource(load_tokenizer(model)), random.Random(0)
    tmp = Path(tempfile.mkdtemp(prefix="lbd-cold-route-"))
    fleet, ranks = start_fleet(model, tmp / "supervise.log")
    print("| round | target | direct TTFT p50 ms | through TTFT p50 ms | added ms "
          "| arrival-to-dispatch mean ms |")
    print("|---:|---|---:|---:|---:|---:|")
    try:
        for rnd in range(args.rounds):
            for target in targets:
                texts = [f"Prompt {rnd}-{target}-{i}. " + src.text(rng, args.prompt_len)
                         for i in range(args.requests)]
                direct, through, dispatch = measure(target, ranks, texts, tmp)
                shown = "-" if dispatch is None else f"{dispatch:.2f}"
                print(f"| {rnd} | {target} | {direct:.2f} | {through:.2f} | {through - direct:+.2f} "
                      f"| {shown} |", flush=True)
    finally:
        stop(fleet, timeout=30)
    print(f"\nlogs in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
