"""What one router scrape costs an engine rank: GET /metrics (Prometheus text, multiprocess mode) against
GET /telemetry (lbd's JSON of the same numbers, which /metrics advertises and `lbd route` prefers).

One real `--device sim` rank (front end + core, the default model's tokenizer) after some chat traffic, so
the histograms are filled as in a benchmark fleet. Rounds of three phases, interleaved: idle, --scrapes GETs
of /metrics, --scrapes GETs of /telemetry (one keep-alive client, back to back). The rank's CPU time (its
whole process tree, user + system) per GET is the phase's CPU minus the idle phase's rate over the phase's
wall time; medians over --rounds. Also the router's side: parsing each answer into a Sample, in this process.
At the router's default (every rank every 100 ms) a fleet of R ranks spends 10 x R x that per second.

    .venv/bin/python benchmarks/scrape_cost.py [--scrapes 100] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from lbd.router.telemetry import parse_metrics, parse_telemetry  # noqa: E402
from support.procs import EngineServer, tree_usage  # noqa: E402


def cpu_of(server: EngineServer, fn) -> tuple[float, float]:
    """(CPU seconds of the rank's tree, wall seconds) while ``fn`` runs."""
    cpu0, t0 = tree_usage(server.proc.pid)[0], time.monotonic()
    fn()
    return tree_usage(server.proc.pid)[0] - cpu0, time.monotonic() - t0


def parse_us(fn, body: bytes, repeat: int = 200) -> float:
    t0 = time.process_time()
    for _ in range(repeat):
        fn(body)
    return (time.process_time() - t0) / repeat * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scrapes", type=int, default=100, help="GETs per phase (CPU times tick every 10 ms)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle-s", type=float, default=2.0, help="length of the idle phase")
    p.add_argument("--ranks", type=int, default=8, help="fleet size for the CPU-share line")
    p.add_argument("--model", default=None, help="default: the default model's converted folder")
    args = p.parse_args()
    if args.model is None:
        from lbd.engine.config.model_files import converted_path, default_gguf
        from lbd.engine.loader import resolve_model

        done = (converted_path(default_gguf()) / "config.json").exists()
        args.model = str(converted_path(default_gguf())) if done else str(resolve_model(None))
    flags = ("--device", "sim", "--sim-profile", "h100-llama3-8b*40", "--log-level", "warning",
             "--disable-log-requests")
    with EngineServer(args.model, *flags) as server, httpx.Client(base_url=server.base_url, timeout=30) as c:
        model = c.get("/v1/models").json()["data"][0]["id"]
        for i in range(20):  # fill the histograms (TTFT, ITL, e2e, ...) as a benchmark's traffic does
            body = {"model": model, "messages": [{"role": "user", "content": f"question {i} " * 50}],
                    "max_tokens": 16}
            assert c.post("/v1/chat/completions", json=body).status_code == 200
        sizes = {path: len(c.get(path).content) for path in ("/metrics", "/telemetry")}
        per_get: dict[str, list[float]] = {"/metrics": [], "/telemetry": []}
        for _ in range(args.rounds):
            idle_cpu, idle_wall = cpu_of(server, lambda: time.sleep(args.idle_s))
            for path in per_get:
                cpu, wall = cpu_of(server, lambda path=path: [c.get(path) for _ in range(args.scrapes)])
                per_get[path].append((cpu - idle_cpu / idle_wall * wall) / args.scrapes)
        bodies = {path: c.get(path).content for path in per_get}
    parse = {"/metrics": parse_us(lambda b: parse_metrics(b.decode()), bodies["/metrics"]),
             "/telemetry": parse_us(parse_telemetry, bodies["/telemetry"])}
    print(f"# scrape cost: one sim rank, {args.scrapes} GETs x {args.rounds} rounds, medians; "
          f"engine CPU = its process tree's user+system time, idle rate subtracted\n")
    print("| path | answer bytes | engine CPU ms / GET | router parse us / GET | engine cores at 10/s x "
          f"{args.ranks} ranks |")
    print("|---|---:|---:|---:|---:|")
    for path, values in per_get.items():
        ms = statistics.median(values) * 1e3
        cores = 10 * args.ranks * ms / 1e3
        print(f"| {path} | {sizes[path]:,} | {ms:.2f} | {parse[path]:.0f} | {cores:.2f} |")
    ratio = statistics.median(per_get["/metrics"]) / max(1e-9, statistics.median(per_get["/telemetry"]))
    print(f"\n/metrics costs the rank {ratio:.0f}x what /telemetry does (rounds: "
          + ", ".join(f"{path} {[round(v * 1e3, 2) for v in vs]}" for path, vs in per_get.items()) + " ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
