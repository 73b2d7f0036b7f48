"""Router overhead, like with like: every router with the same policy, over the same fast stub upstreams, in
one run, rounds interleaved (a shared machine's load drifts), medians shown.

Routers: `lbd route` (1 and 2 workers) and, when installed (`bash scripts/setup-peers.sh`), vllm-router,
sglang-router and nginx. Policies: round robin for all; then each router's cache-aware policy (lbd
prefix_affinity, vllm-router and sglang-router cache_aware; nginx has none). Scenarios, each its own table:
  small   80-byte completions body, a ~250-byte JSON answer
  16KiB   16 KiB completions body (a long prompt: cache-aware policies hash it), the same JSON answer
  stream  a streamed answer: SSE of 128 events (one upstream write each) + [DONE], chunked
For each: the router's latency minus direct latency at concurrency 1 (p50/p99 us), requests/s at concurrency
64 (stream: SSE events/s too), router CPU per 1,000 requests and RSS, and each row's ratio to vllm-router's
requests/s at the same policy. Load generator: wrk when present, else a raw-socket uvloop client
(benchmarks/http_load.py). Stubs are raw uvloop protocols, so the difference is the router's.

    .venv/bin/python benchmarks/router_overhead.py [--seconds 3] [--rounds 3] [--only lbd,vllm-router]
        [--scenarios small,16KiB,stream] [--policies round_robin,cache_aware] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(Path(__file__).resolve().parent), str(ROOT)]
from http_load import STREAM_CHUNKS, Load, large_body, make_loader, small_body, stream_body  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from peers import PEER_KINDS, lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from support.procs import exit_on_sigterm, tree_usage  # noqa: E402

SCENARIOS = {"small": small_body, "16KiB": large_body, "stream": stream_body}
# policy family -> each router's own policy name (None: the router has no such policy)
POLICIES = {
    "round_robin": {"lbd": "round_robin", "vllm-router": "round_robin", "sglang-router": "round_robin",
                    "nginx": "round_robin"},
    "cache_aware": {"lbd": "prefix_affinity", "vllm-router": "cache_aware", "sglang-router": "cache_aware",
                    "nginx": None},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, path: str, timeout: float = 30.0) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}{path}", timeout=1.0).status_code < 500:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    return False


def start(argv: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
                            start_new_session=True, env=dict(os.environ))


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def nginx_conf(tmp: Path, port: int, ups: list[str]) -> list[str]:
    conf = tmp / f"nginx-{port}.conf"
    servers = "\n".join(f"    server {u.split('//')[1]};" for u in ups)
    conf.write_text(f"""daemon off; worker_processes 1; pid {tmp}/nginx-{port}.pid;
error_log {tmp}/nginx-error.log;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/body; proxy_temp_path {tmp}/proxy; fastcgi_temp_path {tmp}/fcgi;
  uwsgi_temp_path {tmp}/uwsgi; scgi_temp_path {tmp}/scgi;
  client_max_body_size 32m; client_body_buffer_size 64k;
  upstream ranks {{
{servers}
    keepalive 128;
  }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://ranks; proxy_http_version 1.1; proxy_set_header Connection "";
                 proxy_buffering off; proxy_request_buffering off; }}
  }}
}}
""")
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    return [nginx, "-p", str(tmp), "-c", str(conf)]


@dataclass(frozen=True)
class RouterSpec:
    name: str  # e.g. "lbd route (1 worker)"
    kind: str  # lbd | vllm-router | sglang-router | nginx
    policy: str  # the router's own policy name
    argv: tuple[str, ...]
    port: int
    ready: str


def router_specs(tmp: Path, ups: list[str], families: list[str], only: list[str]) -> dict[str, RouterSpec]:
    """(family, name) keyed specs for the routers installed here."""
    out: dict[str, RouterSpec] = {}
    for family in families:
        names = POLICIES[family]
        candidates = [("lbd route (1 worker)", "lbd"), ("lbd route (2 workers)", "lbd")]
        candidates += [(k, k) for k in PEER_KINDS if peer_installed(k)]
        if shutil.which("nginx") or Path("/usr/sbin/nginx").exists():
            candidates.append(("nginx", "nginx"))
        for name, kind in candidates:
            policy = names[kind]
            if policy is None or (only and not any(name.startswith(w) for w in only)):
                continue
            port = free_port()
            if kind == "lbd":
                workers = "2" if "2 workers" in name else "1"
                argv, ready = lbd_route_argv(port, ",".join(ups), "--workers", workers, "--policy", policy)
            elif kind == "nginx":
                argv, ready = nginx_conf(tmp, port, ups), "/v1/models"
            else:
                argv, ready = peer_argv(kind, port, ups, policy)
            out[f"{family}|{name}"] = RouterSpec(name, kind, policy, tuple(argv), port, ready)
    return out


@dataclass
class Row:
    scenario: str
    family: str
    name: str
    policy: str
    over_p50_us: float
    over_p99_us: float
    c64_rps: float
    c64_p50_us: float
    c64_p99_us: float
    cpu_ms_per_1k: float
    rss_mib: float
    errors: int
    events_per_s: float | None = None
    vs_vllm_router: float | None = None


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def measure(specs: dict[str, RouterSpec], ups: list[str], loaders: dict[str, Callable[[str, int], Load]],
            rounds: int, tmp: Path) -> list[Row]:
    """Start every router, then run interleaved rounds over (scenario, router): direct first, then each."""
    procs = {key: start(list(s.argv), tmp / (re.sub(r"[^a-z0-9]+", "-", key.lower()) + ".log"))
             for key, s in specs.items()}
    try:
        live = {}
        for key, s in specs.items():
            if wait_port(s.port, s.ready) and procs[key].poll() is None:
                live[key] = f"http://127.0.0.1:{s.port}"
            else:
                print(f"  {key}: did not start (see {tmp})", file=sys.stderr)
        for url in live.values():
            loaders["small"](url, 8)  # warm-up: connections, first scrapes
        runs: dict[tuple[str, str], list[tuple[Load, Load, float, int]]] = {}
        direct: dict[str, list[Load]] = {sc: [] for sc in loaders}
        for i in range(rounds):
            print(f"  round {i + 1}/{rounds}", flush=True)
            for sc, load in loaders.items():
                direct[sc].append(load(ups[0], 1))
                for key, url in live.items():
                    c1 = load(url, 1)
                    cpu0, _ = tree_usage(procs[key].pid)
                    c64 = load(url, 64)
                    cpu1, rss = tree_usage(procs[key].pid)
                    runs.setdefault((sc, key), []).append(
                        (c1, c64, (cpu1 - cpu0) / max(1, c64.requests) * 1e6, rss))
        rows = [_row(sc, specs[key], r, direct[sc]) for (sc, key), r in runs.items()]
    finally:
        for proc in procs.values():
            stop(proc)
    by = {(r.scenario, r.family, r.name): r for r in rows}
    for r in rows:
        peer = by.get((r.scenario, r.family, "vllm-router"))
        if peer is not None and peer.c64_rps:
            r.vs_vllm_router = r.c64_rps / peer.c64_rps
    return rows


def _row(scenario: str, spec: RouterSpec, runs: list[tuple[Load, Load, float, int]],
         direct: list[Load]) -> Row:
    d50, d99 = _median([x.p50_us for x in direct]), _median([x.p99_us for x in direct])
    rps = _median([c.rps for _, c, _, _ in runs])
    family = next(f for f, names in POLICIES.items() if names[spec.kind] == spec.policy)
    return Row(
        scenario, family, spec.name, spec.policy,
        _median([c1.p50_us for c1, _, _, _ in runs]) - d50,
        _median([c1.p99_us for c1, _, _, _ in runs]) - d99,
        rps, _median([c.p50_us for _, c, _, _ in runs]), _median([c.p99_us for _, c, _, _ in runs]),
        _median([cpu for _, _, cpu, _ in runs]), max(r for _, _, _, r in runs) / 2**20,
        sum(c1.errors + c.errors for c1, c, _, _ in runs),
        events_per_s=rps * (STREAM_CHUNKS + 1) if scenario == "stream" else None,
    )


def print_tables(rows: list[Row]) -> None:
    for sc in SCENARIOS:
        mine = [r for r in rows if r.scenario == sc]
        if not mine:
            continue
        stream = sc == "stream"
        print(f"\n### {sc}\n")
        extra = " SSE events/s |" if stream else ""
        print("| policy | router | c=1 p50 overhead (us) | c=1 p99 overhead (us) | c=64 req/s |" + extra
              + " vs vllm-router | c=64 p50 (us) | c=64 p99 (us) | CPU ms / 1k req | RSS MiB | errors |")
        print("|---|---|---:|---:|---:|" + ("---:|" if stream else "") + "---:|---:|---:|---:|---:|---:|")
        for r in sorted(mine, key=lambda r: (list(POLICIES).index(r.family), r.name)):
            ratio = f"{r.vs_vllm_router:.2f}x" if r.vs_vllm_router is not None else "-"
            cells = [f"{r.over_p50_us:.0f}", f"{r.over_p99_us:.0f}", f"{r.c64_rps:.0f}"]
            if stream:
                cells.append(f"{r.events_per_s:.0f}")
            cells += [ratio, f"{r.c64_p50_us:.0f}", f"{r.c64_p99_us:.0f}", f"{r.cpu_ms_per_1k:.0f}",
                      f"{r.rss_mib:.0f}", str(r.errors)]
            print(f"| {r.policy} | {r.name} | " + " | ".join(cells) + " |")


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=3.0, help="length of each closed-loop run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; the tables show medians")
    p.add_argument("--only", default="", help="comma-separated router name prefixes (e.g. 'lbd,vllm-router')")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of: " + ", ".join(SCENARIOS))
    p.add_argument("--policies", default=",".join(POLICIES), help="comma list of: " + ", ".join(POLICIES))
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = p.parse_args(argv)
    scenarios = [s for s in args.scenarios.split(",") if s]
    families = [f for f in args.policies.split(",") if f]
    for s in scenarios:
        if s not in SCENARIOS:
            p.error(f"--scenarios: unknown {s!r}")
    for f in families:
        if f not in POLICIES:
            p.error(f"--policies: unknown {f!r}")
    tmp = Path(tempfile.mkdtemp(prefix="lbd-router-bench-"))
    stubs = []
    try:
        ports = [free_port(), free_port()]
        stub = str(Path(__file__).resolve().parent / "http_load.py")
        stubs = [start([sys.executable, stub, "--stub", str(port), str(i)], tmp / f"stub{i}.log")
                 for i, port in enumerate(ports)]
        ups = [f"http://127.0.0.1:{port}" for port in ports]
        for port in ports:
            wait_port(port, "/health")
        loaders = {s: make_loader(args.seconds, tmp, s, SCENARIOS[s]()) for s in scenarios}
        gen = "wrk" if shutil.which("wrk") else "python raw-socket client"
        print(f"load generator: {gen}; {args.seconds:g} s per run, {args.rounds} interleaved rounds "
              f"(medians); 2 raw uvloop stub upstreams; {os.cpu_count()} cpus; "
              f"load average {os.getloadavg()[0]:.1f}")
        wanted = [x.strip() for x in args.only.split(",") if x.strip()]
        specs = router_specs(tmp, ups, families, wanted)
        rows = measure(specs, ups, loaders, args.rounds, tmp)
        print(f"load average after: {os.getloadavg()[0]:.1f}")
        print_tables(rows)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    finally:
        for s in stubs:
            stop(s)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
