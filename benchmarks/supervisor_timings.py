"""`lbd supervise` on a tiny model: start-to-ready for 1, 2 and 4 ranks, hung-rank detection against its
bound (interval x threshold + timeout), restart-to-ready, and health-port latency while a rank hangs.

    python benchmarks/supervisor_timings.py [--model DIR] [--repeats 3]
                                           [--interval 0.2 --timeout 0.5 --threshold 2]

Ranks start in parallel, so a node is ready close to its slowest rank, not the sum of the ranks' start
times: the table shows both. Every process started here is stopped before the script exits.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support.node import SupervisorNode  # noqa: E402
from support.procs import exit_on_sigterm  # noqa: E402
from support.tiny import make_tiny_llama  # noqa: E402


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def start_to_ready(model: Path, ranks: int, probe: dict[str, float], log_dir: Path) -> dict[str, float]:
    """Seconds from spawning `lbd supervise` to /readyz 200, and the ranks' own start-to-ready times."""
    node = SupervisorNode(model, ranks, log=log_dir / f"start-{ranks}.log", **probe)
    try:
        health_up = node.wait_for(lambda: node.get("/health").status_code == 200, 30, "health port",
                                  interval=0.005)
        ready = node.wait_ready(600) + health_up
        own = [r["uptime_s"] - r["ready_for_s"] for r in node.status()["ranks"]]
        return {"ready_s": ready, "health_up_s": health_up, "slowest_rank_s": max(own),
                "sum_ranks_s": sum(own)}
    finally:
        node.close()


class LatencyProbe:
    """Sequential GETs of /readyz and /status on one keep-alive connection, timed on the client."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url, timeout=5.0)
        self.samples: dict[str, list[float]] = {"/readyz": [], "/status": []}

    def once(self) -> dict:
        t0 = time.perf_counter()
        self.client.get("/readyz")
        t1 = time.perf_counter()
        status = self.client.get("/status").json()
        t2 = time.perf_counter()
        self.samples["/readyz"].append(t1 - t0)
        self.samples["/status"].append(t2 - t1)
        return status

    def run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.once()


def rank_state(status: dict, rank: int) -> dict:
    return next(r for r in status["ranks"] if r["rank"] == rank)


def hang_and_restart(node: SupervisorNode, probe: LatencyProbe, rank: int) -> tuple[float, float]:
    """SIGSTOP a rank; return (detection s, detection-to-ready s). Health latency is sampled from the
    SIGSTOP until the hang is detected: the window in which probes of the hung rank are pending."""
    node.wait_ready(600)
    before = rank_state(node.status(), rank)["restarts"]
    node.signal_rank(rank, signal.SIGSTOP)
    t0 = time.monotonic()
    while rank_state(probe.once(), rank)["state"] == "ready":
        if time.monotonic() - t0 > 60:
            raise RuntimeError("hang not detected in 60 s")
    detected = time.monotonic() - t0
    t1 = time.monotonic()
    node.wait_for(lambda: (r := node.rank(rank))["state"] == "ready" and r["restarts"] > before, 600,
                  "restart", interval=0.02)
    return detected, time.monotonic() - t1


def kill_and_restart(node: SupervisorNode, rank: int) -> float:
    node.wait_ready(600)
    before = node.rank(rank)["restarts"]
    node.signal_rank(rank, signal.SIGKILL)
    t0 = time.monotonic()
    node.wait_for(lambda: (r := node.rank(rank))["state"] == "ready" and r["restarts"] > before, 600,
                  "restart", interval=0.02)
    return time.monotonic() - t0


def row(name: str, value: str, note: str = "") -> None:
    print(f"| {name:<44} | {value:>22} | {note} |")


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="model folder (default: a tiny random Llama)")
    p.add_argument("--repeats", type=int, default=3, help="hangs and kills per measurement")
    p.add_argument("--interval", type=float, default=0.2, help="--dp-supervisor-probe-interval-s")
    p.add_argument("--timeout", type=float, default=0.5, help="--dp-supervisor-probe-timeout-s")
    p.add_argument("--threshold", type=int, default=2, help="--dp-supervisor-probe-failure-threshold")
    p.add_argument("--backoff", type=float, default=1.0, help="--restart-backoff-initial-s")
    p.add_argument("--sizes", default="1,2,4", help="rank counts for start-to-ready")
    args = p.parse_args()
    probe_cfg = {"interval": args.interval, "timeout": args.timeout, "threshold": args.threshold}
    bound = args.interval * args.threshold + args.timeout
    with tempfile.TemporaryDirectory(prefix="lbd-bench-supervisor-") as tmp:
        tmp_path = Path(tmp)
        model = args.model or make_tiny_llama(tmp_path / "tiny-llama")
        starts = {n: start_to_ready(model, n, probe_cfg, tmp_path) for n in map(int, args.sizes.split(","))}

        node = SupervisorNode(model, 2, "--restart-backoff-initial-s", str(args.backoff),
                              "--restart-backoff-max-s", str(args.backoff), log=tmp_path / "node.log",
                              **probe_cfg)
        try:
            node.wait_ready(600)
            healthy = LatencyProbe(node.url)
            healthy.run_for(3.0)
            hung = LatencyProbe(node.url)
            hangs = [hang_and_restart(node, hung, rank=1) for _ in range(args.repeats)]
            kills = [kill_and_restart(node, rank=1) for _ in range(args.repeats)]
        finally:
            node.close()

    detect = [d for d, _ in hangs]
    name = model if args.model else "tiny random Llama (2 layers)"
    load = os.getloadavg()[0]
    print(f"\nlbd supervise benchmark: model {name} on CPU ({os.cpu_count()} cores, load average "
          f"{load:.1f}); probe interval {args.interval:g} s, timeout {args.timeout:g} s, "
          f"threshold {args.threshold}; restart backoff {args.backoff:g} s\n")
    print(f"| {'measure':<44} | {'value':>22} | note |")
    print(f"|{'-' * 46}|{'-' * 24}|------|")
    for n, s in starts.items():
        row(f"start-to-ready, {n} rank{'s' if n > 1 else ''}", f"{s['ready_s']:.1f} s",
            f"slowest rank {s['slowest_rank_s']:.1f} s, sum of ranks {s['sum_ranks_s']:.1f} s")
    row("health port answering after spawn", f"{min(s['health_up_s'] for s in starts.values()) * 1e3:.0f} ms",
        "python start + imports + bind")
    row("hung-rank detection (SIGSTOP)", f"{statistics.mean(detect):.2f} s (max {max(detect):.2f})",
        f"bound interval x threshold + timeout = {bound:.2f} s; {len(detect)} hangs")
    row("hang detected -> ready again", f"{statistics.mean(r for _, r in hangs):.1f} s",
        f"SIGTERM+SIGCONT, {args.backoff:g} s backoff, engine start")
    row("SIGKILL -> ready again", f"{statistics.mean(kills):.1f} s (max {max(kills):.1f})",
        f"{args.backoff:g} s backoff + engine start; {len(kills)} kills")
    for path in ("/readyz", "/status"):
        for label, lp in (("healthy", healthy), ("one rank hung", hung)):
            s = lp.samples[path]
            row(f"{path} latency, {label}", f"p50 {pct(s, 50) * 1e3:.2f} / p99 {pct(s, 99) * 1e3:.2f} ms",
                f"{len(s)} sequential requests, client-side")
    return 0


if __name__ == "__main__":
    sys.exit(main())
