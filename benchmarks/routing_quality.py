"""Routing quality at fleet scale: 8 simulated H100 ranks, the same seeded workloads through every router.

For each workload and each target, a fresh `lbd supervise` starts 8 `--device sim` ranks (real front ends,
schedulers, KV-cache managers and prefix caches; the forward pass is the h100-llama3-8b timing model, time
dilated --time-scale times so two CPU cores are never the bottleneck), then the router under test starts, then
`lbd bench` sends the seeded workload, then each rank's /metrics is read. Fresh ranks per target: every router
starts from cold caches and zeroed counters.

Targets: `lbd route --policy P` for every policy (round_robin included), and vllm-router (cache_aware,
power_of_two) and sglang-router (cache_aware) when installed (`bash scripts/setup-peers.sh`).
Workloads: shared-prefix multi-turn chat (8 system prompts, 4-turn sessions, X-Session-ID), long/short skew.

Per target: TTFT p50/p99, ITL p99, output tok/s (latencies divided by the time scale: simulated H100 time),
prefix-cache hit rate from the engines' counters, that rate as a share of an oracle's (one cache that holds
every block any rank computed, looked up in arrival order: the best any router could do), and the most/fewest
requests served by one rank.

    .venv/bin/python benchmarks/routing_quality.py [--quick] [--only predicted_ttft,round_robin]
        [--workloads multi-turn,skew] [--mt-rate 800] [--skew-rate 250] [--time-scale 40]
        [--plot benchmarks/routing_quality.png] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
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

from peers import PEER_KINDS, lbd_route_argv, peer_argv, peer_installed  # noqa: E402

from lbd.bench.client import Target  # noqa: E402
from lbd.bench.oracle import oracle_hit_rate  # noqa: E402
from lbd.bench.procs import (  # noqa: E402
    exit_on_sigterm,
    free_port,
    free_port_run,
    spawn,
    stop,
    tree_usage,
    wait_http,
)
from lbd.bench.runner import BenchConfig, RunResult, run_target  # noqa: E402
from lbd.bench.stats import percentile  # noqa: E402
from lbd.bench.tokenizer import load_tokenizer  # noqa: E402
from lbd.bench.workloads import TextSource, WorkloadSpec  # noqa: E402

PY = sys.executable


# ---- workloads ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Workload:
    name: str
    spec: WorkloadSpec
    cfg: BenchConfig


def workloads(args: argparse.Namespace) -> dict[str, Workload]:
    """Rates are simulated requests/s; the client sends them time-dilated (divided by --time-scale)."""
    n_mt, n_skew = (96, 96) if args.quick else (320, 300)
    seed = args.seed
    mt = Workload(
        "shared-prefix multi-turn",
        WorkloadSpec(
            name="multi-turn",
            num_groups=8,
            system_prompt_len=2000,
            question_len=200,
            num_turns=4,
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
    return {"multi-turn": mt, "skew": skew}


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


def start_fleet(args: argparse.Namespace, log: Path) -> Fleet:
    base, sup = free_port_run(args.ranks), free_port()
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
        f"{args.sim_profile}*{args.time_scale:g}",
        "--model",
        str(args.model),
        "--log-level",
        "warning",
        "--disable-log-requests",
    ]
    proc = spawn(argv, log=log)
    fleet = Fleet(proc, base, sup, args.ranks)
    try:
        wait_http(f"http://127.0.0.1:{sup}/readyz", timeout=300, proc=proc)
    except Exception:
        stop(proc)
        raise
    return fleet


def router_argv(name: str, port: int, fleet: Fleet) -> tuple[list[str], str]:
    """argv and readiness path of target ``name`` (``lbd:<policy>``, ``vllm-router:<policy>``, ...)."""
    kind, _, policy = name.partition(":")
    if kind == "lbd":
        return lbd_route_argv(port, f"supervisor://127.0.0.1:{fleet.sup_port}", "--policy", policy)
    if kind in PEER_KINDS:
        return peer_argv(kind, port, fleet.urls, policy)
    raise ValueError(name)


def available_targets() -> list[str]:
    import policies

    names = [f"lbd:{p}" for p in sorted(policies.available())]
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
        out.append(
            {
                k: _metric_sum(text, f"vllm:{k}")
                for k in ("prefix_cache_queries_total", "prefix_cache_hits_total", "request_success_total")
            }
        )
    return out


# ---- one run -----------------------------------------------------------------------------------------------
@dataclass(slots=True)
class Row:
    workload: str
    target: str
    completed: int
    failed: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    short_ttft_p99_ms: float  # skew: p99 TTFT of the short prompts alone (the ones stuck behind long ones)
    itl_p99_ms: float
    output_tok_s: float
    hit_rate: float
    oracle_hit_rate: float
    oracle_length_matches: str  # prompts the oracle tokenized to the server's length / all
    max_per_rank: int
    min_per_rank: int
    errors: dict[str, int] = field(default_factory=dict)
    ttfts_ms: list[float] = field(default_factory=list)
    host_cpu_percent: float = math.nan
    own_cores: float = math.nan

    @property
    def hit_vs_oracle(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else math.nan


def run_one(args: argparse.Namespace, wl: Workload, target: str, src: TextSource, logs: Path) -> Row:
    tag = f"{wl.spec.name}-{target.replace(':', '-')}"
    fleet = start_fleet(args, logs / f"{tag}-supervise.log")
    router = None
    try:
        port = free_port()
        argv, ready = router_argv(target, port, fleet)
        router = spawn(argv, log=logs / f"{tag}-router.log")
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=120, proc=router)
        time.sleep(1.0)  # let telemetry-driven routers take a first scrape of every rank
        # the engines' model name: some routers' /v1/models answer a placeholder ("unknown")
        model = httpx.get(fleet.urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
        psutil.cpu_percent(None)
        trees = [os.getpid()]  # this client and its children: the fleet and the router
        cpu0, t0 = tree_usage(*trees)[0], time.monotonic()
        result: RunResult = asyncio.run(
            run_target(wl.cfg, wl.spec, Target(target, f"http://127.0.0.1:{port}", model), src)
        )
        host_cpu = psutil.cpu_percent(None)  # the whole machine over the run (other users included)
        own_cores = (tree_usage(*trees)[0] - cpu0) / (time.monotonic() - t0)  # ranks + router + this client
        per_rank = scrape(fleet)
    finally:
        if router is not None:
            stop(router)
        stop(fleet.proc, timeout=30)
    s, scale = result.summary, args.time_scale
    queries = sum(r["prefix_cache_queries_total"] for r in per_rank)
    served = [int(r["request_success_total"]) for r in per_rank]
    oracle = oracle_hit_rate(result.records, src.tok, args.block_size)
    return Row(
        workload=wl.name,
        target=target,
        completed=s.completed,
        failed=s.failed,
        ttft_p50_ms=s.ttft_ms["p50"] / scale,
        ttft_p99_ms=s.ttft_ms["p99"] / scale,
        short_ttft_p99_ms=percentile([r.ttft for r in result.records if r.ok and r.kind == "short"], 99)
        * 1e3
        / scale,
        itl_p99_ms=s.itl_ms["p99"] / scale,
        output_tok_s=s.output_throughput * scale,
        hit_rate=sum(r["prefix_cache_hits_total"] for r in per_rank) / queries if queries else math.nan,
        oracle_hit_rate=oracle.hit_rate,
        oracle_length_matches=f"{oracle.length_matches}/{oracle.requests}",
        max_per_rank=max(served),
        min_per_rank=min(served),
        errors=s.errors,
        ttfts_ms=[r.ttft * 1e3 / scale for r in result.records if r.ok and r.ttft is not None],
        host_cpu_percent=host_cpu,
        own_cores=own_cores,
    )


# ---- report ------------------------------------------------------------------------------------------------
def table(rows: list[Row]) -> str:
    """One markdown table; the short-prompt p99 column only where the workload has short prompts."""
    shorts = any(math.isfinite(r.short_ttft_p99_ms) for r in rows)
    header = ["target", "TTFT p50 ms", "TTFT p99 ms", *(["short-prompt TTFT p99 ms"] if shorts else []),
              "ITL p99 ms", "out tok/s", "prefix hit", "hit/oracle", "req/rank max/min", "errors"]
    body = [
        [
            r.target,
            f"{r.ttft_p50_ms:,.1f}",
            f"{r.ttft_p99_ms:,.1f}",
            *([f"{r.short_ttft_p99_ms:,.1f}"] if shorts else []),
            f"{r.itl_p99_ms:,.1f}",
            f"{r.output_tok_s:,.0f}",
            f"{100 * r.hit_rate:.1f}%",
            f"{100 * r.hit_vs_oracle:.0f}%" if r.oracle_hit_rate > 0 else "-",
            f"{r.max_per_rank}/{r.min_per_rank}",
            str(r.failed),
        ]
        for r in rows
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def verdicts(rows: list[Row], ours: str = "lbd:predicted_ttft") -> list[str]:
    """The issue's targets, each with MET or MISSED and the numbers behind it."""
    out = []

    def line(ok: bool, text: str) -> None:
        out.append(f"- {'MET' if ok else 'MISSED'}: {text}")

    for wl in dict.fromkeys(r.workload for r in rows):
        by = {r.target: r for r in rows if r.workload == wl}
        me, rr = by.get(ours), by.get("lbd:round_robin")
        if me is None:
            continue
        peers = [r for name, r in by.items() if not name.startswith("lbd:")]
        if rr is not None and me.oracle_hit_rate > 0:
            ratio = rr.ttft_p99_ms / me.ttft_p99_ms
            line(ratio >= 2.0, f"{wl}: {ours} p99 TTFT {me.ttft_p99_ms:.1f} ms vs round robin "
                               f"{rr.ttft_p99_ms:.1f} ms = {ratio:.2f}x lower (target >= 2x)")
            line(me.hit_vs_oracle >= 0.9, f"{wl}: {ours} prefix hit rate {100 * me.hit_rate:.1f}% = "
                                          f"{100 * me.hit_vs_oracle:.0f}% of the oracle's (target >= 90%)")
        for peer in peers:
            line(me.ttft_p99_ms <= peer.ttft_p99_ms,
                 f"{wl}: p99 TTFT {me.ttft_p99_ms:.1f} ms vs {peer.target} {peer.ttft_p99_ms:.1f} ms")
            line(me.output_tok_s >= peer.output_tok_s * 0.98,  # 2%: run-to-run noise of the same router
                 f"{wl}: output {me.output_tok_s:,.0f} tok/s vs {peer.target} {peer.output_tok_s:,.0f} tok/s")
    return out


def plot(rows: list[Row], path: Path, scale: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.workload for r in rows))
    palette = plt.get_cmap("tab10").colors
    color = {t: palette[i % len(palette)] for i, t in enumerate(dict.fromkeys(r.target for r in rows))}
    fig, axes = plt.subplots(len(names), 2, figsize=(14, 5 * len(names)), squeeze=False)
    for i, wl in enumerate(names):
        mine = [r for r in rows if r.workload == wl]
        ax = axes[i][0]
        for r in mine:
            xs = sorted(r.ttfts_ms)
            ax.plot(xs, [(k + 1) / len(xs) for k in range(len(xs))], label=r.target, color=color[r.target])
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms, simulated H100 time)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{wl}: TTFT CDF")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        ax = axes[i][1]
        xs = range(len(mine))
        ax.bar([x - 0.2 for x in xs], [r.ttft_p99_ms for r in mine], width=0.4, label="TTFT p99 (ms)")
        ax.set_ylabel("TTFT p99 (ms)")
        ax2 = ax.twinx()
        ax2.bar(
            [x + 0.2 for x in xs],
            [100 * r.hit_rate for r in mine],
            width=0.4,
            color="tab:orange",
            label="prefix hit rate (%)",
        )
        ax2.set_ylabel("prefix-cache hit rate (%)")
        ax2.set_ylim(0, 100)
        ax.set_xticks(list(xs), [r.target for r in mine], rotation=30, ha="right", fontsize=7)
        ax.set_title(f"{wl}: p99 TTFT (blue) and prefix hit rate (orange)")
    fig.suptitle(f"Routing quality: 8 simulated H100 ranks (Llama-3-8B), time scale {scale:g}")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--sim-profile", default="h100-llama3-8b")
    p.add_argument("--time-scale", type=float, default=40.0, help="dilation of simulated time (see the doc)")
    p.add_argument("--mt-rate", type=float, default=800.0, help="multi-turn: simulated requests/s (Poisson)")
    p.add_argument("--skew-rate", type=float, default=250.0, help="skew: simulated requests/s (Poisson)")
    p.add_argument(
        "--model",
        default=None,
        help="folder with tokenizer + config for the sim ranks "
        "(default: the default model's converted folder)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--only", default=None, help="comma-separated targets (see --list)")
    p.add_argument("--list", action="store_true", help="print the targets available here and exit")
    p.add_argument("--workloads", default="multi-turn,skew")
    p.add_argument("--quick", action="store_true", help="fewer requests (a smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=str(ROOT / "benchmarks" / "routing_quality.png"))
    p.add_argument("--json", default=None, help="write every row here")
    args = p.parse_args(argv)
    targets = available_targets()
    if args.list:
        print("\n".join(targets))
        return 0
    if args.only:
        wanted = [t.strip() for t in args.only.split(",")]
        unknown = [t for t in wanted if t not in targets and f"lbd:{t}" not in targets]
        if unknown:
            p.error(f"--only: unknown targets {unknown}; available: {', '.join(targets)}")
        targets = [t if t in targets else f"lbd:{t}" for t in wanted]
    if args.model is None:
        from engine.loader import converted_path, default_gguf, resolve_model

        args.model = (
            str(resolve_model(None))
            if not (converted_path(default_gguf()) / "config.json").exists()
            else str(converted_path(default_gguf()))
        )
    all_wl = workloads(args)
    chosen = [all_wl[w.strip()] for w in args.workloads.split(",")]
    src = TextSource(load_tokenizer(args.model))
    logs = Path(tempfile.mkdtemp(prefix="routing-quality-"))
    print(
        f"# routing quality: {args.ranks} sim ranks, {args.sim_profile} x{args.time_scale:g}, "
        f"{platform.node()} ({os.cpu_count()} CPUs), logs in {logs}",
        flush=True,
    )
    rows: list[Row] = []
    for wl in chosen:
        for target in targets:
            t0 = time.monotonic()
            row = run_one(args, wl, target, src, logs)
            rows.append(row)
            print(
                f"  {wl.name} / {target}: TTFT p99 {row.ttft_p99_ms:,.1f} ms, hit {100 * row.hit_rate:.1f}% "
                f"(oracle {100 * row.oracle_hit_rate:.1f}%, lengths matched {row.oracle_length_matches}), "
                f"{row.failed} failed, host CPU "
                f"{row.host_cpu_percent:.0f}% (ours {row.own_cores:.2f} cores), "
                f"{time.monotonic() - t0:.0f} s",
                flush=True,
            )
    for wl in chosen:
        mine = [r for r in rows if r.workload == wl.name]
        print(
            f"\n### {wl.name} ({wl.cfg.num_prompts} requests, Poisson {wl.cfg.request_rate:g} req/s dilated "
            f"time = {wl.cfg.request_rate * args.time_scale:g} req/s simulated)\n"
        )
        print(table(mine))
    checks = verdicts(rows)
    if checks:
        print("\n### Targets (issue 6)\n")
        print("\n".join(checks))
    if args.plot:
        plot(rows, Path(args.plot), args.time_scale)
        print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).write_bytes(orjson.dumps([asdict(r) for r in rows], option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
