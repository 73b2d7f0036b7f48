"""A burst of sessions on cold shared system prompts: lbd's default policy against sglang-router's
`cache_aware`, interleaved, on one sim fleet (issue 42, acceptance 3's second bullet).

One `lbd supervise` fleet of 8 `--device sim` ranks, slowed (`--sim-profile h100-llama3-8b*20`: a cold
1,700-token prefill takes ~1.1 s, so prefills queue) and publishing KV events (lbd's exact view), then for
each run and each target (A B A B ...): every rank's prefix cache is emptied, the router starts, `lbd bench
--workload multi-turn --endpoint chat` sends 300 requests at 8/s: 12 system prompts of 1,500 tokens, 3-turn
sessions (200-token questions, 16-token answers), `--group-burst 5`: each drawn prompt starts 5 sessions in a
row, within about a second of each other; the router stops. Same seed, same requests for every target.
Targets: `lbd:<policy>`, `lbd:<label>=<routing-config.json>` (a variant of a profile),
`sglang-router:<policy>` or `vllm-router:<policy>` (installed by scripts/setup-peers.sh).

Printed per run: TTFT p50/p90/p99/max of each target (ms, real time), the ranks' prefix-cache hit rate, and
per burst (a prompt's first turns starting within ``--burst-window`` s of the burst's first) how long its
first turns waited: the median cold prefill (each group's first request), the slowest follower of a cold
burst, ``stacked``: the bursts whose followers waited more than ``--stack-factor`` x that cold prefill
(behind more than one prefill), and the worst burst. The verdict needs the first target's p99 at or below
each other's in every run and no burst of it stacked. Ratios only: this host's speed drifts.

    .venv/bin/python benchmarks/policy_burst.py [--runs 5] [--targets lbd:predicted_ttft,sglang-router]
        [--time-scale 20] [--bench-args "..."] [--trace DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT / "tests")]

from lbd.bench.stats import percentile  # noqa: E402
from peers import lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from policy_tail import cache_counters, rank_urls, reset_caches, start_fleet  # noqa: E402
from support.procs import exit_on_sigterm, free_port, spawn, stop, wait_http  # noqa: E402

PY = sys.executable
KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'
BENCH = ["--workload", "multi-turn", "--endpoint", "chat", "--num-groups", "12",
         "--system-prompt-len", "1500", "--question-len", "200", "--num-turns", "3", "--output-len", "16",
         "--group-burst", "5", "--session-header", "--num-prompts", "300", "--request-rate", "8",
         "--seed", "42"]


def router_for(args: argparse.Namespace, target: str, run: int, port: int, sup: int, urls: list[str],
               logs: Path) -> tuple[list[str], str]:
    """argv and readiness path of ``lbd:<policy>`` (over the supervisor) or ``sglang-router[:policy]``."""
    kind, _, policy = target.partition(":")
    if kind == "lbd":
        name, _, config = policy.partition("=")  # a policy name, or LABEL=routing-config.json
        how = ["--routing-config", config] if config else ["--policy", name or "predicted_ttft"]
        argv, ready = lbd_route_argv(port, f"supervisor://127.0.0.1:{sup}", *how,
                                     *shlex.split(args.route_args))
        if args.trace:
            Path(args.trace).mkdir(parents=True, exist_ok=True)
            trace = Path(args.trace) / f"{label(target)}-run{run}.jsonl"
            trace.unlink(missing_ok=True)
            argv = [PY, str(ROOT / "benchmarks" / "policy_tail.py"), "--as-router", str(trace), "--",
                    *argv[4:]]
        return argv, ready
    return peer_argv(kind, port, urls, policy or "cache_aware")


def label(target: str) -> str:
    return target.partition("=")[0].replace(":", "-").replace("/", "-")


def bursts(records: list[dict], window: float) -> list[list[dict]]:
    """Each prompt group's first turns, in runs starting within ``window`` s of the run's first."""
    firsts = sorted((r for r in records if r["turn"] == 0), key=lambda r: (r["group"], r["start"]))
    out: list[list[dict]] = []
    for r in firsts:
        if out and out[-1][0]["group"] == r["group"] and r["start"] - out[-1][0]["start"] <= window:
            out[-1].append(r)
        else:
            out.append([r])
    return out


def burst_stats(records: list[dict], window: float, factor: float) -> dict:
    """The cold prefill (median TTFT of each group's very first request), the slowest follower of a cold
    burst (a first turn of the group's first burst, after its first request), the bursts whose followers
    waited more than ``factor`` cold prefills, and the worst burst's first-turn TTFTs."""
    groups = bursts(records, window)
    seen: set[int] = set()
    cold, cold_followers = [], []
    for b in groups:
        if b[0]["group"] not in seen:
            seen.add(b[0]["group"])
            cold.append(b[0]["ttft"])
            cold_followers += [r["ttft"] for r in b[1:]]
    cold_s = statistics.median(cold) if cold else math.nan
    stacked, worst, worst_wait = 0, [], -1.0
    for b in groups:
        waits = [r["ttft"] for r in b[1:]]
        if not waits:
            continue
        if max(waits) > factor * cold_s:
            stacked += 1
        if max(waits) > worst_wait:
            worst_wait, worst = max(waits), [round(r["ttft"] * 1000) for r in b]
    return {"cold_ms": cold_s * 1000, "cold_follower_max_ms": max(cold_followers, default=0.0) * 1000,
            "bursts": sum(1 for b in groups if len(b) > 1), "stacked": stacked, "worst_burst_ms": worst}


def run_one(args: argparse.Namespace, target: str, run: int, sup: int, urls: list[str], logs: Path) -> dict:
    reset_caches(urls)
    q0, h0 = cache_counters(urls)
    port = free_port()
    argv, ready = router_for(args, target, run, port, sup, urls, logs)
    router = spawn(argv, log=logs / f"route-{label(target)}-{run}.log")
    result = logs / f"bench-{label(target)}-{run}.json"
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=60, proc=router)
        wait_http(f"http://127.0.0.1:{port}/v1/models", timeout=60, proc=router)
        time.sleep(1.0)  # the first pushed load state (lbd) / health check (peers) of every rank
        bench = [PY, "-m", "lbd", "bench", "--base-url", f"http://127.0.0.1:{port}", "--no-progress",
                 "--model", args.model, *BENCH, *shlex.split(args.bench_args), "--result-json", str(result)]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=args.bench_timeout)
        if done.returncode != 0:
            raise RuntimeError(f"lbd bench exited {done.returncode}: {done.stderr[-2000:]}")
    finally:
        stop(router)
    q1, h1 = cache_counters(urls)
    records = json.loads(result.read_text())["runs"][0]["requests"]
    ok = [r for r in records if r.get("ttft") is not None and not r.get("error")]
    ttfts = [r["ttft"] * 1000 for r in ok]
    return {"target": target.partition("=")[0], "run": run, "n": len(ttfts), "failed": len(records) - len(ok),
            "p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99),
            "max": max(ttfts, default=0.0), "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else math.nan,
            "load1": os.getloadavg()[0], **burst_stats(ok, args.burst_window, args.stack_factor)}


def table(rows: list[dict], ours: str, peer: str) -> tuple[str, bool]:
    lines = [f"| run | {ours} p50 / p90 / p99 / max ms | {peer} p50 / p90 / p99 / max ms | p99 ratio "
             "(peer / ours) | stacked bursts (ours / peer) | hit (ours / peer) | load |",
             "|---|---|---|---|---|---|---|"]
    ok = True
    for run in sorted({r["run"] for r in rows}):
        a = next((r for r in rows if r["run"] == run and r["target"] == ours), None)
        b = next((r for r in rows if r["run"] == run and r["target"] == peer), None)
        if a is None or b is None:
            continue
        good = a["p99"] <= b["p99"] and a["stacked"] == 0
        ok &= good
        lines.append(f"| {run} | {a['p50']:.0f} / {a['p90']:.0f} / {a['p99']:.0f} / {a['max']:.0f} "
                     f"| {b['p50']:.0f} / {b['p90']:.0f} / {b['p99']:.0f} / {b['max']:.0f} "
                     f"| **{b['p99'] / a['p99']:.2f}x** | {a['stacked']}/{a['bursts']} / {b['stacked']}/"
                     f"{b['bursts']} | {a['hit_rate']:.1%} / {b['hit_rate']:.1%} "
                     f"| {max(a['load1'], b['load1']):.1f} |" + ("" if good else " behind"))
    return "\n".join(lines), ok


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--targets", default="lbd:predicted_ttft,sglang-router:cache_aware",
                   help="ours,peer[,...]: lbd:<policy>, lbd:<label>=<routing-config.json>, "
                   "sglang-router:<policy> or vllm-router:<policy>")
    p.add_argument("--model", default="lbd-sim", help="the model name the ranks serve")
    p.add_argument("--time-scale", type=float, default=20.0, help="dilation of the sim's time")
    p.add_argument("--fleet-args", default="", help="more `lbd supervise` flags")
    p.add_argument("--route-args", default="", help="more `lbd route` flags")
    p.add_argument("--bench-args", default="", help="more `lbd bench` flags (after the defaults)")
    p.add_argument("--bench-timeout", type=float, default=600.0)
    p.add_argument("--burst-window", type=float, default=1.0, help="s: first turns of one burst")
    p.add_argument("--stack-factor", type=float, default=1.5,
                   help="a burst is stacked when a follower waited this many cold prefills")
    p.add_argument("--trace", default=None, metavar="DIR", help="lbd targets: write every decision here")
    p.add_argument("--json", default=None, help="write the rows here")
    p.add_argument("--logs", default=None, help="logs folder (default: a temporary one)")
    args = p.parse_args(argv)
    args.fleet_args = (f"--sim-profile h100-llama3-8b*{args.time_scale:g} --served-model-name {args.model} "
                       f"--kv-events-config '{KV_EVENTS}' {args.fleet_args}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    exit_on_sigterm()
    ours, *peers = args.targets.split(",")
    for t in peers:
        if not t.startswith("lbd:") and not peer_installed(t.partition(":")[0]):
            sys.exit(f"{t} is not installed (bash scripts/setup-peers.sh routers)")
    logs = Path(args.logs or tempfile.mkdtemp(prefix="policy_burst-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"logs in {logs}", flush=True)
    fleet, port, sup = start_fleet(args, logs / "fleet.log")
    rows: list[dict] = []
    try:
        urls = rank_urls(port, args.ranks)
        for run in range(1, args.runs + 1):
            for target in (ours, *peers):
                row = run_one(args, target, run, sup, urls, logs)
                rows.append(row)
                print(f"run {run} {row['target']:>26}: p50 {row['p50']:.0f} p90 {row['p90']:.0f} "
                      f"p99 {row['p99']:.0f} max {row['max']:.0f} ms, hit {row['hit_rate']:.1%}, "
                      f"cold {row['cold_ms']:.0f} ms, cold followers max "
                      f"{row['cold_follower_max_ms']:.0f} ms, "
                      f"stacked {row['stacked']}/{row['bursts']}, worst burst {row['worst_burst_ms']}, "
                      f"failed {row['failed']}, load {row['load1']:.1f}", flush=True)
                if args.json:
                    Path(args.json).write_text(json.dumps(rows, indent=1))
    finally:
        stop(fleet)
    ok = True
    ours = ours.partition("=")[0]
    for peer in (p.partition("=")[0] for p in peers):
        text, good = table(rows, ours, peer)
        ok &= good
        print(text)
        print(f"verdict: {ours} p99 at or below {peer}'s with no burst stacked in every run: "
              f"{'yes' if good else 'no'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
