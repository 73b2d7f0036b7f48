"""Routing quality at fleet scale: 8 simulated H100 ranks, the same seeded workloads through every router.

For each workload and each target, a fresh `lbd supervise` starts 8 `--device sim` ranks (real front ends,
schedulers, KV-cache managers, prefix caches and KV-event publishers; the forward pass is the h100-llama3-8b
timing model, time dilated --time-scale times so two CPU cores are never the bottleneck), then the router
under test starts, then `lbd bench` sends the seeded workload, then each rank's /metrics is read. Fresh ranks
per target: every router starts from cold caches and zeroed counters. Every fleet publishes KV events
(vLLM's format), so every target runs against the same engines; only lbd's routers read them.

Targets: `lbd:<policy>` for every policy (KV events on where advertised, the default), with suffixes
`/w2`, `/w4` (router workers), `/approx` (`--kv-events off`: the text-prefix index), `/noevict`
(`--evict-weight 0`: no charge for the hot prefixes a placement evicts), `/noids`
(`--no-forward-prompt-ids`: the ranks render and tokenize every prompt themselves), `/nopush`
(`--telemetry-push off`: the router scrapes every rank's /metrics instead of following its pushed load
state) and `/nomig` (`--migration-limit 0`: no mid-stream migration, so no token ids asked of the ranks),
combined as wanted (`lbd:predicted_ttft/approx/nopush`), and vllm-router
(cache_aware, power_of_two) and sglang-router (cache_aware) when installed (`bash scripts/setup-peers.sh`).

Workloads: shared-prefix multi-turn chat (8 system prompts, 4-turn sessions, X-Session-ID; 2,000 requests by
default: the first ~70 ms of simulated time are 8 cold 2,200-token prefills with every request of their groups
queued behind them, about 20 slow requests no placement avoids, so with the 320 requests of earlier runs p99
was the 3rd-worst request and measured that floor, not routing; --mt-groups, --mt-prompt-len and --mt-turns
reshape it, e.g. issue 32's cold burst: 12 prompts of 1,500 tokens, 5 turns, --mt-rate 40); many-tenant (after
llm-d's precise-prefix benchmark: 48 tenants each with a 3,000-token system prompt, several users per tenant
in 3-turn sessions, Poisson arrivals stepping up; each rank's KV cache holds a fifth of all the tenants'
prompts and the fleet 1.6x of them, so tenants partitioned over the ranks fit with room for the running
requests, while a router that spreads every tenant everywhere thrashes). The steps go up past the one where
round robin saturates (its median TTFT at least twice its first step's: the median request queues as long as
it computes); round robin stops stepping there (higher steps would only queue it longer). Long/short skew.

Per target: TTFT p50/p90/p99, the p99 of the requests sent after start-up (once every prompt group's first
request has its first token) and how many of the slowest 1% are start-up requests
(routing_report.startup_split), ITL p99, output tok/s (latencies divided by the time scale: simulated H100
time), prefix-cache hit rate from the engines' counters, that rate as a share of an oracle's (one cache that
holds every block any rank computed, looked up in arrival order: the best any router could do), and the
most/fewest requests served by one rank, and how many cold requests (each group's first) waited for other
work on their rank (routing_report.cold_waits: slower than 1.2x the fastest cold request). Stepped
workloads report every step.
`--repeat N` runs every target N times, interleaved (all targets, then all again), and tabulates every run.

    .venv/bin/python benchmarks/routing_quality.py [--quick] [--only lbd:predicted_ttft,lbd:round_robin]
        [--workloads multi-turn,many-tenant,skew] [--mt-rate 800] [--skew-rate 250] [--time-scale 40]
        [--mt-groups 8 --mt-prompt-len 2000 --mt-turns 4] [--repeat 1]
        [--plot benchmarks/routing_quality.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import orjson
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from lbd.bench.client import RequestRecord, Target  # noqa: E402
from lbd.bench.oracle import block_hashes, prompt_ids  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # test-support helpers
from lbd.bench.runner import BenchConfig, run_target  # noqa: E402
from lbd.bench.stats import percentile, summarize  # noqa: E402
from lbd.bench.tokenizer import load_tokenizer  # noqa: E402
from lbd.bench.workloads import TextSource, WorkloadSpec  # noqa: E402
from peers import PEER_KINDS, lbd_route_argv, peer_argv, peer_installed  # noqa: E402
from routing_report import (  # noqa: E402
    BASELINE,
    OURS,
    Row,
    cold_requests,
    cold_table,
    cold_waits,
    plot,
    runs_table,
    saturated_step,
    startup_split,
    step_table,
    table,
    verdicts,
)
from support.procs import (  # noqa: E402
    exit_on_sigterm,
    free_port,
    free_port_run,
    spawn,
    stop,
    tree_usage,
    wait_http,
)

PY = sys.executable
KV_EVENTS = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:0", "replay_endpoint": "tcp://*:0"}'


# ---- workloads ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Workload:
    name: str
    spec: WorkloadSpec
    cfg: BenchConfig
    engine_flags: list[str] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)  # simulated req/s of each step (empty: one run)
    step_s: float = 0.0  # simulated seconds of arrivals per step
    time_scale: float | None = None  # overrides --time-scale


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    """Rates are simulated requests/s; the client sends them time-dilated (divided by the time scale)."""
    n_mt, n_skew = (96, 96) if args.quick else (args.mt_requests, 300)
    seed = args.seed
    mt = Workload(
        "shared-prefix multi-turn",
        WorkloadSpec(
            name="multi-turn",
            num_groups=args.mt_groups,
            system_prompt_len=args.mt_prompt_len,
            question_len=200,
            num_turns=args.mt_turns,
            output_len=32,
        ),
        BenchConfig(
            endpoint="chat",
            num_prompts=n_mt,
            request_rate=args.mt_rate / args.time_scale,
            session_header=True,
            seed=seed,
            progress=False,
            timeout=900,
        ),
    )
    tenants = Workload(
        "many-tenant",
        WorkloadSpec(
            name="multi-turn",
            num_groups=args.tenants,
            system_prompt_len=args.tenant_prompt_len,
            question_len=150,
            num_turns=3,
            output_len=64,
            prefix_seed=seed,
            group_skew=args.tenant_skew,
        ),
        BenchConfig(
            endpoint="chat", num_prompts=None, session_header=True, seed=seed, progress=False, timeout=900
        ),
        # each rank's KV cache holds --tenant-kv-share of all tenants' system prompts
        engine_flags=[
            "--kv-cache-memory-bytes",
            str(int(args.tenants * args.tenant_prompt_len * args.tenant_kv_share * 131072)),
        ],
        steps=[float(x) for x in args.mt_steps.split(",")][: 2 if args.quick else None],
        step_s=args.step_s / (3 if args.quick else 1),
        time_scale=args.tenant_time_scale,
    )
    skew = Workload(
        "long/short skew",
        WorkloadSpec(name="skew", long_fraction=0.1, long_input_len=6000, short_input_len=200, output_len=32),
        BenchConfig(
            endpoint="completions",
            num_prompts=n_skew,
            request_rate=args.skew_rate / args.time_scale,
            seed=seed,
            progress=False,
            timeout=900,
        ),
    )
    return {"multi-turn": mt, "many-tenant": tenants, "skew": skew}


# ---- processes ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Fleet:
    """`lbd supervise` with N sim ranks on consecutive ports."""

    proc: object
    base_port: int
    sup_port: int
    ranks: int

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{self.base_port + i}" for i in range(self.ranks)]


def start_fleet(args: argparse.Namespace, wl: Workload, log: Path) -> Fleet:
    base, sup = free_port_run(args.ranks), free_port()
    scale = wl.time_scale or args.time_scale
    argv = [
        PY,
        "-m",
        "lbd",
        "supervise",
        "--data-parallel-multi-port-external-lb",
        "--data-parallel-size",
        str(args.ranks),
        "--data-parallel-size-local",
        str(args.ranks),
        "--host",
        "127.0.0.1",
        "--port",
        str(base),
        "--data-parallel-supervisor-port",
        str(sup),
        "--device",
        "sim",
        "--sim-profile",
        f"{args.sim_profile}*{scale:g}",
        "--model",
        str(args.model),
        "--log-level",
        "warning",
        "--disable-log-requests",
        "--kv-events-config",
        KV_EVENTS,
        *wl.engine_flags,
    ]
    proc = spawn(argv, log=log)
    fleet = Fleet(proc, base, sup, args.ranks)
    try:
        wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=300, proc=proc)
    except BaseException:  # SIGTERM arrives as SystemExit (exit_on_sigterm): no fleet left behind
        stop(proc)
        raise
    return fleet


LBD_SUFFIXES = ("w2", "w4", "approx", "noevict", "noids", "nopush", "nomig")


def known_target(name: str, targets: list[str]) -> bool:
    """A listed target, or an lbd policy with any of ``LBD_SUFFIXES`` (``lbd:round_robin/approx/nopush``)."""
    base, *mods = (name if name.startswith("lbd:") else f"lbd:{name}").split("/")
    return name in targets or (base in targets and all(m in LBD_SUFFIXES for m in mods))


def router_argv(name: str, port: int, fleet: Fleet) -> tuple[list[str], str]:
    """argv and readiness path of ``name``: ``lbd:<policy>[/wN][/approx]``, ``vllm-router:<policy>``..."""
    kind, _, rest = name.partition(":")
    if kind == "lbd":
        policy, *mods = rest.split("/")
        extra = ["--policy", policy]
        for mod in mods:
            if mod.startswith("w") and mod[1:].isdigit():
                extra += ["--workers", mod[1:]]
            elif mod == "approx":
                extra += ["--kv-events", "off"]
            elif mod == "noevict":
                extra += ["--evict-weight", "0"]
            elif mod == "noids":
                extra += ["--no-forward-prompt-ids"]
            elif mod == "nopush":
                extra += ["--telemetry-push", "off"]
            elif mod == "nomig":
                extra += ["--migration-limit", "0"]
            else:
                raise ValueError(f"target {name}: unknown suffix /{mod}")
        return lbd_route_argv(port, f"supervisor://127.0.0.1:{fleet.sup_port}", *extra)
    if kind in PEER_KINDS:
        return peer_argv(kind, port, fleet.urls, rest)
    raise ValueError(name)


def available_targets() -> list[str]:
    from lbd import policies

    names = [f"lbd:{p}" for p in sorted(policies.available())]
    names += [f"{OURS}/{m}" for m in LBD_SUFFIXES]
    if peer_installed("vllm-router"):
        names += ["vllm-router:cache_aware", "vllm-router:power_of_two"]
    if peer_installed("sglang-router"):
        names += ["sglang-router:cache_aware"]
    return names


# ---- engine metrics and the oracle -------------------------------------------------------------------------
def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(fleet: Fleet) -> list[dict[str, float]]:
    out = []
    for url in fleet.urls:
        text = httpx.get(url + "/metrics", timeout=10).text
        keys = ("prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total")
        out.append({k: _metric_sum(text, f"vllm:{k}") for k in keys})
    return out


def oracle(steps: list[list[RequestRecord]], tok: object, block_size: int) -> list[tuple[float, int, int]]:
    """(hit rate, prompts at the server's length, prompts) per step; the cache carries across steps."""
    seen: set[int] = set()
    out = []
    for records in steps:
        hits = queries = matches = n_req = 0
        for rec in sorted((r for r in records if r.ok and r.prompt is not None), key=lambda r: r.start):
            ids = prompt_ids(tok, rec.prompt)
            matches += len(ids) == rec.prompt_tokens
            n_req += 1
            hashes = block_hashes(ids, block_size)
            n, limit = 0, (len(ids) - 1) // block_size
            while n < limit and hashes[n] in seen:
                n += 1
            hits, queries = hits + n * block_size, queries + len(ids)
            seen.update(hashes)
            seen.update(block_hashes(ids + tok.encode(rec.text, add_special_tokens=False), block_size))
        out.append((hits / queries if queries else 0.0, matches, n_req))
    return out


def decision_counts(port: int) -> dict[str, int]:
    """lbd's routing decisions by reason, from its /metrics (every worker's)."""
    out: dict[str, int] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("lbd_router_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = out.get(reason, 0) + int(float(line.rsplit(" ", 1)[1]))
    return out


def overhead_ms(port: int, q: float = 0.95) -> tuple[float, float]:
    """lbd's time from a request's arrival to its dispatch (parse, tokenize, decide), real ms: (the mean,
    quantile ``q`` interpolated in the histogram's buckets), summed over workers. The 95th covers a run's cold
    requests (each group's first, tokenized by the router), a few percent of a multi-turn run."""
    buckets: dict[float, float] = {}
    total = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("lbd_router_overhead_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = math.inf if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith("lbd_router_overhead_seconds_sum{"):
            total += float(line.rsplit(" ", 1)[1])
    cum = sorted(buckets.items())
    if not cum or cum[-1][1] <= 0:
        return math.nan, math.nan
    mean = 1e3 * total / cum[-1][1]
    want, lo, c_lo = q * cum[-1][1], 0.0, 0.0
    for hi, c_hi in cum:
        if c_hi >= want:
            hi = lo if math.isinf(hi) else hi
            return mean, 1e3 * (lo + (hi - lo) * (want - c_lo) / max(1e-9, c_hi - c_lo))
        lo, c_lo = hi, c_hi
    return mean, math.nan


def wait_exact(port: int, workers: int, timeout: float = 60.0) -> None:
    """Until every router worker has answered /router/status with an exact view of every rank (a new
    connection per poll, so SO_REUSEPORT spreads them over the workers)."""
    ready: set[int] = set()
    deadline = time.monotonic() + timeout
    while len(ready) < workers and time.monotonic() < deadline:
        st = httpx.get(f"http://127.0.0.1:{port}/router/status", timeout=10).json()
        modes = [(e.get("kv_events") or {}).get("mode") for e in st["endpoints"]]
        if modes and all(m == "exact" for m in modes):
            ready.add(st["worker"])
        time.sleep(0.05)
    if len(ready) < workers:
        print(f"  warning: only workers {sorted(ready)} of {workers} had exact views after {timeout:g} s")


# ---- one run -----------------------------------------------------------------------------------------------
def run_one(
    args: argparse.Namespace, wl: Workload, target: str, src: TextSource, logs: Path, run: int = 0
) -> list[Row]:
    tag = f"{wl.spec.name}-{wl.name[:4]}-{target.replace(':', '-').replace('/', '-')}-{run}"
    fleet = start_fleet(args, wl, logs / f"{tag}-supervise.log")
    scale = wl.time_scale or args.time_scale
    router = None
    results, per_rank = [], [scrape(fleet)]
    try:
        port = free_port()
        argv, ready = router_argv(target, port, fleet)
        router = spawn(argv, log=logs / f"{tag}-router.log")
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=120, proc=router)
        time.sleep(2.0)  # let telemetry-driven routers take a first scrape (and lbd its event sources)
        if target.startswith("lbd:") and "/approx" not in target:
            wait_exact(port, int(next((m[1:] for m in target.split("/") if m[:1] == "w"), "1")))
        # the engines' model name: some routers' /v1/models answer a placeholder ("unknown")
        model = httpx.get(fleet.urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        psutil.cpu_percent(None)
        trees = [os.getpid()]  # this client and its children: the fleet and the router
        cpu0, t0 = tree_usage(*trees)[0], time.monotonic()
        plan = [(wl.cfg, math.nan)]
        if wl.steps:
            plan = [
                (
                    dataclasses.replace(
                        wl.cfg,
                        request_rate=rate / scale,
                        num_prompts=max(24, int(rate * wl.step_s)),
                        seed=wl.cfg.seed + 101 * i,
                    ),
                    rate,
                )
                for i, rate in enumerate(wl.steps)
            ]
        for cfg, rate in plan:
            target_obj = Target(target, f"http://127.0.0.1:{port}", model)
            results.append((asyncio.run(run_target(cfg, wl.spec, target_obj, src)), rate))
            per_rank.append(scrape(fleet))
            p50s = [percentile([r.ttft for r in res.records if r.ok and r.ttft], 50) for res, _ in results]
            if target == BASELINE and saturated_step(p50s) is not None:
                break  # the baseline saturated: higher steps would only queue longer (see the doc)
        reasons = decision_counts(port) if target.startswith("lbd:") else {}
        over_mean, overhead = overhead_ms(port) if target.startswith("lbd:") else (math.nan, math.nan)
        host_cpu = psutil.cpu_percent(None)  # the whole machine over the run (other users included)
        own_cores = (tree_usage(*trees)[0] - cpu0) / (time.monotonic() - t0)  # ranks + router + this client
    finally:
        if router is not None:
            stop(router)
        stop(fleet.proc, timeout=30)
    orc = oracle([r.records for r, _ in results], src.tok, args.block_size)
    rows = []
    for i, ((result, rate), (o_rate, o_match, o_n)) in enumerate(zip(results, orc, strict=True)):
        before, after = per_rank[i], per_rank[i + 1]

        def delta(key: str, rank: int, a: list = after, b: list = before) -> float:
            return a[rank][key] - b[rank][key]

        queries = sum(delta("prefix_cache_queries_total", k) for k in range(args.ranks))
        hits = sum(delta("prefix_cache_hits_total", k) for k in range(args.ranks))
        served = [int(delta("request_success_total", k)) for k in range(args.ranks)]
        s = summarize(result.records, result.duration_s, {})
        n_startup, steady_p99, slowest_startup = startup_split(result.records, scale)
        records = result.records
        n_cold, n_waited = cold_waits(records)
        shorts = [r.ttft for r in result.records if r.ok and r.kind == "short"]
        rows.append(
            Row(
                workload=wl.name,
                target=target,
                completed=s.completed,
                failed=s.failed,
                ttft_p50_ms=s.ttft_ms["p50"] / scale,
                ttft_p99_ms=s.ttft_ms["p99"] / scale,
                ttft_p90_ms=percentile([r.ttft for r in result.records if r.ok and r.ttft is not None], 90)
                * 1e3
                / scale,
                short_ttft_p99_ms=percentile(shorts, 99) * 1e3 / scale,
                itl_p99_ms=s.itl_ms["p99"] / scale,
                output_tok_s=s.output_throughput * scale,
                hit_rate=hits / queries if queries else math.nan,
                oracle_hit_rate=o_rate,
                oracle_length_matches=f"{o_match}/{o_n}",
                max_per_rank=max(served),
                min_per_rank=min(served),
                errors=s.errors,
                ttfts_ms=[r.ttft * 1e3 / scale for r in result.records if r.ok and r.ttft is not None],
                host_cpu_percent=host_cpu,
                own_cores=own_cores,
                step_rate=rate,
                reasons=reasons,
                startup_requests=n_startup,
                steady_ttft_p99_ms=steady_p99,
                slowest_startup=slowest_startup,
                run=run,
                cold_requests=n_cold,
                cold_waited=n_waited,
                load_avg=os.getloadavg()[0],
                router_overhead_ms=overhead,
                router_overhead_mean_ms=over_mean,
                cold_ttfts=[(r.group, r.prompt_tokens, r.ttft * 1e3 / scale) for r in cold_requests(records)],
            )
        )
    return rows


def report(files: list[Path]) -> int:
    """Tables and verdicts of saved runs; each file stays its own side-by-side run."""
    for f in files:
        known = {fl.name for fl in dataclasses.fields(Row)}  # runs saved by other versions may carry more
        rows = [  # JSON keeps NaN as null
            Row(**{k: math.nan if v is None else v for k, v in d.items() if k in known})
            for d in orjson.loads(f.read_bytes())
        ]
        print(f"## {f.name}")
        for wl in dict.fromkeys(r.workload for r in rows):
            mine = [r for r in rows if r.workload == wl]
            stepped = any(math.isfinite(r.step_rate) for r in mine)
            print(f"\n### {wl}\n\n{step_table(mine) if stepped else table(mine)}")
            if any(r.run for r in mine):
                print(f"\n{runs_table(mine)}")
        print("\n### Targets (issue 13)\n\n" + "\n".join(verdicts(rows)) + "\n")
    return 0


# ---- main --------------------------------------------------------------------------------------------------
def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=40.0, help="dilation of simulated time (see the doc)")
    p.add_argument("--mt-rate", type=float, default=800.0, help="multi-turn: simulated requests/s (Poisson)")
    p.add_argument("--mt-requests", type=int, default=2000, help="multi-turn: requests (see the doc)")
    p.add_argument("--mt-groups", type=int, default=8, help="multi-turn: system prompts (prefix groups)")
    p.add_argument("--mt-prompt-len", type=int, default=2000, help="multi-turn: system prompt tokens")
    p.add_argument("--mt-turns", type=int, default=4, help="multi-turn: turns per session")
    p.add_argument("--skew-rate", type=float, default=250.0, help="skew: simulated requests/s (Poisson)")
    p.add_argument("--tenants", type=int, default=48, help="many-tenant: tenants (system prompts)")
    p.add_argument("--tenant-prompt-len", type=int, default=3000, help="many-tenant: system prompt tokens")
    p.add_argument("--mt-steps", default="160,320,480,640", help="many-tenant: simulated req/s of each step")
    p.add_argument("--step-s", type=float, default=0.75, help="many-tenant: simulated seconds per step")
    p.add_argument("--tenant-kv-share", type=float, default=0.2,
                   help="many-tenant: share of all tenants' system prompts one rank's KV cache holds")
    p.add_argument("--tenant-skew", type=float, default=0.0, help="many-tenant: Zipf exponent of popularity")
    p.add_argument("--tenant-time-scale", type=float, default=20.0, help="many-tenant: time dilation")
    p.add_argument(
        "--model",
        default=None,
        help="folder with tokenizer + config for the sim ranks "
        "(default: the default model's converted folder)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--cold-detail", action="store_true",
                   help="with --repeat: every run's cold requests (groups' first), side by side by target")
    p.add_argument("--only", default=None, help="comma-separated targets (see --list)")
    p.add_argument("--list", action="store_true", help="print the targets available here and exit")
    p.add_argument("--workloads", default="multi-turn,many-tenant,skew")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--repeat", type=int, default=1, help="run every target this many times, interleaved")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(ROOT / "benchmarks" / "routing_quality.png"))
    p.add_argument("--json", default=None, help="write every row here (after every target)")
    p.add_argument("--report", default=None, metavar="JSON[,JSON]",
                   help="run nothing: print the tables and verdicts of earlier --json files, one run each")
    args = p.parse_args(argv)
    args.parser = p
    return args


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    args = parse(argv)
    if args.report:
        return report([Path(f) for f in args.report.split(",")])
    targets = available_targets()
    if args.list:
        print("\n".join(targets))
        return 0
    if args.only:
        wanted = [t.strip() for t in args.only.split(",")]
        unknown = [t for t in wanted if not known_target(t, targets)]
        if unknown:
            args.parser.error(f"--only: unknown targets {unknown}; available: {', '.join(targets)}")
        targets = [t if t in targets or ":" in t else f"lbd:{t}" for t in wanted]
    if args.model is None:
        from lbd.engine.config.model_files import converted_path, default_gguf
        from lbd.engine.loader import resolve_model

        done = (converted_path(default_gguf()) / "config.json").exists()
        args.model = str(converted_path(default_gguf())) if done else str(resolve_model(None))
    all_wl = workloads(args)
    chosen = [all_wl[w.strip()] for w in args.workloads.split(",")]
    src = TextSource(load_tokenizer(args.model))
    logs = Path(tempfile.mkdtemp(prefix="routing-quality-"))
    print(
        f"# routing quality: {args.ranks} sim ranks, {args.sim_profile}, {platform.node()} "
        f"({os.cpu_count()} CPUs), load average {os.getloadavg()[0]:.1f}, logs in {logs}",
        flush=True,
    )
    rows: list[Row] = []
    for wl, run, target in ((w, k, t) for w in chosen for k in range(args.repeat) for t in targets):
        t0 = time.monotonic()
        got = run_one(args, wl, target, src, logs, run)
        rows += got
        for row in got:
            step = f" @ {row.step_rate:g} req/s" if math.isfinite(row.step_rate) else ""
            print(
                f"  {wl.name}{step} / {target}: TTFT p90 {row.ttft_p90_ms:,.1f} "
                f"p99 {row.ttft_p99_ms:,.1f} ms, hit {100 * row.hit_rate:.1f}% "
                f"(oracle {100 * row.oracle_hit_rate:.1f}%, lengths matched "
                f"{row.oracle_length_matches}), {row.failed} failed, host CPU "
                f"{row.host_cpu_percent:.0f}% (ours {row.own_cores:.2f} cores) {row.reasons or ''}",
                flush=True,
            )
        print(f"  ({time.monotonic() - t0:.0f} s, load average {os.getloadavg()[0]:.1f})", flush=True)
        if args.json:  # after every target: a run cut short keeps what it measured
            rows_json = orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2)
            Path(args.json).write_bytes(rows_json)
    for wl in chosen:
        mine = [r for r in rows if r.workload == wl.name]
        scale = wl.time_scale or args.time_scale
        if wl.steps:
            print(
                f"\n### {wl.name} ({wl.spec.num_groups} tenants x {wl.spec.system_prompt_len}-token prompts, "
                f"steps {wl.steps} req/s simulated, {wl.step_s:g} s each, time scale {scale:g})\n"
            )
            print(step_table(mine))
        else:
            print(
                f"\n### {wl.name} ({wl.cfg.num_prompts} requests, Poisson "
                f"{wl.cfg.request_rate * scale:g} req/s simulated, time scale {scale:g})\n"
            )
            print(table(mine))
        if args.repeat > 1:
            print(f"\nEvery run (cold waited: see routing_report.cold_waits)\n\n{runs_table(mine)}")
            if args.cold_detail:
                print(cold_table(mine))
    checks = verdicts(rows)
    if checks:
        print("\n### Targets (issue 13)\n")
        print("\n".join(checks))
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")
    if args.plot:
        plot(rows, Path(args.plot), args.time_scale)
        print(f"\nplot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
