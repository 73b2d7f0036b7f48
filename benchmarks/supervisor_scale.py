"""`lbd supervise` at scale: one node of N ``--device sim`` ranks, its health port polled while ranks restart.

    python benchmarks/supervisor_scale.py [--sizes 8,64] [--steady-s 10] [--chaos-s 40] [--hz 50]
                                          [--kill-every-s 2] [--interval 1.0] [--settle-s 10]

For each node size: start the node, wait until every rank is ready, read what one sim rank costs (RSS of its
process tree, CPU while idle), then poll /health, /readyz and /status on the health port from a client
process of its own, one keep-alive connection, ``--hz`` ticks a second (each tick asks all three in turn):
for ``--steady-s`` with nothing happening, then for ``--chaos-s`` while ranks restart (a rolling restart
through the admin endpoint, and a SIGKILL of a random ready rank every ``--kill-every-s``). Latencies are
timed on the client, as a router or an orchestrator sees them, with the supervisor's own CPU over the window.

Both windows run twice: at normal priority, then with the supervisor and the client at SCHED_FIFO (ranks
started meanwhile are reset to normal priority on fork). On a small shared machine the first measures the
run queue as much as the supervisor; the second shows the supervisor's own latency. Needs root (or
CAP_SYS_NICE) for the second. Every process started here is stopped before the script exits.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support.node import SupervisorNode  # noqa: E402
from support.procs import exit_on_sigterm  # noqa: E402
from support.tiny import make_tiny_llama  # noqa: E402

SIM_FLAGS = ["--device", "sim", "--max-model-len", "512", "--max-num-seqs", "8", "--log-level", "warning"]
PATHS = ("/health", "/readyz", "/status")
TOKEN = "bench-admin-token"  # pragma: allowlist secret (a throwaway, in the environment only)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))] if ordered else 0.0


class _Conn(http.client.HTTPConnection):
    """Counts its connects and the slowest one: a reconnect that waits on a dropped SYN shows here."""

    connects = 0
    slowest_connect_s = 0.0

    def connect(self) -> None:
        t0 = time.perf_counter()
        super().connect()
        _Conn.connects += 1
        _Conn.slowest_connect_s = max(_Conn.slowest_connect_s, time.perf_counter() - t0)


class Poller(threading.Thread):
    """GET each of PATHS in turn on one keep-alive connection, ``hz`` ticks a second, timed on the client."""

    def __init__(self, port: int, hz: float, rt: bool) -> None:
        super().__init__(daemon=True)
        self.port, self.period, self.rt = port, 1.0 / hz, rt
        self.samples: dict[str, list[float]] = {p: [] for p in PATHS}
        self.status_bytes: list[int] = []
        self.errors = 0
        self._halt = threading.Event()

    def run(self) -> None:
        if self.rt:
            set_realtime(0)  # this thread only
        conn = _Conn("127.0.0.1", self.port, timeout=5.0)
        next_tick = time.perf_counter()
        while not self._halt.is_set():
            for path in PATHS:
                try:
                    t0 = time.perf_counter()
                    conn.request("GET", path)
                    body = conn.getresponse().read()
                    self.samples[path].append(time.perf_counter() - t0)
                    if path == "/status":
                        self.status_bytes.append(len(body))
                except (OSError, http.client.HTTPException):
                    self.errors += 1
                    conn.close()
                    conn = _Conn("127.0.0.1", self.port, timeout=5.0)
            next_tick += self.period
            delay = next_tick - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            else:
                next_tick = time.perf_counter()
        conn.close()

    def stop(self) -> None:
        self._halt.set()
        self.join(10)


def set_realtime(pid: int, on: bool = True) -> None:
    """SCHED_FIFO (or back to SCHED_OTHER) for one thread; with SCHED_RESET_ON_FORK, so ranks the
    supervisor starts meanwhile run at normal priority."""
    if on:
        os.sched_setscheduler(pid, os.SCHED_FIFO | os.SCHED_RESET_ON_FORK, os.sched_param(10))
    else:
        os.sched_setscheduler(pid, os.SCHED_OTHER, os.sched_param(0))


def supervisor_realtime(node: SupervisorNode, on: bool) -> None:
    for tid in os.listdir(f"/proc/{node.proc.pid}/task"):
        set_realtime(int(tid), on)


def poll_for(node: SupervisorNode, hz: float, seconds: float, rt: bool, during=None) -> dict:
    """Poll for ``seconds`` from a process of its own (no other thread holds its GIL), running
    ``during(stop_event)`` here meanwhile; latencies and the supervisor's CPU."""
    sup = psutil.Process(node.proc.pid)
    cpu0, t0 = sum(sup.cpu_times()[:2]), time.monotonic()
    argv = [sys.executable, __file__, "--poll", str(node.sport), "--hz", str(hz), "--seconds", str(seconds)]
    poller = subprocess.Popen([*argv, *(["--realtime"] if rt else [])], stdout=subprocess.PIPE)
    stop = threading.Event()
    side = threading.Thread(target=during, args=(stop,), daemon=True) if during else None
    if side:
        side.start()
    out, _ = poller.communicate(timeout=seconds + 60)
    stop.set()
    if side:
        side.join(30)
    cpu = (sum(sup.cpu_times()[:2]) - cpu0) / (time.monotonic() - t0)
    return {**json.loads(out), "sup_cpu": cpu, "load": os.getloadavg()[0]}


def poll_main(port: int, hz: float, seconds: float, rt: bool) -> int:
    """The poller's process: poll, then print the samples as JSON."""
    poller = Poller(port, hz, rt)
    poller.start()
    time.sleep(seconds)
    poller.stop()
    result = {"samples": poller.samples, "status_bytes": poller.status_bytes, "errors": poller.errors,
              "connects": _Conn.connects, "slowest_connect_s": _Conn.slowest_connect_s}
    print(json.dumps(result))
    return 0


def rank_cost(node: SupervisorNode, seconds: float = 5.0) -> dict:
    """Per rank: RSS of its process tree (MiB) and CPU while idle (fraction of a core), all ranks ready."""
    trees = [node.rank_tree(r["rank"]) for r in node.status()["ranks"]]
    procs = [p for tree in trees for p in tree]
    rss = sum(p.memory_info().rss for p in procs) / len(trees) / 2**20

    def cpu() -> float:
        total = 0.0
        for p in procs:
            try:
                total += sum(p.cpu_times()[:2])
            except psutil.Error:
                pass
        return total

    c0 = cpu()
    time.sleep(seconds)
    return {"rss_mib": rss, "cpu_idle": (cpu() - c0) / seconds / len(trees),
            "procs": len(procs) / len(trees)}


def chaos(node: SupervisorNode, kill_every_s: float, counts: dict):
    """A rolling restart through the admin endpoint, and a SIGKILL of a random ready rank every so often."""

    def run(stop: threading.Event) -> None:
        r = node.post("/rolling-restart", token=TOKEN)
        counts["rolling_accepted"] = r.status_code == 202
        rng = random.Random(0)
        while not stop.wait(kill_every_s):
            try:
                ready = [x for x in node.status()["ranks"] if x["state"] == "ready" and x["pid"]]
                if ready:
                    os.kill(rng.choice(ready)["pid"], signal.SIGKILL)
                    counts["kills"] += 1
            except (OSError, ValueError, KeyError):
                pass

    return run


def measure(model: Path, ranks: int, args: argparse.Namespace, log_dir: Path) -> dict:
    node = SupervisorNode(model, ranks, "--restart-backoff-initial-s", "0.5", "--restart-backoff-max-s", "2",
                          "--drain-timeout-s", "2", "--shutdown-timeout", "5",
                          interval=args.interval, timeout=2.0, threshold=3, engine_flags=SIM_FLAGS,
                          env={"LBD_ADMIN_TOKEN": TOKEN}, log=log_dir / f"node-{ranks}.log")
    try:
        ready_s = node.wait_ready(900)
        time.sleep(args.settle_s)  # the ranks' start-up burst is over
        cost = rank_cost(node)
        phases = []
        for rt in (False, True):
            supervisor_realtime(node, rt)
            node.wait_ready(900)
            steady = poll_for(node, args.hz, args.steady_s, rt)
            counts = {"kills": 0, "rolling_accepted": False}
            before = sum(r["restarts"] for r in node.status()["ranks"])
            chaotic = poll_for(node, args.hz, args.chaos_s, rt, chaos(node, args.kill_every_s, counts))
            status = node.status()
            restarts = sum(r["restarts"] for r in status["ranks"]) - before
            rolled = len((status.get("rolling_restart") or {}).get("done_ranks", []))
            phases.append({"rt": rt, "steady": steady, "chaos": chaotic, "restarts": restarts,
                           "rolled": rolled, **counts})
        return {"ranks": ranks, "ready_s": ready_s, "cost": cost, "phases": phases}
    finally:
        node.close()


def print_table(results: list[dict], args: argparse.Namespace) -> None:
    print(f"\nlbd supervise at scale: sim ranks, {os.cpu_count()} cores; probe interval {args.interval:g} s; "
          f"client polls {', '.join(PATHS)} at {args.hz:g} Hz; steady {args.steady_s:g} s, restarts "
          f"{args.chaos_s:g} s (rolling restart + SIGKILL every {args.kill_every_s:g} s)\n")
    print("| ranks | priority | phase | endpoint | p50 ms | p99 ms | max ms | n | /status size "
          "| supervisor CPU | load |")
    print("|------:|----------|-------|----------|-------:|-------:|-------:|--:|-------------:"
          "|---------------:|-----:|")
    for res in results:
        for ph in res["phases"]:
            for phase in ("steady", "chaos"):
                m = ph[phase]
                size = f"{pct(m['status_bytes'], 50) / 1024:.1f} KiB" if m["status_bytes"] else "-"
                for path in PATHS:
                    s = m["samples"][path]
                    print(f"| {res['ranks']} | {'realtime' if ph['rt'] else 'normal'} | "
                          f"{'restarts' if phase == 'chaos' else 'steady'} | {path} | "
                          f"{pct(s, 50) * 1e3:.2f} | {pct(s, 99) * 1e3:.2f} | {max(s or [0]) * 1e3:.2f} | "
                          f"{len(s)} | {size if path == '/status' else ''} | {m['sup_cpu'] * 100:.0f}% | "
                          f"{m['load']:.1f} |")
    print("\n| ranks | start-to-ready | per rank: RSS, processes, idle CPU "
          "| restarts in window (normal; realtime) | errors |")
    print("|------:|---------------:|------------------------------------"
          "|-------------------------------------|-------:|")
    for res in results:
        c = res["cost"]
        windows = "; ".join(f"{ph['restarts']} ({ph['kills']} SIGKILLs, {ph['rolled']} rolled so far)"
                            for ph in res["phases"])
        errors = sum(ph[k]["errors"] for ph in res["phases"] for k in ("steady", "chaos"))
        connects = [(ph[k]["connects"], ph[k]["slowest_connect_s"])
                    for ph in res["phases"] for k in ("steady", "chaos")]
        print(f"poller connects per window (count, slowest ms): "
              f"{', '.join(f'{n} {t * 1e3:.1f}' for n, t in connects)}", file=sys.stderr)
        print(f"| {res['ranks']} | {res['ready_s']:.0f} s | {c['rss_mib']:.0f} MiB, {c['procs']:.0f}, "
              f"{c['cpu_idle'] * 100:.1f}% of a core | {windows} | {errors} |")


def main() -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="8,64", help="node sizes (ranks), comma-separated")
    p.add_argument("--steady-s", type=float, default=10.0, help="polling with every rank ready")
    p.add_argument("--chaos-s", type=float, default=40.0, help="polling while ranks restart")
    p.add_argument("--hz", type=float, default=50.0, help="client ticks per second (3 requests each)")
    p.add_argument("--kill-every-s", type=float, default=2.0, help="SIGKILL a random ready rank this often")
    p.add_argument("--settle-s", type=float, default=10.0, help="wait after every rank is ready")
    p.add_argument("--interval", type=float, default=1.0, help="--dp-supervisor-probe-interval-s")
    p.add_argument("--poll", type=int, default=0, help=argparse.SUPPRESS)  # the poller's own process
    p.add_argument("--seconds", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--realtime", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.poll:
        return poll_main(args.poll, args.hz, args.seconds, args.realtime)
    with tempfile.TemporaryDirectory(prefix="lbd-bench-supervisor-scale-") as tmp:
        model = make_tiny_llama(Path(tmp) / "tiny-llama")
        results = [measure(model, n, args, Path(tmp)) for n in map(int, args.sizes.split(","))]
    print_table(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
