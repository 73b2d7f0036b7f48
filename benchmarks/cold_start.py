"""Cold start of `lbd route` and `lbd supervise`, two source trees side by side: the time from spawning the
program to the first answer of its health endpoint (the router's /health, the supervisor's /health on its
health port), interleaved A B A B so a shared machine's drift hits both alike.

    python benchmarks/cold_start.py --trees /path/to/old/src /path/to/new/src [--rounds 7]

Each tree is put first on PYTHONPATH (a src/ folder of a checkout). Both trees are byte-compiled first, as
pip does when it installs a wheel: a checkout run with PYTHONDONTWRITEBYTECODE set compiles every module
from source on every start, which times the compiler, not the program (``--from-source`` measures that).
The supervisor starts one rank of a tiny random Llama on the simulated device; only its own start is timed,
not the rank's. Every process started here is stopped before the next one starts.
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from support.procs import exit_on_sigterm, free_port, spawn, stop  # noqa: E402
from support.tiny import make_tiny_llama  # noqa: E402


def first_answer(argv: list[str], url: str, env: dict[str, str], log: Path) -> float:
    """Seconds from spawn until ``url`` answers with any status."""
    t0 = time.perf_counter()
    proc = spawn(argv, env=env, log=log)
    try:
        while True:
            try:
                httpx.get(url, timeout=0.5)
                return time.perf_counter() - t0
            except httpx.HTTPError:
                if proc.poll() is not None:
                    raise SystemExit(f"{argv[:4]} exited {proc.returncode}: see {log}") from None
                time.sleep(0.005)
    finally:
        stop(proc)


def programs(model: Path) -> dict[str, tuple[list[str], str]]:
    route_port, health_port, rank_port = free_port(), free_port(), free_port()
    py = [sys.executable, "-m", "lbd"]
    return {
        "lbd route": ([*py, "route", "--port", str(route_port), "--upstreams", "http://127.0.0.1:9"],
                      f"http://127.0.0.1:{route_port}/health"),
        "lbd supervise": ([*py, "supervise", "--model", str(model), "--device", "sim",
                           "--port", str(rank_port), "--data-parallel-size", "1",
                           "--data-parallel-supervisor-port", str(health_port)],
                          f"http://127.0.0.1:{health_port}/health"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs=2, required=True, metavar=("A_SRC", "B_SRC"))
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--from-source", action="store_true",
                    help="do not byte-compile the trees first (pycs already there are still read)")
    args = ap.parse_args()
    exit_on_sigterm()
    if not args.from_source:
        for tree in args.trees:
            compileall.compile_dir(tree, quiet=1, workers=0)
    work = Path(tempfile.mkdtemp(prefix="lbd-cold-"))
    model = make_tiny_llama(work / "tiny")
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for tree in args.trees:
            env = {**os.environ, "PYTHONPATH": tree}
            for name, (argv, url) in programs(model).items():
                times.setdefault((name, tree), []).append(first_answer(argv, url, env, work / "log.txt"))
    a, b = args.trees
    print(f"A={a}  B={b}  {args.rounds} rounds, interleaved")
    print(f"{'program':<16}{'A median s':>12}{'B median s':>12}{'B/A':>8}")
    for name in ("lbd route", "lbd supervise"):
        ma, mb = statistics.median(times[(name, a)]), statistics.median(times[(name, b)])
        print(f"{name:<16}{ma:>12.3f}{mb:>12.3f}{mb / ma:>8.2f}")


if __name__ == "__main__":
    main()
