"""The default policy's tail: predicted_ttft against round robin, interleaved, on one sim fleet (issue 42).

One `lbd supervise --data-parallel-multi-port-external-lb --data-parallel-size 8 --data-parallel-size-local 8
--device sim` fleet (real front ends, schedulers and prefix caches; the forward pass is the sim profile's
timing model), then for each run and each policy (A B A B ...): every rank's prefix cache is emptied
(`POST /reset_prefix_cache`, so no policy inherits the previous one's cache), `lbd route --policy P` starts
over the supervisor, `lbd bench --workload multi-turn --num-prompts 400 --request-rate 20 --seed 87` runs
through it with the same seed, and the router stops. Printed per run: TTFT p50/p99/max of each policy, the
prefix-cache hit rate from the ranks' counters, and the ratios round_robin / predicted_ttft (above 1:
predicted_ttft is better). The verdict needs predicted_ttft's p99 at least ``--target``x better in every
run, and its p50 and hit rate no worse than round robin's. Ratios only: this host's speed drifts.

`--trace DIR` runs the router under a wrapper that writes every decision (prompt tokens, the chosen rank,
each rank's score parts and load at dispatch, the cached tokens it predicted) and the first byte's time to a
JSON-lines file per run: the per-request detail behind a tail (each router worker numbers its own decisions:
``w`` is its pid).

    .venv/bin/python benchmarks/policy_tail.py [--runs 3] [--policies round_robin,predicted_ttft]
        [--bench-args "..."] [--route-args "..."] [--trace DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from lbd.bench.stats import percentile  # noqa: E402
from peers import lbd_route_argv  # noqa: E402
from support.procs import exit_on_sigterm, free_port, free_port_run, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
BENCH = ["--workload", "multi-turn", "--num-prompts", "400", "--request-rate", "20", "--seed", "87"]


# ---- the router under a decision trace (--trace) ------------------------------------------------------
def traced_router(trace: str, argv: list[str]) -> int:
    """`lbd route argv` with every decision and first byte appended to ``trace`` (JSON lines)."""
    from lbd.policies.profile import Profile

    out = open(trace, "a", buffering=1)  # noqa: SIM115 - the process's lifetime
    decide, first_byte = Profile.decide, Profile.on_first_byte
    t0 = time.monotonic()
    seq = [0]
    traced: dict[int, int] = {}  # id(decision) -> its number (Decision has slots)

    def traced_decide(self: Profile, ctx):  # type: ignore[no-untyped-def]
        d = decide(self, ctx)
        seq[0] += 1
        pool, facts = ctx.pool, ctx.facts
        rec = {
            "ev": "decide", "n": seq[0], "w": os.getpid(), "t": round(time.monotonic() - t0, 4),
            "prompt": facts.prompt_tokens,
            "pick": d.endpoint.rank, "reason": d.reason, "cost": round(d.cost_tokens, 1),
            "pred_ms": round(d.predicted_s * 1000, 2), "root": facts.prefix_hashes[1] % 100000
            if len(facts.prefix_hashes) > 1 else None,
            "totals": [round(v, 1) for v in ctx.totals] if ctx.totals else None,
            "uncached": [round(u) for u, _ in ctx.memo.get("uncached", [])],
            "ranks": [e.rank for e in pool],
            "unstarted": [e.unstarted for e in pool], "unstarted_tok": [e.unstarted_tokens for e in pool],
            "inflight": [e.inflight for e in pool], "waiting": [e.waiting for e in pool],
            "running": [e.running for e in pool], "age_ms": [round(e.age_s * 1000) for e in pool],
        }
        for state in self.learned:  # predicted_ttft's learned token prices of the load
            if hasattr(state, "request_tokens"):
                rec["per_running"] = round(state.running_tokens, 1)
                rec["per_ahead"] = round(state.request_tokens, 1)
        out.write(json.dumps(rec) + "\n")
        traced[id(d)] = seq[0]
        return d

    def traced_first_byte(self: Profile, decision, ttft_s: float) -> None:  # type: ignore[no-untyped-def]
        first_byte(self, decision, ttft_s)
        out.write(json.dumps({"ev": "first_byte", "n": traced.pop(id(decision), None), "w": os.getpid(),
                              "t": round(time.monotonic() - t0, 4), "ttft_ms": round(ttft_s * 1000, 2),
                              "pick": decision.endpoint.rank}) + "\n")

    gc_start = [0.0]

    def gc_pause(phase: str, info: dict) -> None:  # the router's own pauses (a full collection stops it)
        now = time.perf_counter()
        if phase == "start":
            gc_start[0] = now
        elif now - gc_start[0] > 0.002:
            out.write(json.dumps({"ev": "gc", "t": round(time.monotonic() - t0, 4), "gen": info["generation"],
                                  "ms": round((now - gc_start[0]) * 1000, 2)}) + "\n")

    gc.callbacks.append(gc_pause)
    Profile.decide = traced_decide  # type: ignore[method-assign]
    Profile.on_first_byte = traced_first_byte  # type: ignore[method-assign]
    from lbd.cli import main

    return main(["route", *argv])


# ---- the fleet --------------------------------------------------------------------------------------------
def start_fleet(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int, int]:
    base, sup = free_port_run(args.ranks), free_port()
    argv = [PY, "-m", "lbd", "supervise", "--data-parallel-multi-port-external-lb",
            "--data-parallel-size", str(args.ranks), "--data-parallel-size-local", str(args.ranks),
            "--device", "sim", "--host", "127.0.0.1", "--port", str(base),
            "--data-parallel-supervisor-port", str(sup), "--log-level", "warning", "--disable-log-requests",
            *shlex.split(args.fleet_args)]
    proc = spawn(argv, env={"VLLM_SERVER_DEV_MODE": "1"}, log=log)
    try:
        wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=300, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc, base, sup


def rank_urls(base: int, ranks: int) -> list[str]:
    return [f"http://127.0.0.1:{base + i}" for i in range(ranks)]


def reset_caches(urls: list[str]) -> None:
    """Empty every rank's prefix cache (each must be idle: retried while a rank still holds blocks)."""
    for url in urls:
        for _ in range(100):
            r = httpx.post(url + "/reset_prefix_cache", timeout=15)
            if r.status_code == 200:
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{url}/reset_prefix_cache: {r.status_code} {r.text[:200]}")


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric_sums(urls: list[str], *names: str) -> tuple[float, ...]:
    """Each metric of ``names`` summed over the ranks' /metrics."""
    totals = [0.0] * len(names)
    for url in urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        for i, name in enumerate(names):
            totals[i] += _metric_sum(text, name)
    return tuple(totals)


def cache_counters(urls: list[str]) -> tuple[float, float]:
    """(prefix-cache queries, hits) summed over the ranks."""
    q, h = metric_sums(urls, "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total")
    return q, h


def router_cpu(pid: int) -> float:
    """CPU seconds (user + system) the router process has used so far."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


# ---- one run -----------------------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, policy: str, run: int, sup: int, urls: list[str], logs: Path) -> dict:
    reset_caches(urls)
    q0, h0 = cache_counters(urls)
    port = free_port()
    label, _, config = policy.partition("=")  # a name, or label=routing-config.json
    how = ["--routing-config", config] if config else ["--policy", policy]
    route, ready = lbd_route_argv(port, f"supervisor://127.0.0.1:{sup}", *how, *shlex.split(args.route_args))
    trace = None
    if args.trace:
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        trace = Path(args.trace) / f"{label}-run{run}.jsonl"
        trace.unlink(missing_ok=True)
        route = [PY, str(Path(__file__).resolve()), "--as-router", str(trace), "--", *route[4:]]
    router = spawn(route, log=logs / f"route-{label}-{run}.log")
    result = logs / f"bench-{label}-{run}.json"
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=60, proc=router)
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60, proc=router)
        time.sleep(1.0)  # the first scrape / pushed load state of every rank
        bench = [PY, "-m", "lbd", "bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress",
                 *BENCH, *shlex.split(args.bench_args), "--result-json", str(result)]
        cpu0 = router_cpu(router.pid)
        done = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        cpu = router_cpu(router.pid) - cpu0
        if done.returncode != 0:
            raise RuntimeError(f"lbd bench exited {done.returncode}: {done.stderr[-2000:]}")
    finally:
        stop(router)
    q1, h1 = cache_counters(urls)
    data = json.loads(result.read_text())
    records = data["runs"][0]["requests"]
    ttfts = [r["ttft"] * 1000 for r in records if r.get("ttft") is not None and not r.get("error")]
    failed = sum(1 for r in records if r.get("error"))
    return {"policy": label, "run": run, "n": len(ttfts), "failed": failed,
            "p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99),
            "max": max(ttfts, default=0),
            "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else math.nan,
            "load1": os.getloadavg()[0], "router_cpu_s": cpu}


# ---- the table ---------------------------------------------------------------------------------------------
def table(rows: list[dict], base: str, ours: str, target: float) -> tuple[str, bool]:
    lines = [f"| run | {base} p50 / p99 / max ms | {ours} p50 / p99 / max ms | p99 ratio | p50 ratio "
             "| hit rate (rr / ours) | load |", "|---|---|---|---|---|---|---|"]
    ok = True
    for run in sorted({r["run"] for r in rows}):
        a = next((r for r in rows if r["run"] == run and r["policy"] == base), None)
        b = next((r for r in rows if r["run"] == run and r["policy"] == ours), None)
        if a is None or b is None:
            continue
        p99r, p50r = a["p99"] / b["p99"], a["p50"] / b["p50"]
        good = p99r >= target and p50r >= 1.0 and b["hit_rate"] >= a["hit_rate"] - 0.01
        ok &= good
        lines.append(f"| {run} | {a['p50']:.0f} / {a['p99']:.0f} / {a['max']:.0f} "
                     f"| {b['p50']:.0f} / {b['p99']:.0f} / {b['max']:.0f} | **{p99r:.2f}x** | {p50r:.2f}x "
                     f"| {a['hit_rate']:.1%} / {b['hit_rate']:.1%} | {max(a['load1'], b['load1']):.1f} |"
                     + ("" if good else " behind"))
    return "\n".join(lines), ok


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--policies", default="round_robin,predicted_ttft",
                   help="baseline,ours[,...]: policy names or LABEL=routing-config.json")
    p.add_argument("--target", type=float, default=2.0, help="p99 ratio baseline/ours to pass")
    p.add_argument("--fleet-args", default="", help="more `lbd supervise` flags (e.g. --sim-profile)")
    p.add_argument("--route-args", default="", help="more `lbd route` flags")
    p.add_argument("--bench-args", default="", help="more `lbd bench` flags (after the issue's)")
    p.add_argument("--bench-timeout", type=float, default=600.0)
    p.add_argument("--trace", default=None, metavar="DIR", help="write every decision here (JSON lines)")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--logs", default=None, help="logs folder (default: a temporary one)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--as-router"]:
        return traced_router(argv[1], argv[3:])
    args = parse(argv)
    exit_on_sigterm()
    base, *others = args.policies.split(",")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="policy_tail-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", flush=True)
    fleet, port, sup = start_fleet(args, logs / "fleet.log")
    rows: list[dict] = []
    try:
        urls = rank_urls(port, args.ranks)
        for run in range(1, args.runs + 1):
            for policy in (base, *others):
                row = run_one(args, policy, run, sup, urls, logs)
                rows.append(row)
                print(f"run {run} {policy:>15}: p50 {row['p50']:.1f} p90 {row['p90']:.1f} "
                      f"p99 {row['p99']:.1f} max {row['max']:.1f} ms, hit {row['hit_rate']:.1%}, "
                      f"failed {row['failed']}, router cpu {row['router_cpu_s']:.1f} s, "
                      f"load {row['load1']:.1f}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        stop(fleet)
    ok = True
    for policy in others:
        ours = policy.partition("=")[0]
        text, good = table(rows, base, ours, args.target)
        ok &= good
        print(text)
        print(f"verdict: {ours} p99 >= {args.target}x better than {base} with p50 and hit rate no worse in "
              f"every run: {'yes' if good else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
